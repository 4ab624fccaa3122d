"""The policy losses users pick by name in TRL 1.16 and verl 0.9, with KL, masks and the entropy bonus.

Pure: :class:`LossInputs` (one micro-batch's tensors), :class:`~shared.config.objective.Objective` (the settings) and
:class:`BatchNormalisers` (counts of the optimizer batch the micro-batch belongs to) in, :class:`LossOutputs`
(scalar loss and a flat dict of metrics) out. This module alone turns the per-token loss into the scalar to
backward; the learner only sums micro-batch gradients. Shapes: B sequences (completions) by T completion
positions; ``mask`` is 1 on the tokens the policy sampled and 0 on padding and on a multi-turn trajectory's
context tokens (tool results, template tokens: the batch's ``loss_mask``).

Ratio (``ratio_level``, TRL ``importance_sampling_level``), on the proximal policy ``old``:

    token:     r_t = exp(logp_t - old_t)                                   [B, T]
    sequence:  r   = exp(mean_t (logp_t - old_t) over the mask)            [B, 1]   GSPO

Per-token objective ``l`` (``loss_type``; A is the sequence's advantage, eps_l/eps_h the clip range):

==========  ===================================================================  ===========================
grpo, bnpo  -min(r_u A, clip(r, 1-eps_l, 1+eps_h) A),  r_u = min(r, delta)         PPO clip; TRL, verl vanilla
dr_grpo,
dapo, luspo
cispo       -sg(clamp(r, cispo_clip_min, cispo_clip_max)) A logp                    MiniMax-M1; TRL, verl
sapo        -(4/tau) sigmoid(tau (r - 1)) A,  tau = tau_pos if A > 0 else tau_neg   SAPO; TRL, verl
vespo       -sg(phi(w)) A logp,  phi(w) = exp(lam + k log w - lam w),               VESPO; TRL
            w = exp(sum_t (logp - old) + sum_t log iw), (k, lam) by sign of A
geo_mean    -A exp(mean_t s(clamp_s(logp - old, -eps_l, eps_h))) * geo-mean(iw)     GMPO; verl ``geo_mean``
            (one value per sequence; clamp_s clips only in the direction of A)
kl_cov      -A r, plus kl_cov_coef |logp - old| on the top kl_cov_ratio tokens      verl ``kl_cov``
            ranked by cov = (A - mean A)(logp - mean logp) over the micro-batch
==========  ===================================================================  ===========================

Then, in TRL's order: ``l *= off-policy sequence mask`` (DeepSeek-V3.2: drop a sequence when A < 0 and
mean_t (behaviour - logp) > ``off_policy_mask_threshold``); ``l *= entropy mask`` (keep tokens whose entropy
is at least the ``1 - top_entropy_quantile`` quantile, "Beyond the 80/20 rule"); ``l *= importance_weights``
(behaviour correction, detached; VESPO folds them into w instead and GMPO takes their geometric mean);
``l += beta * KL`` with ``kl_estimator`` (below), times the ratio r when ``kl_bias_correction`` (TRL
``use_bias_correction_kl``).

KL estimators of KL(pi || pi_ref) per token, with x = logp - ref (Schulman's k1/k2/k3; verl's names):
k1 = x; abs = |x|; k2 = x^2 / 2; k3 = exp(-x) + x - 1 (TRL); low_var_kl = clamp(k3 on clamp(x, ±20), ±10) (verl).

Aggregation (each loss type keeps its peer's; ``aggregation`` overrides it, as verl's ``loss_agg_mode``):

==========  =================================================  ======================================
grpo        sum_i [ sum_t l m / max(sum_t m, 1) ] / N_seq      grpo, sapo, geo_mean; verl seq-mean-token-mean
bnpo        sum l m / max(N_tok, 1)                            bnpo (token mean)
dr_grpo     sum l m / (N_seq * max_completion_length)          dr_grpo; verl seq-mean-token-sum-norm
dapo        sum l m / num_items_in_batch                       dapo, cispo, vespo, kl_cov; verl token-mean
seq_sum     sum_i [ sum_t l m ] / N_seq                        luspo; verl seq-mean-token-sum
==========  =================================================  ======================================

The counts come from :class:`BatchNormalisers`: N_seq (``num_sequences``) and N_tok (``num_tokens``) are the
optimizer batch's completions and loss tokens, so the micro-batches' losses add up to the batch's; left None
they are this micro-batch's own B and sum m (TRL's bnpo is the micro-batch's token mean). ``dapo`` divides by
``num_items_in_batch`` as TRL does, and has no default. :meth:`BatchNormalisers.of_batch` sets N_tok =
num_items_in_batch = the batch's loss tokens, so that ``bnpo`` and ``dapo`` are both the exact token mean of
the whole batch. Truncated completions (``truncated`` with ``mask_truncated_completions``) leave the mask,
hence every sum and count above, like TRL. The entropy bonus is ``- entropy_coef * sum(H m_e) / sum(m_e)`` over
the tokens the policy term acts on (m_e: mask times the entropy mask; the count is ``num_entropy_tokens`` when
given), independent of the aggregation (TRL).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shared.config.objective import (
    AGGREGATIONS,
    CLIPPED_LOSSES,
    KL_ESTIMATORS,
    LOSS_TYPES,
    KlEstimator,
    Objective,
    RatioLevel,
)

# The settings, their lists of names and their cross-field checks are defined once, in shared/config/objective.py.
_MAX_LOG_RATIO = 20.0  # exp() stays finite; VESPO and verl's estimators clamp log-ratios here
_VESPO_MIN_LOG_W = math.log(1e-8)  # VESPO's lower clamp of the sequence log-weight (its reference code)
_LOW_VAR_KL_MAX = 10.0  # verl clamps low_var_kl to [-10, 10]
_VESPO_MIN_LAMBDA = 1e-4  # VESPO's reference code keeps the decay positive
_GMPO_EPS = 1e-8  # verl's GMPO divides by (length + 1e-8), not max(length, 1)
_GMPO_LOG_EPS = 1e-10  # verl's GMPO takes log(w + 1e-10) of the importance weights


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch of B completions. Only ``logprobs`` (and ``entropies``, for the bonus) carry a gradient.

    ``truncated``: completions that hit the length limit, dropped from the mask when given.
    """

    logprobs: torch.Tensor  # [B, T] the policy's, with gradient
    old_logprobs: torch.Tensor  # [B, T] the proximal policy's (the ratio's denominator)
    advantages: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, T] 1 on tokens the policy sampled (the batch's loss_mask), 0 on context and padding
    ref_logprobs: torch.Tensor | None = None  # [B, T] the reference model's (beta > 0)
    behaviour_logprobs: torch.Tensor | None = None  # [B, T] the generator's (off-policy mask)
    importance_weights: torch.Tensor | None = None  # [B, T] pi_old / pi_behaviour, constants
    entropies: torch.Tensor | None = None  # [B, T] per-token policy entropy (entropy mask, bonus)
    truncated: torch.Tensor | None = None  # [B] bool


@dataclass(frozen=True)
class BatchNormalisers:
    """Counts of the optimizer batch a micro-batch belongs to, which its loss is divided by so that the
    micro-batches' losses add up to the batch's (module docstring). A count left None is the micro-batch's own:
    the micro-batch is the whole batch."""

    num_sequences: float | None = None  # N_seq: completions (grpo, dr_grpo, seq_sum)
    num_tokens: float | torch.Tensor | None = None  # N_tok: tokens the loss sums over (bnpo)
    num_items_in_batch: float | torch.Tensor | None = None  # dapo's denominator, TRL's name; no default
    num_entropy_tokens: float | torch.Tensor | None = None  # tokens the entropy bonus averages over
    # The entropy quantile over the whole batch (:func:`entropy_threshold`); None takes it over the micro-batch.
    entropy_threshold: float | torch.Tensor | None = None

    @classmethod
    def of_batch(
        cls,
        loss_mask: torch.Tensor,
        *,
        entropy_threshold: float | torch.Tensor | None = None,
        num_entropy_tokens: float | None = None,
    ) -> BatchNormalisers:
        """The counts of a whole optimizer batch from its loss mask [B, T] (truncated completions already
        out when they are masked): bnpo and dapo both become the batch's exact token mean."""
        tokens = float(loss_mask.sum())
        return cls(
            num_sequences=float(loss_mask.shape[0]),
            num_tokens=tokens,
            num_items_in_batch=tokens,
            num_entropy_tokens=tokens if num_entropy_tokens is None else num_entropy_tokens,
            entropy_threshold=entropy_threshold,
        )


WHOLE_BATCH = BatchNormalisers()  # a micro-batch that is its own optimizer batch


@dataclass(frozen=True)
class LossOutputs:
    """``loss``: scalar to backward. ``metrics``: token means under the mask (TRL's names), plus
    ``entropy`` when entropies were given."""

    loss: torch.Tensor  # [] scalar
    metrics: dict[str, float]
    # Entropy summed over the tokens the policy term acts on, and their count: what the adaptive entropy
    # controller measures over the optimizer batch (0 when no entropies were given).
    acting_entropy_sum: float = 0.0
    acting_tokens: float = 0.0


# KL -----------------------------------------------------------------------------------------------------


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    diff = ref_logprobs - logprobs
    return torch.exp(diff) - diff - 1


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KlEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) by name (see the module docstring)."""
    x = logprobs - ref_logprobs
    if estimator == "k1":
        return x
    if estimator == "abs":
        return x.abs()
    if estimator == "k2":
        return 0.5 * x.square()
    if estimator == "k3":
        return k3_kl(logprobs, ref_logprobs)
    if estimator == "low_var_kl":
        d = torch.clamp(-x, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return torch.clamp(torch.exp(d) - d - 1, -_LOW_VAR_KL_MAX, _LOW_VAR_KL_MAX)
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


# Masks and entropy ----------------------------------------------------------------------------------------


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((values.expand_as(mask) * mask).sum() / mask.sum().clamp(min=1.0))


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, 1] mean of ``values`` over each row's masked positions (0 for an empty row)."""
    return (values * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)


def entropy_threshold(active_entropies: torch.Tensor, top_quantile: float) -> torch.Tensor:
    """The ``1 - top_quantile`` quantile (linear interpolation, as ``torch.quantile``) of a 1-D tensor of the
    optimizer batch's active-token entropies; tokens at or above it are the top ``top_quantile`` fraction.

    Sorting instead of ``torch.quantile``, whose input is limited to 2**24 elements.
    """
    values = active_entropies.detach().reshape(-1).to(torch.float64)
    if values.numel() == 0:
        return torch.tensor(float("inf"), dtype=torch.float64)
    ordered = values.sort().values
    position = (1.0 - top_quantile) * (ordered.numel() - 1)
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
    """[B, T] 1.0 on active tokens whose entropy is at least ``threshold`` (TRL ``get_high_entropy_mask``)."""
    threshold = torch.as_tensor(threshold, dtype=entropies.dtype, device=entropies.device)
    return ((entropies.detach() >= threshold) & mask.bool()).to(mask.dtype)


def off_policy_mask(
    advantages: torch.Tensor,
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """[B, 1] DeepSeek-V3.2 off-policy sequence mask: 0 where A < 0 and the sequence's mean
    (behaviour - logp) exceeds ``threshold`` (TRL ``get_off_policy_mask``; NaN behaviour tokens count 0)."""
    gap = torch.nan_to_num(behaviour_logprobs - logprobs.detach(), nan=0.0)
    keep = (advantages.unsqueeze(1) >= 0) | (sequence_mean(gap, mask) <= threshold)
    return keep.to(mask.dtype)


def adaptive_entropy_coef(
    coef: float, entropy: float, *, target: float, delta: float, coef_min: float, coef_max: float
) -> float:
    """Skywork-OR1's controller as TRL runs it after each optimizer step: raise the coefficient by ``delta``
    while the batch's entropy is at or below ``target``, lower it otherwise, within [coef_min, coef_max].
    The bonus applies only while entropy <= target (TRL gates the step's coefficient on the last entropy)."""
    if entropy <= target:
        return min(coef + delta, coef_max)
    return max(coef - delta, coef_min)


# Objectives -----------------------------------------------------------------------------------------------


def log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, level: RatioLevel
) -> torch.Tensor:
    """log r: [B, T] at token level, [B, 1] (the masked mean, GSPO) at sequence level."""
    diff = logprobs - old_logprobs.detach()
    if level == "token":
        return diff
    if level == "sequence":
        return sequence_mean(diff, mask)
    raise ValueError(f"ratio_level must be 'token' or 'sequence', got {level!r}")


def _clip_objective(ratio: torch.Tensor, adv: torch.Tensor, c: Objective) -> tuple[torch.Tensor, dict]:
    clipped = torch.clamp(ratio, 1 - c.epsilon_low, 1 + c.epsilon_high)
    unclipped = torch.clamp(ratio, max=c.delta) if c.delta is not None else ratio
    with torch.no_grad():
        low = (ratio < 1 - c.epsilon_low) & (adv < 0)
        high = (ratio > 1 + c.epsilon_high) & (adv > 0)
    flags = {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high, "clip_ratio/region_mean": low | high}
    return -torch.min(unclipped * adv, clipped * adv), flags


def _cispo_objective(ratio, adv, logprobs, c: Objective) -> tuple[torch.Tensor, dict]:
    weight = torch.clamp(ratio, min=c.cispo_clip_min, max=c.cispo_clip_max).detach()
    with torch.no_grad():
        flags = {"cispo_clip_ratio": (ratio > c.cispo_clip_max) & (adv > 0)}
    return -weight * adv * logprobs, flags


def _sapo_objective(ratio, adv, c: Objective) -> torch.Tensor:
    # Constants enter as tensors of the inputs' dtype: a Python float in torch.where becomes float32 first.
    pos, neg = torch.full_like(adv, c.sapo_temperature_pos), torch.full_like(adv, c.sapo_temperature_neg)
    tau = torch.where(adv > 0, pos, neg).to(ratio.dtype)
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv


@torch.no_grad()
def vespo_weights(
    advantages: torch.Tensor,
    token_log_ratio: torch.Tensor,
    mask: torch.Tensor,
    importance_weights: torch.Tensor | None,
    c: Objective,
) -> torch.Tensor:
    """[B, 1] VESPO's Gamma weight phi(w) = exp(lam + k log w - lam w) of the sequence ratio w (phi(1) = 1).

    log w = sum_t clamp(logp - old, ±20) + sum_t clamp(log iw, log 1e-8, 20), clamped to [log 1e-8, 20];
    with sequence-level importance weights the sequence's one log-weight is added once.
    """
    log_w = (torch.clamp(token_log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO) * mask).sum(dim=1, keepdim=True)
    if importance_weights is not None:
        log_iw = torch.clamp(torch.log(importance_weights), _VESPO_MIN_LOG_W, _MAX_LOG_RATIO)
        if c.importance_level == "sequence":
            log_w = log_w + sequence_mean(log_iw, mask)
        else:
            log_w = log_w + (log_iw * mask).sum(dim=1, keepdim=True)
    log_w = torch.clamp(log_w, _VESPO_MIN_LOG_W, _MAX_LOG_RATIO)
    nonneg = advantages.unsqueeze(1) >= 0

    def by_sign(pos: float, neg: float) -> torch.Tensor:  # [B, 1] in log_w's dtype (float64 stays float64)
        return torch.where(nonneg, torch.full_like(log_w, pos), torch.full_like(log_w, neg))

    k = by_sign(c.vespo_k_pos, c.vespo_k_neg)
    lam = by_sign(c.vespo_lambda_pos, c.vespo_lambda_neg).clamp(min=_VESPO_MIN_LAMBDA)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _geo_mean_objective(inp: LossInputs, mask, adv, weights, c: Objective) -> tuple[torch.Tensor, dict]:
    """[B, 1] GMPO sequence loss (verl ``geo_mean``), importance weights folded in as a geometric mean."""
    diff = inp.logprobs - inp.old_logprobs.detach()
    sign = torch.sign(adv)
    clamped = torch.clamp(diff, -c.epsilon_low, c.epsilon_high)
    chosen = sign * torch.min(sign * diff, sign * clamped)
    length = mask.sum(dim=1, keepdim=True) + _GMPO_EPS
    seq = -adv * torch.exp((chosen * mask).sum(dim=1, keepdim=True) / length)
    if weights is not None:
        seq = seq * torch.exp((torch.log(weights + _GMPO_LOG_EPS) * mask).sum(dim=1, keepdim=True) / length)
    with torch.no_grad():
        clipped = diff != clamped
        flags = {"clip_ratio/high_mean": clipped & (adv > 0), "clip_ratio/low_mean": clipped & (adv < 0)}
    return seq, flags


def _kl_cov_objective(inp: LossInputs, mask, adv, c: Objective) -> tuple[torch.Tensor, dict]:
    """verl ``kl_cov``: -A r, plus kl_cov_coef |log r| on the top-covariance tokens of the micro-batch."""
    diff = inp.logprobs - inp.old_logprobs.detach()
    per_token = -adv * torch.exp(diff)
    active = mask.bool()
    n_active = int(active.sum())
    if n_active == 0:
        return per_token, {"kl_cov/selected_mean": active}
    with torch.no_grad():
        adv_t = adv.expand_as(diff)[active]
        logp_t = inp.logprobs.detach()[active]
        cov = (adv_t - adv_t.mean()) * (logp_t - logp_t.mean())
        top = torch.topk(cov, max(1, int(n_active * c.kl_cov_ratio))).indices
        chosen = torch.zeros(n_active, dtype=torch.bool, device=cov.device)
        chosen[top] = True
        selected = torch.zeros_like(active)
        selected[active] = chosen
    per_token = per_token + c.kl_cov_coef * diff.abs() * selected.to(diff.dtype)
    return per_token, {"kl_cov/selected_mean": selected}


def _objective(
    inp: LossInputs, mask: torch.Tensor, adv: torch.Tensor, ratio: torch.Tensor, weights, c: Objective
) -> tuple[torch.Tensor, dict]:
    """The per-token (or [B, 1] per-sequence) objective ``l`` and its boolean metric flags."""
    if c.loss_type in CLIPPED_LOSSES:
        return _clip_objective(ratio, adv, c)
    if c.loss_type == "cispo":
        return _cispo_objective(ratio, adv, inp.logprobs, c)
    if c.loss_type == "sapo":
        return _sapo_objective(ratio, adv, c), {}
    if c.loss_type == "vespo":
        diff = inp.logprobs.detach() - inp.old_logprobs.detach()
        phi = vespo_weights(inp.advantages, diff, mask, weights, c)
        return -phi * adv * inp.logprobs, {"vespo/phi_seq_mean": phi}
    if c.loss_type == "geo_mean":
        return _geo_mean_objective(inp, mask, adv, weights, c)
    if c.loss_type == "kl_cov":
        return _kl_cov_objective(inp, mask, adv, c)
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {c.loss_type!r}")


def _token_count(aggregation: str, mask: torch.Tensor, batch: BatchNormalisers, dtype: torch.dtype) -> torch.Tensor:
    """The token mean's denominator: N_tok (``bnpo``, default this micro-batch's) or ``num_items_in_batch``
    (``dapo``, required), at least 1."""
    if aggregation == "bnpo":
        tokens = batch.num_tokens if batch.num_tokens is not None else mask.sum()
    elif batch.num_items_in_batch is None:
        raise ValueError(
            "the 'dapo' aggregation (loss_type dapo, cispo, vespo, kl_cov) needs num_items_in_batch "
            "(active tokens in the optimizer step)"
        )
    else:
        tokens = batch.num_items_in_batch
    return torch.as_tensor(tokens, dtype=dtype).clamp(min=1.0)


def aggregate(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str,
    batch: BatchNormalisers = WHOLE_BATCH,
    *,
    max_completion_length: int | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] (or [B, 1]) per-token loss under the [B, T] mask to a scalar, the way ``aggregation``
    says with ``batch``'s counts (module docstring)."""
    masked = per_token_loss * mask
    n_seq = float(batch.num_sequences) if batch.num_sequences is not None else float(mask.shape[0])
    if aggregation == "grpo":
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).sum() / n_seq
    if aggregation in ("bnpo", "dapo"):
        return masked.sum() / _token_count(aggregation, mask, batch, masked.dtype)
    if aggregation == "dr_grpo":
        if not max_completion_length:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        return masked.sum() / (n_seq * max_completion_length)
    if aggregation == "seq_sum":
        return masked.sum() / n_seq
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def _check_inputs(inp: LossInputs, c: Objective) -> None:
    shape = inp.logprobs.shape
    if inp.old_logprobs.shape != shape or inp.mask.shape != shape:
        raise ValueError(
            f"logprobs {tuple(shape)}, old_logprobs {tuple(inp.old_logprobs.shape)} and "
            f"mask {tuple(inp.mask.shape)} must have the same [B, T] shape"
        )
    if inp.advantages.shape != (shape[0],):
        raise ValueError(f"advantages must be [B] = [{shape[0]}], got {tuple(inp.advantages.shape)}")
    if c.beta > 0.0 and inp.ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs")
    if c.off_policy_mask_threshold is not None and inp.behaviour_logprobs is None:
        raise ValueError("off_policy_mask_threshold needs behaviour_logprobs (the generator's)")
    needs_entropy = c.top_entropy_quantile < 1.0 or c.entropy_coef != 0.0
    if needs_entropy and inp.entropies is None:
        raise ValueError("top_entropy_quantile < 1 and entropy_coef != 0 need per-token entropies")


def active_mask(mask: torch.Tensor, truncated: torch.Tensor | None) -> torch.Tensor:
    """[B, T] the tokens the loss sums over: ``mask`` [B, T] minus the ``truncated`` [B] completions when given
    (the learner passes them with ``mask_truncated_completions``). The one place this mask is built."""
    if truncated is None:
        return mask
    return mask * (~truncated.bool()).to(mask.dtype).unsqueeze(1)


def _entropy_mask(
    entropies: torch.Tensor, mask: torch.Tensor, top_quantile: float, threshold: float | torch.Tensor | None
) -> torch.Tensor:
    """[B, T] the entropy mask: tokens at or above ``threshold`` (None: this micro-batch's quantile)."""
    if threshold is None:
        threshold = entropy_threshold(entropies[mask.bool()], top_quantile)
    return high_entropy_mask(entropies, mask, threshold)


def _policy_terms(
    inp: LossInputs, mask: torch.Tensor, c: Objective, threshold: float | torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The per-token loss ``l`` [B, T] (or [B, 1]) in TRL's order (module docstring), the [B, T] tokens the
    policy term acts on (``mask`` times the entropy mask) and the metrics. Inputs are checked already."""
    dtype = inp.logprobs.dtype
    adv = inp.advantages.to(dtype).unsqueeze(1)  # [B, 1]
    weights = inp.importance_weights.detach().to(dtype) if inp.importance_weights is not None else None
    ratio = torch.exp(log_ratio(inp.logprobs, inp.old_logprobs, mask, c.ratio_level))  # [B, T] or [B, 1]
    per_token, flags = _objective(inp, mask, adv, ratio, weights, c)
    metrics: dict[str, float] = {}
    if c.off_policy_mask_threshold is not None and inp.behaviour_logprobs is not None:
        keep = off_policy_mask(adv[:, 0], inp.logprobs, inp.behaviour_logprobs, mask, c.off_policy_mask_threshold)
        per_token = per_token * keep
        metrics["off_policy_mask/masked_mean"] = _masked_mean(1.0 - keep, mask)
    acting = mask
    if c.top_entropy_quantile < 1.0 and inp.entropies is not None:
        entropy_mask = _entropy_mask(inp.entropies, mask, c.top_entropy_quantile, threshold)
        per_token = per_token * entropy_mask
        acting = mask * entropy_mask
    if weights is not None and c.loss_type not in ("vespo", "geo_mean"):  # those two fold the weights in
        per_token = per_token * weights
    if c.beta > 0.0 and inp.ref_logprobs is not None:
        kl = kl_estimate(inp.logprobs, inp.ref_logprobs.detach(), c.kl_estimator)
        kl = kl * ratio if c.kl_bias_correction else kl
        per_token = per_token + c.beta * kl
        metrics["kl"] = _masked_mean(kl.detach(), mask)
    metrics.update({name: _masked_mean(flag.detach().to(dtype), mask) for name, flag in flags.items()})
    return per_token, acting, metrics


def compute_loss(inp: LossInputs, config: Objective, batch: BatchNormalisers = WHOLE_BATCH) -> LossOutputs:
    """The loss of one micro-batch (formulas and order of the terms in the module docstring), divided by the
    counts of the optimizer ``batch`` it belongs to (by default it is the whole batch)."""
    _check_inputs(inp, config)
    mask = active_mask(inp.mask.to(inp.logprobs.dtype), inp.truncated)
    per_token, acting, metrics = _policy_terms(inp, mask, config, batch.entropy_threshold)
    aggregation = config.resolved_aggregation
    loss = aggregate(per_token, mask, aggregation, batch, max_completion_length=config.max_completion_length)
    if inp.entropies is None:
        return LossOutputs(loss=loss, metrics=metrics)
    if config.entropy_coef != 0.0:  # TRL's bonus: the mean entropy over the tokens the policy term acts on
        count = batch.num_entropy_tokens if batch.num_entropy_tokens is not None else acting.sum()
        count = torch.as_tensor(count, dtype=inp.entropies.dtype).clamp(min=1.0)
        loss = loss - config.entropy_coef * (inp.entropies * acting).sum() / count
    entropies = inp.entropies.detach()
    metrics["entropy"] = _masked_mean(entropies, mask)
    return LossOutputs(loss, metrics, float((entropies * acting).sum()), float(acting.sum()))
