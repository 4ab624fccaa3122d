"""services/learner/host_memory.py: set up as the learner process sets it up (after importing its entry point,
which starts numpy's idle OpenBLAS workers), a training thread's second step of large allocations faults no page
back in; with glibc's defaults, or the setting off, or a CUDA learner, it faults every page again. Each case runs
in a fresh interpreter, with transparent huge pages off (so a fault is one 4 KiB page) and no MALLOC_* tunables."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 64 << 20  # one step's large tensor: above glibc's largest mmap threshold (32 MiB)
PAGES = BLOCK // 4096
PR_SET_THP_DISABLE = 41

STEPS = f"""
import ctypes, resource, sys, threading
from types import SimpleNamespace

libc = ctypes.CDLL(None)
libc.prctl({PR_SET_THP_DISABLE}, 1, 0, 0, 0)
from services.learner.__main__ import configure_malloc  # what the process imports before it sets malloc up

device, keep = sys.argv[1], sys.argv[2] == "on"
if keep and not hasattr(libc, "gnu_get_libc_version"):
    print("not glibc"); sys.exit(0)
configure_malloc(SimpleNamespace(device=device, keep_freed_memory=keep))
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


def second_step_faults(device: str, keep: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    result = subprocess.run(
        [sys.executable, "-c", STEPS, device, keep], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        check=True,
    )  # fmt: skip
    if result.stdout.strip() == "not glibc":
        pytest.skip("the C library is not glibc")
    return int(result.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_a_cpu_learner_s_second_step_faults_no_page_back_in():
    assert second_step_faults("cpu", "on") < PAGES // 100


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
@pytest.mark.parametrize(("device", "keep"), [("cpu", "off"), ("cuda", "on"), ("cuda:1", "on")])
def test_glibc_s_defaults_fault_every_page_again(device, keep):
    assert second_step_faults(device, keep) > PAGES // 2
