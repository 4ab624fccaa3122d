"""Per-token entropy of the policy from the logits the log-probabilities already use, in bounded memory.

H = logsumexp(s) - sum_v softmax(s)_v s_v for the temperature-scaled logits s [..., V]. Written naively,
softmax and its product with s are two more [tokens x vocab] float32 tensors, and autograd keeps them for the
backward. Here the forward and the backward walk the logits in chunks of at most ``_CHUNK_ELEMENTS``
elements, and the only tensors kept for the backward are the logits themselves (already kept by the
log-probabilities' log-softmax) and two [tokens] vectors. The backward recomputes softmax per chunk:

    dH/ds_v = -p_v (log p_v + H),   log p_v = s_v - logsumexp(s)
"""

from __future__ import annotations

import torch

_CHUNK_ELEMENTS = 1 << 24  # 64 MiB of float32 per temporary: a few hundred positions of a 150k vocabulary


def _pieces(rows: int, positions: int, vocab: int):
    """(row, position slice) pieces of a [rows, positions, V] tensor, each at most ``_CHUNK_ELEMENTS``."""
    step = max(1, _CHUNK_ELEMENTS // max(1, vocab))
    for row in range(rows):
        for start in range(0, positions, step):
            yield row, slice(start, start + step)


class _ChunkedEntropy(torch.autograd.Function):
    """Entropy of [B, T, V] scaled logits (any strides: slices of the model's logits are not copied)."""

    @staticmethod
    def forward(ctx, scaled: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(lse)
        for row, span in _pieces(*scaled.shape):
            s = scaled[row, span]
            out[row, span] = lse[row, span] - (torch.exp(s - lse[row, span].unsqueeze(-1)) * s).sum(dim=-1)
        ctx.save_for_backward(scaled, lse, out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scaled, lse, entropy = ctx.saved_tensors
        grad_scaled = torch.empty(scaled.shape, dtype=scaled.dtype, device=scaled.device)
        for row, span in _pieces(*scaled.shape):
            log_p = scaled[row, span] - lse[row, span].unsqueeze(-1)
            weight = (log_p + entropy[row, span].unsqueeze(-1)) * grad[row, span].unsqueeze(-1)
            grad_scaled[row, span] = -torch.exp(log_p) * weight
        return grad_scaled, None


def token_entropy(scaled: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy [...] (nats) of softmax over the last dimension of ``scaled`` [..., V], differentiable in
    ``scaled`` when it requires grad. ``lse``: its logsumexp over V when already computed (detached here)."""
    if scaled.dim() != 3:
        return token_entropy(
            scaled.reshape(1, -1, scaled.shape[-1]), None if lse is None else lse.reshape(1, -1)
        ).reshape(scaled.shape[:-1])
    if lse is None:
        with torch.no_grad():
            lse = torch.logsumexp(scaled, dim=-1)
    return _ChunkedEntropy.apply(scaled, lse.detach())
