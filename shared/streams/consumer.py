"""Reading one stream through a consumer group: recovery, claiming, exactly-once commits, dead-lettering.

The guarantees are listed in :mod:`shared.streams`; this module is the consumer's side of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from shared.keys import Keys
from shared.streams.applied import AppliedMarkers
from shared.streams.dead_letter import DeadLetters
from shared.streams.entries import Delivery, MalformedEntry, entry_record
from shared.streams.groups import ensure_group
from shared.streams.producer import Output, outputs_per_producer
from shared.streams.reader import GroupReader, RawEntries, Source

log = logging.getLogger(__name__)

Commit = tuple[Delivery, Sequence[Output]]  # a delivery and the records its processing writes downstream


@dataclass
class StreamStats:
    """Counters of one consumer; services export them to Prometheus."""

    delivered: int = 0
    redelivered: int = 0
    claimed: int = 0
    recovered: int = 0  # left pending under our name by a failed read, read again (StreamConsumer.recover_lost)
    committed: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    malformed: int = 0  # set aside on first sight: fields not a record id and a payload (also in dead_lettered)
    released: int = 0
    keepalive_errors: int = 0


@dataclass
class _ConsumerState:
    in_flight: dict[str, Delivery] = field(default_factory=dict)
    last_error: dict[str, str] = field(default_factory=dict)

    def held(self) -> set[str]:
        """The entries handed out and not finished: in flight, or released for a retry."""
        return set(self.in_flight) | set(self.last_error)


def _log_recovered(stats: StreamStats, source: Source, count: int, stream: str, consumer: str) -> None:
    """Count and log entries a read took back rather than read new."""
    if source == "lost":
        stats.recovered += count
        log.warning("read again %d entries of %s a failed read left with %s", count, stream, consumer)
    elif source == "claimed":
        stats.claimed += count
        log.info(
            "claimed %d entries of %s: handed back by a live consumer, or idle past claim_idle_ms under one that "
            "stopped",
            count,
            stream,
        )


class StreamConsumer:
    """Reads one stream through a consumer group, with claiming, dead-lettering and exactly-once commits."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        stream: str,
        group: str,
        consumer: str,
        *,
        batch_size: int = 16,
        block_ms: int = 1000,
        claim_idle_ms: int = 30_000,
        max_deliveries: int = 5,
        applied_ttl_s: int = 7 * 24 * 3600,
        dead_letter_maxlen: int = 100_000,
    ) -> None:
        if max_deliveries < 1:
            raise ValueError("max_deliveries must be at least 1")
        self.client, self.keys = client, keys
        self.stream, self.group, self.consumer = stream, group, consumer
        self.batch_size = batch_size
        self.block_ms = block_ms
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries
        self._markers = AppliedMarkers(client, keys, stream, group, applied_ttl_s)
        self.dead_letters = DeadLetters(client, keys.dead_letter, dead_letter_maxlen)
        self.stats = StreamStats()
        self._state = _ConsumerState()
        self._reader = GroupReader(client, stream, group, consumer, claim_idle_ms)

    async def start(self) -> None:
        await ensure_group(self.client, self.stream, self.group)

    @property
    def in_flight(self) -> int:
        return len(self._state.in_flight)

    # Reading -------------------------------------------------------------------------------------------

    async def read(self, count: int | None = None, block_ms: int | None = None) -> list[Delivery]:
        """Next deliveries: own pending entries first, then lost deliveries (:meth:`recover_lost`), then
        entries claimed (handed back, or idle past ``claim_idle_ms`` under a consumer that stopped), then new.

        Entries past ``max_deliveries`` go to the dead-letter stream; entries whose record was already
        applied are acknowledged and skipped. May return an empty list after blocking ``block_ms``.
        """
        count = count or self.batch_size
        block_ms = self.block_ms if block_ms is None else block_ms
        raw: RawEntries = []
        in_flight_before: set[str] = set()
        try:
            raw, source = await self._reader.next(count, block_ms, self._state.held)
            in_flight_before = {entry_id for entry_id, _ in raw if entry_id in self._state.in_flight}
            return await self._deliver(raw, source)
        except BaseException:
            # A failed read may have been carried out: what Redis delivered and never reached us, or reached us
            # and was never handed out, is found and read again (an entry released before is claimed again).
            # What was in flight before this read stays so.
            for entry_id, _ in raw:
                if entry_id not in in_flight_before:
                    self._state.in_flight.pop(entry_id, None)
            self._reader.lost_check_due = True
            raise

    async def _deliver(self, raw: RawEntries, source: Source) -> list[Delivery]:
        _log_recovered(self.stats, source, len(raw), self.stream, self.consumer)
        counts = await self._reader.delivery_counts([entry_id for entry_id, _ in raw]) if source != "new" else {}
        deliveries = []
        for entry_id, fields in raw:
            deliveries.append(await self._to_delivery(entry_id, fields, counts.get(entry_id, 1)))
        return await self._drop_applied([d for d in deliveries if d is not None])

    async def recover_lost(self) -> int:
        """How many entries are pending under this consumer's name without it holding them (delivered or
        released): deliveries a failed read never handed out. The next reads return them. Reads look for them
        after a failure and every few seconds; a caller that must know now that nothing is missing (the
        learner, before it takes its data as run out) asks here. Not while a read of this consumer runs."""
        await self._reader.find_lost(self._state.held())
        return len(self._reader.lost)

    async def _to_delivery(self, entry_id: str, fields: dict | None, deliveries: int) -> Delivery | None:
        if deliveries > 1:
            self.stats.redelivered += 1
        try:
            record_id, payload = entry_record(fields)
        except MalformedEntry as exc:
            await self._set_aside_malformed(entry_id, fields, deliveries, str(exc))
            return None
        delivery = Delivery(entry_id, record_id, payload, deliveries)
        if deliveries > self.max_deliveries:
            reason = self._state.last_error.pop(entry_id, None) or (
                "not acknowledged after delivery (its consumer died or kept failing)"
            )
            await self.dead_letter(delivery, f"delivered {deliveries} times (limit {self.max_deliveries}): {reason}")
            return None
        self.stats.delivered += 1
        self._state.in_flight[entry_id] = delivery
        return delivery

    async def _drop_applied(self, deliveries: list[Delivery]) -> list[Delivery]:
        if not deliveries:
            return []
        applied = await self._markers.flags([d.record_id for d in deliveries])
        fresh = []
        duplicate_ids = []
        for delivery, done in zip(deliveries, applied, strict=True):
            if done:
                duplicate_ids.append(delivery.entry_id)
                self._state.in_flight.pop(delivery.entry_id, None)
            else:
                fresh.append(delivery)
        if duplicate_ids:
            self.stats.duplicates += len(duplicate_ids)
            log.info("acknowledged %d already-applied entries of %s", len(duplicate_ids), self.stream)
            await self.client.xack(self.stream, self.group, *duplicate_ids)
        return fresh

    # Finishing -----------------------------------------------------------------------------------------

    async def commit(self, delivery: Delivery, outputs: Sequence[Output] = ()) -> bool:
        """Write ``outputs`` downstream, mark the record applied and ack the entry, atomically.

        Returns False (and writes nothing) when another consumer applied the same record first.
        """
        return (await self.commit_many([(delivery, outputs)]))[0]

    async def commit_many(self, items: Sequence[Commit]) -> list[bool]:
        """Commit several deliveries in one transaction; falls back to one by one on a conflict.

        Room downstream is reserved once, here, for every output; a record someone else applied first
        gives its room back.
        """
        if not items:
            return []
        for producer, n in outputs_per_producer([output for _, outputs in items for output in outputs]):
            await producer.reserve(n)
        try:
            await self._commit_transaction(items)
        except WatchError:
            if len(items) == 1:
                return [await self._ack_duplicate(*items[0])]
            return [await self._commit_reserved(delivery, outputs) for delivery, outputs in items]
        self._committed(items)
        return [True] * len(items)

    async def _commit_reserved(self, delivery: Delivery, outputs: Sequence[Output]) -> bool:
        """Commit one delivery whose room downstream :meth:`commit_many` has already reserved."""
        try:
            await self._commit_transaction([(delivery, outputs)])
        except WatchError:
            return await self._ack_duplicate(delivery, outputs)
        self._committed([(delivery, outputs)])
        return True

    async def _commit_transaction(self, items: Sequence[Commit]) -> None:
        applied_keys = [self._markers.key(d.record_id) for d, _ in items]
        async with self.client.pipeline(transaction=True) as pipe:
            await pipe.watch(*applied_keys)
            if await pipe.exists(*applied_keys):
                raise WatchError("record already applied")
            pipe.multi()
            for _, outputs in items:
                for output in outputs:
                    output.producer.queue(pipe, output.record_id, output.payload)
            pipe.xack(self.stream, self.group, *[d.entry_id for d, _ in items])
            self._markers.queue_marks(pipe, applied_keys)
            await pipe.execute()

    def _committed(self, items: Sequence[Commit]) -> None:
        for delivery, _ in items:
            self._finish(delivery.entry_id)
        self.stats.committed += len(items)

    async def _ack_duplicate(self, delivery: Delivery, outputs: Sequence[Output]) -> bool:
        """The record was applied by someone else: acknowledge our copy, apply nothing, free the room."""
        for producer, n in outputs_per_producer(outputs):
            producer.unreserve(n)
        await self.client.xack(self.stream, self.group, delivery.entry_id)
        self._finish(delivery.entry_id)
        self.stats.duplicates += 1
        log.info("record %s of %s was already applied; acknowledged without effect", delivery.record_id, self.stream)
        return False

    async def release(self, delivery: Delivery, error: str, *, at_once: bool = False) -> None:
        """Give up on a delivery for now (processing failed); it is retried after ``claim_idle_ms``, or, with
        ``at_once``, by the next claim of any consumer of the group (this one's next read claims it): for a
        delivery this consumer gave up on while it is alive (an environment fault, weights that went back),
        where waiting ``claim_idle_ms`` would only stall the prompt. A failure that may heal with time (a
        reward service down) keeps the wait, so its deliveries are not spent in a burst.

        After ``max_deliveries`` attempts it goes to the dead-letter stream with ``error`` as its reason.
        """
        self._state.in_flight.pop(delivery.entry_id, None)
        self._state.last_error[delivery.entry_id] = error
        self.stats.released += 1
        if at_once:
            await self._reader.hand_back(delivery.entry_id)

    async def dead_letter(self, delivery: Delivery, reason: str) -> None:
        """Move an entry to the dead-letter stream with its reason and original payload, and ack it."""
        log.warning("dead-lettering entry %s of %s: %s", delivery.entry_id, self.stream, reason)
        await self.dead_letters.move(self.stream, self.group, self.consumer, delivery, reason)
        self._finish(delivery.entry_id)
        self.stats.dead_lettered += 1

    async def _set_aside_malformed(self, entry_id: str, fields: dict | None, deliveries: int, reason: str) -> None:
        """A malformed entry can never be processed: dead-lettered on first sight, its fields kept exactly."""
        log.warning("dead-lettering malformed entry %s of %s: %s", entry_id, self.stream, reason)
        entry = (entry_id, fields, deliveries)
        await self.dead_letters.move_malformed(self.stream, self.group, self.consumer, entry, reason)
        self._finish(entry_id)
        self.stats.dead_lettered += 1
        self.stats.malformed += 1

    def _finish(self, entry_id: str) -> None:
        self._state.in_flight.pop(entry_id, None)
        self._state.last_error.pop(entry_id, None)

    # Liveness ------------------------------------------------------------------------------------------

    async def keepalive(self) -> None:
        """Reset the idle time of our in-flight entries so live work is not claimed by others."""
        entry_ids: list[str | bytes | int | memoryview] = list(self._state.in_flight)
        if not entry_ids:
            return
        await self.client.xclaim(
            self.stream, self.group, self.consumer, min_idle_time=0, message_ids=list(entry_ids), justid=True
        )

    async def run_keepalive(self, stop: asyncio.Event) -> None:
        """Call :meth:`keepalive` every third of ``claim_idle_ms`` until ``stop`` is set."""
        interval = max(self.claim_idle_ms / 3000, 0.05)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval)
            if stop.is_set():
                return
            try:
                await self.keepalive()
            except Exception:
                self.stats.keepalive_errors += 1
                log.exception("keepalive of %d in-flight entries failed", self.in_flight)
