"""The scorer's I/O loop: rollouts stream -> reward functions -> scored stream.

Scores up to ``max_groups_in_flight`` rollouts at once (HTTP plugins are I/O bound). Each rollout's entry
is acknowledged in the transaction that writes its ``ScoredGroup``; a scorer that dies leaves its rollouts
pending for another scorer to claim.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.scorer.rewards.functions import RewardFunction, score_batch
from services.scorer.scoring import reward_batch, scored_group
from shared.codec import WireError, decode, encode
from shared.records import AdvantageSpec, Rollout
from shared.redis_conn import RedisRetry
from shared.streams import Delivery, Output, StreamConsumer, StreamProducer

log = logging.getLogger(__name__)


@dataclass
class ScorerStats:
    groups_scored: int = 0
    groups_zero_std: int = 0
    groups_dropped: int = 0
    failures: int = 0
    rejected: int = 0
    last_metrics: dict[str, float] = field(default_factory=dict)


class ScoringLoop:
    def __init__(
        self,
        consumer: StreamConsumer,
        scored: StreamProducer,
        functions: Sequence[RewardFunction],
        weights: Sequence[float],
        spec: AdvantageSpec,
        *,
        drop_zero_std: bool,
        max_in_flight: int,
    ) -> None:
        self.consumer, self.scored = consumer, scored
        self.functions, self.weights = list(functions), list(weights)
        self.names = [f.name for f in self.functions]
        self.spec, self.drop_zero_std = spec, drop_zero_std
        self.max_in_flight = max_in_flight
        self.stats = ScorerStats()
        self._tasks: set[asyncio.Task] = set()
        self.redis = RedisRetry()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            room = self.max_in_flight - len(self._tasks)
            if room <= 0:
                await asyncio.wait(self._tasks, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                continue
            deliveries = await self.redis.run(
                lambda room=room: self.consumer.read(count=room, block_ms=500), "reading rollouts"
            )
            for delivery in deliveries:
                task = asyncio.create_task(self.handle(delivery))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def handle(self, delivery: Delivery) -> None:
        try:
            rollout = decode(delivery.payload, Rollout)
        except WireError as exc:
            self.stats.rejected += 1
            reason = f"WireError: {exc}"
            await self.redis.run(lambda: self.consumer.dead_letter(delivery, reason), "dead-lettering a rollout")
            return
        try:
            per_func = await score_batch(self.functions, reward_batch(rollout))
            group = scored_group(
                rollout,
                self.names,
                self.weights,
                per_func,
                self.spec,
                drop_zero_std=self.drop_zero_std,
                scorer_id=self.consumer.consumer,
            )
            output = Output(self.scored, group.group_id, encode(group))
            committed = await self.redis.run(lambda: self.consumer.commit(delivery, [output]), "writing a scored group")
        except Exception as exc:
            self.stats.failures += 1
            log.exception("scoring group %s failed; it will be retried", delivery.record_id)
            await self.consumer.release(delivery, f"{type(exc).__name__}: {exc}")
            return
        if committed:
            self.stats.groups_scored += 1
            self.stats.groups_zero_std += group.zero_std
            self.stats.groups_dropped += group.dropped
            self.stats.last_metrics = group.metrics
