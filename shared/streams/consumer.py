"""Reading one stream through a consumer group: recovery, claiming, exactly-once commits, dead-lettering.

The guarantees are listed in :mod:`shared.streams`; this module is the consumer's side of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from shared.keys import Keys
from shared.streams.applied import AppliedMarkers
from shared.streams.dead_letter import DeadLetters
from shared.streams.entries import Delivery, MalformedEntry, entry_record, read_entries, text
from shared.streams.groups import ensure_group
from shared.streams.producer import Output, outputs_per_producer

log = logging.getLogger(__name__)

_PENDING_PAGE = 1000  # pending entries listed per XPENDING call when looking for lost deliveries
_LOST_CHECK_S = 5.0  # how often a reader looks for lost deliveries when no read failed (ids only: cheap)
# Claims each id (ARGV[3:]) for consumer ARGV[2] of group ARGV[1] only while it is pending under that consumer,
# keeping its delivery count; returns the claimed entries as XCLAIM does.
_CLAIM_IF_OURS = """
local claimed = {}
for i = 3, #ARGV do
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if pending[1] then
    local entry = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'RETRYCOUNT', pending[1][4])
    if entry[1] then claimed[#claimed + 1] = entry[1] end
  end
end
return claimed
"""
Commit = tuple[Delivery, Sequence[Output]]  # a delivery and the records its processing writes downstream
_Raw = list[tuple[str, dict | None]]  # entries as Redis returns them: (entry id, fields)
Source = Literal["own", "lost", "claimed", "new"]  # own pending, lost deliveries, claimed (handed back or idle), new


def _id_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id ("ms-seq", or "0") as a sortable pair."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _fields(flat: list) -> dict:
    """An entry's fields as a script returns them (name, value, name, value, ...) as XCLAIM's dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


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


@dataclass
class _GroupReader:
    """Where a consumer's next entries come from, in Redis: its own pending entries (left by its previous
    life), lost deliveries, entries idle past ``claim_idle_ms`` (their consumer stopped, or handed them back:
    :meth:`hand_back`), and new entries.

    A read that fails may have been carried out: Redis delivered the entries (they are pending under our
    name, and with AOF they outlive a restart) and the reply never arrived (the connection or the server went
    down before it was sent), or it arrived and what the consumer does next with Redis (delivery counts,
    applied marks) failed before it handed them out. The client may also have retried the connection inside
    itself and returned other entries, raising nothing. Such entries are nobody's work until
    ``claim_idle_ms`` has passed (10 minutes for the learner), so the reader looks for them - entries pending
    under our name that the consumer does not hold - after a failed read (``lost_check_due``, which
    :meth:`StreamConsumer.read` sets) and every ``_LOST_CHECK_S``.

    One read at a time per consumer (every service reads from one loop): entries a concurrent read had
    just been given would look lost.
    """

    client: aioredis.Redis
    stream: str
    group: str
    consumer: str
    claim_idle_ms: int
    pending_cursor: str | None = "0"  # None once our own pending entries have been re-read
    claim_cursor: str = "0-0"
    next_claim_at: float = 0.0
    lost_check_due: bool = False  # a read failed: some of our pending entries may never have reached us
    next_lost_check_at: float = 0.0
    lost: list[str] = field(default_factory=list)  # ids pending under our name, not held when last looked

    @property
    def claim_due(self) -> bool:
        return time.monotonic() >= self.next_claim_at

    async def next(self, count: int, block_ms: int, held: Callable[[], Collection[str]]) -> tuple[_Raw, Source]:
        """The next entries and where they came from, in the order above."""
        if raw := await self.own_pending(count):
            return raw, "own"
        if self.lost_check_due or time.monotonic() >= self.next_lost_check_at:
            await self.find_lost(held())
        if self.lost and (raw := await self.claim_lost(count)):
            return raw, "lost"
        if self.claim_due and (raw := await self.claim_idle(count)):
            claimed = {entry_id for entry_id, _ in raw}
            self.lost = [entry_id for entry_id in self.lost if entry_id not in claimed]  # handed out once only
            return raw, "claimed"
        return await self.new(count, block_ms), "new"

    async def own_pending(self, count: int) -> _Raw:
        if self.pending_cursor is None:
            return []
        reply = await self.client.xreadgroup(self.group, self.consumer, {self.stream: self.pending_cursor}, count=count)
        entries = read_entries(reply)
        self.pending_cursor = entries[-1][0] if entries else None
        return entries

    async def find_lost(self, held: Collection[str]) -> None:
        """Set ``lost`` to the entries pending under our name that are not in ``held`` (ids only, paged), and
        that our own pending entries' re-read, while under way, will not hand out anyway."""
        lost, start = [], "-"
        while True:
            page: list[dict[str, Any]] = await self.client.xpending_range(
                self.stream, self.group, min=start, max="+", count=_PENDING_PAGE, consumername=self.consumer
            )
            ids = [text(entry["message_id"]) for entry in page]
            lost += [entry_id for entry_id in ids if entry_id not in held and not self._rereads(entry_id)]
            if len(page) < _PENDING_PAGE:
                break
            start = "(" + ids[-1]
        self.lost, self.lost_check_due = lost, False
        self.next_lost_check_at = time.monotonic() + _LOST_CHECK_S

    def _rereads(self, entry_id: str) -> bool:
        """Whether the re-read of our own pending entries, under way, is yet to hand out ``entry_id``."""
        return self.pending_cursor is not None and _id_order(entry_id) > _id_order(self.pending_cursor)

    async def claim_lost(self, count: int) -> _Raw:
        """The first ``count`` lost entries, handed to us again: each taken (XCLAIM) only if it is still pending
        under our name, in one script, so an entry another consumer claimed or finished since stays theirs; its
        delivery count is kept (no work was done on it: a hand-out that keeps failing is a Redis that keeps
        failing, which ``max_deliveries`` is not for). Entries deleted from the stream meanwhile are dropped from
        the pending list by Redis and not returned."""
        wanted, self.lost = self.lost[:count], self.lost[count:]
        reply = await self.client.eval(_CLAIM_IF_OURS, 1, self.stream, self.group, self.consumer, *wanted)
        return [(text(entry_id), _fields(flat)) for entry_id, flat in reply]

    async def claim_idle(self, count: int) -> _Raw:
        self.next_claim_at = time.monotonic() + max(self.claim_idle_ms / 4000, 0.05)
        next_cursor, entries, *_ = await self.client.xautoclaim(
            self.stream,
            self.group,
            self.consumer,
            min_idle_time=self.claim_idle_ms,
            start_id=self.claim_cursor,
            count=count,
        )
        self.claim_cursor = text(next_cursor)
        return [(text(entry_id), fields) for entry_id, fields in entries if fields]

    async def hand_back(self, entry_id: str) -> None:
        """Make our pending ``entry_id`` claimable now: its idle time set to ``claim_idle_ms`` (XCLAIM to
        ourselves with IDLE, JUSTID so its delivery count stays), the claim cursor moved back to it and the
        next claim due at once. It stays pending throughout, so nothing is lost, and the claim that takes it
        counts one more delivery, so ``max_deliveries`` still ends an entry that keeps failing."""
        await self.client.xclaim(
            self.stream,
            self.group,
            self.consumer,
            min_idle_time=0,
            message_ids=[entry_id],
            idle=self.claim_idle_ms,
            justid=True,
        )
        if _id_order(entry_id) <= _id_order(self.claim_cursor):
            self.claim_cursor = "0-0"
        self.next_claim_at = 0.0

    async def new(self, count: int, block_ms: int) -> _Raw:
        reply = await self.client.xreadgroup(
            self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms or None
        )
        return read_entries(reply)

    async def delivery_counts(self, entry_ids: list[str]) -> dict[str, int]:
        async with self.client.pipeline(transaction=False) as pipe:
            for entry_id in entry_ids:
                pipe.xpending_range(self.stream, self.group, min=entry_id, max=entry_id, count=1)
            replies = await pipe.execute()
        counts = {}
        for entry_id, reply in zip(entry_ids, replies, strict=True):
            counts[entry_id] = int(reply[0]["times_delivered"]) if reply else 1
        return counts


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
        self._reader = _GroupReader(client, stream, group, consumer, claim_idle_ms)

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
        raw: _Raw = []
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

    async def _deliver(self, raw: _Raw, source: Source) -> list[Delivery]:
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
