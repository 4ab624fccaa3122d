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
from typing import Any, Literal, cast

import torch
from torch.utils.checkpoint import checkpoint

from services.learner.logprobs.entropy import token_entropy

EntropyMode = Literal["none", "value", "grad"]
Stats = tuple[torch.Tensor, torch.Tensor | None]

_CHUNKING_OFF = (
    "set learner.logprob_chunk_tokens = 0 (LEARNER_LOGPROB_CHUNK_TOKENS=0) to compute the full logits instead"
)


def token_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor | None, entropy: EntropyMode
) -> Stats:
    """log softmax(logits / T)[target] in float32 (float64 stays float64) and, unless ``entropy`` is "none",
    the entropy of softmax(logits / T) from the same log-probabilities ("grad": differentiable; "value": not,
    and computed outside the graph).

    logits [..., V], targets [...], temperatures broadcastable to targets ([B, 1] for [B, T]), or None when every
    temperature is 1 (no division). One fused log-softmax over the vocabulary (its backward is one pass too); no
    [tokens x vocab] tensor is added for the entropy (:mod:`services.learner.logprobs.entropy`).
    """
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> float32
    if temperatures is not None:
        scaled = scaled / temperatures.to(logits.device, scaled.dtype).unsqueeze(-1)
    log_probs = torch.log_softmax(scaled, dim=-1)
    logprobs = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if entropy == "none":
        return logprobs, None
    if entropy == "grad":
        return logprobs, token_entropy(log_probs)
    with torch.no_grad():
        return logprobs, token_entropy(log_probs.detach())


def token_temperatures(temperatures: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
    """Each token's sampling temperature [M] at the [B, T] ``mask``'s positions, from each row's [B] (its
    row's); None stays None (every temperature 1)."""
    return None if temperatures is None else temperatures.to(mask.device)[:, None].expand(mask.shape)[mask]


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
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperatures: torch.Tensor | None,
    entropy: EntropyMode,
) -> Stats:
    """:func:`token_stats` of one chunk: hidden [n, H] -> logits [n, V] -> log-probabilities [n] (entropy [n])."""
    return token_stats(head(hidden), targets, temperatures, entropy)


def _checkpointed_stats(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperatures: torch.Tensor | None,
    entropy: EntropyMode,
) -> Stats:
    """:func:`_head_stats` of one chunk under autograd, its logits recomputed in the backward. The recompute
    rebuilds what the gradient needs and no more: a "value" entropy (outside the graph) comes from the first run
    alone."""
    if entropy != "value":
        return checkpoint(_head_stats, head, hidden, targets, temperatures, entropy, use_reentrant=False)
    values: list[torch.Tensor] = []

    def logprobs_once(head, hidden, targets, temperatures) -> torch.Tensor:
        logprobs, entropies = _head_stats(head, hidden, targets, temperatures, "none" if values else "value")
        if entropies is not None:
            values.append(entropies)
        return logprobs

    logprobs = checkpoint(logprobs_once, head, hidden, targets, temperatures, use_reentrant=False)
    return logprobs, values[0]


def chunked_token_stats(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperatures: torch.Tensor | None,
    entropy: EntropyMode,
    chunk_tokens: int,
) -> Stats:
    """:func:`token_stats` of ``head(hidden)``, ``chunk_tokens`` tokens at a time: hidden [N, H], targets [N],
    temperatures [N] (None: all 1) -> log-probabilities [N] (and entropy [N], or None when ``entropy`` is "none").

    With gradients enabled each chunk is checkpointed, so its logits are recomputed in the backward instead of
    kept. N = 0 still runs one empty chunk: the result stays in the graph (a zero-weighted pass backpropagates).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    parts = []
    for start in range(0, max(1, hidden.shape[0]), chunk_tokens):
        span = slice(start, start + chunk_tokens)
        args = (head, hidden[span], targets[span], None if temperatures is None else temperatures[span], entropy)
        parts.append(_checkpointed_stats(*args) if torch.is_grad_enabled() else _head_stats(*args))
    logprobs = torch.cat([lp for lp, _ in parts])
    if entropy == "none":
        return logprobs, None
    return logprobs, torch.cat([cast(torch.Tensor, h) for _, h in parts])  # every chunk made one
