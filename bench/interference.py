"""What two cores of this machine lose to each other, measured: each core's throughput running alone and with
the other core running the same kernel at the same time (one process pinned to each core, one thread each).

Two kernels bound the cases a pipeline's processes fall between:

* ``matmul``: a float32 matrix product small enough to stay in each core's own caches (compute-bound). Cores
  that are two hyperthreads of one physical core, or a host that time-slices them, slow it down together.
* ``copy``: copying a buffer several times larger than the last-level cache (memory-bound). Cores that share
  the memory bandwidth slow it down together, the more so the more of it one core can draw alone.

``together / alone`` is the throughput of both cores at once over the sum of their throughputs alone: 1.0
means the cores do not slow each other; 0.75 means a quarter of the work is lost to sharing. For
``bench/async_vs_sync.py``: a CPU generator's sampling reads the whole model at every decode step, so it is
closer to ``copy`` than to ``matmul``; when the phases lose no more side by side than ``copy`` does, the loss
is within what the hardware's sharing can explain, and no change to threads or polling is shown to remove it.

    python bench/interference.py [--cores 0 1] [--seconds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import time
from collections.abc import Sequence
from pathlib import Path

KINDS = ("matmul", "copy")
MATMUL_SIZE = 128  # 3 x 64 KiB of float32: resident in any core's L2
MIN_COPY_BYTES = 64 * 2**20  # past the last-level cache of a CPU whose sysfs does not say (and of most that do)


def copy_bytes(cache_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """Bytes per copy buffer: twice the largest cache the CPU reports (core 0's view: the last-level cache is
    the one the cores share), at least ``MIN_COPY_BYTES``."""
    largest = 0
    for index in cache_dir.glob("index*"):
        try:
            largest = max(largest, parse_cache_size((index / "size").read_text()))
        except (OSError, ValueError):
            continue  # an index without a readable size: the others, or the floor, decide
    return max(MIN_COPY_BYTES, 2 * largest)


def parse_cache_size(text: str) -> int:
    """Bytes in a sysfs cache size such as ``32768K`` or ``2M``."""
    text = text.strip()
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    if text[-1:].upper() in units:
        return int(text[:-1]) * units[text[-1].upper()]
    return int(text)


def together_over_alone(alone: Sequence[float], together: Sequence[float]) -> float:
    """The cores' summed throughput running at once over their summed throughput each alone."""
    if len(alone) != len(together) or not alone:
        raise ValueError(f"one throughput per core on each side, got {len(alone)} alone and {len(together)} together")
    if min(alone) <= 0:
        raise ValueError(f"a core did no work alone: {list(alone)}")
    return sum(together) / sum(alone)


def _kernel(kind: str, buffer_bytes: int):
    """(the operation, the bytes or flops it does once) for ``kind``."""
    import torch

    if kind == "matmul":
        a, b = torch.randn(MATMUL_SIZE, MATMUL_SIZE), torch.randn(MATMUL_SIZE, MATMUL_SIZE)
        return (lambda: torch.mm(a, b)), 2.0 * MATMUL_SIZE**3
    if kind == "copy":
        source = torch.ones(buffer_bytes // 4)
        target = torch.empty_like(source)
        return (lambda: target.copy_(source)), 2.0 * buffer_bytes  # read once, written once
    raise ValueError(f"kind {kind!r} is none of {', '.join(KINDS)}")


def _worker(core: int, kind: str, seconds: float, buffer_bytes: int, start, results) -> None:
    try:
        import torch

        os.sched_setaffinity(0, {core})
        torch.set_num_threads(1)
        operation, unit = _kernel(kind, buffer_bytes)
        for _ in range(3):  # first touch of the buffers, kernels' first calls
            operation()
    except BaseException:
        start.abort()  # the other workers' wait fails at once instead of at its timeout
        raise
    start.wait(timeout=120)
    done, began = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - began) < seconds:
        operation()
        done += 1
    results.put((core, done * unit / elapsed))


def throughputs(cores: Sequence[int], kind: str, seconds: float, buffer_bytes: int) -> list[float]:
    """Each of ``cores``' throughput (flops or bytes per second) of ``kind``, all of them running at once."""
    context = multiprocessing.get_context("spawn")  # no inherited torch threads or locks
    start, results = context.Barrier(len(cores)), context.Queue()
    workers = [
        context.Process(target=_worker, args=(core, kind, seconds, buffer_bytes, start, results), daemon=True)
        for core in cores
    ]
    for worker in workers:
        worker.start()
    got: dict[int, float] = {}
    deadline = time.monotonic() + seconds + 180
    while len(got) < len(cores) and time.monotonic() < deadline:
        try:
            core, rate = results.get(timeout=1.0)
            got[core] = rate
        except queue.Empty:
            if any(worker.exitcode not in (None, 0) for worker in workers):
                break  # a worker died: the others cannot report either (their barrier is broken)
    for worker in workers:
        worker.join(timeout=30)
        if worker.is_alive():
            worker.terminate()
            worker.join()
    if len(got) != len(cores):
        codes = {core: worker.exitcode for core, worker in zip(cores, workers, strict=True)}
        raise RuntimeError(f"the {kind} workers on cores {list(cores)} reported {sorted(got)}; exit codes {codes}")
    return [got[core] for core in cores]


def measure(cores: Sequence[int], seconds: float = 3.0) -> dict[str, float]:
    """``together / alone`` of each kernel on ``cores`` (each core alone in turn, then all at once)."""
    if len(cores) < 2:
        raise ValueError(f"interference needs two cores or more, got {list(cores)}")
    missing = set(cores) - os.sched_getaffinity(0)
    if missing:
        raise ValueError(f"cores {sorted(missing)} are not among this process's {sorted(os.sched_getaffinity(0))}")
    buffer_bytes = copy_bytes()
    figures = {}
    for kind in KINDS:
        alone = [throughputs([core], kind, seconds, buffer_bytes)[0] for core in cores]
        together = throughputs(cores, kind, seconds, buffer_bytes)
        figures[kind] = together_over_alone(alone, together)
    return figures


def describe(figures: dict[str, float]) -> str:
    """One line for a bench's output."""
    return (
        f"this machine's cores side by side (bench/interference.py): a cache-resident matmul keeps "
        f"{figures['matmul']:.2f} of its speed alone, a copy through memory {figures['copy']:.2f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cores", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--seconds", type=float, default=3.0, help="each measurement's duration")
    arguments = parser.parse_args()
    print(describe(measure(arguments.cores, arguments.seconds)))
