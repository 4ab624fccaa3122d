"""Layout arithmetic of a weight push, shared by the learner (which packs buckets) and the generators (which
receive them): both sides must agree on every bucket's size to the byte."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def bucket_byte_sizes(layout: Iterable[tuple[str, Sequence[int], int]], num_buckets: int) -> list[int]:
    """Bytes in each of ``num_buckets`` buckets, from the layout's ``(dtype, shape, bucket)`` per tensor."""
    sizes = [0] * num_buckets
    for dtype, shape, bucket in layout:
        sizes[bucket] += math.prod(shape) * DTYPE_BYTES[dtype]
    return sizes
