"""The generator's rollout loop running multi-turn trajectories on real Redis (a scripted engine, real Python
environments): a group's trajectories become one v2 ``Rollout`` committed with its prompt's ack; an
environment fault abandons the prompt, which is redelivered and dead-lettered after ``max_deliveries`` with
the reason, and no ``Rollout`` is ever written for it; every session opened is closed on every path."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest

from environments.build import build_environment
from services.generator.heartbeat import GeneratorTelemetry
from services.generator.rollout_loop import RolloutLoop
from services.generator.trajectory.runner import TrajectoryRunner, TrajectorySettings
from shared.codec import decode, encode
from shared.config.environment import EnvironmentSettings
from shared.config.generator import GeneratorSettings
from shared.keys import Keys
from shared.records import ChatMessage, PromptTask, Rollout, SamplingSpec
from shared.streams import StreamConsumer, StreamProducer
from tests.support.scripted_turns import ScriptedEngine, tool_call
from tests.support.tiny_model import build_tokenizer

pytestmark = pytest.mark.integration


def _loop(redis_client, keys, script, env, max_deliveries=3, claim_idle_ms=100, **environment):
    engine = ScriptedEngine(build_tokenizer(), script)
    settings = EnvironmentSettings(python=f"tests.support.trajectory_envs:{env}", **environment)
    runner = TrajectoryRunner(
        engine,
        build_environment(settings),
        TrajectorySettings(max_turns=4, max_tool_response_tokens=64, max_model_len=2048),
    )
    consumer = StreamConsumer(
        redis_client,
        keys,
        keys.prompts,
        Keys.GENERATORS,
        "gen-0",
        claim_idle_ms=claim_idle_ms,
        max_deliveries=max_deliveries,
    )
    rollouts = StreamProducer(redis_client, keys.rollouts)
    return RolloutLoop(engine, consumer, rollouts, "gen-0", max_in_flight=2, trajectories=runner)


async def _run_until(redis_client, keys, loop: RolloutLoop, until, tasks=1) -> None:
    for i in range(tasks):
        task = PromptTask(
            prompt=(ChatMessage(role="user", content=f"What is {i} + 2?"),),
            group_size=3,
            sampling=SamplingSpec(max_tokens=400),
            policy_version=0,
        )
        await StreamProducer(redis_client, keys.prompts).add(task.task_id, encode(task))
    await loop.consumer.start()
    stop = asyncio.Event()
    running = asyncio.create_task(loop.run(stop))
    deadline = time.monotonic() + 30
    while not await until() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(running, 10)


async def test_a_groups_trajectories_are_one_rollout_committed_with_the_prompts_ack(redis_client, keys):
    loop = _loop(redis_client, keys, [tool_call("add", a=1, b=2), "3"], "AdderEnv")

    async def written() -> bool:
        return await redis_client.xlen(keys.rollouts) >= 2

    await _run_until(redis_client, keys, loop, written, tasks=2)
    entries = await redis_client.xrange(keys.rollouts)
    assert len(entries) == 2 and loop.stats.prompts_done == 2
    for _, fields in entries:
        rollout = decode(fields[b"data"], Rollout)
        assert rollout.group_size == 3 and rollout.policy_version == 3
        assert all(c.trajectory.turns == 2 and c.loss_mask is not None for c in rollout.completions)
    assert (await redis_client.xpending(keys.prompts, Keys.GENERATORS))["pending"] == 0
    stats = loop.trajectories.environment.stats
    assert stats.sessions_opened == stats.sessions_closed == 6
    return loop


async def test_an_environment_fault_abandons_the_prompt_until_it_is_dead_lettered_and_writes_no_rollout(
    redis_client, keys
):
    # The breaker stays closed here: once open, the loop stops reading prompts for breaker_reset_s, and whether the
    # third delivery was claimed before that was a race (this test is about delivery counts, not the breaker).
    loop = _loop(
        redis_client,
        keys,
        [tool_call("wait", seconds=3)],
        "StuckEnv",
        max_deliveries=2,
        timeout_s=0.2,
        breaker_failures=1000,
    )

    async def dead() -> bool:
        return await redis_client.xlen(keys.dead_letter) > 0

    await _run_until(redis_client, keys, loop, dead)
    [(_, fields)] = await redis_client.xrange(keys.dead_letter)
    reason = fields[b"reason"].decode()
    assert "environment" in reason and "delivered 3 times" in reason
    assert await redis_client.xlen(keys.rollouts) == 0
    assert loop.stats.abandoned == 2 and loop.stats.prompts_done == 0
    stats = loop.trajectories.environment.stats
    assert stats.sessions_opened == stats.sessions_closed == 6
    metrics = _metrics(redis_client, keys, loop)
    assert metrics["generator/abandoned"] == 2 and metrics["env/sessions_open"] == 0
    assert metrics["env/calls/fault"] >= 2 and metrics["env/close_failures"] == 0


async def test_an_abandoned_prompt_is_sampled_again_at_once_by_its_live_generator(redis_client, keys, caplog):
    """``claim_idle_ms`` is two minutes: each environment fault hands the prompt back, so this generator, alive,
    takes it again at its next read; its three deliveries and the dead letter come in seconds, not minutes, and
    no log line calls the live generator dead."""
    loop = _loop(
        redis_client,
        keys,
        [tool_call("wait", seconds=3)],
        "StuckEnv",
        max_deliveries=2,
        claim_idle_ms=120_000,
        timeout_s=0.2,
        breaker_failures=1000,
    )

    async def dead() -> bool:
        return await redis_client.xlen(keys.dead_letter) > 0

    started = time.monotonic()
    with caplog.at_level(logging.INFO):
        await _run_until(redis_client, keys, loop, dead)
    assert await dead(), "the abandoned prompt was not delivered again within 30 s (claim_idle_ms is 120 s)"
    assert time.monotonic() - started < 20
    assert loop.stats.abandoned == 2 and loop.consumer.stats.claimed == 2
    assert await redis_client.xlen(keys.rollouts) == 0
    assert not [r for r in caplog.records if "dead" in r.getMessage() and "dead-letter" not in r.getMessage()]


def _metrics(redis_client, keys, loop: RolloutLoop) -> dict[str, float]:
    """What the generator's /metrics shows of a multi-turn loop."""
    lease = SimpleNamespace(indices=[], keeper=None)
    telemetry = GeneratorTelemetry(
        redis_client, keys, GeneratorSettings(model="m"), loop.engine, loop, loop.consumer, lease, "http://g"
    )
    collector = telemetry.collector()
    return {**collector._counters(), **collector._gauges()}


async def test_an_open_environment_breaker_stops_the_loop_reading_prompts(redis_client, keys):
    """The first delivery's timeout opens a breaker of one failure: the loop then takes no prompt, so the
    released one stays pending with one delivery instead of being sampled against a dead environment."""
    loop = _loop(
        redis_client,
        keys,
        [tool_call("wait", seconds=1)],
        "StuckEnv",
        max_deliveries=5,
        timeout_s=0.2,
        breaker_failures=1,
        breaker_reset_s=60,
    )

    abandoned_at: list[float] = []

    async def abandoned_then_idle_for_a_while() -> bool:
        if loop.stats.abandoned and not abandoned_at:
            abandoned_at.append(time.monotonic())
        return bool(abandoned_at) and time.monotonic() - abandoned_at[0] > 1.5

    await _run_until(redis_client, keys, loop, abandoned_then_idle_for_a_while)
    assert loop.stats.abandoned == 1 and not loop.accepting()
    [pending] = await redis_client.xpending_range(keys.prompts, Keys.GENERATORS, "-", "+", 10)
    assert pending["times_delivered"] == 1
    assert await redis_client.xlen(keys.dead_letter) == 0 and await redis_client.xlen(keys.rollouts) == 0
