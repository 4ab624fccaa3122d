"""Encoding of wire records: msgpack, with numpy arrays packed as raw bytes.

Layout of one encoded record: a msgpack map ``{"kind": str, "v": int, "body": map}``. Arrays inside the
body are msgpack extension type 1 whose data is itself msgpack ``[dtype, shape, raw little-endian bytes]``.
Decoding checks the kind, the schema version and then validates the body with the record's model in wire
mode (exact dtypes, lengths that agree, G that matches); every failure raises :class:`WireError`, whose
message names the offending field.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgpack
import numpy as np
from pydantic import ValidationError

from shared.records import RECORDS_BY_KIND, SCHEMA_VERSION, WireModel

_ARRAY_EXT = 1
# Only these dtypes cross the wire; anything else in a payload is corruption or a foreign writer.
_ALLOWED_DTYPES = frozenset({"<i4", "<f4", "<i8", "<f8", "|u1"})

R = TypeVar("R", bound=WireModel)


class WireError(ValueError):
    """A payload that is not a valid encoded record. ``field`` names where it went wrong."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


def _pack_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
        array = array.astype(dtype, copy=False)
        data = msgpack.packb([dtype.str, list(array.shape), array.tobytes()], use_bin_type=True)
        return msgpack.ExtType(_ARRAY_EXT, data)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    raise TypeError(f"cannot encode {type(value).__name__}")


def _unpack_ext(code: int, data: bytes) -> Any:
    if code != _ARRAY_EXT:
        raise WireError(f"unknown msgpack extension type {code}")
    dtype_str, shape, raw = msgpack.unpackb(data, raw=False)
    if dtype_str not in _ALLOWED_DTYPES:
        raise WireError(f"array dtype {dtype_str!r} is not allowed on the wire")
    dtype = np.dtype(dtype_str)
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise WireError(f"invalid array shape {shape!r}")
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if not isinstance(raw, bytes) or len(raw) != expected:
        raise WireError(f"array of shape {shape} and dtype {dtype_str} needs {expected} bytes")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def encode(record: WireModel) -> bytes:
    """Encode a record to bytes."""
    body = record.model_dump(mode="python", exclude={"schema_version"})
    return msgpack.packb(
        {"kind": record.kind, "v": record.schema_version, "body": body},
        default=_pack_default,
        use_bin_type=True,
    )


def _field_of(error: ValidationError) -> str:
    first = error.errors()[0]
    return ".".join(str(part) for part in first["loc"])


def decode(data: bytes, expected: type[R] | None = None) -> R:
    """Decode bytes to a record, validating it; raises :class:`WireError` on anything malformed.

    ``expected`` restricts the record type (a prompts-stream reader passes ``PromptTask``).
    """
    try:
        envelope = msgpack.unpackb(data, raw=False, ext_hook=_unpack_ext, strict_map_key=True)
    except WireError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on corrupt input
        raise WireError(f"not a msgpack record ({type(exc).__name__}: {exc})") from None
    if not isinstance(envelope, dict) or set(envelope) != {"kind", "v", "body"}:
        raise WireError("envelope must be a map with exactly kind, v and body", "envelope")
    kind, version, body = envelope["kind"], envelope["v"], envelope["body"]
    cls = RECORDS_BY_KIND.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise WireError(f"unknown record kind {kind!r}", "kind")
    if expected is not None and cls is not expected:
        raise WireError(f"expected a {expected.kind} record, got {kind}", "kind")
    if version != SCHEMA_VERSION:
        raise WireError(
            f"schema version {version!r} is not supported (this build reads {SCHEMA_VERSION})", "v"
        )
    if not isinstance(body, dict):
        raise WireError("body must be a map", "body")
    try:
        return cls.model_validate(body, context={"wire": True})  # type: ignore[return-value]
    except ValidationError as exc:
        raise WireError(exc.errors()[0]["msg"], _field_of(exc)) from None
