"""``--profile DIR`` of the benchmarks: one more step of a loop under ``torch.profiler``, written as tables.

For each profiled loop ``name`` the directory gets ``name.txt``: the step's wall time, the time the device
spent in kernels (CUDA) and their share of the wall, the number of host-device synchronisations and copies
(``cudaStreamSynchronize`` / ``cudaDeviceSynchronize`` / ``cudaMemcpy*``: every ``.item()``, ``.tolist()`` or
``float(tensor)`` of a CUDA tensor is one), then the ops by their own device time and by their own host time
(top ``rows``; on the CPU, by host time alone). A device busy less than the wall is waiting for the host:
launches, Python, or the synchronisations counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync")


def _kernel_seconds(averages) -> float:
    """The device's busy time: the kernels' own time, as the table's "Self CUDA time total" counts it (an op's
    own device time repeats its kernels', so summing every row counts them twice)."""
    kernels = (e for e in averages if e.device_type == DeviceType.CUDA and not e.is_user_annotation)
    return sum(e.self_device_time_total for e in kernels) / 1e6


def profile_step(name: str, device: str, step: Callable[[], object], directory: Path, rows: int = 40) -> str:
    """Run ``step()`` once under the profiler and write ``directory/name.txt``; returns its summary line."""
    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities, record_shapes=True) as prof:
        started = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
    averages = prof.key_averages()
    device_s = _kernel_seconds(averages) if cuda else 0.0
    waits = {e.key: e.count for e in averages if e.key in _WAITS}
    summary = (
        f"{name}: wall {wall:.3f} s (profiled)"
        + (f", device kernels {device_s:.3f} s = {device_s / wall:.0%} of the wall" if cuda else "")
        + f", host syncs and copies {sum(waits.values())} {waits}"
    )
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    tables = [summary, "", f"by own {'device' if cuda else 'host'} time:", averages.table(sort_by=sort, row_limit=rows)]
    if cuda:
        tables += ["by own host time:", averages.table(sort_by="self_cpu_time_total", row_limit=rows)]
        shaped = prof.key_averages(group_by_input_shape=True)
        tables += ["by own device time, with input shapes:", shaped.table(sort_by=sort, row_limit=rows)]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.txt").write_text("\n".join(tables) + "\n")
    return summary
