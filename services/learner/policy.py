"""The trained model: loading (full or LoRA), per-token logprobs of completions, weights to push.

Logprobs are computed as the generator sampled them: logits divided by the sampling temperature, then a
log-softmax in float32 (also when the model runs in bf16), for the completion positions only
(``logits_to_keep`` skips the prompt's logits).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch

from services.learner.batch import TrainBatch
from services.learner.entropy import token_entropy
from services.learner.hardware import resolve_precision
from shared.config.learner import LearnerSettings

log = logging.getLogger(__name__)


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
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
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


def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """log softmax(logits / T)[target], in float32 (float64 stays float64). logits [B, T, V]."""
    dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16 -> float32
    scaled = logits.to(dtype) / temperatures.to(logits.device, dtype).view(-1, 1, 1)
    return scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)


EntropyMode = Literal["none", "value", "grad"]
_Stats = tuple[torch.Tensor, torch.Tensor | None]


def _token_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor, entropy: EntropyMode
) -> _Stats:
    """:func:`_token_logprobs` and, when asked, the entropy of softmax(logits / T) from the same scaled logits."""
    if entropy == "none":
        return _token_logprobs(logits, targets, temperatures), None
    dtype = torch.promote_types(logits.dtype, torch.float32)
    scaled = logits.to(dtype) / temperatures.to(logits.device, dtype).view(-1, 1, 1)
    lse = torch.logsumexp(scaled, dim=-1)
    logprobs = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    return logprobs, token_entropy(scaled if entropy == "grad" else scaled.detach(), lse)


def _padded_logprobs(model: torch.nn.Module, batch: TrainBatch, entropy: EntropyMode = "none") -> _Stats:
    """One forward over left-padded prompts + right-padded completions."""
    output = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=batch.completion_length + 1,
        use_cache=False,
    )
    return _token_stats(output.logits[:, :-1], batch.completion_ids, batch.temperatures, entropy)


def _shared_prompt_logprobs(model: torch.nn.Module, batch: TrainBatch, entropy: EntropyMode = "none") -> _Stats:
    """Each group's prompt once, its completions on top of the prompt's KV cache (gradients flow into it).

    The completions of one group share their prompt, so computing it once per group instead of once per
    completion saves (G - 1) prompt passes. Completions are right-padded, so causal attention alone keeps
    real tokens from seeing padding: no attention mask is needed.
    """
    prompt_end = batch.input_ids.shape[1] - batch.completion_length
    parts = []
    rows = batch.group_index.tolist()
    start = 0
    while start < len(rows):
        end = start
        while end < len(rows) and rows[end] == rows[start]:
            end += 1
        prompt_len = int(batch.attention_mask[start, :prompt_end].sum())
        prompt = batch.input_ids[start : start + 1, prompt_end - prompt_len : prompt_end]
        first = model(input_ids=prompt, use_cache=True)
        cache = first.past_key_values
        cache.batch_repeat_interleave(end - start)
        completions = batch.completion_ids[start:end]
        steps = completions.shape[1]
        positions = torch.arange(prompt_len, prompt_len + steps, device=completions.device).expand(end - start, -1)
        rest = model(
            input_ids=completions, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=steps
        )
        logits = torch.cat([first.logits[:, -1:].expand(end - start, -1, -1), rest.logits[:, :-1]], dim=1)
        parts.append(_token_stats(logits, completions, batch.temperatures[start:end], entropy))
        start = end
    logprobs = torch.cat([lp for lp, _ in parts])
    return logprobs, None if entropy == "none" else torch.cat([h for _, h in parts])  # type: ignore[misc]


def completion_logprobs(model: torch.nn.Module, batch: TrainBatch, *, share_prompts: bool = True) -> torch.Tensor:
    """log pi(token | prefix) of each completion token, [B, T] float32 (0 where masked)."""
    logprobs, _ = completion_logprobs_and_entropy(model, batch, share_prompts=share_prompts, entropy="none")
    return logprobs


def completion_logprobs_and_entropy(
    model: torch.nn.Module, batch: TrainBatch, *, share_prompts: bool = True, entropy: EntropyMode = "value"
) -> _Stats:
    """:func:`completion_logprobs` and, from the same logits, the policy's entropy at each completion position
    ([B, T] float32, 0 where masked; None when ``entropy="none"``). ``"grad"`` lets the entropy bonus
    differentiate it; ``"value"`` keeps it out of the graph. No [tokens x vocab] tensor is added
    (:mod:`services.learner.entropy`)."""
    forward = _shared_prompt_logprobs if share_prompts else _padded_logprobs
    logprobs, entropies = forward(model, batch, entropy)
    mask = batch.completion_mask.to(logprobs.dtype)
    return logprobs * mask, None if entropies is None else entropies * mask


@torch.no_grad()
def logprobs_no_grad(
    model: torch.nn.Module, batch: TrainBatch, micro_batch_size: int, *, share_prompts: bool = True
) -> torch.Tensor:
    """:func:`completion_logprobs` without gradients, in micro-batches (the training micro-batch size)."""
    was_training = model.training
    model.eval()
    try:
        parts = [
            completion_logprobs(model, mb, share_prompts=share_prompts) for mb in batch.micro_batches(micro_batch_size)
        ]
    finally:
        model.train(was_training)
    return torch.cat(parts)


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
