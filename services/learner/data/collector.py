"""Batch collection: the next ``groups_per_step`` scored groups to train, read from the scored stream while
admitting prompts (:mod:`services.learner.data.admission`).

A group is dropped, acknowledged and counted rather than trained (:func:`drop_reason`) when it was trained
before a restart, when the scorer marked it (zero-std, with dynamic sampling), when it was sampled by weights
a crashed learner pushed after its last checkpoint, or when it is stale
(:func:`~services.learner.data.staleness.is_stale`). Dynamic sampling's cap (:func:`replacement_cap_reached`)
bounds how long a step waits for replacements of the zero-std groups it skipped. The data has run out
(``drained``) only when nothing is in flight and no delivery to the learner was lost on the way
(:meth:`~shared.streams.StreamConsumer.recover_lost`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection

from redis.exceptions import ResponseError

from services.learner.data.admission import Admission
from services.learner.data.feeder import PromptFeeder
from services.learner.data.staleness import is_stale
from services.learner.metrics.counters import Counters, DropReason
from services.learner.metrics.metric_sinks import MetricsSink
from shared.config.learner import LearnerSettings
from shared.intake import decode_or_reject
from shared.records import ScoredGroup
from shared.redis_conn import RedisRetry
from shared.streams import Delivery, StreamConsumer

log = logging.getLogger(__name__)

# A step still waiting for replacements says so each time it has skipped this many more zero-std groups: without
# a cap (max_replacement_groups) a run whose groups are nearly all unanimous waits long between progress lines.
SKIPS_REPORTED_EVERY = 8


def replacement_cap_reached(skipped: int, cap: int | None, collected: int) -> bool:
    """Dynamic sampling's bound (verl ``max_num_gen_batches``, in groups): once a step has skipped more than
    ``cap`` zero-std groups while waiting for replacements, it trains on the ``collected`` groups it has
    (never on none)."""
    return cap is not None and skipped > cap and collected > 0


def skip_report_due(skipped: int, reported: int) -> bool:
    """Whether a step that has skipped ``skipped`` zero-std groups, and last said so at ``reported``, says so
    again (every :data:`SKIPS_REPORTED_EVERY`)."""
    return skipped >= reported + SKIPS_REPORTED_EVERY


def drop_reason(
    group: ScoredGroup, trained: Collection[str], policy_version: int, max_staleness: int
) -> DropReason | None:
    """Why ``group`` is not trained at ``policy_version``, or None when it is. The group's age is its rollout's
    ``policy_version``, which the record validates to be at most every sampled token's version
    (:func:`shared.sampled_versions.trajectory_version`): a trajectory is as old as its oldest sampled turn."""
    version = group.rollout.policy_version
    if group.group_id in trained:
        return "already_trained"
    if group.dropped:
        return "zero_std_dropped"
    if version > policy_version:
        # Sampled by weights a crashed learner pushed after its last checkpoint: they no longer exist.
        return "from_lost_versions"
    if is_stale(policy_version, version, max_staleness):
        return "stale_dropped"
    return None


class BatchCollector:
    """Buffers the scored groups read and hands out batches of them. ``trained``: the ids of the groups
    trained so far (the loop adds to it); ``while_waiting``: called on every round of waiting for groups."""

    def __init__(
        self,
        *,
        settings: LearnerSettings,
        consumer: StreamConsumer,
        admission: Admission,
        feeder: PromptFeeder,
        counters: Counters,
        sink: MetricsSink,
        redis: RedisRetry,
        trained: Collection[str],
        version: Callable[[], int],
        while_waiting: Callable[[], Awaitable[None]],
    ) -> None:
        self.settings, self.consumer, self.admission, self.feeder = settings, consumer, admission, feeder
        self.counters, self.sink, self.redis, self.trained = counters, sink, redis, trained
        self.version, self.while_waiting = version, while_waiting
        self.buffer: list[tuple[Delivery, ScoredGroup]] = []  # read, not yet trained
        self.dynamic_sampling: dict[str, float] = {}  # the last collected batch's figures
        self.drained = False  # every epoch admitted and every group in flight back (see collect)

    async def _accept(self, delivery: Delivery) -> None:
        group = await decode_or_reject(self.consumer, self.redis, delivery, ScoredGroup, "a group", self.settings)
        if group is None:
            self.counters.rejected()
            return
        version = self.version()
        reason = drop_reason(group, self.trained, version, self.settings.max_staleness)
        if reason is None:
            self.buffer.append((delivery, group))
            return
        self.counters.dropped(reason)
        self.sink.write_drop(group.group_id, reason, group.rollout.policy_version, version)
        await self.redis.run(lambda: self.consumer.commit(delivery), "acknowledging a dropped group")

    async def collect(self, stop: asyncio.Event) -> list[tuple[Delivery, ScoredGroup]] | None:
        """The next batch; a partial one when the data ran out, None when nothing is left or on stop."""
        wanted = self.settings.groups_per_step
        skipped_before = self.counters.groups_zero_std_dropped
        capped, reported = False, 0
        while len(self.buffer) < wanted and not stop.is_set():
            skipped = self.counters.groups_zero_std_dropped - skipped_before
            if replacement_cap_reached(skipped, self.settings.max_replacement_groups, len(self.buffer)):
                capped = True
                log.warning(
                    "dynamic sampling cap: %d zero-std groups skipped; training on %d", skipped, len(self.buffer)
                )
                break
            if skip_report_due(skipped, reported):
                reported = skipped
                log.info(
                    "dynamic sampling: %d zero-std groups skipped for this step, %d of %d groups collected; "
                    "waiting for replacements (max_replacement_groups %s)",
                    skipped,
                    len(self.buffer),
                    wanted,
                    self.settings.max_replacement_groups,
                )
            await self.admission.admit(len(self.buffer))
            await self._read(wanted - len(self.buffer))
            await self.while_waiting()
            if await self._drained(wanted):
                self.drained = True
                break
        if stop.is_set() or not self.buffer:
            return None
        self.dynamic_sampling = {
            "dynamic_sampling/skipped_groups": float(self.counters.groups_zero_std_dropped - skipped_before),
            "dynamic_sampling/capped": float(capped),
        }
        batch, self.buffer = self.buffer[:wanted], self.buffer[wanted:]
        return batch

    async def _drained(self, wanted: int) -> bool:
        """Every row admitted, fewer than ``wanted`` groups buffered, and nothing else in flight: no backlog,
        and no scored group left pending under the learner's name by a failed read (a restart or a dropped
        connection at the wrong moment), which the in-flight count leaves out (the learner's pending entries
        are its trained, not yet acknowledged groups). Such groups are read again by the next reads."""
        if not self.feeder.exhausted or len(self.buffer) >= wanted:
            return False
        if await self.admission.measure_in_flight(len(self.buffer)) != len(self.buffer):
            return False
        lost = await self.redis.run(self.consumer.recover_lost, "looking for lost deliveries of scored groups")
        if lost:
            log.warning("%d scored groups were left pending by a failed read; reading them again", lost)
        return not lost

    async def _read(self, count: int) -> None:
        """Read up to ``count`` scored groups: each is buffered for training, or dropped with its reason."""
        try:
            deliveries = await self.redis.run(lambda: self.consumer.read(count=count, block_ms=200), "reading groups")
        except ResponseError:  # NOGROUP: the learner's group may have gone with the rest of Redis's state
            await self.admission.check_redis_state()
            raise
        for delivery in deliveries:
            await self._accept(delivery)
