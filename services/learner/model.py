"""The trained model: loading it (full or LoRA), activation checkpointing of its decoder layers, its frozen
reference copy, and its weights as a push sends them (LoRA merged; which of them only linear layers hold;
:class:`WeightExport`)."""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint

from services.learner import distributed
from services.learner.distributed import Topology
from services.learner.hardware import resolve_precision
from services.learner.logprobs.packing import attention_implementation
from services.learner.ranks import RankChannel
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
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attention_implementation(settings.device)
    )
    model.to(settings.device)
    model.config.use_cache = False
    if settings.lora_rank:
        model = _with_adapters(model, settings, adapter_path)
    if settings.gradient_checkpointing:
        layers = checkpoint_layers(model)
        log.info("gradient checkpointing: %d decoder layers recompute their activations in the backward", layers)
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


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a causal LM (``.model.layers``, under PEFT's wrapper too); a ValueError naming
    the setting to turn off when the model has none."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(getattr(base, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(
            f"{type(base).__name__} has no .model.layers to checkpoint; set learner.gradient_checkpointing = false"
        )
    return layers


class _ReplayedCache:
    """The KV cache as one checkpointed layer sees it. The forward updates the model's cache once; the
    recompute in the backward gets the same keys and values back instead of appending its own a second
    time (the shared-prompt forward, :mod:`services.learner.logprobs.policy`, runs its completions on top of
    the prompt's cache, and the recomputed layer must see exactly what the forward saw)."""

    def __init__(self, cache) -> None:
        self._cache = cache
        self._keys_values: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self._keys_values is None:
            self._keys_values = self._cache.update(key_states, value_states, *args, **kwargs)
        return self._keys_values

    def __getattr__(self, name: str):
        if name == "_cache":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self._cache, name)


# The names transformers' decoder layers take the KV cache under (the plural since transformers 4.56).
_CACHE_ARGUMENTS = ("past_key_values", "past_key_value")


class _CheckpointedForward:
    """A decoder layer's forward that keeps only its inputs for the backward and recomputes the rest there
    (``torch.utils.checkpoint``, non-reentrant: gradients reach LoRA adapters and inputs that do not require
    grad, and keyword arguments pass through). Only while autograd records: the no-grad passes (old and
    reference logprobs) run the plain forward. An attribute of the layer, not a wrapper module, so parameter
    names, FSDP2's hooks on the layer (which gather its shards before the recompute of its backward) and a
    ``deepcopy`` (the reference model) are unchanged."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer

    def __call__(self, *args, **kwargs):
        forward = type(self.layer).forward.__get__(self.layer)
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        for name in _CACHE_ARGUMENTS:
            if kwargs.get(name) is not None:
                kwargs[name] = _ReplayedCache(kwargs[name])
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_layers(model: torch.nn.Module) -> int:
    """Activation checkpointing per decoder layer (``gradient_checkpointing``): a layer's activations are
    recomputed in the backward instead of kept from the forward, so a training pass holds one layer's
    activations plus every layer's input hidden states (and, with shared prompts, its KV cache). Not
    transformers' ``gradient_checkpointing_enable``, which drops the KV cache the shared-prompt forward
    needs. The values and gradients are unchanged. Idempotent; returns the number of layers."""
    layers = decoder_layers(model)
    for layer in layers:
        if not isinstance(layer.__dict__.get("forward"), _CheckpointedForward):
            layer.forward = _CheckpointedForward(layer)
    return len(layers)


def reference_model(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A frozen copy of the initial policy (for the KL term), in ``dtype`` when given (it never updates,
    so the compute dtype loses nothing that a later step needs)."""
    reference = copy.deepcopy(model)
    if dtype is not None:
        reference.to(dtype)
    reference.eval()
    reference.requires_grad_(False)
    return reference


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


class WeightExport:
    """The whole model's weights as a push or a checkpoint takes them, on the leader: on several ranks the
    others are told to join the gather (:class:`~services.learner.ranks.RankChannel`)."""

    def __init__(self, model: torch.nn.Module, topology: Topology, ranks: RankChannel) -> None:
        self.model, self.topology, self.ranks = model, topology, ranks

    @property
    def pushes_parameters(self) -> bool:
        """Whether :meth:`full_weights` hands out the parameters themselves (one process, no LoRA), which a
        push may then move into its kept buffers (``weight_sync.send_buffers.place_parameters``)."""
        return not self.topology.distributed and not hasattr(self.model, "get_base_model")

    @functools.cached_property
    def linear_weights(self) -> frozenset[str]:
        """Names of the weights in :meth:`full_weights` that only linear layers hold (they may travel
        transposed to CPU engines: ``WeightPusher.push``'s ``linear``)."""
        return linear_weight_names(self.model)

    @contextmanager
    def full_weights(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """(name, tensor) of the whole model as vLLM names them (LoRA merged)."""
        if self.topology.distributed:
            self.ranks.gather_weights()
            with distributed.full_weights(self.model) as named:
                yield named
        else:
            with merged_weights(self.model) as named:
                yield named
