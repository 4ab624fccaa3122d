"""The learner's warm-up (AdamW's state made while the first rollouts are sampled) changes nothing: trained with and
without it, every weight, AdamW moment, step count and metric is the same bit for bit."""

from __future__ import annotations

import pytest
import torch

from services.learner.model import load_policy
from services.learner.trainer import Trainer
from tests.support.tiny_model import build_tiny_llama
from tests.unit.test_learner_core import _batch, _groups, _settings


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=3)


def _trainer(tiny, **overrides) -> Trainer:
    settings = _settings(tiny, weight_decay=0.1, **overrides)
    model, _ = load_policy(settings, str(tiny))
    return Trainer(model, settings)


def _train(trainer: Trainer, steps: int) -> list[dict[str, float]]:
    batches = [_batch(_groups(trainer.model, seed=seed)) for seed in range(steps)]
    return [trainer.train(batch)[0] for batch in batches]


def _numbers(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith("seconds")}


@pytest.mark.parametrize("dtypes", [{}, {"param_dtype": "bfloat16", "compute_dtype": "bfloat16"}])
def test_training_after_the_state_is_made_is_bit_for_bit_training_without(tiny, dtypes):
    warmed, cold = _trainer(tiny, **dtypes), _trainer(tiny, **dtypes)
    before = {name: p.detach().clone() for name, p in warmed.model.named_parameters()}
    warmed.optimizer.make_state()
    for name, p in warmed.model.named_parameters():
        assert torch.equal(p, before[name]), name
        assert p.grad is None
        state = warmed.optimizer.adamw.state[p]  # made, as the first step would make it
        assert float(state["step"]) == 0.0
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    assert warmed.step == 0
    assert warmed.optimizer.adamw.param_groups[0]["lr"] == cold.optimizer.adamw.param_groups[0]["lr"]

    for ours, theirs in zip(_train(warmed, 3), _train(cold, 3), strict=True):
        assert _numbers(ours) == _numbers(theirs)
    cold_params = dict(cold.model.named_parameters())
    for name, p in warmed.model.named_parameters():
        assert torch.equal(p, cold_params[name]), name
        ours, theirs = warmed.optimizer.adamw.state[p], cold.optimizer.adamw.state[cold_params[name]]
        assert all(torch.equal(ours[key], theirs[key]) for key in ("step", "exp_avg", "exp_avg_sq")), name


def test_a_resumed_optimizer_keeps_its_state(tiny):
    trainer = _trainer(tiny)
    _train(trainer, 1)
    moments = {p: trainer.optimizer.adamw.state[p]["exp_avg"].clone() for p in trainer.model.parameters()}
    trainer.optimizer.make_state()
    for p, moment in moments.items():
        assert torch.equal(trainer.optimizer.adamw.state[p]["exp_avg"], moment)
        assert float(trainer.optimizer.adamw.state[p]["step"]) == 1.0
