"""glibc malloc settings for a CPU learner: keep the memory a training step frees for the next step.

Every step allocates the same large tensors (logits, activations, gradients) and frees them. With glibc's
defaults a large block (128 KiB at first, up to 32 MiB as blocks are freed; always past 32 MiB) is an ``mmap``
given back at ``free``, and a thread other than the main one
(the learner trains in one) allocates from its own arena, whose heaps are unmapped as they empty: each step
faults its memory back in and the kernel zeroes every page again. Measured on the CPU demo (2-core AMD EPYC,
``perf``): a quarter of the learner's CPU time in the kernel, ``clear_page_erms`` first. One arena (the main
one), no ``mmap`` for large blocks and no trimming below :data:`TRIM_THRESHOLD` keep those pages mapped from
step to step, as PyTorch's caching allocator keeps device memory on a GPU. The price: the process keeps its peak
heap since start-up (model loading and checkpoints included, and what fragmentation leaves), unless 2 GiB lie free
at its top. The settings override any ``MALLOC_*`` or ``GLIBC_TUNABLES`` of the environment;
``keep_freed_memory = false`` in ``[learner]`` leaves glibc's as they are.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

log = logging.getLogger(__name__)

# mallopt(3) parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the top of the heap is returned only past 2 GiB free

KEEP_FREED = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def keep_freed_memory() -> bool:
    """Apply :data:`KEEP_FREED` to this process's glibc malloc; False (logged) where the C library is not glibc.

    Call it before the process starts threads: a thread that has already allocated keeps its own arena."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):
        log.warning("keep_freed_memory: the C library is not glibc; its malloc keeps its own settings")
        return False
    for parameter, value in KEEP_FREED:
        if libc.mallopt(ctypes.c_int(parameter), ctypes.c_int(value)) != 1:
            raise RuntimeError(f"glibc mallopt({parameter}, {value}) failed; set keep_freed_memory = false")
    log.info("glibc malloc keeps freed memory: one arena, no mmap for large blocks, trim past 2 GiB")
    return True


def configure_malloc(settings: Any) -> None:
    """:func:`keep_freed_memory` where the learner trains on the CPU and ``keep_freed_memory`` is on."""
    if not settings.device.startswith("cuda") and settings.keep_freed_memory:
        keep_freed_memory()
