"""Typed numpy array fields for the wire records.

Token ids and logprobs travel as packed numeric arrays, never as JSON lists of floats. These annotated
types let a pydantic model hold a numpy array of a fixed dtype: constructors may pass lists or arrays that
convert safely; a decoded record (validation context ``{"wire": True}``) must carry exactly the declared
dtype, so a corrupted or foreign payload is rejected instead of silently reinterpreted.
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from pydantic import BeforeValidator, PlainSerializer, ValidationInfo, WithJsonSchema

_WIRE_CONTEXT_KEY = "wire"


def _array_validator(dtype: np.dtype, ndim: int):
    def validate(value: Any, info: ValidationInfo) -> np.ndarray:
        strict = bool(info.context and info.context.get(_WIRE_CONTEXT_KEY))
        if isinstance(value, np.ndarray):
            if value.dtype != dtype:
                if strict:
                    raise ValueError(f"expected dtype {dtype.name}, got {value.dtype.name}")
                if not np.can_cast(value.dtype, dtype, casting="same_kind"):
                    raise ValueError(f"cannot convert {value.dtype.name} to {dtype.name}")
            array = np.asarray(value, dtype=dtype)
        elif strict:
            raise ValueError(f"expected a packed {dtype.name} array, got {type(value).__name__}")
        else:
            try:
                array = np.asarray(value, dtype=dtype)
            except (TypeError, ValueError, OverflowError) as exc:
                raise ValueError(f"not convertible to a {dtype.name} array: {exc}") from None
        if array.ndim != ndim:
            raise ValueError(f"expected {ndim} dimension(s), got shape {array.shape}")
        if array is value and array.flags.writeable:
            array = array.copy()  # never alias a caller's mutable buffer
        array.flags.writeable = False
        return array

    return validate


def _to_list(array: np.ndarray) -> list:
    return array.tolist()


def _array_type(dtype: str, ndim: int, item_schema: dict) -> Any:
    np_dtype = np.dtype(dtype)
    schema: dict = item_schema
    for _ in range(ndim):
        schema = {"type": "array", "items": schema}
    return Annotated[
        np.ndarray,
        BeforeValidator(_array_validator(np_dtype, ndim)),
        PlainSerializer(_to_list, when_used="json"),
        WithJsonSchema(schema),
    ]


Int32Array = _array_type("int32", 1, {"type": "integer"})
Float32Array = _array_type("float32", 1, {"type": "number"})
Float32Matrix = _array_type("float32", 2, {"type": "number"})
UInt8Array = _array_type("uint8", 1, {"type": "integer", "minimum": 0, "maximum": 255})
