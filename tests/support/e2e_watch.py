"""Watching an end-to-end run from the test's side (tests/e2e/test_faults.py, test_multi_turn.py,
test_multi_turn_faults.py): an audit that reads streams through consumer groups of its own, so it sees every
record the services see without taking any from them, and a wait that fails as soon as a service dies.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from shared.keys import Keys
from shared.redis_conn import RedisRetry
from shared.streams import StreamConsumer
from shared.streams.entries import Delivery
from tests.support.processes import ServiceProcess


async def audit_streams(
    client: Any,
    keys: Keys,
    streams: Sequence[str],
    on_record: Callable[[str, Delivery], None],
    stop: asyncio.Event,
    *,
    retry: RedisRetry | None = None,
    block_ms: int = 50,
) -> None:
    """``on_record(stream, delivery)`` for every record of ``streams`` (full keys) until ``stop`` is set, each
    read through the consumer group ``audit`` and committed; ``retry``: ride out a Redis restart."""

    async def call(operation: Callable[[], Awaitable[Any]], what: str) -> Any:
        return await (retry.run(operation, what) if retry is not None else operation())

    consumers = {
        stream: StreamConsumer(client, keys, stream, "audit", "auditor", block_ms=block_ms, batch_size=100)
        for stream in streams
    }
    for consumer in consumers.values():
        await call(consumer.start, "creating audit groups")
    while not stop.is_set():
        for stream, consumer in consumers.items():
            for delivery in await call(consumer.read, f"auditing {stream}"):
                on_record(stream, delivery)
                await call(lambda d=delivery, c=consumer: c.commit(d), "auditing")


async def wait_until(
    condition: Callable[[], bool],
    what: str,
    timeout_s: float,
    services: Sequence[ServiceProcess],
    killed: Iterable[str] = (),
) -> None:
    """Until ``condition()``; fails when one of ``services`` exits meanwhile (with its exit status and last lines:
    a learner says there how it ended) or after ``timeout_s`` (with every service's last lines). ``services`` is
    read afresh on every check (a test may add a restarted service, or rename one it killed, meanwhile); those
    named in ``killed`` (the ones the test killed itself) may exit."""
    killed = set(killed)
    deadline = time.monotonic() + timeout_s
    while not condition():
        for service in services:
            status = service.process.poll()
            if status is not None and service.name not in killed:
                raise AssertionError(
                    f"{service.name} exited ({status}) while waiting for {what}:\n{service.output()[-3000:]}"
                )
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {s.name}:\n{s.output()[-1500:]}" for s in services)
            raise AssertionError(f"timed out waiting for {what}:\n{tails}")
        await asyncio.sleep(0.2)
