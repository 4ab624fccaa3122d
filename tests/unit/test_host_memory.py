"""services/learner/host_memory.py: with keep_freed_memory a thread's second step of large allocations faults no
page back in; with glibc's defaults it faults every page again (each case in a fresh interpreter)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 64 << 20  # one step's large tensor: above glibc's largest mmap threshold (32 MiB)
PAGES = BLOCK // 4096

STEPS = f"""
import ctypes, resource, sys, threading
from services.learner.host_memory import keep_freed_memory

if sys.argv[1] == "keep" and not keep_freed_memory():
    print("not glibc"); sys.exit(0)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
faults = []

def step():
    block = libc.malloc({BLOCK})
    ctypes.memset(block, 1, {BLOCK})
    libc.free(block)

def train():  # off the main thread, as the learner trains
    step()
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

thread = threading.Thread(target=train)
thread.start()
thread.join()
print(faults[0])
"""


def second_step_faults(mode: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", STEPS, mode], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    if result.stdout.strip() == "not glibc":
        pytest.skip("the C library is not glibc")
    return int(result.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_a_kept_step_faults_no_page_back_in_where_glibc_s_defaults_fault_them_all():
    assert second_step_faults("defaults") > PAGES // 2
    assert second_step_faults("keep") < PAGES // 100
