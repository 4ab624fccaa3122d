"""The CPU generator's engine processes get glibc malloc settings that keep freed memory (GLIBC_TUNABLES)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from services.generator.engine_memory import KEEP_FREED, TUNABLES_ENV, engine_tunables, keep_freed_in_engines

OURS = ":".join(KEEP_FREED)


def test_the_tunables_follow_the_environments_own_once():
    assert engine_tunables("") == OURS
    assert engine_tunables("glibc.malloc.mmap_max=5") == f"glibc.malloc.mmap_max=5:{OURS}"  # ours last: they win
    assert engine_tunables(engine_tunables("a=1")) == engine_tunables("a=1")


@pytest.mark.parametrize(
    ("keep", "on_cpu", "want"), [(True, True, f"x=1:{OURS}"), (False, True, "x=1"), (True, False, "x=1")]
)
def test_only_a_cpu_engine_with_the_setting_on_changes_the_environment(keep, on_cpu, want):
    environ = {TUNABLES_ENV: "x=1"}
    keep_freed_in_engines(environ, keep, on_cpu)
    assert environ == {TUNABLES_ENV: want}


_PROBE = """
import ctypes
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
before = libc.mallinfo2().hblks
block = libc.malloc(64 << 20)
print(libc.mallinfo2().hblks - before)
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="needs glibc >= 2.33 (mallinfo2)")
def test_a_process_started_with_them_takes_a_large_block_from_its_heap_not_mmap():
    """What a spawned engine process sees: glibc reads GLIBC_TUNABLES at start-up."""

    def mmapped_blocks(environ: dict[str, str]) -> int:
        clean = {k: v for k, v in os.environ.items() if k != TUNABLES_ENV and not k.startswith("MALLOC_")}
        result = subprocess.run(
            [sys.executable, "-c", _PROBE], env={**clean, **environ}, capture_output=True, text=True, check=True
        )
        return int(result.stdout)

    assert mmapped_blocks({}) == 1  # glibc's default: 64 MiB is an mmap, unmapped again at free
    environ: dict[str, str] = {}
    keep_freed_in_engines(environ, keep_freed_memory=True, on_cpu=True)
    assert mmapped_blocks(environ) == 0
