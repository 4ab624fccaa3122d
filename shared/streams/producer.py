"""Adding records to a stream under a backlog bound, alone or as part of a consumer's commit."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared.streams.entries import entry_fields, text
from shared.streams.groups import stream_backlog, trim_processed


class StreamProducer:
    """Adds records to one stream, waiting while its backlog is at ``max_backlog``.

    The bound is exact for a single producer; with several producers on one stream it can be exceeded by
    at most one batch each. ``max_backlog=None`` disables backpressure (control streams). ``trim``: also trim
    what every group has finished while waiting; the services leave that to the learner
    (:meth:`services.learner.data.admission.Admission.trim_streams`), the one user granted ``XTRIM``.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        stream: str,
        *,
        max_backlog: int | None = None,
        poll_interval_s: float = 0.05,
        trim: bool = False,
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
            # The backlog is read before trimming: entries a consumer finishes in between are then counted (as
            # still owed) rather than left in the stream uncounted, so one producer never holds more than
            # ``max_backlog`` entries in the stream with one in-order consumer.
            self._credit = self.max_backlog - await stream_backlog(self.client, self.stream)
            if self.trim:
                await trim_processed(self.client, self.stream)
            if self._credit < count:
                if not waited:
                    self.waits += 1
                    waited = True
                await asyncio.sleep(self.poll_interval_s)
        self._credit -= count

    def unreserve(self, count: int) -> None:
        """Give back room reserved for ``count`` entries that were not added after all."""
        if self.max_backlog is not None:
            self._credit = min(self._credit + count, self.max_backlog)

    def queue(self, pipe: aioredis.client.Pipeline, record_id: str, payload: bytes) -> None:
        """Queue an XADD on a pipeline (room must have been reserved)."""
        pipe.xadd(self.stream, entry_fields(record_id, payload))

    async def add(self, record_id: str, payload: bytes) -> str:
        """Add one record, waiting for room; returns its entry id."""
        await self.reserve(1)
        return text(await self.client.xadd(self.stream, entry_fields(record_id, payload)))

    async def add_many(self, items: Sequence[tuple[str, bytes]]) -> list[str]:
        """Add records in one round trip, waiting for room for all of them."""
        await self.reserve(len(items))
        async with self.client.pipeline(transaction=False) as pipe:
            for record_id, payload in items:
                self.queue(pipe, record_id, payload)
            return [text(entry_id) for entry_id in await pipe.execute()]


@dataclass(frozen=True, slots=True)
class Output:
    """A record to write downstream as part of a commit."""

    producer: StreamProducer
    record_id: str
    payload: bytes


def outputs_per_producer(outputs: Sequence[Output]) -> list[tuple[StreamProducer, int]]:
    """How many of ``outputs`` each producer adds (the room a commit reserves), in first-seen order."""
    counts: dict[int, tuple[StreamProducer, int]] = {}
    for output in outputs:
        producer, n = counts.get(id(output.producer), (output.producer, 0))
        counts[id(output.producer)] = (producer, n + 1)
    return list(counts.values())
