"""Hostile stream entries and what a consumer must say about them, for the tests that feed them to readers.

The entry layout is restated here independently of :mod:`shared.streams.entries`: exactly two fields, a
non-empty UTF-8 record id and a payload; the first rule an entry breaks names its reason.
"""

from __future__ import annotations

import base64
import json

# Hand-picked malformed entries (property tests draw many more); the last two are large.
EDGE_ENTRIES: list[dict[bytes, bytes]] = [
    {b"id": b"\xff", b"data": b"x"},
    {b"id": b"", b"data": b"x"},
    {b"data": b"no id field"},
    {b"id": b"no-data-field"},
    {b"id": b"one-too-many", b"data": b"x", b"more": b"1"},
    {b"\xff": b"\xff"},
    {b"": b""},
    {b"id": b"\xed\xa0\x80", b"data": b""},  # a surrogate encoded as if UTF-8: not UTF-8
    {b"id": b"caf\xc3", b"data": b""},  # cut inside a character
    {b"id": b"\xff" * 100_000, b"data": b"\x00" * 1_000_000},
    {b"id": b"huge-extra", b"data": b"", b"x" * 10_000: b"y" * 1_000_000},
]


def expected_reason(fields: dict[bytes, bytes]) -> str | None:
    """What a consumer must say about an entry (a part of its dead letter's reason); None: it is valid."""
    for name in (b"id", b"data"):
        if name not in fields:
            return f"entry lacks the {name.decode()} field"
    if set(fields) != {b"id", b"data"}:
        return "entry has fields other than id and data"
    try:
        record_id = fields[b"id"].decode("utf-8")
    except UnicodeDecodeError:
        return "record id is not UTF-8"
    return None if record_id else "record id is empty"


def decoded_raw(letter: dict[bytes, bytes]) -> dict[bytes, bytes]:
    """The original fields a dead letter keeps under ``raw``."""
    return {base64.b64decode(name): base64.b64decode(value) for name, value in json.loads(letter[b"raw"])}


def text_fields_of(letter: dict[bytes, bytes]) -> dict[str, str]:
    """Every field of a dead letter but its payload, decoded: they must all be UTF-8."""
    return {name.decode(): value.decode() for name, value in letter.items() if name != b"data"}
