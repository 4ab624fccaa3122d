"""The dead-letter stream: where an entry that cannot be processed is set aside, with why, instead of lost.

Each dead letter keeps the source stream, group and entry id, the record id, the reason, how often it was
delivered, the consumer that gave up and when, and the original payload, so an operator can inspect or
replay it. Every field but ``data`` is UTF-8 text, so a reader can decode them all.

A malformed entry (:class:`~shared.streams.entries.MalformedEntry`: a missing or extra field, a record id
that is not UTF-8) is set aside the same way, on first sight. Its ``id`` is the record id with the bytes that
are not UTF-8 escaped (``\\xff``), its ``data`` the data field's bytes (empty when missing), and ``raw`` holds
the original fields exactly: a JSON list of ``[name, value]`` pairs, each base64. A registry value that does
not decode (:mod:`shared.registry`) is set aside with the same layout, its key as ``stream``.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from shared.streams.entries import DATA_FIELD, ID_FIELD, Delivery, escaped

RawEntry = tuple[str, Mapping[bytes, bytes] | None, int]  # (entry id, its fields as Redis returned them, deliveries)


def dead_letter_fields(
    source: str, group: str, consumer: str, delivery: Delivery, reason: str
) -> dict[FieldT, EncodableT]:
    """The fields of one dead letter (see the module docstring)."""
    return {
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


def raw_fields(fields: Mapping[bytes, bytes]) -> bytes:
    """``fields`` exactly, as text: a JSON list of ``[name, value]`` pairs, each base64."""
    pairs = [[base64.b64encode(name).decode(), base64.b64encode(value).decode()] for name, value in fields.items()]
    return json.dumps(pairs).encode()


def malformed_letter(source: str, group: str, consumer: str, entry: RawEntry, reason: str) -> dict[FieldT, EncodableT]:
    """The dead letter of a malformed ``(entry id, fields, deliveries)``: what its fields hold, escaped, and
    all of them exactly, under ``raw``."""
    entry_id, fields, deliveries = entry
    fields = fields or {}
    shown_as = Delivery(entry_id, escaped(fields.get(ID_FIELD, b"")), fields.get(DATA_FIELD, b""), deliveries)
    return dead_letter_fields(source, group, consumer, shown_as, reason) | {b"raw": raw_fields(fields)}


@dataclass(frozen=True, slots=True)
class DeadLetters:
    """The dead-letter stream of one consumer's group (capped at about ``maxlen`` entries)."""

    client: aioredis.Redis
    stream: str
    maxlen: int

    async def move(self, source: str, group: str, consumer: str, delivery: Delivery, reason: str) -> None:
        """Add ``delivery`` here and acknowledge it on ``source``, in one transaction."""
        fields = dead_letter_fields(source, group, consumer, delivery, reason)
        await self._add_and_ack(source, group, delivery.entry_id, fields)

    async def move_malformed(self, source: str, group: str, consumer: str, entry: RawEntry, reason: str) -> None:
        """Add a malformed ``(entry id, fields, deliveries)`` here, its fields kept exactly, and acknowledge it
        on ``source``."""
        fields = malformed_letter(source, group, consumer, entry, reason)
        await self._add_and_ack(source, group, entry[0], fields)

    async def _add_and_ack(self, source: str, group: str, entry_id: str, fields: dict[FieldT, EncodableT]) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.xadd(self.stream, fields, maxlen=self.maxlen, approximate=True)
            pipe.xack(source, group, entry_id)
            await pipe.execute()
