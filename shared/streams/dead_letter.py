"""The dead-letter stream: where an entry that cannot be processed is set aside, with why, instead of lost.

Each dead letter keeps the source stream, group and entry id, the record id, the reason, how often it was
delivered, the consumer that gave up and when, and the original payload, so an operator can inspect or
replay it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from shared.streams.entries import DATA_FIELD, ID_FIELD, Delivery


@dataclass(frozen=True, slots=True)
class DeadLetters:
    """The dead-letter stream of one consumer's group (capped at about ``maxlen`` entries)."""

    client: aioredis.Redis
    stream: str
    maxlen: int

    async def move(self, source: str, group: str, consumer: str, delivery: Delivery, reason: str) -> None:
        """Add ``delivery`` here and acknowledge it on ``source``, in one transaction."""
        fields: dict[FieldT, EncodableT] = {
            b"stream": source.encode(),
            b"group": group.encode(),
            b"entry_id": delivery.entry_id.encode(),
            ID_FIELD: delivery.record_id.encode(),
            b"reason": reason.encode(),
            b"deliveries": str(delivery.deliveries).encode(),
            b"consumer": consumer.encode(),
            b"at": repr(time.time()).encode(),
            DATA_FIELD: delivery.payload,
        }
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.xadd(self.stream, fields, maxlen=self.maxlen, approximate=True)
            pipe.xack(source, group, delivery.entry_id)
            await pipe.execute()
