"""Per-token entropy of the policy from the log-probabilities the loss already uses, in bounded memory.

H = -sum_v p_v log p_v with log p = log_softmax(s) over the (temperature-scaled) logits s [..., V]. Written
naively, p and p log p are two more [tokens x vocab] float32 tensors, and autograd keeps them for the backward.
Here the forward and the backward walk the log-probabilities in chunks of at most ``_CHUNK_ELEMENTS``
elements, and the only tensor kept for the backward is the log-probabilities themselves (already kept by the
log-softmax for its own backward). The backward recomputes p per chunk:

    dH/d(log p_v) = -p_v (log p_v + 1)

which the log-softmax's backward turns into dH/ds_v = -p_v (log p_v + H).
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
    """Entropy of [B, T, V] log-probabilities (any strides: slices are not copied)."""

    @staticmethod
    def forward(ctx, log_probs: torch.Tensor) -> torch.Tensor:
        out = torch.empty(log_probs.shape[:-1], dtype=log_probs.dtype, device=log_probs.device)
        for row, span in _pieces(*log_probs.shape):
            piece = log_probs[row, span]
            out[row, span] = -(torch.exp(piece) * piece).sum(dim=-1)
        ctx.save_for_backward(log_probs)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (log_probs,) = ctx.saved_tensors
        grad_log_probs = torch.empty(log_probs.shape, dtype=log_probs.dtype, device=log_probs.device)
        for row, span in _pieces(*log_probs.shape):
            piece = log_probs[row, span]
            grad_log_probs[row, span] = -torch.exp(piece) * (piece + 1.0) * grad[row, span].unsqueeze(-1)
        return grad_log_probs


def token_entropy(log_probs: torch.Tensor) -> torch.Tensor:
    """Entropy [...] (nats) of the distributions whose log-probabilities are the last dimension of
    ``log_probs`` [..., V] (a log-softmax's output), differentiable in ``log_probs`` when it requires grad."""
    if log_probs.dim() != 3:
        return token_entropy(log_probs.reshape(1, -1, log_probs.shape[-1])).reshape(log_probs.shape[:-1])
    return _ChunkedEntropy.apply(log_probs)
