"""A Redis Streams transport that loses nothing (Redis 7.0 commands only).

Guarantees, each tested in ``tests/integration/test_streams.py``:

* **Consumer groups, acks.** Replicas share a stream through one consumer group. An entry stays pending
  until :meth:`StreamConsumer.commit` acknowledges it, in the same ``MULTI/EXEC`` that writes its results
  downstream (both live on the same Redis), so a crash leaves either nothing or everything done.
* **Recovery.** A consumer first re-reads its own pending entries (a restart under a stable name). Entries
  idle longer than ``claim_idle_ms`` - their consumer died - are taken over with ``XAUTOCLAIM``. A live
  consumer keeps its in-flight entries fresh (``XCLAIM ... JUSTID``), so slow work is not stolen.
* **Poison entries.** An entry delivered more than ``max_deliveries`` times, or one the service rejects,
  moves to the dead-letter stream with its reason and original payload.
* **Exactly-once effect.** Each entry carries a record id. Committing sets an "applied" key under ``WATCH``;
  an entry whose record was already applied (a redelivery, or a producer that retried its ``XADD``) is acked
  without being applied again.
* **Backpressure.** A producer waits while the stream's backlog (undelivered plus pending entries of its
  busiest consumer group) is at its bound; streams are trimmed only below the oldest entry that some group
  still needs (``XTRIM MINID``), so trimming never drops unprocessed work.

The Redis client is passed in (``redis.asyncio.Redis`` created with ``decode_responses=False``); nothing
here holds a module-level connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError, WatchError

from shared.keys import Keys

log = logging.getLogger(__name__)

_ID_FIELD = b"id"
_DATA_FIELD = b"data"


def default_consumer_name(role: str) -> str:
    """A consumer name unique to this process: ``role-host-pid-random``."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _entries(reply: Any) -> list[tuple[str, dict | None]]:
    """Entries of a single-stream XREADGROUP reply as ``(entry_id, fields)``."""
    if not reply:
        return []
    return [(_text(entry_id), fields) for entry_id, fields in reply[0][1]]


def _entry_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass(frozen=True, slots=True)
class Delivery:
    """One stream entry handed to a consumer."""

    entry_id: str
    record_id: str
    payload: bytes
    deliveries: int  # how many times this entry has been delivered, this time included


@dataclass
class StreamStats:
    """Counters of one consumer; services export them to Prometheus."""

    delivered: int = 0
    redelivered: int = 0
    claimed: int = 0
    committed: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    released: int = 0
    keepalive_errors: int = 0


async def ensure_group(client: aioredis.Redis, stream: str, group: str) -> None:
    """Create ``group`` on ``stream`` (and the stream) if missing; starts from the first entry."""
    try:
        await client.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def stream_backlog(client: aioredis.Redis, stream: str) -> int:
    """Entries not yet done by the busiest consumer group (undelivered + pending); XLEN without groups."""
    try:
        groups = await client.xinfo_groups(stream)
    except ResponseError as exc:  # no such key: nothing queued
        if "no such key" in str(exc).lower():
            return 0
        raise
    if not groups:
        return int(await client.xlen(stream))
    worst = 0
    length: int | None = None
    for info in groups:
        lag = info.get("lag")
        if lag is None:  # Redis cannot compute the lag after some deletions: count conservatively
            if length is None:
                length = int(await client.xlen(stream))
            lag = length
        worst = max(worst, int(lag) + int(info.get("pending", 0)))
    return worst


async def group_backlog(client: aioredis.Redis, stream: str, group: str, *, include_pending: bool = True) -> int:
    """Entries of ``stream`` that ``group`` has not finished: undelivered (lag), plus pending if asked.

    A stream or group that does not exist yet counts every entry as undelivered.
    """
    try:
        groups = await client.xinfo_groups(stream)
    except ResponseError as exc:
        if "no such key" in str(exc).lower():
            return 0
        raise
    for info in groups:
        if _text(info["name"]) == group:
            lag = info.get("lag")
            if lag is None:
                lag = int(await client.xlen(stream))
            return int(lag) + (int(info.get("pending", 0)) if include_pending else 0)
    return int(await client.xlen(stream))


async def trim_processed(client: aioredis.Redis, stream: str) -> int:
    """Remove entries every consumer group is done with; returns how many were removed.

    The cut is the smallest of, per group, its oldest pending entry and the entry after its last delivered
    one; ``XTRIM MINID`` keeps everything at or above it. Without groups nothing is trimmed.
    """
    try:
        groups = await client.xinfo_groups(stream)
    except ResponseError:
        return 0
    if not groups:
        return 0
    cut: tuple[int, int] | None = None
    for info in groups:
        name = _text(info["name"])
        last = _entry_key(_text(info["last-delivered-id"]))
        needed = (last[0], last[1] + 1)
        if int(info.get("pending", 0)) > 0:
            summary = await client.xpending(stream, name)
            oldest = summary.get("min")
            if oldest is not None:
                needed = min(needed, _entry_key(_text(oldest)))
        cut = needed if cut is None else min(cut, needed)
    assert cut is not None
    return int(await client.xtrim(stream, minid=f"{cut[0]}-{cut[1]}", approximate=False))


class StreamProducer:
    """Adds records to one stream, waiting while its backlog is at ``max_backlog``.

    The bound is exact for a single producer; with several producers on one stream it can be exceeded by
    at most one batch each. ``max_backlog=None`` disables backpressure (control streams).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        stream: str,
        *,
        max_backlog: int | None = None,
        poll_interval_s: float = 0.05,
        trim: bool = True,
    ) -> None:
        if max_backlog is not None and max_backlog < 1:
            raise ValueError("max_backlog must be at least 1 (or None for no bound)")
        self.client = client
        self.stream = stream
        self.max_backlog = max_backlog
        self.poll_interval_s = poll_interval_s
        self.trim = trim
        self._credit = 0  # entries we may add before asking Redis for the backlog again
        self.waits = 0  # times a producer had to wait for consumers (exported as a metric)

    async def reserve(self, count: int = 1) -> None:
        """Wait until ``count`` more entries fit under the backlog bound, then claim that room."""
        if self.max_backlog is None:
            return
        if count > self.max_backlog:
            raise ValueError(f"cannot add {count} entries at once under a backlog bound of {self.max_backlog}")
        waited = False
        while self._credit < count:
            if self.trim:
                await trim_processed(self.client, self.stream)
            self._credit = self.max_backlog - await stream_backlog(self.client, self.stream)
            if self._credit < count:
                if not waited:
                    self.waits += 1
                    waited = True
                await asyncio.sleep(self.poll_interval_s)
        self._credit -= count

    def queue(self, pipe: aioredis.client.Pipeline, record_id: str, payload: bytes) -> None:
        """Queue an XADD on a pipeline (room must have been reserved)."""
        pipe.xadd(self.stream, {_ID_FIELD: record_id.encode(), _DATA_FIELD: payload})

    async def add(self, record_id: str, payload: bytes) -> str:
        """Add one record, waiting for room; returns its entry id."""
        await self.reserve(1)
        entry_id = await self.client.xadd(self.stream, {_ID_FIELD: record_id.encode(), _DATA_FIELD: payload})
        return _text(entry_id)

    async def add_many(self, items: Sequence[tuple[str, bytes]]) -> list[str]:
        """Add records in one round trip, waiting for room for all of them."""
        await self.reserve(len(items))
        async with self.client.pipeline(transaction=False) as pipe:
            for record_id, payload in items:
                self.queue(pipe, record_id, payload)
            return [_text(entry_id) for entry_id in await pipe.execute()]


@dataclass(frozen=True, slots=True)
class Output:
    """A record to write downstream as part of a commit."""

    producer: StreamProducer
    record_id: str
    payload: bytes


@dataclass
class _ConsumerState:
    pending_cursor: str | None = "0"  # None once our own pending entries have been re-read
    claim_cursor: str = "0-0"
    next_claim_at: float = 0.0
    in_flight: dict[str, Delivery] = field(default_factory=dict)
    last_error: dict[str, str] = field(default_factory=dict)


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
        self.client = client
        self.keys = keys
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.batch_size = batch_size
        self.block_ms = block_ms
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries
        self.applied_ttl_s = applied_ttl_s
        self.dead_letter_maxlen = dead_letter_maxlen
        self.stats = StreamStats()
        self._state = _ConsumerState()

    async def start(self) -> None:
        await ensure_group(self.client, self.stream, self.group)

    @property
    def in_flight(self) -> int:
        return len(self._state.in_flight)

    # Reading -------------------------------------------------------------------------------------------

    async def read(self, count: int | None = None, block_ms: int | None = None) -> list[Delivery]:
        """Next deliveries: own pending entries first, then entries claimed from dead consumers, then new.

        Entries past ``max_deliveries`` go to the dead-letter stream; entries whose record was already
        applied are acknowledged and skipped. May return an empty list after blocking ``block_ms``.
        """
        count = count or self.batch_size
        raw, redelivered = await self._read_own_pending(count)
        if not raw and time.monotonic() >= self._state.next_claim_at:
            raw = await self._claim_idle(count)
            redelivered = True
        if not raw:
            raw = await self._read_new(count, self.block_ms if block_ms is None else block_ms)
            redelivered = False
        if not raw:
            return []
        counts = await self._delivery_counts([entry_id for entry_id, _ in raw]) if redelivered else {}
        deliveries = []
        for entry_id, fields in raw:
            deliveries.append(await self._to_delivery(entry_id, fields, counts.get(entry_id, 1)))
        return await self._drop_applied([d for d in deliveries if d is not None])

    async def _read_own_pending(self, count: int) -> tuple[list[tuple[str, dict | None]], bool]:
        cursor = self._state.pending_cursor
        if cursor is None:
            return [], False
        reply = await self.client.xreadgroup(self.group, self.consumer, {self.stream: cursor}, count=count)
        entries = _entries(reply)
        if not entries:
            self._state.pending_cursor = None
            return [], False
        self._state.pending_cursor = entries[-1][0]
        return entries, True

    async def _claim_idle(self, count: int) -> list[tuple[str, dict | None]]:
        self._state.next_claim_at = time.monotonic() + max(self.claim_idle_ms / 4000, 0.05)
        next_cursor, entries, *_ = await self.client.xautoclaim(
            self.stream,
            self.group,
            self.consumer,
            min_idle_time=self.claim_idle_ms,
            start_id=self._state.claim_cursor,
            count=count,
        )
        self._state.claim_cursor = _text(next_cursor)
        claimed = [(_text(entry_id), fields) for entry_id, fields in entries if fields]
        if claimed:
            self.stats.claimed += len(claimed)
            log.info("claimed %d idle entries of %s from dead consumers", len(claimed), self.stream)
        return claimed

    async def _read_new(self, count: int, block_ms: int) -> list[tuple[str, dict | None]]:
        reply = await self.client.xreadgroup(
            self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms or None
        )
        return _entries(reply)

    async def _delivery_counts(self, entry_ids: list[str]) -> dict[str, int]:
        async with self.client.pipeline(transaction=False) as pipe:
            for entry_id in entry_ids:
                pipe.xpending_range(self.stream, self.group, min=entry_id, max=entry_id, count=1)
            replies = await pipe.execute()
        counts = {}
        for entry_id, reply in zip(entry_ids, replies, strict=True):
            counts[entry_id] = int(reply[0]["times_delivered"]) if reply else 1
        return counts

    async def _to_delivery(self, entry_id: str, fields: dict | None, deliveries: int) -> Delivery | None:
        fields = fields or {}  # an entry deleted while pending comes back without fields
        record_id = fields.get(_ID_FIELD)
        payload = fields.get(_DATA_FIELD)
        if deliveries > 1:
            self.stats.redelivered += 1
        if record_id is None or payload is None:
            bad = Delivery(entry_id, _text(record_id or b""), payload or b"", deliveries)
            await self.dead_letter(bad, f"entry lacks the {'id' if record_id is None else 'data'} field")
            return None
        delivery = Delivery(entry_id, _text(record_id), payload, deliveries)
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
        applied = await self._applied_flags([d.record_id for d in deliveries])
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

    async def _applied_flags(self, record_ids: list[str]) -> list[bool]:
        async with self.client.pipeline(transaction=False) as pipe:
            for record_id in record_ids:
                pipe.exists(self.keys.applied(self.stream, self.group, record_id))
            return [bool(flag) for flag in await pipe.execute()]

    # Finishing -----------------------------------------------------------------------------------------

    async def commit(self, delivery: Delivery, outputs: Sequence[Output] = ()) -> bool:
        """Write ``outputs`` downstream, mark the record applied and ack the entry, atomically.

        Returns False (and writes nothing) when another consumer applied the same record first.
        """
        return (await self.commit_many([(delivery, outputs)]))[0]

    async def commit_many(self, items: Sequence[tuple[Delivery, Sequence[Output]]]) -> list[bool]:
        """Commit several deliveries in one transaction; falls back to one by one on a conflict."""
        if not items:
            return []
        for producer, n in _outputs_per_producer(items):
            await producer.reserve(n)
        try:
            await self._commit_transaction(items)
            results = [True] * len(items)
        except WatchError:
            if len(items) == 1:
                results = [await self._ack_duplicate(items[0][0])]
            else:
                results = [await self.commit(delivery, outputs) for delivery, outputs in items]
            return results
        for delivery, _ in items:
            self._finish(delivery.entry_id)
        self.stats.committed += len(items)
        return results

    async def _commit_transaction(self, items: Sequence[tuple[Delivery, Sequence[Output]]]) -> None:
        applied_keys = [self.keys.applied(self.stream, self.group, d.record_id) for d, _ in items]
        async with self.client.pipeline(transaction=True) as pipe:
            await pipe.watch(*applied_keys)
            if await pipe.exists(*applied_keys):
                raise WatchError("record already applied")
            pipe.multi()
            for _, outputs in items:
                for output in outputs:
                    output.producer.queue(pipe, output.record_id, output.payload)
            pipe.xack(self.stream, self.group, *[d.entry_id for d, _ in items])
            for key in applied_keys:
                pipe.set(key, b"1", ex=self.applied_ttl_s)
            await pipe.execute()

    async def _ack_duplicate(self, delivery: Delivery) -> bool:
        """The record was applied by someone else: acknowledge our copy, apply nothing."""
        await self.client.xack(self.stream, self.group, delivery.entry_id)
        self._finish(delivery.entry_id)
        self.stats.duplicates += 1
        log.info(
            "record %s of %s was already applied; acknowledged without effect",
            delivery.record_id,
            self.stream,
        )
        return False

    async def release(self, delivery: Delivery, error: str) -> None:
        """Give up on a delivery for now (processing failed); it is retried after ``claim_idle_ms``.

        After ``max_deliveries`` attempts it goes to the dead-letter stream with ``error`` as its reason.
        """
        self._state.in_flight.pop(delivery.entry_id, None)
        self._state.last_error[delivery.entry_id] = error
        self.stats.released += 1

    async def dead_letter(self, delivery: Delivery, reason: str) -> None:
        """Move an entry to the dead-letter stream with its reason and original payload, and ack it."""
        log.warning("dead-lettering entry %s of %s: %s", delivery.entry_id, self.stream, reason)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.xadd(
                self.keys.dead_letter,
                {
                    b"stream": self.stream.encode(),
                    b"group": self.group.encode(),
                    b"entry_id": delivery.entry_id.encode(),
                    _ID_FIELD: delivery.record_id.encode(),
                    b"reason": reason.encode(),
                    b"deliveries": str(delivery.deliveries).encode(),
                    b"consumer": self.consumer.encode(),
                    b"at": repr(time.time()).encode(),
                    _DATA_FIELD: delivery.payload,
                },
                maxlen=self.dead_letter_maxlen,
                approximate=True,
            )
            pipe.xack(self.stream, self.group, delivery.entry_id)
            await pipe.execute()
        self._finish(delivery.entry_id)
        self.stats.dead_lettered += 1

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


def _outputs_per_producer(
    items: Sequence[tuple[Delivery, Sequence[Output]]],
) -> list[tuple[StreamProducer, int]]:
    counts: dict[int, tuple[StreamProducer, int]] = {}
    for _, outputs in items:
        for output in outputs:
            producer, n = counts.get(id(output.producer), (output.producer, 0))
            counts[id(output.producer)] = (producer, n + 1)
    return list(counts.values())
