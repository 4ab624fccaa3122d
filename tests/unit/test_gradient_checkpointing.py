"""``gradient_checkpointing``: each decoder layer's activations are recomputed in the backward, and a training
step's gradient is the one without it, in float64, for the padded, packed and shared-prompt forwards (whole and
chunked logits), with LoRA, and sharded by FSDP2 on two gloo ranks; the no-grad passes and the reference model
(a copy of a checkpointed policy) run the plain forward on their own weights."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
from collections.abc import Iterator

import pytest
import torch
import torch.multiprocessing as mp

from services.learner import distributed
from services.learner.model import checkpoint_layers, decoder_layers, load_policy, reference_model
from services.learner.trainer import Trainer
from tests.support.tiny_model import build_tiny_llama
from tests.unit.test_learner_core import _batch, _groups, _settings

# (max_tokens_per_micro_batch, share_prompts) of each forward the trainer runs.
PATHS = {"padded": (0, "off"), "shared-prompt": (0, "on"), "packed": ("auto", "off"), "packed-shared": ("auto", "on")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=3)


@contextlib.contextmanager
def _layer_passes(model: torch.nn.Module) -> Iterator[list[int]]:
    """Counts the passes through the layers' MLPs (a recompute in the backward is one too)."""
    count = [0]
    hooks = [
        layer.mlp.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
        for layer in decoder_layers(model)
    ]
    try:
        yield count
    finally:
        for hook in hooks:
            hook.remove()


def _perturb_adapters(model: torch.nn.Module) -> None:
    """The same adapters in both runs (PEFT draws A at random), and a nonzero B (it starts at zero, which gives
    A no gradient at all)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.linspace(-0.1, 0.1, param.numel(), dtype=param.dtype).reshape(param.shape))


def _step(tiny, checkpointing: bool, path: str, **overrides) -> tuple[dict[str, torch.Tensor], int, Trainer]:
    """One step's accumulated float64 gradient of the trainable parameters, the layer passes of its backward
    (forwards and recomputes) and the trainer. Old logprobs are shifted so that the ratios are off 1."""
    budget, share = PATHS[path]
    settings = _settings(
        tiny,
        gradient_checkpointing=checkpointing,
        max_tokens_per_micro_batch=budget,
        share_prompts=share,
        beta=0.0,
        max_staleness=0,
        **overrides,
    )
    model, _ = load_policy(settings, str(tiny))
    model.double()
    _perturb_adapters(model)
    batch = _batch(_groups(model, seed=5))
    trainer = Trainer(model, settings)
    assert (trainer.planner.packed, trainer.planner.share_prompts) == (budget == "auto", share == "on")
    prepared = trainer.prepare(batch)
    assert prepared.old_logprobs is not None
    shift = torch.linspace(-0.4, 0.4, batch.loss_mask.numel(), dtype=torch.float64).reshape(batch.loss_mask.shape)
    prepared = dataclasses.replace(prepared, old_logprobs=prepared.old_logprobs + shift * batch.loss_mask)
    model.zero_grad()
    with _layer_passes(model) as passes:
        trainer.accumulate_gradients(batch, prepared)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return grads, passes[0], trainer


def _assert_same_gradients(ours: dict[str, torch.Tensor], plain: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == plain.keys()
    for name, grad in plain.items():
        assert float(grad.abs().max()) > 0, f"{name} has no gradient: the comparison would prove nothing"
        torch.testing.assert_close(ours[name], grad, rtol=1e-12, atol=1e-15, msg=name)


@pytest.mark.parametrize("chunk_tokens", [0, 3])
@pytest.mark.parametrize("path", list(PATHS))
def test_a_checkpointed_step_has_the_plain_steps_gradient(tiny, path, chunk_tokens):
    plain, plain_passes, _ = _step(tiny, False, path, logprob_chunk_tokens=chunk_tokens)
    ours, our_passes, _ = _step(tiny, True, path, logprob_chunk_tokens=chunk_tokens)
    _assert_same_gradients(ours, plain)
    assert our_passes == 2 * plain_passes > 0  # every layer pass recomputed once in the backward


@pytest.mark.parametrize("path", ["padded", "shared-prompt", "packed"])
def test_a_checkpointed_lora_step_has_the_plain_steps_adapter_gradients(tiny, path):
    lora = dict(lora_rank=4, lora_alpha=8.0, lora_target_modules=["q_proj", "v_proj", "down_proj"])
    plain, plain_passes, _ = _step(tiny, False, path, **lora)
    ours, our_passes, trainer = _step(tiny, True, path, **lora)
    assert ours and all("lora_" in name for name in ours)
    _assert_same_gradients(ours, plain)
    assert our_passes == 2 * plain_passes > 0
    assert len(decoder_layers(trainer.model)) == 2  # found under PEFT's wrapper


def test_entropy_bonus_gradients_are_unchanged_too(tiny):
    overrides = dict(entropy_coef=0.05, top_entropy_quantile=0.5)
    plain, _, _ = _step(tiny, False, "shared-prompt", **overrides)
    ours, _, _ = _step(tiny, True, "shared-prompt", **overrides)
    _assert_same_gradients(ours, plain)


def test_no_grad_passes_run_once_and_checkpointing_twice_wraps_once(tiny):
    model, _ = load_policy(_settings(tiny, gradient_checkpointing=True), str(tiny))
    assert checkpoint_layers(model) == 2  # already checkpointed: not wrapped again
    ids = torch.tensor([[5, 6, 7, 8]])
    with _layer_passes(model) as passes, torch.no_grad():
        model(ids)
    assert passes[0] == 2
    with _layer_passes(model) as passes:
        model(ids).logits.sum().backward()
    assert passes[0] == 4


def test_a_reference_copied_from_a_checkpointed_policy_computes_with_its_own_weights(tiny):
    model, _ = load_policy(_settings(tiny, gradient_checkpointing=True), str(tiny))
    reference = reference_model(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    before = reference(ids).logits.detach()  # autograd on: the checkpointed forward
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.5)
    torch.testing.assert_close(reference(ids).logits.detach(), before, rtol=0, atol=0)
    assert not torch.equal(model(ids).logits.detach(), before)


def test_a_model_without_decoder_layers_is_refused_with_the_setting_to_change():
    with pytest.raises(ValueError, match=r"set learner\.gradient_checkpointing = false"):
        checkpoint_layers(torch.nn.Linear(2, 2))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sharded_gradients(rank: int, port: int, tiny: str, batch_path: str, out: str) -> None:
    """One of two gloo ranks: the FSDP2-sharded step's full gradients without and with checkpointing (padded
    micro-batches, unshared prompts, as under torchrun), saved by rank 0."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    topology = distributed.topology_from_env()
    distributed.start(topology, "cpu")
    from transformers import AutoModelForCausalLM

    batch = torch.load(batch_path, weights_only=False)
    results = {}
    for checkpointing in (False, True):
        settings = _settings(tiny, gradient_checkpointing=checkpointing, beta=0.0, max_staleness=0)
        model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float64)
        if checkpointing:
            checkpoint_layers(model)
        distributed.shard_model(model, torch.float64)
        trainer = Trainer(model, settings, None, topology)
        prepared = trainer.prepare(batch)
        with _layer_passes(model) as passes:
            trainer.accumulate_gradients(batch, prepared)
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        results[checkpointing] = (grads, passes[0])
    if topology.is_leader:
        torch.save(results, out)
    distributed.exit_process(0)


def test_a_checkpointed_fsdp2_step_has_the_plain_steps_gradient(tiny, tmp_path):
    model, _ = load_policy(_settings(tiny), str(tiny))
    torch.save(_batch(_groups(model, seed=5)), tmp_path / "batch.pt")
    args = (_free_port(), str(tiny), str(tmp_path / "batch.pt"), str(tmp_path / "grads.pt"))
    mp.spawn(_sharded_gradients, args=args, nprocs=2)
    results = torch.load(tmp_path / "grads.pt", weights_only=False)
    (plain, plain_passes), (ours, our_passes) = results[False], results[True]
    _assert_same_gradients(ours, plain)
    assert our_passes == 2 * plain_passes > 0
