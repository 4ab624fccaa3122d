"""Log-probabilities (and the entropy) of completion tokens from the final hidden states, with the LM head
applied a chunk of tokens at a time, so that no [tokens x vocab] float32 tensor is made.

The plain path lets the model turn every kept position into logits [B, T, V] and casts them to float32: with a
150k vocabulary that is the largest tensor of a training step (600 MB per 1,000 tokens in float32, plus the
model-dtype logits and the softmax autograd keeps for the backward). Here:

* :func:`final_hidden_states` runs the model's forward with its LM head (``get_output_embeddings()``) handed no
  position: a forward pre-hook records the head's input, the final hidden states at the positions the model
  keeps (``logits_to_keep``), and the head computes [B, 0, V]. The whole forward runs as usual (PEFT wrappers,
  FSDP's hooks, autocast), only the head's product is left out.
* :func:`chunked_token_stats` applies the head to at most ``chunk_tokens`` tokens at a time and computes their
  log-probabilities (and entropy) with :func:`token_stats`, the same per-token arithmetic as the plain path.
  Under autograd each chunk is checkpointed (``torch.utils.checkpoint``, non-reentrant): its forward keeps
  only its outputs ([chunk] vectors), its backward recomputes the chunk's logits, so one chunk's
  [chunk x V] tensors exist at a time, forward or backward.

Models that change the logits after their head (Gemma's ``final_logit_softcapping``, Cohere's
``logit_scale``, Granite's ``logits_scaling``, a ``final_logits_bias``...) are refused with an error that
names the setting turning chunking off: the model's returned logits must be the very tensor its head made.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch.utils.checkpoint import checkpoint

from services.learner.logprobs.entropy import token_entropy

EntropyMode = Literal["none", "value", "grad"]
Stats = tuple[torch.Tensor, torch.Tensor | None]

_CHUNKING_OFF = (
    "set learner.logprob_chunk_tokens = 0 (LEARNER_LOGPROB_CHUNK_TOKENS=0) to compute the full logits instead"
)


def token_stats(logits: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor, entropy: EntropyMode) -> Stats:
    """log softmax(logits / T)[target] in float32 (float64 stays float64) and, unless ``entropy`` is "none",
    the entropy of softmax(logits / T) from the same scaled logits ("grad": differentiable; "value": not).

    logits [..., V], targets [...], temperatures broadcastable to targets ([B, 1] for [B, T]). No
    [tokens x vocab] tensor is added for the entropy (:mod:`services.learner.logprobs.entropy`).
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16 -> float32
    scaled = logits.to(dtype) / temperatures.to(logits.device, dtype).unsqueeze(-1)
    lse = torch.logsumexp(scaled, dim=-1)
    logprobs = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if entropy == "none":
        return logprobs, None
    return logprobs, token_entropy(scaled if entropy == "grad" else scaled.detach(), lse)


@contextmanager
def _head_skipped(head: torch.nn.Module) -> Iterator[dict[str, Any]]:
    """While open, ``head`` computes no position: its input (the hidden states it was given) goes to
    ``seen["hidden"]``, its empty output to ``seen["logits"]`` (with its version, to see in-place changes)."""
    seen: dict[str, Any] = {}

    def before(module: torch.nn.Module, args: tuple) -> tuple:
        if len(args) != 1 or "hidden" in seen:
            raise ValueError(
                f"the output embeddings ({type(module).__name__}) are called other than once with the hidden "
                f"states as their only argument; {_CHUNKING_OFF}"
            )
        seen["hidden"] = args[0]
        return (args[0][..., :0, :],)

    def after(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        seen["logits"] = output
        seen["version"] = None if output.is_inference() else output._version  # inference tensors have none

    handles = [head.register_forward_pre_hook(before), head.register_forward_hook(after)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def output_embeddings(model: torch.nn.Module) -> torch.nn.Module:
    """The model's LM head, hidden states -> logits (PEFT's wrappers hand on their base model's, with its
    adapters when the head has some)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    if not isinstance(head, torch.nn.Module):
        raise ValueError(f"{type(model).__name__} has no output embeddings (get_output_embeddings()); {_CHUNKING_OFF}")
    return head


def final_hidden_states(model: torch.nn.Module, **inputs: Any) -> tuple[torch.Tensor, Any]:
    """``model(**inputs)`` without its LM head's product: the hidden states the head would have turned into
    logits ([B, K, H], the ``logits_to_keep`` positions) and the model's output (for its cache).

    Refused (ValueError naming the setting to turn chunking off) when the model has no output embeddings, does
    not call them, or returns logits other than its head's output (a softcapping or scaling after the head).
    """
    name = type(model).__name__
    with _head_skipped(output_embeddings(model)) as seen:
        output = model(**inputs)
    if "hidden" not in seen:
        raise ValueError(f"{name}'s forward did not call its output embeddings; {_CHUNKING_OFF}")
    logits = output.logits
    changed = seen["version"] is not None and logits._version != seen["version"]
    if logits is not seen["logits"] or changed:
        raise ValueError(
            f"{name} changes its logits after its LM head (as Gemma's final_logit_softcapping, Cohere's "
            f"logit_scale or Granite's logits_scaling do), which chunked log-probabilities would leave out; "
            f"{_CHUNKING_OFF}"
        )
    return seen["hidden"], output


def _head_stats(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor, entropy: EntropyMode
) -> Stats:
    """:func:`token_stats` of one chunk: hidden [n, H] -> logits [n, V] -> log-probabilities [n] (entropy [n])."""
    return token_stats(head(hidden), targets, temperatures, entropy)


def chunked_token_stats(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperatures: torch.Tensor,
    entropy: EntropyMode,
    chunk_tokens: int,
) -> Stats:
    """:func:`token_stats` of ``head(hidden)``, ``chunk_tokens`` tokens at a time: hidden [N, H], targets [N],
    temperatures [N] -> log-probabilities [N] (and entropy [N], or None when ``entropy`` is "none").

    With gradients enabled each chunk is checkpointed, so its logits are recomputed in the backward instead of
    kept. N = 0 still runs one empty chunk: the result stays in the graph (a zero-weighted pass backpropagates).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    parts = []
    for start in range(0, max(1, hidden.shape[0]), chunk_tokens):
        span = slice(start, start + chunk_tokens)
        args = (head, hidden[span], targets[span], temperatures[span], entropy)
        if torch.is_grad_enabled():
            parts.append(checkpoint(_head_stats, *args, use_reentrant=False))
        else:
            parts.append(_head_stats(*args))
    logprobs = torch.cat([lp for lp, _ in parts])
    if entropy == "none":
        return logprobs, None
    return logprobs, torch.cat([h for _, h in parts])
