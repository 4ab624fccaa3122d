"""Admission control (AReaL-style), in one place: the learner publishes prompts only while fewer than
``admission_bound = (max_staleness + 1) * groups_per_step`` groups are in flight, so few samples ever age past
``max_staleness`` (:mod:`services.learner.data.staleness`).

In flight: prompts not yet sampled + rollouts not yet scored + scored groups not yet read (the three streams'
backlogs) + groups read but not yet trained (the collector's buffer). Each prompt is published in one
MULTI/EXEC with the feeder's new position, so a restarted learner resumes exactly after the last admitted
prompt. Every measurement first checks that Redis still holds the run (:class:`RedisStateLost`), and every
``TRIM_EVERY_S`` trims what every group has finished from the pipeline's streams.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from services.learner.data.feeder import PromptFeeder
from services.learner.metrics.counters import Counters
from shared.codec import encode
from shared.config.learner import LearnerSettings
from shared.keys import Keys
from shared.redis_conn import RedisRetry
from shared.streams import StreamProducer, group_backlog, trim_processed

FEEDER_POSITION = b"feeder_position"
RUNTIME = b"runtime"  # written into ``learner_state`` at start; its absence means Redis lost the run's state
TRIM_EVERY_S = 5.0  # trimming reads every group's pending entries: not on every measurement


class RedisStateLost(RuntimeError):
    """Redis no longer holds what the learner wrote at its start: it restarted without persistence (AOF or
    RDB), or it was flushed. The groups in flight are gone, and counting them in Redis would count none."""


def admission_budget(in_flight: int, bound: int) -> int:
    """How many more groups may be admitted now: ``bound - in_flight``, never negative."""
    return max(0, bound - in_flight)


class Admission:
    """Measures the groups in flight and publishes prompts up to the bound. ``version``: the learner's
    policy version now (the tasks carry it)."""

    def __init__(
        self,
        *,
        settings: LearnerSettings,
        client: aioredis.Redis,
        keys: Keys,
        feeder: PromptFeeder,
        counters: Counters,
        redis: RedisRetry,
        version: Callable[[], int],
    ) -> None:
        self.settings, self.client, self.keys, self.feeder = settings, client, keys, feeder
        self.counters, self.redis, self.version = counters, redis, version
        self.prompts = StreamProducer(client, keys.prompts)
        self.in_flight = 0  # at the last measurement, plus what was admitted since
        self.next_trim_at = 0.0

    async def trim_streams(self) -> int:
        """Trim, from each stream of the pipeline, the entries every group has finished (``XTRIM MINID``): the
        learner is the one user allowed to (:mod:`shared.redis_acl`), so no producer can cut what its consumers
        have not read. Returns how many entries went."""
        self.next_trim_at = time.monotonic() + TRIM_EVERY_S
        keys = self.keys
        return sum(
            [await trim_processed(self.client, s) for s in (keys.prompts, keys.rollouts, keys.scored, keys.evaluated)]
        )

    async def measure_in_flight(self, buffered: int) -> int:
        """The groups in flight: the streams' backlogs plus ``buffered`` (read, not yet trained)."""

        async def measure() -> int:
            await self.check_redis_state()
            if time.monotonic() >= self.next_trim_at:
                await self.trim_streams()
            prompts = await group_backlog(self.client, self.keys.prompts, Keys.GENERATORS)
            rollouts = await group_backlog(self.client, self.keys.rollouts, Keys.SCORERS)
            scored = await group_backlog(self.client, self.keys.scored, Keys.LEARNER, include_pending=False)
            return prompts + rollouts + scored

        self.in_flight = await self.redis.run(measure, "measuring groups in flight") + buffered
        return self.in_flight

    async def check_redis_state(self) -> None:
        """Raise :class:`RedisStateLost` when Redis no longer holds the runtime record the learner wrote at
        its start: every stream, group and count it would read next is gone or starts from nothing."""
        if not await self.client.hexists(self.keys.learner_state, RUNTIME):
            raise RedisStateLost(
                f"Redis no longer holds the learner's state ({self.keys.learner_state!r} has no {RUNTIME.decode()!r}): "
                "it restarted without persistence or was flushed, and the groups in flight with it. Stopping at "
                f"step {self.version()} of {self.settings.max_steps}; restart the learner to go on from its last "
                "checkpoint, and run Redis with appendonly yes so that a restart keeps the streams"
            )

    async def admit(self, buffered: int) -> int:
        """Publish tasks up to the admission bound; returns how many were admitted."""
        budget = admission_budget(await self.measure_in_flight(buffered), self.settings.admission_bound)
        admitted = 0
        for _ in range(budget):
            before = self.feeder.position
            task = self.feeder.next_task(self.version())
            if task is None:
                break
            try:
                await self.redis.run(lambda task=task: self._publish(task), "admitting a prompt")
            except BaseException:
                self.feeder.position = before  # not admitted: the next attempt starts from the same row
                raise
            admitted += 1
        self.counters.admitted(admitted)
        self.in_flight += admitted
        return admitted

    async def _publish(self, task) -> None:
        """The task and the feeder's position after it, in one transaction."""
        position = json.dumps(self.feeder.position.model_dump()).encode()
        async with self.client.pipeline(transaction=True) as pipe:
            self.prompts.queue(pipe, task.task_id, encode(task))
            pipe.hset(self.keys.learner_state, FEEDER_POSITION, position)
            await pipe.execute()
