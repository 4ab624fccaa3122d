"""The trained model: loading (full or LoRA), per-token logprobs of completions, weights to push.

Logprobs are computed as the generator sampled them: logits divided by the sampling temperature, then a
log-softmax in float32 (also when the model runs in bf16), for the completion positions only
(``logits_to_keep`` skips the prompt's logits). With ``chunk_tokens`` > 0 the LM head runs on the final hidden
states a chunk of completion tokens at a time (:mod:`services.learner.lm_head`), so the [tokens x vocab]
float32 logits never exist; 0 computes them whole.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from services.learner.batch import TrainBatch
from services.learner.hardware import resolve_precision
from services.learner.lm_head import (
    EntropyMode,
    Stats,
    chunked_token_stats,
    final_hidden_states,
    output_embeddings,
    token_stats,
)
from services.learner.packing import attention_implementation, packed_logprobs
from shared.config.learner import LearnerSettings

log = logging.getLogger(__name__)

# (model, **inputs) -> (per-position tensor, model output): logits or the final hidden states.
Forward = Callable[..., tuple[torch.Tensor, Any]]


def load_policy(settings: LearnerSettings, path: str, adapter_path: str | None = None):
    """The model to train (with LoRA adapters when ``lora_rank`` > 0) and its tokenizer.

    Full fine-tuning keeps the weights in ``param_dtype`` (the float32 master weights). With LoRA the base is
    frozen, so it is stored in the compute dtype, and the adapters, which train, are float32.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    precision = resolve_precision(settings.param_dtype, settings.compute_dtype, settings.device)
    if precision.param == torch.bfloat16:
        log.warning("param_dtype = bfloat16: AdamW steps below half a bf16 unit of a weight are rounded away")
    dtype = precision.compute if settings.lora_rank else precision.param
    log.info("loading %s in %s on %s (%s)", path, dtype, settings.device, precision.describe())
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attention_implementation(settings.device)
    )
    model.to(settings.device)
    model.config.use_cache = False
    if settings.lora_rank:
        model = _with_adapters(model, settings, adapter_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def _with_adapters(model: torch.nn.Module, settings: LearnerSettings, adapter_path: str | None) -> torch.nn.Module:
    """LoRA adapters in float32 over the frozen base (PEFT keeps bf16 adapters out: autocast_adapter_dtype)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter_path:
        model = PeftModel.from_pretrained(model, adapter_path, is_trainable=True, autocast_adapter_dtype=True)
    else:
        config = LoraConfig(
            r=settings.lora_rank,
            lora_alpha=settings.lora_alpha,
            target_modules=settings.lora_target_modules,
            lora_dropout=0.0,
            bias="none",
        )
        model = get_peft_model(model, config, autocast_adapter_dtype=True)
    for name, param in model.named_parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()  # an adapter saved in another dtype trains in float32 too
            log.info("adapter %s cast to float32", name)
    return model


def reference_model(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A frozen copy of the initial policy (for the KL term), in ``dtype`` when given (it never updates,
    so the compute dtype loses nothing that a later step needs)."""
    reference = copy.deepcopy(model)
    if dtype is not None:
        reference.to(dtype)
    reference.eval()
    reference.requires_grad_(False)
    return reference


def _chunked_stats(
    model: torch.nn.Module, hidden: torch.Tensor, batch: TrainBatch, entropy: EntropyMode, chunk_tokens: int
) -> Stats:
    """Log-probabilities [B, T] (and entropies) from hidden [B, T, H], whose position t predicts completion
    token t, through the LM head in chunks (:mod:`services.learner.lm_head`). Only completion tokens are
    computed: padding positions are 0, as the plain path's are after masking."""
    mask = batch.completion_mask.bool()
    temperatures = batch.temperatures.to(hidden.device)[:, None].expand(mask.shape)[mask]
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
    return token_stats(output.logits[:, :-1], batch.completion_ids, batch.temperatures[:, None], entropy)


def _logits(model: torch.nn.Module, **inputs: Any) -> tuple[torch.Tensor, Any]:
    """The model's logits [B, K, V] and its output: :func:`final_hidden_states`'s plain counterpart."""
    output = model(**inputs)
    return output.logits, output


def _group_spans(group_index: list[int]) -> list[slice]:
    """The row spans of each group (rows of a group are contiguous; a micro-batch may split a group)."""
    starts = [row for row in range(len(group_index)) if row == 0 or group_index[row] != group_index[row - 1]]
    return [slice(start, stop) for start, stop in zip(starts, [*starts[1:], len(group_index)], strict=True)]


def _group_predictors(model: torch.nn.Module, batch: TrainBatch, rows: slice, forward: Forward) -> torch.Tensor:
    """The prompt of the group at ``rows`` once, its completions on top of the prompt's KV cache: [b, T, X]
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
    """Each group's prompt once, its completions on top of the prompt's KV cache (gradients flow into it).

    The completions of one group share their prompt, so computing it once per group instead of once per
    completion saves (G - 1) prompt passes. Completions are right-padded, so causal attention alone keeps
    real tokens from seeing padding: no attention mask is needed.
    """
    spans = _group_spans(batch.group_index.tolist())
    if chunk_tokens:
        hidden = torch.cat([_group_predictors(model, batch, rows, final_hidden_states) for rows in spans])
        return _chunked_stats(model, hidden, batch, entropy, chunk_tokens)
    parts = [
        token_stats(
            _group_predictors(model, batch, rows, _logits),
            batch.completion_ids[rows],
            batch.temperatures[rows, None],
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
    """log pi(token | prefix) of each completion token, [B, T] float32 (0 where masked)."""
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
    ([B, T] float32, 0 where masked; None when ``entropy="none"``). ``"grad"`` lets the entropy bonus
    differentiate it; ``"value"`` keeps it out of the graph. No [tokens x vocab] tensor is added
    (:mod:`services.learner.entropy`). ``chunk_tokens`` > 0: the LM head runs on that many tokens at a time
    and no [tokens x vocab] float32 logits exist at all (:mod:`services.learner.lm_head`); 0: full logits.
    ``packed``: one padding-free row of the batch's sequences (:mod:`services.learner.packing`)."""
    if packed:
        logprobs, entropies = packed_logprobs(model, batch, entropy, chunk_tokens, share_prompts)
    else:
        forward = _shared_prompt_logprobs if share_prompts else _padded_logprobs
        logprobs, entropies = forward(model, batch, entropy, chunk_tokens)
    mask = batch.completion_mask.to(logprobs.dtype)
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


def linear_weight_names(model: torch.nn.Module) -> frozenset[str]:
    """Names, as :func:`merged_weights` gives them, of the weights that only linear layers hold (a weight
    tied to an embedding is left out: engines look rows up in it). These may travel transposed to engines
    that repack linear weights (``GeneratorRegistration.transposed_linear``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    holders: dict[int, list[torch.nn.Module]] = {}
    names: dict[int, str] = {}
    for module_name, module in base.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append(module)
            names.setdefault(id(param), f"{module_name}.{leaf}" if module_name else leaf)
    return frozenset(
        names[key].replace(".base_layer", "")
        for key, held in holders.items()
        if names[key].endswith("weight")
        and "lora_" not in names[key]  # adapters are merged into the base weights, never pushed themselves
        and all(isinstance(m, torch.nn.Linear) for m in held)
    )


@contextmanager
def merged_weights(model: torch.nn.Module) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """(name, tensor) of the full model as vLLM and transformers name them. Tied weights appear once.

    With LoRA each adapted weight is ``base + B @ A * scaling`` computed in float32 into a new tensor: the
    base is never merged in place, since adding a small update to a bf16 base and subtracting it again
    would round the frozen weights a little more at every push.
    """
    if not hasattr(model, "get_base_model"):
        yield [(name, param.detach()) for name, param in model.named_parameters()]
        return
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and not module.disable_adapters:
            adapters = [a for a in module.active_adapters if a in module.lora_A]
            with torch.no_grad():
                deltas[f"{name}.base_layer.weight"] = sum(module.get_delta_weight(a).float() for a in adapters)
    named = []
    for name, param in base.named_parameters():
        if "lora_" in name:
            continue
        tensor = param.detach()
        if name in deltas:
            tensor = tensor.float() + deltas[name]
        named.append((name.replace(".base_layer", ""), tensor))
    yield named
