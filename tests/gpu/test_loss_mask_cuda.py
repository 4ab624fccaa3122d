"""The loss-mask paths on CUDA: a batch mixing single-turn rows and trajectories with environment spans and a
per-sample prompt, through every logprob path (padded, prompt-shared, packed, each plain and chunked) and one
training step, on the GPU in float32 against the CPU's float64 per-sequence reference."""

from __future__ import annotations

import copy

import pytest
import torch

from services.learner.logprobs.policy import completion_logprobs_and_entropy
from services.learner.trainer import Trainer
from tests.unit.test_learner_core import assert_grads_close
from tests.unit.test_loss_mask import _batch, _groups, _model, _paths, float64_norms, masked_reference, tiny

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

__all__ = ["float64_norms", "tiny"]  # fixtures used by name


def test_every_logprob_path_on_cuda_matches_the_float64_reference_and_is_0_off_the_mask(tiny):
    cpu_model, _ = _model(tiny)
    groups = _groups(cpu_model, seed=1)
    batch = _batch(groups)
    reference = masked_reference(cpu_model, groups, batch)
    model = cpu_model.float().to("cuda")
    on_gpu = batch.to("cuda")
    results = _paths(model, on_gpu)
    context = on_gpu.loss_mask == 0
    _, _, padded_grads = results["padded/chunk0"]
    for name, (logprobs, entropies, grads) in results.items():
        assert logprobs.is_cuda, name
        torch.testing.assert_close(logprobs.double().cpu(), reference, atol=5e-5, rtol=0, msg=name)
        assert torch.all(logprobs[context] == 0) and torch.all(entropies[context] == 0), name
        assert_grads_close(grads, padded_grads, rel=1e-4)


def test_a_training_step_on_cuda_counts_the_sampled_tokens_only(tiny):
    cpu_model, settings = _model(tiny, num_iterations=1)
    batch = _batch(_groups(cpu_model, seed=5))
    model = cpu_model.float().to("cuda")
    trainer = Trainer(model, settings.model_copy(update={"device": "cuda", "compute_dtype": "float32"}))
    prepared = trainer.prepare(batch.to(trainer.device))
    tokens = float(batch.loss_mask.sum())
    assert tokens < float(batch.completion_mask.sum())
    assert prepared.normalisers.num_tokens == tokens
    _, entropies = completion_logprobs_and_entropy(model, batch.to("cuda"), entropy="value")
    (metrics,) = trainer.train(batch)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values() if isinstance(v, float)), metrics
    assert metrics["entropy"] == pytest.approx(float(entropies[batch.loss_mask.bool().cuda()].mean()), rel=1e-4)


def test_behaviour_old_logprobs_on_cuda_give_the_cpu_gradient(tiny):
    """``old_logprobs = "behaviour"`` on the GPU: the generator's logprobs (trajectory rows with tool results off
    the loss mask among them) as the old policy give the CPU's gradient, both in float64."""
    cpu_model, settings = _model(tiny, num_iterations=1, old_logprobs="behaviour")
    batch = _batch(_groups(cpu_model, seed=5))
    grads = {}
    for device in ("cpu", "cuda"):
        model = copy.deepcopy(cpu_model).to(device)
        trainer = Trainer(model, settings.model_copy(update={"device": device, "compute_dtype": "float32"}))
        on_device = batch.to(trainer.device)
        model.zero_grad()
        step = trainer.accumulate_gradients(on_device, trainer.prepare(on_device))
        assert step.importance_weights is None
        grads[device] = {name: p.grad.detach().cpu() for name, p in model.named_parameters()}
    assert_grads_close(grads["cuda"], grads["cpu"], rel=1e-6)
