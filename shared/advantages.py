"""Group-relative advantages: how GRPO turns G rewards per prompt into a learning signal.

The scorer computes them per group; the learner redoes the ones that need the whole training batch
(``AdvantageSpec.needs_batch``) over exactly its batch, with these same functions. That is why they live in
``shared/`` and use numpy only: both services import them and neither imports the other (nor torch here).

Pure functions on float arrays (float32 or float64; the dtype of the input is kept); no I/O, settings or
logging. Groups are contiguous blocks of ``group_size`` rows: rows ``[k*G, (k+1)*G)`` are the G completions of
prompt k. Shapes: N = number of completions, F = number of reward functions.

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

The figures TRL logs next to the advantages (:func:`reward_metrics`, :func:`reward_function_metrics`,
:func:`completion_metrics`) are here too: the scorer logs them per group, the learner per batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from shared.records import AdvantageSpec

FloatArray = npt.NDArray[np.floating[Any]]
BoolArray = npt.NDArray[np.bool_]
ScaleRewards = Literal["group", "batch", "none"]

BNPO_MAX_WEIGHT = 1e6  # 1/pdf grows without bound where the fitted Beta density vanishes (p = 0 or 1)
_WHITEN_EPS = 1e-8  # verl's masked_mean / masked_whiten epsilon


def _as_float(values: npt.ArrayLike) -> FloatArray:
    """``values`` as a float array: float32 and float64 stay as they are, anything else becomes float64."""
    array = np.asarray(values)
    return array if np.issubdtype(array.dtype, np.floating) else array.astype(np.float64)


def _check_per_func(rewards_per_func: FloatArray, weights: FloatArray) -> None:
    if rewards_per_func.ndim != 2 or weights.shape != (rewards_per_func.shape[1],):
        raise ValueError(f"expected rewards [N, F] and weights [F], got {rewards_per_func.shape} and {weights.shape}")


def combine_rewards(rewards_per_func: npt.ArrayLike, weights: npt.ArrayLike) -> FloatArray:
    """Weighted sum of F reward functions per completion, ignoring NaN: ``sum_f w_f * r_f`` -> [N].

    ``rewards_per_func`` is [N, F], ``weights`` [F]. A row where every function is NaN stays NaN (TRL's
    ``nansum`` would make it 0; a reward nobody could compute is not a zero reward).
    """
    per_func = _as_float(rewards_per_func)
    w = np.asarray(weights, dtype=per_func.dtype)
    _check_per_func(per_func, w)
    missing = np.isnan(per_func)
    combined = np.where(missing, 0.0, per_func * w).sum(axis=1)
    return np.where(missing.all(axis=1), np.nan, combined)


def _grouped(rewards: FloatArray, group_size: int) -> FloatArray:
    """[N] -> [N/G, G], after checking that N is a multiple of G."""
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    if rewards.ndim != 1 or rewards.size % group_size:
        raise ValueError(
            f"expected rewards [N] with N a multiple of group_size={group_size}, got shape {rewards.shape}"
        )
    return rewards.reshape(-1, group_size)


def _nan_mean_std(values: FloatArray, unbiased: bool, axis: int | None = None) -> tuple[Any, Any]:
    """Mean and std over non-NaN entries (along ``axis``, or all). Std is NaN with too few entries."""
    present = ~np.isnan(values)
    count = np.asarray(present.sum(axis=axis)).astype(values.dtype)
    dof = count - 1 if unbiased else count
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(present, values, 0.0).sum(axis=axis) / count  # NaN where count == 0
        centred = values - (np.expand_dims(mean, axis) if axis is not None else mean)
        sum_squares = np.where(present, centred * centred, 0.0).sum(axis=axis)
        std = np.sqrt(sum_squares / np.maximum(dof, 0))
    return mean, np.where(dof > 0, std, np.nan)


def zero_std_groups(rewards: npt.ArrayLike, group_size: int) -> BoolArray:
    """[N/G] bool: groups whose non-NaN rewards all agree (or that have fewer than two), i.e. no signal."""
    grouped = _grouped(_as_float(rewards), group_size)
    present = ~np.isnan(grouped)
    high = np.where(present, grouped, -np.inf).max(axis=1)
    low = np.where(present, grouped, np.inf).min(axis=1)
    return (present.sum(axis=1) < 2) | (high == low)


def group_advantages(
    rewards: npt.ArrayLike,
    group_size: int,
    *,
    scale_rewards: ScaleRewards = "group",
    eps: float = 1e-4,
    std_unbiased: bool = True,
) -> FloatArray:
    """GRPO advantages [N] from rewards [N] (see the module docstring for the variants).

    ``group``: (r - mean_g)/(std_g + eps); ``batch``: (r - mean_g)/(std over all non-NaN rewards + eps);
    ``none``: r - mean_g. Matches TRL's GRPOTrainer (``scale_rewards``), with two documented differences:
    NaN rewards are excluded and get 0, and a group whose rewards all agree gets exactly 0 (TRL gets
    rounding noise / eps there).
    """
    flat = _as_float(rewards)
    grouped = _grouped(flat, group_size)
    mean_g, std_g = _nan_mean_std(grouped, std_unbiased, axis=1)
    centred = grouped - mean_g[:, None]
    if scale_rewards == "group":
        advantages = centred / (std_g[:, None] + eps)
    elif scale_rewards == "batch":
        _, std_b = _nan_mean_std(flat, std_unbiased)
        advantages = centred / (std_b + eps)
    elif scale_rewards == "none":
        advantages = centred
    else:
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
    no_signal = zero_std_groups(flat, group_size)[:, None] | np.isnan(grouped)
    return np.where(no_signal, 0.0, advantages).reshape(-1)


def _xlogy(x: float, y: FloatArray) -> FloatArray:
    """x * log(y), 0 where x == 0 (NaN where y is NaN), as ``torch.xlogy``; x is a scalar."""
    if x == 0:
        return np.where(np.isnan(y), np.nan, np.zeros_like(y))
    with np.errstate(divide="ignore", invalid="ignore"):
        return x * np.log(y)


def _beta_log_pdf(p: FloatArray, alpha: float, beta: float) -> FloatArray:
    log_norm = math.lgamma(alpha) + math.lgamma(beta) - math.lgamma(alpha + beta)
    return _xlogy(alpha - 1, p) + _xlogy(beta - 1, 1 - p) - log_norm


def bnpo_beta_parameters(success_rates: npt.ArrayLike) -> tuple[float, float]:
    """(alpha, beta) of BNPO's Beta fitted to the groups' mean normalised rewards p [N/G] (NaN ignored).

    m = mean(p), v = var(p) (unbiased); k = m(1-m)/v - 1; alpha = max(1 + k*m/3, 1),
    beta = max(1 + k*(1-m)/3, 1). With v = 0, v undefined (one group) or m(1-m) = 0: alpha = beta = 1.
    """
    m, s = _nan_mean_std(_as_float(success_rates), unbiased=True)
    m, v = float(m), float(s) ** 2
    if not math.isfinite(v) or v == 0.0:
        return 1.0, 1.0
    k = m * (1 - m) / v - 1
    return max(1 + k * m / 3, 1.0), max(1 + k * (1 - m) / 3, 1.0)


def bnpo_advantages(
    rewards: npt.ArrayLike,
    group_size: int,
    *,
    reward_min: float = 0.0,
    reward_max: float = 1.0,
) -> FloatArray:
    """Beta Normalization Policy Optimization advantages [N], as BNPO's authors implement them.

    s = (r - min)/(max - min); p_q = mean of s over group q; (alpha, beta) from
    :func:`bnpo_beta_parameters` over the batch's groups;
    A = min(1/Beta(alpha, beta).pdf(p_q), 1e6) * (s - p_q).
    NaN rewards get 0 and are left out of p_q. Rewards outside [reward_min, reward_max] raise ValueError.
    """
    if not reward_max > reward_min:
        raise ValueError(f"reward_max ({reward_max}) must exceed reward_min ({reward_min})")
    flat = _as_float(rewards)
    present = flat[~np.isnan(flat)]
    if present.size and (present.min() < reward_min or present.max() > reward_max):
        raise ValueError(
            f"BNPO needs rewards in [{reward_min}, {reward_max}], got values in "
            f"[{float(present.min())}, {float(present.max())}]; set reward_min/reward_max"
        )
    scaled = _grouped((flat - reward_min) / (reward_max - reward_min), group_size)
    p, _ = _nan_mean_std(scaled, unbiased=True, axis=1)
    alpha, beta = bnpo_beta_parameters(p)
    with np.errstate(over="ignore"):
        weight = np.minimum(np.exp(-_beta_log_pdf(p, alpha, beta)), BNPO_MAX_WEIGHT)  # NaN stays NaN
    advantages = weight[:, None] * (scaled - p[:, None])
    return np.where(np.isnan(advantages), 0.0, advantages).reshape(-1)


def rloo_advantages(rewards: npt.ArrayLike, group_size: int) -> FloatArray:
    """REINFORCE leave-one-out advantages [N]: r_i minus the mean of the group's other non-NaN rewards,
    i.e. n/(n-1) (r_i - mean_g) (verl ``compute_rloo_outcome_advantage``). A group with one reward keeps it
    (verl's baseline 0 for a lone sample); NaN rewards get 0."""
    grouped = _grouped(_as_float(rewards), group_size)
    present = ~np.isnan(grouped)
    n = present.sum(axis=1, keepdims=True).astype(grouped.dtype)
    mean, _ = _nan_mean_std(grouped, unbiased=False, axis=1)
    scale = np.where(n > 1, n / np.maximum(n - 1, 1.0), 1.0)
    baseline = np.where(n > 1, mean[:, None], 0.0)
    return np.where(present, scale * (grouped - baseline), 0.0).reshape(-1)


def _whiten(x: FloatArray, weight: FloatArray) -> FloatArray:
    """verl's ``masked_whiten`` of [N] values, each weighted by its token count [N] (0: left out)."""
    tokens = weight.sum()
    if float(tokens) <= 1.0:
        return np.zeros_like(x)
    mean = (weight * x).sum() / (tokens + _WHITEN_EPS)
    var = (weight * (x - mean) ** 2).sum() / (tokens + _WHITEN_EPS) * tokens / (tokens - 1)
    return (x - mean) / np.sqrt(var + _WHITEN_EPS)


def reinforce_pp_advantages(
    rewards: npt.ArrayLike, group_size: int, lengths: npt.ArrayLike | None = None, *, baseline: bool = True
) -> FloatArray:
    """REINFORCE++ advantages [N] for outcome rewards (gamma 1): optionally minus the group mean (``baseline``,
    verl ``reinforce_plus_plus_baseline``; a lone sample's baseline is 0), then whitened over the batch with
    each completion weighted by its token count ``lengths`` [N] (verl whitens over response tokens).

    ``lengths=None`` weighs every completion 1: the scorer's provisional per-group value; the learner redoes
    it over the training batch with the real token counts. NaN rewards get 0 and weigh nothing; with fewer
    than two tokens in all, there is nothing to whiten and every advantage is 0.
    """
    grouped = _grouped(_as_float(rewards), group_size)
    present = ~np.isnan(grouped)
    centred = grouped
    if baseline:
        mean, _ = _nan_mean_std(grouped, unbiased=False, axis=1)
        lone = present.sum(axis=1, keepdims=True) <= 1
        centred = grouped - np.where(lone, 0.0, mean[:, None])
    x = centred.reshape(-1)
    counts = np.ones_like(x) if lengths is None else np.asarray(lengths)
    weight = counts.astype(x.dtype).reshape(-1)
    if weight.shape != x.shape:
        raise ValueError(f"lengths must be [N] = [{x.size}], got {counts.shape}")
    keep = present.reshape(-1)
    whitened = _whiten(np.where(keep, x, 0.0), np.where(keep, weight, 0.0))
    return np.where(keep, whitened, 0.0)


def gdpo_rewards(
    rewards_per_func: npt.ArrayLike,
    weights: npt.ArrayLike,
    group_size: int,
    *,
    eps: float = 1e-4,
    std_unbiased: bool = True,
) -> FloatArray:
    """GDPO's decoupled reward [N]: sum_f w_f (r_f - mean_g,f) / (std_g,f + eps), NaN terms left out; NaN where
    every function is NaN. A group of one has std 0 (TRL), so its normalised rewards are 0."""
    per_func = _as_float(rewards_per_func)
    _check_per_func(per_func, np.asarray(weights))
    n_func = per_func.shape[1]
    _grouped(per_func[:, 0], group_size)  # checks N against group_size
    grouped = per_func.reshape(-1, group_size, n_func)  # [N/G, G, F]
    mean, std = _nan_mean_std(grouped, std_unbiased, axis=1)
    if group_size == 1:
        std = np.zeros_like(std)
    normalised = (grouped - mean[:, None, :]) / (std[:, None, :] + eps)
    return combine_rewards(normalised.reshape(-1, n_func), weights)


def gdpo_advantages(
    rewards_per_func: npt.ArrayLike,
    weights: npt.ArrayLike,
    group_size: int,
    *,
    eps: float = 1e-4,
    std_unbiased: bool = True,
) -> FloatArray:
    """GDPO advantages [N]: :func:`gdpo_rewards` normalised over the whole batch, (s - mean)/(std + eps),
    as TRL's ``multi_objective_aggregation="normalize_then_sum"``. Unscorable rows get 0."""
    summed = gdpo_rewards(rewards_per_func, weights, group_size, eps=eps, std_unbiased=std_unbiased)
    mean, std = _nan_mean_std(summed, std_unbiased)
    if summed.size <= 1 or not np.isfinite(std):
        std = np.zeros_like(mean)
    with np.errstate(invalid="ignore", divide="ignore"):
        advantages = (summed - mean) / (std + eps)
    return np.where(np.isnan(advantages), 0.0, advantages)


def compute_advantages(
    rewards: npt.ArrayLike,
    group_size: int,
    spec: AdvantageSpec,
    *,
    rewards_per_func: npt.ArrayLike | None = None,
    lengths: npt.ArrayLike | None = None,
) -> FloatArray:
    """Advantages [N] for rewards [N] of N/G groups, with the estimator and aggregation ``spec`` names.

    GDPO needs ``rewards_per_func`` [N, F] (and ``spec.reward_weights``); REINFORCE++ whitens with the
    completions' token counts ``lengths`` [N] when given (see :func:`reinforce_pp_advantages`).
    """
    if spec.reward_aggregation == "normalize_then_sum":
        if rewards_per_func is None:
            raise ValueError("reward_aggregation='normalize_then_sum' (GDPO) needs rewards_per_func [N, F]")
        per_func = _as_float(rewards_per_func)
        weights = np.asarray(spec.reward_weights or [1.0] * per_func.shape[1], dtype=per_func.dtype)
        return gdpo_advantages(per_func, weights, group_size, eps=spec.eps, std_unbiased=spec.std_unbiased)
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


# The figures TRL logs next to the advantages -------------------------------------------------------------


def reward_metrics(rewards: npt.ArrayLike, group_size: int, *, std_unbiased: bool = True) -> dict[str, float]:
    """TRL's reward figures for rewards [N]: ``reward``, ``reward_std`` (mean within-group std),
    ``frac_reward_zero_std`` (groups with no signal) and ``frac_reward_nan``."""
    flat = _as_float(rewards)
    _, std_g = _nan_mean_std(_grouped(flat, group_size), std_unbiased, axis=1)
    mean_all, _ = _nan_mean_std(flat, std_unbiased)
    zero = zero_std_groups(flat, group_size)
    return {
        "reward": float(mean_all),
        "reward_std": float(np.where(zero, 0.0, std_g).mean()),
        "frac_reward_zero_std": float(zero.mean()),
        "frac_reward_nan": float(np.isnan(flat).mean()),
    }


def reward_function_metrics(names: Sequence[str], rewards_per_func: FloatArray) -> dict[str, float]:
    """TRL's ``rewards/<name>/mean`` and ``rewards/<name>/std`` (unbiased; 0 for one value) of each
    function's non-NaN rewards, from rewards [N, F] (F = ``len(names)``); both NaN where it has none."""
    metrics: dict[str, float] = {}
    for index, name in enumerate(names):
        column = rewards_per_func[:, index]
        values = column[~np.isnan(column)]
        metrics[f"rewards/{name}/mean"] = float(values.mean()) if values.size else math.nan
        spread = float(values.std(ddof=1)) if values.size > 1 else 0.0
        metrics[f"rewards/{name}/std"] = spread if values.size else math.nan
    return metrics


def completion_metrics(lengths: Sequence[int], truncated: Sequence[bool]) -> dict[str, float]:
    """TRL's ``completions/{mean,min,max}_length`` of N completions' token counts, and
    ``completions/clipped_ratio``: the fraction ``truncated`` (cut at the token limit)."""
    counts = np.asarray(lengths, dtype=np.float64)
    return {
        "completions/mean_length": float(counts.mean()),
        "completions/min_length": float(counts.min()),
        "completions/max_length": float(counts.max()),
        "completions/clipped_ratio": float(np.mean(np.asarray(truncated, dtype=bool))),
    }
