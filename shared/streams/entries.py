"""What a stream entry holds (a record id and its payload), what a consumer is handed for it, and how an
entry that does not hold exactly that is told apart.

An entry's fields come from whoever could write to the stream, so they are arbitrary bytes until checked:
:func:`entry_record` is the one place that checks them, and it raises :class:`MalformedEntry` (never a
``UnicodeDecodeError``) with a reason that names what is wrong.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any

from redis.typing import EncodableT, FieldT

ID_FIELD = b"id"
DATA_FIELD = b"data"
_MAX_SHOWN = 64  # bytes of a bad value quoted in a reason; the dead letter keeps the whole value
_MAX_NAMES_SHOWN = 4  # extra field names a reason lists


class MalformedEntry(ValueError):
    """An entry whose fields are not exactly a UTF-8 record id and a payload; the message says why."""


def default_consumer_name(role: str) -> str:
    """A consumer name unique to this process: ``role-host-pid-random``."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def text(value: bytes | str) -> str:
    """A name Redis itself made (an entry id, a group name): always ASCII. Never for an entry's fields."""
    return value.decode() if isinstance(value, bytes) else value


def shown(value: bytes) -> str:
    """``value`` quoted for a reason or a log line, cut to ``_MAX_SHOWN`` bytes."""
    if len(value) <= _MAX_SHOWN:
        return repr(value)
    return f"{value[:_MAX_SHOWN]!r}... ({len(value)} bytes)"


def escaped(value: bytes) -> str:
    """``value`` as text, its bytes that are not UTF-8 written ``\\xNN`` (what a dead letter shows as its id)."""
    return value.decode("utf-8", "backslashreplace")


def entry_record(fields: dict | None) -> tuple[str, bytes]:
    """The record id and payload an entry's fields hold; :class:`MalformedEntry` when they hold anything else.

    No fields at all (``None`` or empty) is what Redis returns for an entry deleted while it was pending: an
    entry cannot be added without fields.
    """
    if not fields:
        raise MalformedEntry("entry has no fields: it was deleted while pending")
    for name in (ID_FIELD, DATA_FIELD):
        if name not in fields:
            raise MalformedEntry(f"entry lacks the {name.decode()} field")
    extra = sorted(set(fields) - {ID_FIELD, DATA_FIELD})
    if extra:
        names = ", ".join(shown(name) for name in extra[:_MAX_NAMES_SHOWN])
        more = f" and {len(extra) - _MAX_NAMES_SHOWN} more" if len(extra) > _MAX_NAMES_SHOWN else ""
        raise MalformedEntry(f"entry has fields other than id and data: {names}{more}")
    raw_id = fields[ID_FIELD]
    try:
        record_id = raw_id.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedEntry(f"record id is not UTF-8 ({exc.reason} at byte {exc.start}): {shown(raw_id)}") from None
    if not record_id:
        raise MalformedEntry("record id is empty")
    return record_id, fields[DATA_FIELD]


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
