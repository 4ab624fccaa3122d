"""Padding-free micro-batches: completions split by a token budget and packed into one row without padding.

The padded layout (:mod:`services.learner.data.batch`) pads every prompt to the longest prompt and every completion to
the longest completion of the micro-batch, and computes the padding. Here a micro-batch's sequences are laid end
to end in one row ``[1, N]``, N = the micro-batch's real tokens, each with its own position ids (0, 1, ... from
its first token, as the generator saw it), and attention is kept inside each sequence:

* ``share_prompts`` off: each sequence is ``prompt + completion``; no attention mask is passed, and the model's
  attention tells the sequences apart by their position ids. transformers (>= 4.53) does this for every
  attention implementation: flash-attn's varlen kernel (``flash_attention_2``, chosen by
  :func:`attention_implementation` on CUDA when flash-attn is installed), flex_attention's block mask, and a
  block-diagonal causal mask for SDPA and eager (``masking_utils.find_packed_sequence_indices``).
* ``share_prompts`` on: each group's prompt is in the row once, followed by the group's completions of the
  micro-batch, every completion with the positions it has after the prompt ("a group's prompt": a run of
  rows with one ``prompt_index``, so a sample whose environment gave it a prompt of its own is never shared).
  A [N, N] mask lets a completion token see its group's prompt and the earlier tokens of its own completion
  only (the prompt as a shared prefix, a tree of sequences). SDPA and eager take such a mask; flash-attn's
  varlen kernel cannot, which :func:`check_attention` refuses with the setting to change.

Only the predictors of sampled tokens (the batch's ``loss_mask``) reach the LM head: a multi-turn trajectory's
tool results and template tokens are context (in the row and the attention, not the head). Either way every
sampled token's log-probability is computed from exactly the tokens it sees in the padded forward, so the
values and gradients are the padded forward's (float64 tests, tests/unit/test_packing.py and
tests/unit/test_loss_mask.py); the loss and its normalisers (:mod:`services.learner.objective.loss`) are
unchanged, since the results come back in the padded [b, T] layout.

:func:`plan_micro_batches` splits a batch into consecutive rows by ``max_tokens_per_micro_batch`` (the packed
row's length) and ``micro_batch_size`` (an upper bound on completions).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

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

# Attention implementations that take the shared-prompt [N, N] mask as given (a 4-D tensor skips transformers'
# own mask making).
MASKED_ATTENTION = ("sdpa", "eager")


def attention_implementation(device: str) -> str | None:
    """The attention implementation to load the policy with: flash-attn's kernels (``flash_attention_2``, whose
    varlen kernel takes packed rows by their position ids) on CUDA when the package is installed; None
    (transformers' default, SDPA) otherwise."""
    if device.startswith("cuda") and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return None


def resolve_share_prompts(setting: str, device_type: str, distributed: bool) -> bool:
    """Whether each group's prompt is computed once (``share_prompts`` = "auto", "on" or "off").

    auto: on for the CPU, off for CUDA (measured, see ``LearnerSettings.share_prompts``). Never under torchrun:
    the shared-prompt forward runs a pass count that depends on group boundaries, and FSDP's collectives need
    the same count on every rank.
    """
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"share_prompts must be 'auto', 'on' or 'off', got {setting!r}")
    if distributed:
        return False
    if setting == "auto":
        return device_type == "cpu"
    return setting == "on"


def resolve_token_budget(
    setting: int | str, device_type: str, rows: int, sequence_tokens: int, attention: str | None = None
) -> int:
    """Tokens per micro-batch (``max_tokens_per_micro_batch``); 0: padded micro-batches of ``rows`` rows.

    auto: packing on, with a budget of ``rows`` x ``sequence_tokens`` (micro_batch_size x (max_prompt_length +
    max_completion_length), the padded worst case), so a packed micro-batch never holds more tokens than a
    padded one could - on the CPU, and on CUDA with flash-attn's varlen kernel (``attention`` =
    "flash_attention_2"). On CUDA with SDPA packing is off: its block-diagonal mask is a dense [tokens x tokens]
    mask that keeps SDPA off its fused kernels (measured, see ``LearnerSettings.max_tokens_per_micro_batch``).
    """
    if setting == "auto":
        if device_type == "cuda" and attention != "flash_attention_2":
            return 0
        return rows * sequence_tokens
    if isinstance(setting, str) or setting < 0:
        raise ValueError(f"max_tokens_per_micro_batch must be 'auto' or a count >= 0, got {setting!r}")
    return setting


def sequence_lengths(batch: TrainBatch) -> tuple[list[int], list[int]]:
    """Each row's prompt and completion length in tokens (the padded layout's real tokens)."""
    prompt_end = batch.input_ids.shape[1] - batch.completion_length
    real = batch.attention_mask.sum(dim=1)
    prompts = batch.attention_mask[:, :prompt_end].sum(dim=1)
    return prompts.tolist(), (real - prompts).tolist()


def plan_micro_batches(
    prompt_lengths: Sequence[int],
    completion_lengths: Sequence[int],
    prompt_index: Sequence[int],
    *,
    max_tokens: int,
    max_rows: int,
    share_prompts: bool,
) -> list[slice]:
    """Consecutive rows in micro-batches of at most ``max_rows`` rows and ``max_tokens`` packed tokens.

    A micro-batch's tokens are its rows' prompt + completion lengths; with ``share_prompts`` a prompt counts once
    per micro-batch and run of rows with its ``prompt_index``. Greedy, in order: a row that would take the
    micro-batch past either bound starts the next one; a row longer than ``max_tokens`` on its own makes a
    micro-batch alone.
    """
    if max_tokens < 1 or max_rows < 1:
        raise ValueError(f"max_tokens ({max_tokens}) and max_rows ({max_rows}) must be at least 1")
    plan: list[slice] = []
    start, tokens = 0, 0
    for row, (prompt, completion) in enumerate(zip(prompt_lengths, completion_lengths, strict=True)):
        new_prompt = row == start or prompt_index[row] != prompt_index[row - 1]
        cost = completion + (prompt if new_prompt or not share_prompts else 0)
        if row > start and (row - start >= max_rows or tokens + cost > max_tokens):
            plan.append(slice(start, row))
            start, tokens = row, prompt + completion
        else:
            tokens += cost
    if len(prompt_lengths) > start:
        plan.append(slice(start, len(prompt_lengths)))
    return plan


@dataclass(frozen=True)
class PackedRow:
    """One micro-batch as one row of N tokens."""

    input_ids: torch.Tensor  # [1, N]
    position_ids: torch.Tensor  # [1, N] from 0 at each sequence's start (after the prompt with shared prompts)
    attention: torch.Tensor | None  # [N, N] bool, True: query may see key (shared prompts); None: by position ids
    predictors: torch.Tensor  # [b, T] the row position whose output predicts completion token t (0 past its end)


def _span_mask(owner: list[int], document: list[int]) -> torch.Tensor:
    """[N, N] causal mask inside each document where a completion token sees the prompt (owner -1) and its
    own completion only."""
    owners, documents = torch.tensor(owner), torch.tensor(document)
    same_document = documents[:, None] == documents[None, :]
    visible = (owners[None, :] == -1) | (owners[:, None] == owners[None, :])
    causal = torch.ones(len(owner), len(owner), dtype=torch.bool).tril()
    return same_document & visible & causal


def pack(batch: TrainBatch, share_prompts: bool) -> PackedRow:
    """The micro-batch ``batch`` (padded layout) as one padding-free row (module docstring)."""
    prompt_lengths, completion_lengths = sequence_lengths(batch)
    prompt_end = batch.input_ids.shape[1] - batch.completion_length
    ids: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    owner: list[int] = []
    document: list[int] = []
    predictors = torch.zeros(batch.completion_ids.shape, dtype=torch.long)
    prompts = batch.prompt_index.tolist()
    length = 0
    prompt_last = 0
    for row, (p, n) in enumerate(zip(prompt_lengths, completion_lengths, strict=True)):
        if not share_prompts or row == 0 or prompts[row] != prompts[row - 1]:
            ids.append(batch.input_ids[row, prompt_end - p : prompt_end])
            positions.append(torch.arange(p))
            owner += [-1] * p
            document += [row] * p
            length += p
            prompt_last = length - 1
        ids.append(batch.completion_ids[row, :n])
        positions.append(torch.arange(p, p + n))
        owner += [row] * n
        document += [document[-1]] * n
        predictors[row, :n] = torch.cat([torch.tensor([prompt_last]), torch.arange(length, length + n - 1)])[:n]
        length += n
    device = batch.input_ids.device
    return PackedRow(
        input_ids=torch.cat(ids)[None],
        position_ids=torch.cat(positions)[None].to(device),
        attention=_span_mask(owner, document).to(device) if share_prompts else None,
        predictors=predictors.to(device),
    )


def check_attention(implementation: str, share_prompts: bool) -> None:
    """Refuse packed shared prompts under an attention implementation that cannot take their [N, N] mask."""
    if share_prompts and implementation not in MASKED_ATTENTION:
        raise ValueError(
            f"packed micro-batches with shared prompts need an attention that takes a [tokens x tokens] mask "
            f"({', '.join(MASKED_ATTENTION)}), and the model uses {implementation!r}: set learner.share_prompts = "
            "'off' (flash-attn's varlen kernel then packs by position ids), or max_tokens_per_micro_batch = 0"
        )


def _mask_argument(attention: torch.Tensor | None, implementation: str, dtype: torch.dtype) -> torch.Tensor | None:
    """The [N, N] mask as the model's attention takes it: [1, 1, N, N] bool for SDPA, additive for eager."""
    if attention is None:
        return None
    check_attention(implementation, share_prompts=True)
    mask = attention[None, None]
    if implementation == "sdpa":
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def packed_logprobs(
    model: torch.nn.Module, batch: TrainBatch, entropy: EntropyMode, chunk_tokens: int, share_prompts: bool
) -> Stats:
    """Log-probabilities [b, T] (and entropies) of ``batch``'s sampled tokens from one packed forward; only
    their predictors reach the LM head (``logits_to_keep`` = their row positions). 0 at context and padding
    positions, as the padded forward's are after masking."""
    row = pack(batch, share_prompts)
    implementation = getattr(model.config, "_attn_implementation", None) or "sdpa"
    mask = batch.loss_mask.bool()
    keep = row.predictors[mask]  # [M] in the [b, T] mask's order; a shared prompt's last position repeats
    inputs = dict(
        input_ids=row.input_ids,
        position_ids=row.position_ids,
        attention_mask=_mask_argument(row.attention, implementation, next(model.parameters()).dtype),
        logits_to_keep=keep,
        use_cache=False,
    )
    temperatures = token_temperatures(batch.sampling_temperatures(), mask)
    targets = batch.completion_ids[mask]
    if chunk_tokens:
        hidden, _ = final_hidden_states(model, **inputs)
        logprobs, entropies = chunked_token_stats(
            output_embeddings(model), hidden[0], targets, temperatures, entropy, chunk_tokens
        )
    else:
        logprobs, entropies = token_stats(model(**inputs).logits[0], targets, temperatures, entropy)
    logprobs = logprobs.new_zeros(mask.shape).masked_scatter(mask, logprobs)
    return logprobs, None if entropies is None else entropies.new_zeros(mask.shape).masked_scatter(mask, entropies)
