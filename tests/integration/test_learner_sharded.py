"""The learner on two ranks (FSDP2 over gloo, as under ``torchrun`` on CPU) takes exactly the step one
process takes on the same batches, through a checkpoint of the sharded optimizer and a restart; and with bf16
compute over float32 shards (FSDP2's MixedPrecisionPolicy) it keeps the update, as one process does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.learner.data.batch import collate
from services.learner.distributed import Topology, mesh_device_type, micro_batch_plan, split_rows
from shared.config.learner import LearnerSettings
from tests.support.factories import make_task
from tests.support.fake_pipeline import scored_group_for
from tests.support.mixed_precision import fixed_batch, moved_fraction, relative_l2, train_update, update_of
from tests.support.sharded_trainer import build
from tests.support.tiny_model import build_tiny_llama

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "support" / "sharded_trainer.py"


def test_rows_and_passes_are_shared_out_evenly():
    assert [split_rows(9, Topology(rank=r, world_size=2)) for r in (0, 1)] == [slice(0, 5), slice(5, 9)]
    assert [split_rows(3, Topology(rank=r, world_size=4)) for r in range(4)] == [
        slice(0, 1),
        slice(1, 2),
        slice(2, 3),
        slice(3, 3),
    ]
    # 9 rows, micro-batches of 4: rank 0 runs 4 + 1 rows, rank 1 runs 4 rows and one padding pass.
    assert micro_batch_plan(9, 4, Topology(rank=0, world_size=2)) == [slice(0, 4), slice(4, 5)]
    assert micro_batch_plan(9, 4, Topology(rank=1, world_size=2)) == [slice(0, 4), None]
    assert micro_batch_plan(3, 2, Topology(rank=3, world_size=4)) == [None]


def _batch(count: int, group_size: int, seed: int, pad_id: int):
    groups = []
    for i in range(count):
        task = make_task(group_size=group_size, task_id=f"s{seed}-{i}")
        groups.append(scored_group_for(task, version=0))
    advantages = [torch.from_numpy(g.advantages) for g in groups]
    return collate(groups, advantages, pad_id)


def _torchrun(*args: str, timeout: float = 300) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT)]
    result = subprocess.run([*command, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]


def test_the_mesh_follows_the_process_group_not_the_machine():
    # gloo ranks on a machine with a GPU shard on the CPU (FSDP's default mesh would put them on cuda:<rank>).
    assert mesh_device_type("gloo") == "cpu"
    assert mesh_device_type("nccl") == "cuda"
    with pytest.raises(ValueError, match="'mpi'"):
        mesh_device_type("mpi")


@pytest.mark.slow
def test_two_ranks_take_the_single_process_step_through_a_checkpoint(tmp_path):
    tiny = build_tiny_llama(tmp_path / "tiny", seed=3, logit_scale=1.0)
    fields = dict(
        model=str(tiny),
        compute_dtype="float32",  # float64 weights compute in float64: equal to rounding
        group_size=4,
        groups_per_step=3,
        micro_batch_size=4,
        num_iterations=2,
        max_steps=10,
        loss_type="grpo",
        beta=0.04,
        lr=1e-3,
        max_completion_length=32,
        importance_cap=2.0,
        warmup_steps=1,
    )
    settings = LearnerSettings(**fields)
    # 12 rows (6 per rank, passes of 4 + 2), then 9 rows (5 and 4: rank 1 runs a padding pass).
    first, second = _batch(3, 4, seed=1, pad_id=4), _batch(3, 3, seed=2, pad_id=4)
    torch.save([first], tmp_path / "first.pt")
    torch.save([second], tmp_path / "second.pt")

    settings_json = json.dumps(fields)
    _torchrun("--model", str(tiny), "--batches", str(tmp_path / "first.pt"), "--settings", settings_json,
              "--out", str(tmp_path / "a"))  # fmt: skip
    assert (tmp_path / "a" / "state" / "optimizer" / ".metadata").exists()
    _torchrun("--model", str(tiny), "--batches", str(tmp_path / "second.pt"), "--settings", settings_json,
              "--out", str(tmp_path / "b"), "--weights", str(tmp_path / "a" / "weights.pt"),
              "--resume", str(tmp_path / "a" / "state"))  # fmt: skip

    single = build(str(tiny), None, settings, Topology())
    # The sharded learner runs the padded forward (equal pass counts on every rank). The shared-prompt and
    # packed forwards give the same logprobs to ~1e-15, but AdamW's first steps amplify such rounding in
    # near-zero gradients to ~1e-6 in the weights, so the comparison uses the same forward.
    single.planner.share_prompts = False
    single.planner.token_budget = 0
    expected_metrics = single.train(first) + single.train(second)
    got_metrics = json.loads((tmp_path / "a" / "metrics.json").read_text())
    got_metrics += json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert len(got_metrics) == len(expected_metrics) == 4
    for step, (got, want) in enumerate(zip(got_metrics, expected_metrics, strict=True)):
        for name in ("loss", "grad_norm", "kl", "learning_rate", "sampling/importance_sampling_ratio/mean"):
            assert got[name] == pytest.approx(want[name], rel=1e-9, abs=1e-12), (step, name)
        for name in want:
            # The clip extremes are over micro-batches, which two ranks cut differently from one process (TRL's
            # are over processes); every other figure is over the whole batch and must agree.
            if not name.startswith("seconds/") and name not in ("clip_ratio/low_min", "clip_ratio/high_max"):
                assert got[name] == pytest.approx(want[name], rel=1e-7, abs=1e-10), (step, name)
    weights = torch.load(tmp_path / "b" / "weights.pt")
    expected = dict(single.model.named_parameters())
    assert set(weights) == set(expected)
    moved = 0.0
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected[name].detach(), rtol=1e-9, atol=1e-11)
        moved = max(moved, float((expected[name].detach() - build_tiny_reference(tiny)[name]).abs().max()))
    assert moved > 1e-4, "the steps did not change the weights: the comparison would prove nothing"


def build_tiny_reference(tiny: Path, _cache: dict = {}) -> dict[str, torch.Tensor]:  # noqa: B006
    if tiny not in _cache:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float64)
        _cache[tiny] = dict(model.named_parameters())
    return _cache[tiny]


@pytest.mark.slow  # 20 s on an idle machine, 65-100 s with the 2 cores shared
def test_two_ranks_with_bf16_compute_keep_the_float32_update(tmp_path, capsys):
    """5 steps at lr 1e-6, bf16 gathers and float32 reduce-scatters: >= 90% of the float32 shards move and
    the update is within 30% (relative L2) of one float32 process's on the same batch."""
    tiny = build_tiny_llama(tmp_path / "tiny", seed=3, logit_scale=1.0)
    fields = dict(
        model=str(tiny),
        param_dtype="float32",
        compute_dtype="bfloat16",
        group_size=4,
        groups_per_step=2,
        micro_batch_size=4,
        num_iterations=5,
        max_steps=1000,
        lr=1e-6,
        max_completion_length=16,
    )
    torch.save([fixed_batch()], tmp_path / "batch.pt")
    _torchrun("--model", str(tiny), "--batches", str(tmp_path / "batch.pt"), "--settings", json.dumps(fields),
              "--out", str(tmp_path / "out"), "--dtype", "float32")  # fmt: skip
    after = torch.load(tmp_path / "out" / "weights.pt")
    before = {name: tensor.detach().float() for name, tensor in build_tiny_reference(tiny).items()}
    assert all(tensor.dtype == torch.float32 for tensor in after.values())
    reference = update_of(*train_update(tiny, "cpu", "float32", "float32"))
    moved = moved_fraction(before, after)
    distance = relative_l2(update_of(before, after), reference)
    with capsys.disabled():
        print(f"\ntwo ranks, bf16 compute: moved {moved:.4f}, relative L2 to one float32 process {distance:.4f}")
    assert moved >= 0.90
    assert 1e-4 < distance <= 0.30
