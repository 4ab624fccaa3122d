"""Importance weights for stale samples (the staleness rule itself is :mod:`services.learner.data.staleness`).

Asynchronous GRPO trains on completions sampled by an older policy (the behaviour policy, whose per-token
logprobs the generator recorded). Following AReaL's decoupled objective, the learner recomputes
``old_logprobs`` under its current weights (the proximal policy, used inside the clipped ratio) and
corrects for the gap between proximal and behaviour policy with a weight per token:

    d = clamp((old - behaviour) * mask, -20, 20)
    token level:     w_t = exp(d_t)
    sequence level:  w_t = exp(clamp(sum_t d_t, -20, 20)) for every token of the sequence
    truncate mode:   w = min(w, cap), and max(w, cap_min) when cap_min is given   (TIS, as TRL's
                     ``vllm_importance_sampling_mode="token_truncate"``)
    mask mode:       w = w * 1[cap_min <= w <= cap], cap_min defaulting to -inf     (MIS / TRL ``*_mask``)

The weights carry no gradient. Padding positions get d = 0 (weight 1 at token level); the loss masks them.
"""

from __future__ import annotations

from typing import Literal

import torch

ImportanceLevel = Literal["token", "sequence"]
ImportanceMode = Literal["truncate", "mask"]

MAX_LOG_RATIO = 20.0  # exp() stays finite in float32 (e^20 ~ 4.9e8) and in bf16


@torch.no_grad()
def importance_weights(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: ImportanceLevel = "token",
    mode: ImportanceMode = "truncate",
    cap: float = 2.0,
    cap_min: float | None = None,
) -> torch.Tensor:
    """Weights pi_old / pi_behaviour, [B, T], truncated or masked (see the module docstring)."""
    if old_logprobs.shape != behaviour_logprobs.shape or old_logprobs.shape != mask.shape:
        raise ValueError("old_logprobs, behaviour_logprobs and mask must have the same [B, T] shape")
    if cap_min is not None and cap_min > cap:
        raise ValueError(f"cap_min ({cap_min}) must not exceed cap ({cap})")
    mask = mask.to(old_logprobs.dtype)
    log_ratio = torch.clamp((old_logprobs - behaviour_logprobs) * mask, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    if level == "token":
        weights = torch.exp(log_ratio)
    elif level == "sequence":
        per_sequence = torch.clamp(log_ratio.sum(dim=1, keepdim=True), -MAX_LOG_RATIO, MAX_LOG_RATIO)
        weights = torch.exp(per_sequence).expand_as(log_ratio).clone()
    else:
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    return _bound(weights, mode, cap, cap_min)


def _bound(weights: torch.Tensor, mode: ImportanceMode, cap: float, cap_min: float | None) -> torch.Tensor:
    """[B, T] weights truncated to [cap_min, cap] or masked outside it (see the module docstring)."""
    if mode == "truncate":
        weights = torch.clamp(weights, max=cap)
        return weights if cap_min is None else torch.clamp(weights, min=cap_min)
    if mode == "mask":
        low = -float("inf") if cap_min is None else cap_min
        return weights * ((weights >= low) & (weights <= cap)).to(weights.dtype)
    raise ValueError(f"mode must be 'truncate' or 'mask', got {mode!r}")


def importance_weight_metrics(weights: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """``sampling/importance_sampling_ratio/{min,mean,max}`` over active tokens (TRL's names)."""
    active = weights[mask.bool()]
    if active.numel() == 0:
        return {}
    return {
        "sampling/importance_sampling_ratio/min": float(active.min()),
        "sampling/importance_sampling_ratio/mean": float(active.mean()),
        "sampling/importance_sampling_ratio/max": float(active.max()),
    }
