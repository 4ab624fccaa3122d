"""bench/interference.py's arithmetic: sysfs cache sizes, the copy buffer's size, together / alone, and the
refusals; the measurement itself runs in bench/async_vs_sync.py's --quick (tests/e2e/test_bench_smoke.py)."""

from __future__ import annotations

import os
import time

import pytest

from bench import interference


@pytest.mark.parametrize(
    ("text", "expected"), [("32768K\n", 32 * 2**20), ("2M", 2 * 2**20), ("512", 512), ("1G", 2**30)]
)
def test_parse_cache_size(text: str, expected: int) -> None:
    assert interference.parse_cache_size(text) == expected


def _cache(directory, sizes: dict[str, str]):
    """A sysfs-like cache directory: one ``indexN`` per entry, with a ``size`` file unless the size is empty."""
    for index, size in sizes.items():
        (directory / index).mkdir(parents=True)
        if size:
            (directory / index / "size").write_text(size)
    return directory


def test_copy_buffer_is_twice_the_largest_cache_with_a_floor(tmp_path) -> None:
    big = _cache(tmp_path / "big", {"index0": "48K", "index2": "1024K", "index3": "98304K"})
    assert interference.copy_bytes(big) == 2 * 96 * 2**20
    small = _cache(tmp_path / "small", {"index0": "32K", "index3": "16M"})
    assert interference.copy_bytes(small) == interference.MIN_COPY_BYTES
    unreadable = _cache(tmp_path / "unreadable", {"index0": "", "index3": "80M"})  # index0: no size file, skipped
    assert interference.copy_bytes(unreadable) == 160 * 2**20
    assert interference.copy_bytes(tmp_path / "absent") == interference.MIN_COPY_BYTES


def test_together_over_alone() -> None:
    assert interference.together_over_alone([2.0, 2.0], [1.5, 1.5]) == pytest.approx(0.75)
    assert interference.together_over_alone([1.0, 3.0], [1.0, 3.0]) == 1.0
    with pytest.raises(ValueError, match="one throughput per core"):
        interference.together_over_alone([1.0, 1.0], [1.0])
    with pytest.raises(ValueError, match="did no work alone"):
        interference.together_over_alone([0.0, 1.0], [1.0, 1.0])


def test_measure_refuses_one_core_and_cores_it_may_not_use() -> None:
    with pytest.raises(ValueError, match="two cores or more"):
        interference.measure([0])
    usable = os.sched_getaffinity(0)
    outside = max(usable) + 1
    with pytest.raises(ValueError, match=f"cores \\[{outside}\\] are not among"):
        interference.measure([min(usable), outside])


def test_describe_names_both_kernels() -> None:
    line = interference.describe({"matmul": 0.98, "copy": 0.7})
    assert "matmul keeps 0.98 of its speed alone" in line and "copy through memory 0.70" in line


def test_a_worker_that_fails_is_reported_with_its_exit_code_not_waited_for() -> None:
    core = min(os.sched_getaffinity(0))
    started = time.monotonic()
    with pytest.raises(
        RuntimeError, match=rf"nope workers on cores \[{core}\] reported \[\]; exit codes \{{{core}: 1\}}"
    ):
        interference.throughputs([core], "nope", 0.1, 1024)  # no such kernel: the worker raises before the barrier
    assert time.monotonic() - started < 60  # the parent notices the exit, not its 180 s deadline
