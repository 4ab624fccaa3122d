"""Mixed precision keeps every update: float32 master weights and AdamW state under bf16 compute.

The finding it guards against: AdamW at lr 1e-6 changes a weight of size ~0.02 by less than half a bf16
unit in the last place, so bf16 weights round ~98% of the updates away. With float32 master weights and
bf16 only in the forward/backward, the tiny Llama's 5 steps move >= 90% of the weights and the update stays
within 30% (relative L2) of the float32 run's.
"""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file

from services.learner.checkpoint import LearnerState, save_checkpoint
from services.learner.distributed import mixed_precision_policy
from services.learner.hardware import Precision, compute_context, resolve_precision
from services.learner.model import load_policy, reference_model
from services.learner.trainer import Trainer
from shared.config.learner import LearnerSettings
from tests.support.mixed_precision import fixed_batch, moved_fraction, relative_l2, train_update, update_of
from tests.support.tiny_model import build_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=3, logit_scale=1.0)


@pytest.fixture(scope="module")
def float32_run(tiny):
    return train_update(tiny, "cpu", "float32", "float32")


def _adamw_moved_fraction(dtype: torch.dtype, steps: int = 10) -> float:
    generator = torch.Generator().manual_seed(0)
    weights = (torch.randn(100_000, generator=generator) * 0.02).to(dtype).requires_grad_()
    before = weights.detach().clone()
    optimizer = torch.optim.AdamW([weights], lr=1e-6, weight_decay=0.0)
    for _ in range(steps):
        weights.grad = torch.randn(weights.shape, generator=generator).to(dtype)
        optimizer.step()
    return float((weights.detach() != before).double().mean())


def test_adamw_at_lr_1e6_rounds_bf16_weights_away_and_keeps_float32_ones():
    """The issue's arithmetic: 100,000 weights ~ N(0, 0.02), 10 AdamW steps at lr 1e-6."""
    assert _adamw_moved_fraction(torch.bfloat16) < 0.05  # measured: 0.02
    assert _adamw_moved_fraction(torch.float32) > 0.99


def test_bf16_compute_over_float32_master_weights_keeps_the_update(tiny, float32_run, capsys):
    before, after = train_update(tiny, "cpu", "float32", "bfloat16")
    assert all(t.dtype == torch.float32 for t in after.values())
    moved = moved_fraction(before, after)
    distance = relative_l2(update_of(before, after), update_of(*float32_run))
    with capsys.disabled():
        print(f"\nbf16 compute, float32 master weights: moved {moved:.4f}, relative L2 to float32 {distance:.4f}")
    assert moved >= 0.90
    assert distance <= 0.30
    assert distance > 1e-4, "the run equals the float32 one: bf16 compute did not happen"


def test_bf16_weights_lose_the_update_as_the_issue_measured(tiny, float32_run, capsys):
    """param_dtype = bfloat16 reproduces the old behaviour: ~2% of the weights move."""
    before, after = train_update(tiny, "cpu", "bfloat16", "bfloat16")
    moved = moved_fraction(before, after)
    distance = relative_l2(update_of(before, after), update_of(*float32_run))
    with capsys.disabled():
        print(f"\nbf16 weights: moved {moved:.4f}, relative L2 to float32 {distance:.4f}")
    assert moved < 0.10
    assert distance > 0.9


def test_optimizer_state_and_gradients_are_float32_under_bf16_compute(tiny):
    settings = LearnerSettings(
        model=str(tiny), compute_dtype="bfloat16", group_size=4, groups_per_step=2, micro_batch_size=4, beta=0.04
    )
    model, _ = load_policy(settings, str(tiny))
    trainer = Trainer(model, settings, reference_model(model, torch.bfloat16))
    assert trainer.optimizer.precision == Precision(param=torch.float32, compute=torch.bfloat16)
    batch = fixed_batch()
    trainer.optimizer.adamw.zero_grad()
    trainer.accumulate_gradients(batch, trainer.prepare(batch))
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    trainer.optimizer.adamw.step()
    states = [s for s in trainer.optimizer.adamw.state.values()]
    assert states and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in states)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in trainer.reference.parameters())


def test_checkpoint_keeps_the_float32_master_weights(tiny, tmp_path):
    settings = LearnerSettings(model=str(tiny), compute_dtype="bfloat16", group_size=4, groups_per_step=2, lr=1e-6)
    model, tokenizer = load_policy(settings, str(tiny))
    trainer = Trainer(model, settings)
    trainer.train(fixed_batch())
    path = save_checkpoint(tmp_path / "ckpt", trainer, tokenizer, LearnerState(step=1, policy_version=1), keep=1)
    saved = load_file(path / "model.safetensors")
    for name, param in model.named_parameters():
        assert saved[name].dtype == torch.float32
        assert torch.equal(saved[name], param.detach()), name
    resumed, _ = load_policy(settings, str(path))
    for name, param in resumed.named_parameters():
        assert torch.equal(param.detach(), saved[name]), name


def test_autocast_only_when_compute_is_lower_than_the_weights():
    x = torch.randn(4, 8)
    layer = torch.nn.Linear(8, 8)
    with compute_context(Precision(torch.float32, torch.bfloat16), "cpu"):
        assert layer(x).dtype == torch.bfloat16
    for precision in (Precision(), Precision(torch.bfloat16, torch.bfloat16), Precision(torch.float64, torch.float32)):
        with compute_context(precision, "cpu"):
            assert layer(x).dtype == torch.float32
    assert resolve_precision("float32", "bfloat16", "cpu") == Precision(torch.float32, torch.bfloat16)
    assert resolve_precision("bfloat16", "auto", "cpu") == Precision(torch.bfloat16, torch.bfloat16)


def test_fsdp_policy_gathers_in_bf16_and_reduces_in_float32():
    policy = mixed_precision_policy(torch.float32, torch.bfloat16)
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert mixed_precision_policy(torch.float32, torch.float32) is None


def test_old_dtype_setting_is_read_as_compute_dtype_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="shared.config.learner"):
        settings = LearnerSettings(model="m", dtype="bfloat16")
    assert (settings.param_dtype, settings.compute_dtype, settings.dtype) == ("float32", "bfloat16", None)
    assert "deprecated" in caplog.text and "compute_dtype" in caplog.text
    assert LearnerSettings(model="m", dtype="float32", compute_dtype="float32").compute_dtype == "float32"
    with pytest.raises(ValueError, match="remove dtype"):
        LearnerSettings(model="m", dtype="bfloat16", compute_dtype="float32")
    with pytest.raises(ValueError, match="param_dtype = 'bfloat16' computes in bfloat16"):
        LearnerSettings(model="m", param_dtype="bfloat16", compute_dtype="float32")
