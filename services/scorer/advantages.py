"""Group-relative advantages: how GRPO turns G rewards per prompt into a learning signal.

Pure functions on tensors (float32 or float64); no I/O, settings or logging. Groups are contiguous blocks
of ``group_size`` rows: rows ``[k*G, (k+1)*G)`` are the G completions of prompt k.

NaN marks a reward that could not be computed (a reward function returned None or failed). NaN rewards are
left out of every mean and standard deviation and get advantage 0, so an unscorable completion neither
teaches nor distorts its group.

Variants (``scale_rewards``), as TRL names them:

=========  ==============================================  ==========================================
name       advantage                                        used by
=========  ==============================================  ==========================================
group      (r - mean_g) / (std_g + eps)                     GRPO (DeepSeekMath), TRL default
batch      (r - mean_g) / (std_batch + eps)                 TRL ``scale_rewards="batch"``
none       r - mean_g                                       Dr. GRPO (no std scaling)
=========  ==============================================  ==========================================

``std_unbiased=True`` uses Bessel's correction like TRL (``torch.std``); ``False`` is the population std of
the DeepSeek formula.

Other estimators (``AdvantageSpec.estimator``; ``scale_rewards`` does not apply to them):

=====================  =======================================================  ============================
rloo                   n/(n-1) (r - mean_g) = r - mean of the other n-1          RLOO; verl ``rloo``
reinforce_pp           whiten(r) over the batch's tokens                         REINFORCE++; verl
                                                                                 ``reinforce_plus_plus`` (gamma 1)
reinforce_pp_baseline  whiten(r - mean_g) over the batch's tokens                verl
                                                                                 ``reinforce_plus_plus_baseline``
bnpo                   min(1/Beta(a, b).pdf(p_g), 1e6) (s - p_g)                 BNPO (:func:`bnpo_advantages`)
=====================  =======================================================  ============================

whiten(x) is verl's ``masked_whiten`` with every completion weighted by its token count L: mean
m = sum L x / (sum L + 1e-8), v = sum L (x - m)^2 / (sum L + 1e-8) * N/(N - 1) with N = sum L, then
(x - m) / sqrt(v + 1e-8). GDPO (``reward_aggregation="normalize_then_sum"``, TRL
``multi_objective_aggregation``): each reward function is normalised in its group, (r_f - mean_g)/(std_g + eps),
the weighted sum of those is then normalised over the batch, (s - mean)/(std + eps).

The learner imports this module (pure maths, no service code) to finalise the normalisations that need the
whole training batch (``batch``, BNPO); see the README's "Algorithm" section.
"""

from __future__ import annotations

from typing import Literal

import torch

from shared.records import AdvantageSpec

ScaleRewards = Literal["group", "batch", "none"]

BNPO_MAX_WEIGHT = 1e6  # 1/pdf grows without bound where the fitted Beta density vanishes (p = 0 or 1)


def combine_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of F reward functions per completion, ignoring NaN: ``sum_f w_f * r_f`` -> [N].

    ``rewards_per_func`` is [N, F], ``weights`` [F]. A row where every function is NaN stays NaN (TRL's
    ``nansum`` would make it 0; a reward nobody could compute is not a zero reward).
    """
    if rewards_per_func.ndim != 2 or weights.shape != (rewards_per_func.shape[1],):
        raise ValueError(
            f"expected rewards [N, F] and weights [F], got {tuple(rewards_per_func.shape)} and {tuple(weights.shape)}"
        )
    weights = weights.to(rewards_per_func.dtype)
    missing = torch.isnan(rewards_per_func)
    combined = torch.where(missing, torch.zeros_like(rewards_per_func), rewards_per_func * weights).sum(dim=1)
    return torch.where(missing.all(dim=1), torch.full_like(combined, float("nan")), combined)


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"expected rewards [N] with N a multiple of group_size={group_size}, got shape {tuple(rewards.shape)}"
        )
    return rewards.view(-1, group_size)


def _nan_mean_std(values: torch.Tensor, unbiased: bool, dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std over non-NaN entries (along ``dim``, or all). Std is NaN with too few entries."""
    present = ~torch.isnan(values)
    count = present.sum(dim=dim) if dim is not None else present.sum()
    filled = torch.where(present, values, torch.zeros_like(values))
    total = filled.sum(dim=dim) if dim is not None else filled.sum()
    mean = total / count  # NaN where count == 0
    centred = values - (mean.unsqueeze(dim) if dim is not None else mean)
    squares = torch.where(present, centred * centred, torch.zeros_like(values))
    sum_squares = squares.sum(dim=dim) if dim is not None else squares.sum()
    dof = count - 1 if unbiased else count
    std = torch.sqrt(sum_squares / dof.clamp(min=0))
    std = torch.where(dof > 0, std, torch.full_like(std, float("nan")))
    return mean, std


def zero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N/G] bool: groups whose non-NaN rewards all agree (or that have fewer than two), i.e. no signal."""
    grouped = _grouped(rewards, group_size)
    present = ~torch.isnan(grouped)
    high = torch.where(present, grouped, torch.full_like(grouped, -float("inf"))).amax(dim=1)
    low = torch.where(present, grouped, torch.full_like(grouped, float("inf"))).amin(dim=1)
    return (present.sum(dim=1) < 2) | (high == low)


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    scale_rewards: ScaleRewards = "group",
    eps: float = 1e-4,
    std_unbiased: bool = True,
) -> torch.Tensor:
    """GRPO advantages [N] from rewards [N] (see the module docstring for the variants).

    ``group``: (r - mean_g)/(std_g + eps); ``batch``: (r - mean_g)/(std over all non-NaN rewards + eps);
    ``none``: r - mean_g. Matches TRL's GRPOTrainer (``scale_rewards``), with two documented differences:
    NaN rewards are excluded and get 0, and a group whose rewards all agree gets exactly 0 (TRL gets
    rounding noise / eps there).
    """
    grouped = _grouped(rewards, group_size)
    mean_g, std_g = _nan_mean_std(grouped, std_unbiased, dim=1)
    centred = grouped - mean_g.unsqueeze(1)
    if scale_rewards == "group":
        advantages = centred / (std_g.unsqueeze(1) + eps)
    elif scale_rewards == "batch":
        _, std_b = _nan_mean_std(rewards, std_unbiased)
        advantages = centred / (std_b + eps)
    elif scale_rewards == "none":
        advantages = centred
    else:
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
    no_signal = zero_std_groups(rewards, group_size).unsqueeze(1) | torch.isnan(grouped)
    advantages = torch.where(no_signal, torch.zeros_like(advantages), advantages)
    return advantages.reshape(-1)


def _beta_log_pdf(p: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    log_norm = torch.lgamma(alpha) + torch.lgamma(beta) - torch.lgamma(alpha + beta)
    return torch.xlogy(alpha - 1, p) + torch.xlogy(beta - 1, 1 - p) - log_norm


def bnpo_beta_parameters(success_rates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(alpha, beta) of BNPO's Beta fitted to the groups' mean normalised rewards p (NaN ignored).

    m = mean(p), v = var(p) (unbiased); k = m(1-m)/v - 1; alpha = max(1 + k*m/3, 1),
    beta = max(1 + k*(1-m)/3, 1). With v = 0, v undefined (one group) or m(1-m) = 0: alpha = beta = 1.
    """
    m, s = _nan_mean_std(success_rates, unbiased=True)
    v = s * s
    one = torch.ones((), dtype=success_rates.dtype, device=success_rates.device)
    if not bool(torch.isfinite(v)) or float(v) == 0.0:
        return one, one
    k = m * (1 - m) / v - 1
    alpha = torch.clamp(1 + k * m / 3, min=1.0)
    beta = torch.clamp(1 + k * (1 - m) / 3, min=1.0)
    return alpha, beta


def bnpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    reward_min: float = 0.0,
    reward_max: float = 1.0,
) -> torch.Tensor:
    """Beta Normalization Policy Optimization advantages [N], as BNPO's authors implement them.

    s = (r - min)/(max - min); p_q = mean of s over group q; (alpha, beta) from
    :func:`bnpo_beta_parameters` over the batch's groups;
    A = min(1/Beta(alpha, beta).pdf(p_q), 1e6) * (s - p_q).
    NaN rewards get 0 and are left out of p_q. Rewards outside [reward_min, reward_max] raise ValueError.
    """
    if not reward_max > reward_min:
        raise ValueError(f"reward_max ({reward_max}) must exceed reward_min ({reward_min})")
    present = rewards[~torch.isnan(rewards)]
    if present.numel() and (present.min() < reward_min or present.max() > reward_max):
        raise ValueError(
            f"BNPO needs rewards in [{reward_min}, {reward_max}], got values in "
            f"[{float(present.min())}, {float(present.max())}]; set reward_min/reward_max"
        )
    scaled = _grouped((rewards - reward_min) / (reward_max - reward_min), group_size)
    p, _ = _nan_mean_std(scaled, unbiased=True, dim=1)
    alpha, beta = bnpo_beta_parameters(p)
    weight = torch.exp(-_beta_log_pdf(p, alpha, beta)).clamp(max=BNPO_MAX_WEIGHT)
    advantages = weight.unsqueeze(1) * (scaled - p.unsqueeze(1))
    advantages = torch.where(torch.isnan(advantages), torch.zeros_like(advantages), advantages)
    return advantages.reshape(-1)


def reward_metrics(rewards: torch.Tensor, group_size: int, *, std_unbiased: bool = True) -> dict[str, float]:
    """TRL's reward figures for a batch: ``reward``, ``reward_std`` (mean within-group std),
    ``frac_reward_zero_std`` (groups with no signal) and ``frac_reward_nan``."""
    grouped = _grouped(rewards, group_size)
    _, std_g = _nan_mean_std(grouped, std_unbiased, dim=1)
    mean_all, _ = _nan_mean_std(rewards, std_unbiased)
    zero = zero_std_groups(rewards, group_size)
    std_g = torch.where(zero, torch.zeros_like(std_g), std_g)
    return {
        "reward": float(mean_all),
        "reward_std": float(std_g.mean()),
        "frac_reward_zero_std": float(zero.to(torch.float64).mean()),
        "frac_reward_nan": float(torch.isnan(rewards).to(torch.float64).mean()),
    }


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out advantages [N]: r_i minus the mean of the group's other non-NaN rewards,
    i.e. n/(n-1) (r_i - mean_g) (verl ``compute_rloo_outcome_advantage``). A group with one reward keeps it
    (verl's baseline 0 for a lone sample); NaN rewards get 0."""
    grouped = _grouped(rewards, group_size)
    present = ~torch.isnan(grouped)
    n = present.sum(dim=1, keepdim=True).to(grouped.dtype)
    mean, _ = _nan_mean_std(grouped, unbiased=False, dim=1)
    scale = torch.where(n > 1, n / (n - 1).clamp(min=1.0), torch.ones_like(n))
    baseline = torch.where(n > 1, mean.unsqueeze(1), torch.zeros_like(n))
    advantages = scale * (grouped - baseline)
    return torch.where(present, advantages, torch.zeros_like(advantages)).reshape(-1)


_WHITEN_EPS = 1e-8  # verl's masked_mean / masked_whiten epsilon


def reinforce_pp_advantages(
    rewards: torch.Tensor, group_size: int, lengths: torch.Tensor | None = None, *, baseline: bool = True
) -> torch.Tensor:
    """REINFORCE++ advantages [N] for outcome rewards (gamma 1): optionally minus the group mean (``baseline``,
    verl ``reinforce_plus_plus_baseline``; a lone sample's baseline is 0), then whitened over the batch with
    each completion weighted by its token count ``lengths`` [N] (verl whitens over response tokens).

    ``lengths=None`` weighs every completion 1: the scorer's provisional per-group value; the learner redoes
    it over the training batch with the real token counts. NaN rewards get 0 and weigh nothing; with fewer
    than two tokens in all, there is nothing to whiten and every advantage is 0.
    """
    grouped = _grouped(rewards, group_size)
    present = ~torch.isnan(grouped)
    centred = grouped
    if baseline:
        n = present.sum(dim=1, keepdim=True)
        mean, _ = _nan_mean_std(grouped, unbiased=False, dim=1)
        centred = grouped - torch.where(n > 1, mean.unsqueeze(1), torch.zeros_like(mean.unsqueeze(1)))
    x = centred.reshape(-1)
    weight = torch.ones_like(x) if lengths is None else lengths.to(x.dtype).reshape(-1)
    if weight.shape != x.shape:
        raise ValueError(f"lengths must be [N] = [{x.numel()}], got {tuple(lengths.shape)}")  # type: ignore[union-attr]
    weight = torch.where(present.reshape(-1), weight, torch.zeros_like(weight))
    x = torch.where(present.reshape(-1), x, torch.zeros_like(x))
    tokens = weight.sum()
    if float(tokens) <= 1.0:
        return torch.zeros_like(x)
    mean = (weight * x).sum() / (tokens + _WHITEN_EPS)
    var = (weight * (x - mean) ** 2).sum() / (tokens + _WHITEN_EPS) * tokens / (tokens - 1)
    advantages = (x - mean) * torch.rsqrt(var + _WHITEN_EPS)
    return torch.where(present.reshape(-1), advantages, torch.zeros_like(advantages))


def gdpo_rewards(
    rewards_per_func: torch.Tensor,
    weights: torch.Tensor,
    group_size: int,
    *,
    eps: float = 1e-4,
    std_unbiased: bool = True,
) -> torch.Tensor:
    """GDPO's decoupled reward [N]: sum_f w_f (r_f - mean_g,f) / (std_g,f + eps), NaN terms left out; NaN where
    every function is NaN. A group of one has std 0 (TRL), so its normalised rewards are 0."""
    if rewards_per_func.ndim != 2 or weights.shape != (rewards_per_func.shape[1],):
        raise ValueError(
            f"expected rewards [N, F] and weights [F], got {tuple(rewards_per_func.shape)} and {tuple(weights.shape)}"
        )
    n_func = rewards_per_func.shape[1]
    _grouped(rewards_per_func[:, 0].contiguous(), group_size)  # checks N against group_size
    grouped = rewards_per_func.reshape(-1, group_size, n_func)
    mean, std = _nan_mean_std(grouped, std_unbiased, dim=1)
    if group_size == 1:
        std = torch.zeros_like(std)
    normalised = (grouped - mean.unsqueeze(1)) / (std.unsqueeze(1) + eps)
    return combine_rewards(normalised.reshape(-1, n_func), weights)


def gdpo_advantages(
    rewards_per_func: torch.Tensor,
    weights: torch.Tensor,
    group_size: int,
    *,
    eps: float = 1e-4,
    std_unbiased: bool = True,
) -> torch.Tensor:
    """GDPO advantages [N]: :func:`gdpo_rewards` normalised over the whole batch, (s - mean)/(std + eps),
    as TRL's ``multi_objective_aggregation="normalize_then_sum"``. Unscorable rows get 0."""
    summed = gdpo_rewards(rewards_per_func, weights, group_size, eps=eps, std_unbiased=std_unbiased)
    mean, std = _nan_mean_std(summed, std_unbiased)
    if summed.numel() <= 1 or not bool(torch.isfinite(std)):
        std = torch.zeros_like(mean)
    advantages = (summed - mean) / (std + eps)
    return torch.where(torch.isnan(advantages), torch.zeros_like(advantages), advantages)


def compute_advantages(
    rewards: torch.Tensor,
    group_size: int,
    spec: AdvantageSpec,
    *,
    rewards_per_func: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages [N] for rewards [N] of N/G groups, with the estimator and aggregation ``spec`` names.

    GDPO needs ``rewards_per_func`` [N, F] (and ``spec.reward_weights``); REINFORCE++ whitens with the
    completions' token counts ``lengths`` [N] when given (see :func:`reinforce_pp_advantages`).
    """
    if spec.reward_aggregation == "normalize_then_sum":
        if rewards_per_func is None:
            raise ValueError("reward_aggregation='normalize_then_sum' (GDPO) needs rewards_per_func [N, F]")
        weights = torch.tensor(spec.reward_weights or [1.0] * rewards_per_func.shape[1], dtype=rewards_per_func.dtype)
        return gdpo_advantages(rewards_per_func, weights, group_size, eps=spec.eps, std_unbiased=spec.std_unbiased)
    if spec.estimator == "bnpo":
        return bnpo_advantages(rewards, group_size, reward_min=spec.reward_min, reward_max=spec.reward_max)
    if spec.estimator == "rloo":
        return rloo_advantages(rewards, group_size)
    if spec.estimator in ("reinforce_pp", "reinforce_pp_baseline"):
        baseline = spec.estimator == "reinforce_pp_baseline"
        return reinforce_pp_advantages(rewards, group_size, lengths, baseline=baseline)
    return group_advantages(
        rewards, group_size, scale_rewards=spec.scale_rewards, eps=spec.eps, std_unbiased=spec.std_unbiased
    )
