"""The generator's rollout loop on real Redis with a hand-written engine: a group whose weights went back while it
was sampled (a restarted learner's reset push) is sampled again, and a failure nobody handled is counted."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.generator.engine import SampledGroup
from services.generator.rollout_loop import RolloutLoop
from shared.codec import decode, encode
from shared.keys import Keys
from shared.records import Rollout
from shared.streams import StreamConsumer, StreamProducer
from tests.support.factories import make_rollout, make_task

pytestmark = pytest.mark.integration


class ScriptedEngine:
    """Answers each ``sample`` with the next (start version, finish version[, lowest version between]) of its
    script, or raises it."""

    def __init__(self, script: list[tuple[int, ...] | Exception]) -> None:
        self.script = script
        self.calls = 0
        self.weights_ok = True
        self.paused_by_operator = False

    def tokenize(self, prompt) -> list[int]:
        return [1, 2, 3]

    async def sample(self, prompt_ids, sampling, n: int) -> SampledGroup:
        step = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        if isinstance(step, Exception):
            raise step
        started, finished, *between = step
        lowest = min(started, finished, *between)
        completions = make_rollout(make_task(group_size=n)).completions
        return SampledGroup(completions, started, finished, time.time(), time.time(), prompt_ids, lowest)


async def _run(redis_client, keys: Keys, engine: ScriptedEngine, until) -> RolloutLoop:
    await StreamProducer(redis_client, keys.prompts).add("p1", encode(make_task(group_size=4)))
    consumer = StreamConsumer(redis_client, keys, keys.prompts, Keys.GENERATORS, "gen-0", claim_idle_ms=100)
    await consumer.start()
    loop = RolloutLoop(engine, consumer, StreamProducer(redis_client, keys.rollouts), "gen-0", max_in_flight=2)
    stop = asyncio.Event()
    running = asyncio.create_task(loop.run(stop))
    keepalive = asyncio.create_task(consumer.run_keepalive(stop))  # as the service runs it
    deadline = time.monotonic() + 20
    while not await until(loop) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(asyncio.gather(running, keepalive), 10)
    return loop


async def test_a_group_whose_weights_went_back_is_sampled_again(redis_client, keys):
    engine = ScriptedEngine([(5, 3), (3, 3)])  # the reset push took version 5 back to 3 mid-group

    async def written(loop: RolloutLoop) -> bool:
        return await redis_client.xlen(keys.rollouts) > 0

    loop = await _run(redis_client, keys, engine, written)
    [(_, fields)] = await redis_client.xrange(keys.rollouts)
    rollout = decode(fields[b"data"], Rollout)
    assert (rollout.policy_version, rollout.finished_policy_version) == (3, 3)
    assert engine.calls == 2 and loop.stats.rolled_back == 1 and loop.stats.prompts_done == 1


async def test_a_group_whose_weights_went_back_and_forward_again_is_sampled_again(redis_client, keys):
    engine = ScriptedEngine([(5, 5, 3), (5, 5)])  # pushes back to 3, then forward to 4 and 5, mid-group

    async def written(loop: RolloutLoop) -> bool:
        return await redis_client.xlen(keys.rollouts) > 0

    loop = await _run(redis_client, keys, engine, written)
    [(_, fields)] = await redis_client.xrange(keys.rollouts)
    assert (decode(fields[b"data"], Rollout).policy_version, engine.calls, loop.stats.rolled_back) == (5, 2, 1)


async def test_a_failure_nobody_handled_is_counted_and_the_prompt_delivered_again(redis_client, keys, monkeypatch):
    engine = ScriptedEngine([(2, 2)])
    loop_commits = []

    async def broken_commit(self, *args) -> None:  # a bug in writing the rollout, the first time only
        loop_commits.append(1)
        if len(loop_commits) == 1:
            raise RuntimeError("a bug")
        await original(self, *args)

    original = RolloutLoop._commit
    monkeypatch.setattr(RolloutLoop, "_commit", broken_commit)

    async def written(loop: RolloutLoop) -> bool:
        return await redis_client.xlen(keys.rollouts) > 0

    loop = await _run(redis_client, keys, engine, written)
    assert loop.stats.failures == 1 and len(loop_commits) == 2
    assert await redis_client.xlen(keys.rollouts) == 1
