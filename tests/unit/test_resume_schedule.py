"""A resumed learner follows the learning-rate schedule of its own settings from its first step on: resumed with
a longer ``max_steps``, its first step's rate is a fresh schedule's for the new length at that step, exactly;
with the same settings, the rate the run would have used had it not stopped."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from services.learner.checkpoint import LearnerState, save_checkpoint
from services.learner.distributed import Topology
from services.learner.optimizer import OptimizerStep, fused_adamw, lr_lambda
from services.learner.startup import build_trainer
from shared.config.learner import LearnerSettings
from shared.runs import run_identity, write_run_file
from tests.support.tiny_model import build_tiny_llama
from tests.unit.test_learner_core import _batch, _groups, _settings

N = 6  # the first run's max_steps
TRAINED = 4  # steps before the checkpoint: past the warm-up, in the cosine decay


def _optimizer(max_steps: int, lr: float = 1e-3) -> OptimizerStep:
    torch.manual_seed(0)
    settings = LearnerSettings(
        model="m",
        api_token="t",
        group_size=2,
        groups_per_step=1,
        micro_batch_size=2,
        lr=lr,
        warmup_steps=2,
        min_lr_ratio=0.1,
        max_steps=max_steps,
    )
    return OptimizerStep(torch.nn.Linear(3, 2), settings, Topology())


def _rates(optimizer: OptimizerStep, steps: int) -> list[float]:
    """The learning rate each of ``steps`` optimizer steps used."""
    rates = []
    for _ in range(steps):
        optimizer.zero_grad()
        optimizer.model(torch.ones(1, 3)).sum().backward()
        rates.append(optimizer.apply(loss=0.0)["learning_rate"])
    return rates


def _through_trainer_pt(optimizer: OptimizerStep) -> dict:
    """The optimizer's state as ``trainer.pt`` gives it back (``torch.load(weights_only=True)``)."""
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _resumed(first: OptimizerStep, max_steps: int, lr: float = 1e-3) -> OptimizerStep:
    resumed = _optimizer(max_steps, lr)
    resumed.load_state_dict(_through_trainer_pt(first))
    return resumed


def test_resumed_with_a_longer_max_steps_the_first_step_takes_the_new_schedules_rate():
    first = _optimizer(N)
    _rates(first, TRAINED)
    resumed = _resumed(first, 2 * N)
    fresh = _rates(_optimizer(2 * N), TRAINED + 3)[TRAINED:]
    assert resumed.step == TRAINED
    assert _rates(resumed, 3) == fresh
    assert fresh[0] == 1e-3 * lr_lambda(TRAINED, 2, 2 * N, 0.1)
    assert _rates(first, 1)[0] != fresh[0]  # the old schedule's rate, which the resumed step no longer takes


def test_resumed_with_the_same_settings_the_rates_are_the_uninterrupted_runs():
    first = _optimizer(N)
    _rates(first, TRAINED)
    resumed = _resumed(first, N)
    assert _rates(resumed, 2) == _rates(first, 2)


def test_resumed_with_another_lr_the_schedule_peaks_at_the_new_lr():
    first = _optimizer(N)
    _rates(first, TRAINED)
    resumed = _resumed(first, N, lr=2e-3)
    assert _rates(resumed, 2) == _rates(_optimizer(N, lr=2e-3), TRAINED + 2)[TRAINED:]


def test_resumed_at_the_end_of_a_schedule_the_rate_decays_from_the_restored_step():
    first = _optimizer(N)
    _rates(first, N)  # the old schedule has reached min_lr_ratio
    resumed = _resumed(first, 2 * N)
    assert _rates(resumed, 1) == _rates(_optimizer(2 * N), N + 1)[N:]
    assert resumed.adamw.param_groups[0]["lr"] > 1e-3 * 0.1


def test_a_learner_restarted_with_a_longer_max_steps_steps_at_the_new_schedules_rate(tmp_path):
    """The service's path: a checkpoint written after two steps of max_steps = 3, resumed by ``build_trainer``
    with max_steps = 6; its first step's ``learning_rate`` is a fresh 6-step schedule's at step 2."""
    tiny = build_tiny_llama(tmp_path / "m", seed=3)
    common = dict(
        warmup_steps=1, max_prompt_length=64, run_name="resume-schedule", checkpoint_dir=str(tmp_path / "checkpoints")
    )
    first = _settings(tiny, max_steps=3, **common)
    trainer, tokenizer, state, resumed = build_trainer(first)
    batch = _batch(_groups(trainer.model, seed=5))
    assert not resumed
    for _ in range(2):
        trainer.train(batch)
    write_run_file(first, run_identity(first))
    save_checkpoint(Path(first.checkpoint_dir), trainer, tokenizer, LearnerState(step=2, policy_version=2), keep=1)

    longer = _settings(tiny, max_steps=6, **common)
    trainer, _, state, resumed = build_trainer(longer)
    assert resumed and state.step == trainer.step == 2
    [metrics] = trainer.train(batch)
    assert metrics["learning_rate"] == longer.lr * lr_lambda(2, 1, 6, longer.min_lr_ratio)
    assert metrics["learning_rate"] != first.lr * lr_lambda(2, 1, 3, first.min_lr_ratio)


def test_adamw_runs_fused_on_one_cpu_process_only():
    plain = [torch.nn.Parameter(torch.zeros(2, dtype=dtype)) for dtype in (torch.float32, torch.bfloat16)]
    assert fused_adamw(plain, distributed_run=False)
    assert not fused_adamw(plain, distributed_run=True)  # sharded parameters are DTensors
    assert not fused_adamw([], distributed_run=False)
    assert not fused_adamw([torch.nn.Parameter(torch.zeros(2, device="meta"))], distributed_run=False)
    assert _optimizer(N).adamw.param_groups[0]["fused"] is True


def test_fused_adamw_takes_the_per_tensor_loop_s_steps_to_float32_rounding():
    fused, loop = _optimizer(N), _optimizer(N)
    for group in loop.adamw.param_groups:
        group["fused"] = None
    _rates(fused, 3), _rates(loop, 3)
    for a, b in zip(fused.model.parameters(), loop.model.parameters(), strict=True):
        assert not torch.equal(a, torch.zeros_like(a))
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_checkpoint_of_the_per_tensor_loop_resumes_fused():
    """A checkpoint's parameter groups carry the run's choice (an older learner's: ``fused`` None); the resumed
    optimizer keeps its own, and its next step equals a resumed per-tensor loop's to float32 rounding."""
    first = _optimizer(N)
    for group in first.adamw.param_groups:
        group["fused"] = None
    _rates(first, TRAINED)
    state = _through_trainer_pt(first)
    resumed = _optimizer(N)
    resumed.model.load_state_dict(first.model.state_dict())
    resumed.load_state_dict(state)
    assert resumed.adamw.param_groups[0]["fused"] is True
    _rates(resumed, 1), _rates(first, 1)
    for a, b in zip(resumed.model.parameters(), first.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_fused_adamw_steps_parameters_in_transposed_and_sliced_views_like_the_loop(caplog):
    """PyTorch's fused CPU kernel walks memory flat: a parameter moved into a transposed view or a column slice
    of a wider block (as the weight push places them) must take the per-tensor loop, and step like it."""
    fused, loop = _optimizer(N), _optimizer(N)
    loop.fused = False
    for group in loop.adamw.param_groups:
        group["fused"] = None
    _rates(fused, 1), _rates(loop, 1)
    blocks = []
    for optimizer in (fused, loop):
        weight, bias = optimizer.model.weight, optimizer.model.bias
        transposed = torch.empty(weight.shape[1], weight.shape[0]).t()  # strides (1, 2)
        transposed.copy_(weight.detach())
        block = torch.zeros(bias.shape[0], 3)  # the bias as column 1 of a [2, 3] block
        block[:, 1] = bias.detach()
        weight.data, bias.data = transposed, block[:, 1]
        blocks.append(block)
    with caplog.at_level("WARNING", logger="services.learner.optimizer"):
        _rates(fused, 2), _rates(loop, 2)
    assert fused.adamw.param_groups[0]["fused"] is None  # the loop took these steps
    assert sum("per-tensor loop" in r.getMessage() for r in caplog.records) == 1  # said once
    for a, b in zip(fused.model.parameters(), loop.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for block in blocks:  # the neighbouring columns untouched
        assert not block[:, 0].any() and not block[:, 2].any()
    for p in fused.model.parameters():  # back in memory of their own: the fused kernel again
        p.data = p.data.clone(memory_format=torch.contiguous_format)
    _rates(fused, 1)
    assert fused.adamw.param_groups[0]["fused"] is True
