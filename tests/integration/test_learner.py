"""The learner against real Redis with a stand-in generator/scorer: admission control, stale drops, and a
checkpoint -> SIGKILL -> restart that resumes at the same step with the same next batch."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from services.learner.startup import build_learner
from shared.codec import decode
from shared.config.learner import LearnerSettings
from shared.keys import Keys
from shared.records import LearnerRuntime
from tests.support.fake_pipeline import run_fake_pipeline
from tests.support.processes import start_service
from tests.support.tiny_model import build_tiny_llama

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=7, logit_scale=1.0)


def _settings(tiny: Path, tmp: Path, prefix: str, redis_url: str, **overrides) -> LearnerSettings:
    fields = dict(
        model=str(tiny),
        redis_url=redis_url,
        stream_prefix=prefix,
        api_token="t",
        group_size=4,
        groups_per_step=2,
        micro_batch_size=4,
        max_steps=8,
        max_staleness=1,
        max_completion_length=8,
        max_prompt_length=200,
        checkpoint_dir=str(tmp / "ckpt"),
        checkpoint_every=3,
        log_dir=str(tmp / "logs"),
        weight_sync_port=0,
        min_generators=0,
        progress="off",
        lr=1e-3,
    )
    fields.update(overrides)
    return LearnerSettings(**fields)


async def test_admission_bounds_in_flight_and_stale_groups_are_dropped(tiny, tmp_path, redis_client, redis_url, keys):
    settings = _settings(tiny, tmp_path, keys.prefix, redis_url, log_completions=4, num_completions_to_log=6)
    keys = Keys(keys.prefix)
    async with httpx.AsyncClient() as http:
        loop, resumed = await build_learner(settings, redis_client, http, CollectorRegistry())
        assert not resumed
        stop = asyncio.Event()
        served = Counter()

        def version_of(task):
            served["n"] += 1
            # Every third group claims to come from a policy far older than max_staleness allows.
            return (
                max(0, loop.policy_version - 5)
                if served["n"] % 3 == 0 and loop.policy_version >= 5
                else loop.policy_version
            )

        fake = asyncio.create_task(run_fake_pipeline(redis_client, keys, stop, version_of))
        observed = []
        # Groups handed to training (being trained or trained): the loop writes each batch just before training.
        taken: list[str] = []
        write_batch = loop.sink.write_batch

        def record_batch(step, groups):
            taken.extend(g.group_id for g in groups)
            write_batch(step, groups)

        loop.sink.write_batch = record_batch

        async def watch():
            while not stop.is_set():
                consumed = len(taken) + loop.counters.groups_stale_dropped
                observed.append(loop.counters.groups_admitted - consumed)
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        await asyncio.wait_for(loop.run(stop, resumed=False), timeout=300)
        stop.set()
        await asyncio.gather(fake, watcher)
        loop.sink.close()
    bound = settings.admission_bound
    assert loop.trainer.step == 8
    assert loop.counters.groups_trained == 16
    assert loop.counters.groups_stale_dropped >= 1
    # Groups admitted but neither trained nor dropped never exceeded the admission bound.
    assert max(observed) <= bound, (max(observed), bound)
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["staleness/max"] <= settings.max_staleness for r in records)
    assert records[-1]["counters/groups_stale_dropped"] == loop.counters.groups_stale_dropped
    # log_completions = 4: the first 6 completions (a group of 4, then 2 of the next) of steps 4 and 8.
    completions = [json.loads(line) for line in (tmp_path / "logs" / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in completions] == [4] * 6 + [8] * 6
    batches = _batches(tmp_path / "logs")
    for step, rows in ((4, completions[:6]), (8, completions[6:])):
        assert [r["group_id"] for r in rows] == [batches[step][0][0]] * 4 + [batches[step][0][1]] * 2
    assert all(r["completion"] and any(k.startswith("rewards/") for k in r) for r in completions)
    print(
        f"\nadmitted={loop.counters.groups_admitted} trained={loop.counters.groups_trained} "
        f"stale_dropped={loop.counters.groups_stale_dropped} max_in_flight={max(observed)} bound={bound}"
    )


def _batches(log_dir: Path) -> dict[int, list[str]]:
    path = log_dir / "batches.jsonl"
    if not path.exists():
        return {}
    batches = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        batches.setdefault(record["step"], []).append(record["group_ids"])
    return batches


def _skip_without_enough_gpus(ranks: int) -> None:
    """Under ``LEARNER_DEVICE=cuda`` every torchrun rank takes a GPU of its own (NCCL refuses two ranks on one
    GPU): a test with more ranks than GPUs skips and says why instead of failing."""
    if not os.environ.get("LEARNER_DEVICE", "cpu").startswith("cuda") or ranks == 1:
        return
    import torch

    available = torch.cuda.device_count()
    if available < ranks:
        pytest.skip(
            f"{ranks} learner ranks on CUDA need {ranks} GPUs (one per NCCL rank); this machine has {available}"
        )


@pytest.mark.smokes("python -m services.learner")  # ranks 1: the documented command
@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow, id="torchrun-2-ranks")])
async def test_checkpoint_sigkill_restart_resumes_with_the_same_next_batch(
    tiny, tmp_path, redis_client, redis_url, keys, ranks
):
    """One learner process, or two FSDP2 ranks under torchrun (gloo; NCCL under LEARNER_DEVICE=cuda): the
    same guarantees."""
    _skip_without_enough_gpus(ranks)
    keys = Keys(keys.prefix)
    env = {
        "LEARNER_MODEL": str(tiny),
        "REDIS_URL": redis_url,
        "STREAM_PREFIX": keys.prefix,
        "API_TOKEN": "learner-test-token-" + "x" * 32,
        "LEARNER_GROUP_SIZE": "4",
        "LEARNER_GROUPS_PER_STEP": "2",
        "LEARNER_MICRO_BATCH_SIZE": "4",
        "LEARNER_MAX_STEPS": "9",
        "LEARNER_MAX_COMPLETION_LENGTH": "8",
        "LEARNER_MAX_PROMPT_LENGTH": "200",
        "LEARNER_RUN_NAME": "restarted",  # the restarted process continues this run (another name would not)
        "LEARNER_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "LEARNER_CHECKPOINT_EVERY": "3",
        "LEARNER_LOG_DIR": str(tmp_path / "logs"),
        "LEARNER_WEIGHT_SYNC_PORT": "0",
        "LEARNER_PORT": "0",
        "LEARNER_MIN_GENERATORS": "0",
        "LEARNER_PROGRESS": "off",
        "LEARNER_LR": "1e-3",
    }

    def start(name: str):
        if ranks == 1:
            return start_service(name, "services.learner", env)
        torchrun = ["--standalone", "--nproc_per_node", str(ranks), "-m", "services.learner"]
        return start_service(name, "torch.distributed.run", {**env, "OMP_NUM_THREADS": "1"}, torchrun)

    stop = asyncio.Event()
    fake = asyncio.create_task(run_fake_pipeline(redis_client, keys, stop))
    learner = start("learner")
    try:
        deadline = time.monotonic() + 240
        while 5 not in _batches(tmp_path / "logs"):  # step 5 started: after the step-3 checkpoint
            assert time.monotonic() < deadline and learner.process.poll() is None, learner.output()[-3000:]
            await asyncio.sleep(0.05)
        learner.kill()
        first_run = _batches(tmp_path / "logs")
        assert (tmp_path / "ckpt" / "step-3").exists() and not (tmp_path / "ckpt" / "step-6").exists()

        assert (tmp_path / "ckpt" / "step-3" / "optimizer").exists() == (ranks > 1)
        restarted = start("learner-2")
        line = await asyncio.to_thread(restarted.wait_for_line, "learner ready", 120)
        assert "step 3" in line, line
        await asyncio.to_thread(restarted.wait_for_line, "learner finished", 240)
        assert await asyncio.to_thread(restarted.process.wait, 120) == 0, restarted.output()[-3000:]
    finally:
        learner.kill()
        stop.set()
        await fake
    second = _batches(tmp_path / "logs")
    # The restarted learner trained steps 4 and 5 on exactly the batches the killed one had started.
    for step in (4, 5):
        assert second[step][-1] == first_run[step][0], step
    state = json.loads((tmp_path / "ckpt" / "step-9" / "state.json").read_text())
    trained = state["trained_group_ids"]
    assert len(trained) == 18 and len(set(trained)) == 18, "a group was lost or trained twice"
    assert state["step"] == 9
    # num_tokens (TRL's cumulative prompt + completion tokens) goes on from the checkpoint, not from zero.
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 10))
    tokens = [r["num_tokens"] for r in records]
    assert tokens == sorted(set(tokens)), tokens  # strictly increasing
    assert tokens[-1] == state["counters"]["input_tokens_seen"]
    pending = await redis_client.xpending(keys.scored, Keys.LEARNER)
    assert pending["pending"] == 0
    # Every rank's device and physical GPU, gathered at start and published by rank 0.
    runtime = decode(await redis_client.hget(keys.learner_state, "runtime"), LearnerRuntime)
    assert len(runtime.rank_devices) == len(runtime.rank_device_uuids) == ranks
    assert runtime.rank_devices[0] == runtime.device and runtime.rank_device_uuids[0] == runtime.device_uuid
    if runtime.device == "cpu":
        assert runtime.rank_devices == ("cpu",) * ranks and runtime.rank_device_uuids == (None,) * ranks
    else:  # one GPU per rank, each its own
        assert all(device.startswith("cuda") for device in runtime.rank_devices), runtime.rank_devices
        assert None not in runtime.rank_device_uuids and len(set(runtime.rank_device_uuids)) == ranks
    print(
        f"\n{ranks} rank(s): killed during step 5 (checkpoint at 3); restarted at step 3; final step 9, trained "
        f"{len(trained)} unique groups"
    )


async def test_evaluation_rounds_at_start_every_n_steps_and_at_the_end(tiny, tmp_path, redis_client, redis_url, keys):
    """Held-out prompts go out marked with the step, come back on the evaluated stream, and become ``eval/*``
    records of their own at steps 0, 3 and 4 (the last); none of them is trained, and each round's groups come
    from the weights of its step (the learner trains nothing while it waits)."""
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"question": f"h{i}", "answer": str(i)}) + "\n" for i in range(9)))
    settings = _settings(
        tiny, tmp_path, keys.prefix, redis_url, max_steps=4, eval_data=str(held_out), eval_samples=6, eval_every=3
    )
    async with httpx.AsyncClient() as http:
        loop, _ = await build_learner(settings, redis_client, http, CollectorRegistry())
        stop = asyncio.Event()
        fake = asyncio.create_task(run_fake_pipeline(redis_client, keys, stop))
        await asyncio.wait_for(loop.run(stop, resumed=False), timeout=300)
        stop.set()
        await fake
        loop.sink.close()
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    evaluations = [r for r in records if "eval/prompts" in r]
    assert [r["step"] for r in evaluations] == [0, 3, 4]
    for record in evaluations:
        assert (record["eval/prompts"], record["eval/missing"]) == (6, 0)
        assert record["eval/policy_version/min"] == record["eval/policy_version/max"] == record["step"]
        assert "eval/rewards/fake/mean" in record and "reward" not in record
    assert [r["step"] for r in records if "reward" in r] == [1, 2, 3, 4]
    trained = {g for line in (tmp_path / "logs" / "batches.jsonl").read_text().splitlines()
               for g in json.loads(line)["group_ids"]}  # fmt: skip
    assert len(trained) == 8 and loop.counters.groups_trained == 8
    assert loop.evaluator is not None and loop.evaluator.orphans == 0
