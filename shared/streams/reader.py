"""Where a stream consumer's next entries come from, in Redis: its own pending entries, lost deliveries,
entries claimed from a consumer that stopped or handed them back, and new entries (:class:`GroupReader`).

:class:`~shared.streams.consumer.StreamConsumer` reads through one and decides what the entries become
(deliveries, dead letters, duplicates); this module only finds and fetches them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Literal

import redis.asyncio as aioredis

from shared.streams.entries import read_entries, text

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
RawEntries = list[tuple[str, dict | None]]  # entries as Redis returns them: (entry id, fields)
Source = Literal["own", "lost", "claimed", "new"]  # own pending, lost deliveries, claimed (handed back or idle), new


def _id_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id ("ms-seq", or "0") as a sortable pair."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _fields(flat: list) -> dict:
    """An entry's fields as a script returns them (name, value, name, value, ...) as XCLAIM's dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


@dataclass
class GroupReader:
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
    :meth:`~shared.streams.consumer.StreamConsumer.read` sets) and every ``_LOST_CHECK_S``.

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

    async def next(self, count: int, block_ms: int, held: Callable[[], Collection[str]]) -> tuple[RawEntries, Source]:
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

    async def own_pending(self, count: int) -> RawEntries:
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

    async def claim_lost(self, count: int) -> RawEntries:
        """The first ``count`` lost entries, handed to us again: each taken (XCLAIM) only if it is still pending
        under our name, in one script, so an entry another consumer claimed or finished since stays theirs; its
        delivery count is kept (no work was done on it: a hand-out that keeps failing is a Redis that keeps
        failing, which ``max_deliveries`` is not for). Entries deleted from the stream meanwhile are dropped from
        the pending list by Redis and not returned."""
        wanted, self.lost = self.lost[:count], self.lost[count:]
        reply = await self.client.eval(_CLAIM_IF_OURS, 1, self.stream, self.group, self.consumer, *wanted)
        return [(text(entry_id), _fields(flat)) for entry_id, flat in reply]

    async def claim_idle(self, count: int) -> RawEntries:
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

    async def new(self, count: int, block_ms: int) -> RawEntries:
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
