"""Encoding of wire records: msgpack, with numpy arrays packed as raw bytes.

Layout of one encoded record: a msgpack map ``{"kind": str, "v": int, "body": map}``. Arrays inside the
body are msgpack extension type 1: a header (dtype code, number of dimensions, each dimension as uint32)
followed by the raw little-endian bytes.
Decoding checks the kind, the schema version and then validates the body with the record's model in wire
mode (exact dtypes, lengths that agree, G that matches); every failure raises :class:`WireError`, whose
message names the offending field.

Versions: a record is written as the lowest schema version that carries it (``WireModel.wire_version``), so a
single-turn record is still v1 byte for byte; the reader takes v1 and v2 (docs/concepts/multi-turn-design.md §2.2).
"""

from __future__ import annotations

import struct
from typing import Any, TypeVar

import msgpack
import numpy as np
from pydantic import ValidationError

from shared.records import READABLE_VERSIONS, RECORDS_BY_KIND, WireModel

_ARRAY_EXT = 1
# Only these dtypes cross the wire (code -> dtype); anything else in a payload is corruption.
_DTYPES: dict[int, np.dtype] = {
    1: np.dtype("<i4"),
    2: np.dtype("<f4"),
    3: np.dtype("<i8"),
    4: np.dtype("<f8"),
    5: np.dtype("|u1"),
}
_DTYPE_CODES = {dtype: code for code, dtype in _DTYPES.items()}
_HEADER = struct.Struct("<BB")  # dtype code, number of dimensions; then one uint32 per dimension

R = TypeVar("R", bound=WireModel)


class WireError(ValueError):
    """A payload that is not a valid encoded record. ``field`` names where it went wrong."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


def _pack_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        dtype = value.dtype.newbyteorder("<") if value.dtype.byteorder == ">" else value.dtype
        code = _DTYPE_CODES.get(dtype)
        if code is None:
            raise TypeError(f"arrays of dtype {value.dtype} cannot be encoded")
        header = _HEADER.pack(code, value.ndim) + struct.pack(f"<{value.ndim}I", *value.shape)
        return msgpack.ExtType(_ARRAY_EXT, header + np.ascontiguousarray(value, dtype=dtype).tobytes())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    raise TypeError(f"cannot encode {type(value).__name__}")


def _unpack_ext(code: int, data: bytes) -> Any:
    if code != _ARRAY_EXT:
        raise WireError(f"unknown msgpack extension type {code}")
    if len(data) < _HEADER.size:
        raise WireError("truncated array header")
    dtype_code, ndim = _HEADER.unpack_from(data)
    dtype = _DTYPES.get(dtype_code)
    if dtype is None:
        raise WireError(f"array dtype code {dtype_code} is not allowed on the wire")
    offset = _HEADER.size + 4 * ndim
    if len(data) < offset:
        raise WireError("truncated array shape")
    shape = struct.unpack_from(f"<{ndim}I", data, _HEADER.size)
    count = 1
    for dim in shape:
        count *= dim
    if len(data) - offset != count * dtype.itemsize:
        raise WireError(f"array of shape {list(shape)} and dtype {dtype.name} needs {count * dtype.itemsize} bytes")
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)


def encode(record: WireModel) -> bytes:
    """Encode a record to bytes."""
    body = record.model_dump(mode="python", exclude={"schema_version"})
    return msgpack.packb(
        {"kind": record.kind, "v": record.wire_version(), "body": body},
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
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        readable = " and ".join(str(v) for v in READABLE_VERSIONS)
        raise WireError(f"schema version {version!r} is not supported (this build reads {readable})", "v")
    if not isinstance(body, dict):
        raise WireError("body must be a map", "body")
    if version == 1:
        body = _upgrade_v1(kind, body)
    try:
        record = cls.model_validate(body, context={"wire": True})
    except ValidationError as exc:
        raise WireError(exc.errors()[0]["msg"], _field_of(exc)) from None
    if record.wire_version() > version:
        raise WireError(f"a schema v{version} record cannot carry fields of v{record.wire_version()}", "v")
    return record  # type: ignore[return-value]


def _upgrade_v1(kind: str, body: dict) -> dict:
    """A v1 body as this build's models read it: unchanged, since every v2 field is optional with a default
    (the version check that a v1 record sets none of them follows validation, in :func:`decode`)."""
    return body
