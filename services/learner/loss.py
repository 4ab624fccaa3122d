"""The GRPO policy loss: clipped importance ratios, optional KL to a reference, four aggregations.

Pure: tensors in, ``(loss, metrics)`` out. Shapes: B sequences (completions) by T completion positions;
``mask`` is 1 on a completion's real tokens and 0 on padding.

Per token (TRL's GRPOTrainer ``_compute_loss``):

    rho     = exp(logprobs - old_logprobs)
    rho_c   = clamp(rho, 1 - epsilon_low, 1 + epsilon_high)
    rho_u   = min(rho, delta) if delta else rho            # two-sided clipping (INTELLECT-2), TRL ``delta``
    l       = -min(rho_u * A, rho_c * A)
    l       = l * importance_weights                       # stale-sample correction (detached), if given
    l       = l + beta * (exp(ref - logp) - (ref - logp) - 1)   # k3 KL estimator, if beta > 0

Aggregation (``loss_type``):

==========  ====================================================  ==================================
grpo        mean_i [ sum_t l*m / max(sum_t m, 1) ]                 GRPO paper, TRL ``grpo``
bnpo        sum l*m / max(sum m, 1)                                TRL ``bnpo`` (token mean of batch)
dr_grpo     sum l*m / (B * max_completion_length)                  Dr. GRPO, TRL ``dr_grpo``
dapo        sum l*m / num_items_in_batch                           DAPO, TRL ``dapo``: exact token mean
                                                                   across gradient-accumulation steps
==========  ====================================================  ==================================
"""

from __future__ import annotations

from typing import Literal

import torch

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo")


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    diff = ref_logprobs - logprobs
    return torch.exp(diff) - diff - 1


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((values * mask).sum() / mask.sum().clamp(min=1.0))


def aggregate(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: LossType,
    *,
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar the way ``loss_type`` says (see the module table)."""
    masked = per_token_loss * mask
    if loss_type == "grpo":
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        return masked.sum() / (per_token_loss.shape[0] * max_completion_length)
    if loss_type == "dapo":
        if num_items_in_batch is None:
            raise ValueError("loss_type='dapo' needs num_items_in_batch (active tokens in the optimizer step)")
        return masked.sum() / torch.as_tensor(num_items_in_batch, dtype=masked.dtype).clamp(min=1.0)
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: LossType = "grpo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO loss over a micro-batch (formulas in the module docstring).

    ``logprobs`` [B, T] carry the gradient; ``old_logprobs`` [B, T] (the proximal policy, recomputed by the
    learner), ``advantages`` [B], ``mask`` [B, T], ``ref_logprobs`` [B, T] and ``importance_weights``
    [B, T] are constants. Metrics (TRL's names): ``clip_ratio/low_mean`` (tokens with rho < 1 - eps_low
    and A < 0), ``clip_ratio/high_mean`` (rho > 1 + eps_high and A > 0), ``clip_ratio/region_mean``
    (either), ``kl`` (token mean of the k3 estimate, when beta > 0); all are token means under the mask.
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and "
            f"mask {tuple(mask.shape)} must have the same [B, T] shape"
        )
    if advantages.shape != (logprobs.shape[0],):
        raise ValueError(f"advantages must be [B] = [{logprobs.shape[0]}], got {tuple(advantages.shape)}")
    if delta is not None and delta <= 1 + epsilon_high:
        raise ValueError(f"delta ({delta}) must exceed 1 + epsilon_high ({1 + epsilon_high})")
    mask = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype).unsqueeze(1)  # [B, 1]
    ratio = torch.exp(logprobs - old_logprobs.detach())  # [B, T]
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    unclipped = torch.clamp(ratio, max=delta) if delta is not None else ratio
    per_token = -torch.min(unclipped * adv, clipped * adv)
    if importance_weights is not None:
        per_token = per_token * importance_weights.detach().to(per_token.dtype)
    metrics: dict[str, float] = {}
    if beta > 0.0:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs ref_logprobs")
        kl = k3_kl(logprobs, ref_logprobs.detach())
        per_token = per_token + beta * kl
        metrics["kl"] = _masked_mean(kl.detach(), mask)
    loss = aggregate(
        per_token,
        mask,
        loss_type,
        max_completion_length=max_completion_length,
        num_items_in_batch=num_items_in_batch,
    )
    with torch.no_grad():
        low = ((ratio < 1 - epsilon_low) & (adv < 0)).to(mask.dtype)
        high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(mask.dtype)
        metrics["clip_ratio/low_mean"] = _masked_mean(low, mask)
        metrics["clip_ratio/high_mean"] = _masked_mean(high, mask)
        metrics["clip_ratio/region_mean"] = _masked_mean(torch.maximum(low, high), mask)
    return loss, metrics
