"""Publishing the learner's weights to the generators: a push to every live generator (retried once), its
announcement, and the catch-up of generators that missed the last push.

While the learner waits for groups, a live generator that missed the last push (its registration lapsed while
Redis was out of reach, it did not answer, its update failed, it restarted from an older checkpoint) is
pushed the weights again: with no group left to train, the learner would otherwise never push again, and
everything that generator samples could stay too stale to train.

On one process without LoRA a push moves the parameters into the pusher's kept buffers
(``weight_sync.send_buffers``), so the next push packs them by no copy; a failed push takes them back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection

import httpx
import redis.asyncio as aioredis
import torch

from services.learner.metrics.counters import Counters
from services.learner.trainer import Trainer
from shared.codec import encode
from shared.config.learner import LearnerSettings
from shared.keys import Keys
from shared.records import GeneratorRegistration, WeightVersionAnnouncement
from shared.redis_conn import RedisRetry
from shared.registry import RegistryStats, live_generators
from weight_sync.send_buffers import own_parameters, place_parameters
from weight_sync.sender import PushReport, WeightPusher, WeightPushError

log = logging.getLogger(__name__)

# While it waits for groups, the learner looks this often for generators that missed the last push (one
# HGETALL); after pushing to them again it waits longer before the next look, so that a push that keeps failing
# is not retried in a tight loop.
_CATCH_UP_CHECK_S = 1.0
_CATCH_UP_RETRY_S = 10.0


class WeightPublisher:
    """Pushes the trainer's weights, remembers whom the last push reached, and catches up those it missed."""

    def __init__(
        self,
        *,
        settings: LearnerSettings,
        client: aioredis.Redis,
        keys: Keys,
        trainer: Trainer,
        pusher: WeightPusher,
        http: httpx.AsyncClient,
        counters: Counters,
        redis: RedisRetry,
        registry_stats: RegistryStats,
    ) -> None:
        self.settings, self.client, self.keys, self.trainer = settings, client, keys, trainer
        self.pusher, self.http, self.counters, self.redis = pusher, http, counters, redis
        self.registry_stats = registry_stats  # invalid registrations found listing generators
        self.pushed_version: int | None = None  # the version the generators were last given
        self.pushed_to: set[str] = set()  # the generators the last push reached
        self.next_catch_up = 0.0  # monotonic time before which missed generators are not pushed again
        self.placed: list[torch.nn.Parameter] = []  # parameters living in the pusher's kept buffers

    @property
    def policy_version(self) -> int:
        return self.trainer.step

    async def push(self, *, reset: bool = False, only: Collection[str] | None = None) -> float:
        """Push the current weights to every live generator (retried once); returns seconds spent. ``only``:
        to those of them alone (a catch-up, which announces no new version)."""
        started = time.perf_counter()
        failed: set[str] = set()
        for attempt in (1, 2):
            generators = await self._live_generators()
            generators = [
                g for g in generators if g.generator_id not in failed and (only is None or g.generator_id in only)
            ]  # the retry skips the failed ones
            try:
                report = await self._push_to(generators, reset=reset)
                self.counters.pushed(ok=True)
                await self._pushed(report, catch_up=only is not None)
                break
            except WeightPushError as exc:
                self.counters.pushed(ok=False)
                failed.update(exc.failed)
                log.error("weight push attempt %d failed: %s", attempt, exc)
        self.next_catch_up = time.monotonic() + _CATCH_UP_CHECK_S
        return time.perf_counter() - started

    async def _push_to(self, generators: list, *, reset: bool) -> PushReport:
        """One push to ``generators``; then the parameters move into the pusher's buffers where they may."""
        export = self.trainer.export
        try:
            with export.full_weights() as named:
                report = await self.pusher.push(
                    named, self.policy_version, generators, self.http, reset=reset, linear=export.linear_weights
                )
        except BaseException:
            if self.placed:  # a straggler may still read them where they lie
                own_parameters(self.placed)
                log.warning("the parameters left the weight push's buffers after a failed push")
                self.placed = []
            raise
        if export.pushes_parameters:  # the next push packs them by no copy
            placed = place_parameters(
                self.trainer.model, self.pusher.weight_homes(), contiguous_only=self.trainer.optimizer.fused
            )
            if placed and not self.placed:
                mb = sum(p.numel() * p.element_size() for p in placed) / 1e6
                log.info("%d parameters (%.0f MB) live in the weight push's buffers now", len(placed), mb)
            self.placed = placed
        return report

    async def _pushed(self, report: PushReport, *, catch_up: bool) -> None:
        """Remember whom a push reached; a push to every generator also announces its version."""
        if catch_up:
            self.pushed_to |= set(report.generators)
            return
        announcement = encode(WeightVersionAnnouncement(policy_version=self.policy_version))
        await self.redis.run(lambda: self.client.set(self.keys.weights, announcement), "announcing weights")
        self.pushed_version, self.pushed_to = self.policy_version, set(report.generators)

    async def catch_up(self) -> None:
        """Push the weights again when a live generator missed the last push and serves older weights (see
        the module docstring); looked for every ``_CATCH_UP_CHECK_S``, retried after ``_CATCH_UP_RETRY_S``."""
        if self.pushed_version is None or time.monotonic() < self.next_catch_up:
            return
        self.next_catch_up = time.monotonic() + _CATCH_UP_CHECK_S
        live = await self._live_generators()
        missed = {
            g.generator_id: g.policy_version
            for g in self.pusher.allowed(live)
            if g.generator_id not in self.pushed_to and g.policy_version < self.pushed_version
        }
        if missed:
            behind = ", ".join(f"{gid} (version {version})" for gid, version in sorted(missed.items()))
            log.warning(
                "generator(s) %s missed the push of version %d: pushing version %d to them while waiting for groups",
                behind, self.pushed_version, self.policy_version,
            )  # fmt: skip
            await self.push(only=missed)
            self.next_catch_up = time.monotonic() + _CATCH_UP_RETRY_S

    async def _live_generators(self) -> list[GeneratorRegistration]:
        """The registered generators whose heartbeat is live (invalid registrations set aside and counted)."""
        return await self.redis.run(
            lambda: live_generators(self.client, self.keys, self.registry_stats), "listing generators"
        )

    async def wait_for_generators(self, stop: asyncio.Event) -> None:
        """Until ``min_generators`` live generators this learner may push to are registered, or ``stop``."""
        last_log = 0.0
        while not stop.is_set():
            live = await self._live_generators()
            live = self.pusher.allowed(live)  # one at a host it may not contact does not count
            if len(live) >= self.settings.min_generators:
                return
            if time.monotonic() - last_log > 10:
                log.info("waiting for generators: %d of %d live", len(live), self.settings.min_generators)
                last_log = time.monotonic()
            await asyncio.sleep(0.5)
