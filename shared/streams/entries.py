"""What a stream entry holds (a record id and its payload) and what a consumer is handed for it."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any

from redis.typing import EncodableT, FieldT

ID_FIELD = b"id"
DATA_FIELD = b"data"


def default_consumer_name(role: str) -> str:
    """A consumer name unique to this process: ``role-host-pid-random``."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def entry_fields(record_id: str, payload: bytes) -> dict[FieldT, EncodableT]:
    """The fields of one entry: the record id (for exactly-once effect) and the encoded record."""
    return {ID_FIELD: record_id.encode(), DATA_FIELD: payload}


def read_entries(reply: Any) -> list[tuple[str, dict | None]]:
    """Entries of a single-stream XREADGROUP reply as ``(entry_id, fields)``."""
    if not reply:
        return []
    return [(text(entry_id), fields) for entry_id, fields in reply[0][1]]


def entry_key(entry_id: str) -> tuple[int, int]:
    """An entry id (``ms-seq``) as a sortable pair."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass(frozen=True, slots=True)
class Delivery:
    """One stream entry handed to a consumer."""

    entry_id: str
    record_id: str
    payload: bytes
    deliveries: int  # how many times this entry has been delivered, this time included
