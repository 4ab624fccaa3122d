"""The learner's loop against real Redis, with a model whose forward turns NaN for some batches (what an
overflow in the forward does): those steps are never applied, their groups are logged by id and counted, and
``MAX_NONFINITE_STEPS_IN_A_ROW`` of them in a row stop the run with an error that names them."""

from __future__ import annotations

import json
import logging
import math

import httpx
import pytest
import torch
from prometheus_client import CollectorRegistry

from services.learner.nonfinite import MAX_NONFINITE_STEPS_IN_A_ROW, NonFiniteTraining
from services.learner.startup import build_learner
from tests.integration.test_learner import _batches, _settings
from tests.support.fake_pipeline import run_loop_to_end
from tests.support.tiny_model import build_tiny_llama

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=7, logit_scale=1.0)


def _poison(loop, poisoned_calls: set[int]) -> list[dict[str, torch.Tensor]]:
    """Make the model's last norm give NaN during the ``poisoned_calls``-th batches (1-based) the loop trains;
    returns the weights before and after each poisoned batch, as they were (appended in pairs)."""
    model = loop.trainer.model
    state = {"on": False, "calls": 0}
    snapshots: list[dict[str, torch.Tensor]] = []

    def nan_out(_module, _inputs, output):
        return output + math.nan if state["on"] else output

    model.model.norm.register_forward_hook(nan_out)
    train = loop._train

    def poisoned_train(groups):
        state["calls"] += 1
        state["on"] = state["calls"] in poisoned_calls
        if state["on"]:
            snapshots.append({name: p.detach().clone() for name, p in model.named_parameters()})
        try:
            return train(groups)
        finally:
            if state["on"]:
                snapshots.append({name: p.detach().clone() for name, p in model.named_parameters()})
            state["on"] = False

    loop._train = poisoned_train
    return snapshots


async def _run(settings, redis_client, keys, poisoned_calls: set[int], seen: list | None = None):
    """Run the loop to its end; ``seen`` gets the loop and the snapshots, also when it raises."""
    async with httpx.AsyncClient() as http:
        loop, _ = await build_learner(settings, redis_client, http, CollectorRegistry())
        snapshots = _poison(loop, poisoned_calls)
        if seen is not None:
            seen.extend((loop, snapshots))
        await run_loop_to_end(loop, redis_client, keys)
    return loop, snapshots


def _assert_unchanged(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    for name, value in before.items():
        assert torch.equal(after[name], value), name


async def test_a_nonfinite_step_is_not_applied_and_the_run_goes_on(
    tiny, tmp_path, redis_client, redis_url, keys, caplog
):
    settings = _settings(tiny, tmp_path, keys.prefix, redis_url, max_steps=3, checkpoint_every=10)
    with caplog.at_level(logging.ERROR, logger="services.learner.nonfinite"):
        loop, snapshots = await _run(settings, redis_client, keys, poisoned_calls={2})
    assert loop.trainer.step == 3  # four batches: the second one's step was not applied
    assert loop.counters.nonfinite_steps == 1 and loop.counters.groups_nonfinite == settings.groups_per_step
    assert loop.counters.groups_trained == 3 * settings.groups_per_step
    before, after = snapshots
    _assert_unchanged(before, after)
    assert all(torch.isfinite(p).all() for p in loop.trainer.model.parameters())
    batches = _batches(tmp_path / "logs")
    skipped = batches[2][0]  # the batch written for step 2 first, whose step was not applied
    [line] = [r.getMessage() for r in caplog.records if "not applied" in r.getMessage()]
    assert all(group_id in line for group_id in skipped), line
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["train/nonfinite_steps"] for r in steps] == [0, 1, 1]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps)


async def test_steps_not_finite_in_a_row_stop_the_run_naming_their_groups(
    tiny, tmp_path, redis_client, redis_url, keys
):
    settings = _settings(tiny, tmp_path, keys.prefix, redis_url, max_steps=8)
    seen: list = []
    with pytest.raises(NonFiniteTraining, match=f"{MAX_NONFINITE_STEPS_IN_A_ROW} optimizer steps in a row") as caught:
        await _run(settings, redis_client, keys, poisoned_calls=set(range(1, 100)), seen=seen)
    loop, snapshots = seen
    assert loop.trainer.step == 0 and loop.counters.nonfinite_steps == MAX_NONFINITE_STEPS_IN_A_ROW
    _assert_unchanged(snapshots[0], snapshots[-1])
    assert loop.trainer.optimizer.scheduler.last_epoch == 0
    batches = _batches(tmp_path / "logs")
    named = [group_id for rows in batches.values() for group_ids in rows for group_id in group_ids]
    assert len(named) == MAX_NONFINITE_STEPS_IN_A_ROW * settings.groups_per_step
    assert all(group_id in str(caught.value) for group_id in named)
    assert not list((tmp_path / "ckpt").glob("step-*")), "nothing was trained, nothing is checkpointed"
