"""The policy forward: per-token logprobs (and entropies) of completions, padded, packed or prompt-shared.

Logprobs are computed as the generator sampled them: logits divided by the sampling temperature, then a
log-softmax in float32 (also when the model runs in bf16), for the completion positions only
(``logits_to_keep`` skips the prompt's logits). With ``chunk_tokens`` > 0 the LM head runs on the final hidden
states a chunk of completion tokens at a time (:mod:`services.learner.logprobs.lm_head`), so the [tokens x vocab]
float32 logits never exist; 0 computes them whole.

The results are the log-probabilities of the tokens the policy sampled (the batch's ``loss_mask``) and 0
elsewhere: a multi-turn trajectory's tool results and template tokens enter the forward and the attention as
context, and the chunked and packed paths do not even take them through the LM head. Rows that share a prompt
(``prompt_index``, not ``group_index``: a sample with a prompt of its own never shares another's) compute it once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from services.learner.data.batch import TrainBatch
from services.learner.logprobs.lm_head import (
    EntropyMode,
    Stats,
    chunked_token_stats,
    final_hidden_states,
    output_embeddings,
    token_stats,
    token_temperatures,
)
from services.learner.logprobs.packing import packed_logprobs

# (model, **inputs) -> (per-position tensor, model output): logits or the final hidden states.
Forward = Callable[..., tuple[torch.Tensor, Any]]


def _row_temperatures(batch: TrainBatch) -> torch.Tensor | None:
    """[B, 1] each row's sampling temperature, or None when every one is 1."""
    temperatures = batch.sampling_temperatures()
    return None if temperatures is None else temperatures[:, None]


def _chunked_stats(
    model: torch.nn.Module, hidden: torch.Tensor, batch: TrainBatch, entropy: EntropyMode, chunk_tokens: int
) -> Stats:
    """Log-probabilities [B, T] (and entropies) from hidden [B, T, H], whose position t predicts completion
    token t, through the LM head in chunks (:mod:`services.learner.logprobs.lm_head`). Only sampled tokens (the
    loss mask) are computed: context and padding positions are 0, as the plain path's are after masking."""
    mask = batch.loss_mask.bool()
    temperatures = token_temperatures(batch.sampling_temperatures(), mask)
    logprobs, entropies = chunked_token_stats(
        output_embeddings(model), hidden[mask], batch.completion_ids[mask], temperatures, entropy, chunk_tokens
    )
    logprobs = logprobs.new_zeros(mask.shape).masked_scatter(mask, logprobs)
    return logprobs, None if entropies is None else entropies.new_zeros(mask.shape).masked_scatter(mask, entropies)


def _padded_logprobs(
    model: torch.nn.Module, batch: TrainBatch, entropy: EntropyMode = "none", chunk_tokens: int = 0
) -> Stats:
    """One forward over left-padded prompts + right-padded completions."""
    inputs = dict(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=batch.completion_length + 1,
        use_cache=False,
    )
    if chunk_tokens:
        hidden, _ = final_hidden_states(model, **inputs)
        return _chunked_stats(model, hidden[:, :-1], batch, entropy, chunk_tokens)
    output = model(**inputs)
    return token_stats(output.logits[:, :-1], batch.completion_ids, _row_temperatures(batch), entropy)


def _logits(model: torch.nn.Module, **inputs: Any) -> tuple[torch.Tensor, Any]:
    """The model's logits [B, K, V] and its output: :func:`final_hidden_states`'s plain counterpart."""
    output = model(**inputs)
    return output.logits, output


def _prompt_spans(prompt_index: list[int]) -> list[slice]:
    """The spans of consecutive rows with one prompt (a micro-batch may split them)."""
    starts = [row for row in range(len(prompt_index)) if row == 0 or prompt_index[row] != prompt_index[row - 1]]
    return [slice(start, stop) for start, stop in zip(starts, [*starts[1:], len(prompt_index)], strict=True)]


def _prompt_predictors(model: torch.nn.Module, batch: TrainBatch, rows: slice, forward: Forward) -> torch.Tensor:
    """The prompt of the rows at ``rows`` once, their completions on top of the prompt's KV cache: [b, T, X]
    whose position t predicts completion token t, X = V (``forward`` = logits) or H (final hidden states)."""
    size = rows.stop - rows.start
    prompt_end = batch.input_ids.shape[1] - batch.completion_length
    prompt_len = int(batch.attention_mask[rows.start, :prompt_end].sum())
    prompt = batch.input_ids[rows.start : rows.start + 1, prompt_end - prompt_len : prompt_end]
    first, output = forward(model, input_ids=prompt, use_cache=True)
    cache = output.past_key_values
    cache.batch_repeat_interleave(size)
    completions = batch.completion_ids[rows]
    steps = completions.shape[1]
    positions = torch.arange(prompt_len, prompt_len + steps, device=completions.device).expand(size, -1)
    rest, _ = forward(
        model,
        input_ids=completions,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=steps,
    )
    return torch.cat([first[:, -1:].expand(size, -1, -1), rest[:, :-1]], dim=1)


def _shared_prompt_logprobs(
    model: torch.nn.Module, batch: TrainBatch, entropy: EntropyMode = "none", chunk_tokens: int = 0
) -> Stats:
    """Each prompt once, its completions on top of the prompt's KV cache (gradients flow into it).

    The completions of one group share their prompt (``prompt_index``: unless a sample has its own), so
    computing it once per group instead of once per completion saves (G - 1) prompt passes. Completions are
    right-padded, so causal attention alone keeps real tokens from seeing padding: no attention mask is needed.
    """
    spans = _prompt_spans(batch.prompt_index.tolist())
    if chunk_tokens:
        hidden = torch.cat([_prompt_predictors(model, batch, rows, final_hidden_states) for rows in spans])
        return _chunked_stats(model, hidden, batch, entropy, chunk_tokens)
    temperatures = _row_temperatures(batch)
    parts = [
        token_stats(
            _prompt_predictors(model, batch, rows, _logits),
            batch.completion_ids[rows],
            None if temperatures is None else temperatures[rows],
            entropy,
        )
        for rows in spans
    ]
    logprobs = torch.cat([lp for lp, _ in parts])
    return logprobs, None if entropy == "none" else torch.cat([h for _, h in parts])  # type: ignore[misc]


def completion_logprobs(
    model: torch.nn.Module,
    batch: TrainBatch,
    *,
    share_prompts: bool = True,
    chunk_tokens: int = 0,
    packed: bool = False,
) -> torch.Tensor:
    """log pi(token | prefix) of each sampled completion token, [B, T] float32 (0 off the loss mask)."""
    logprobs, _ = completion_logprobs_and_entropy(
        model, batch, share_prompts=share_prompts, entropy="none", chunk_tokens=chunk_tokens, packed=packed
    )
    return logprobs


def completion_logprobs_and_entropy(
    model: torch.nn.Module,
    batch: TrainBatch,
    *,
    share_prompts: bool = True,
    entropy: EntropyMode = "value",
    chunk_tokens: int = 0,
    packed: bool = False,
) -> Stats:
    """:func:`completion_logprobs` and, from the same logits, the policy's entropy at each completion position
    ([B, T] float32, 0 off the loss mask; None when ``entropy="none"``). ``"grad"`` lets the entropy bonus
    differentiate it; ``"value"`` keeps it out of the graph. No [tokens x vocab] tensor is added
    (:mod:`services.learner.logprobs.entropy`). ``chunk_tokens`` > 0: the LM head runs on that many tokens at a time
    and no [tokens x vocab] float32 logits exist at all (:mod:`services.learner.logprobs.lm_head`); 0: full logits.
    ``packed``: one padding-free row of the batch's sequences (:mod:`services.learner.logprobs.packing`)."""
    if packed:
        logprobs, entropies = packed_logprobs(model, batch, entropy, chunk_tokens, share_prompts)
    else:
        forward = _shared_prompt_logprobs if share_prompts else _padded_logprobs
        logprobs, entropies = forward(model, batch, entropy, chunk_tokens)
    mask = batch.loss_mask.to(logprobs.dtype)
    return logprobs * mask, None if entropies is None else entropies * mask


def logprobs_no_grad(
    model: torch.nn.Module,
    batch: TrainBatch,
    micro_batch_size: int,
    *,
    share_prompts: bool = True,
    chunk_tokens: int = 0,
) -> torch.Tensor:
    """:func:`completion_logprobs` under ``torch.inference_mode`` (no autograd bookkeeping at all), in
    micro-batches; the result is cloned out of inference mode, so later autograd code may save it."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            parts = [
                completion_logprobs(model, mb, share_prompts=share_prompts, chunk_tokens=chunk_tokens)
                for mb in batch.micro_batches(micro_batch_size)
            ]
            logprobs = torch.cat(parts)
    finally:
        model.train(was_training)
    return logprobs.clone()
