"""shared/threads.py on its own: results and exceptions come back, a hung call is abandoned with the caller's
error type, its slot returns only when its thread ends, and the function's own TimeoutError is not a timeout."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from shared.threads import CallTimeoutError, DaemonThreads


class SlowError(CallTimeoutError):
    pass


def _runner(size: int = 1) -> DaemonThreads:
    return DaemonThreads("slow", size, subject="widget", thread_prefix="widget", error=SlowError)


async def _until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


async def test_results_and_exceptions_come_back_from_the_thread():
    runner = _runner()
    assert await runner.run(lambda a, b: (a + b, threading.current_thread().name), {"a": 1, "b": 2}, 5, "add") == (
        3,
        "widget-slow",
    )
    with pytest.raises(ZeroDivisionError):
        await runner.run(lambda: 1 / 0, {}, 5, "divide")


async def test_a_hung_call_is_abandoned_with_the_callers_error_and_its_slot_waits_for_the_thread(caplog):
    runner, release = _runner(), threading.Event()
    try:
        with pytest.raises(SlowError, match=r"^no answer within timeout_s=0\.1$"):
            await runner.run(lambda: release.wait(30), {}, 0.1, "call 1")
        assert runner.hung == 1 and "widget slow, call 1: no answer within timeout_s=0.1" in caplog.text
        assert "all 1 of its threads are hung" in caplog.text
        with pytest.raises(SlowError, match="all 1 threads of widget slow were busy \\(1 hung on earlier calls\\)"):
            await runner.run(lambda: 42, {}, 0.1, "call 2")
    finally:
        release.set()
    await _until(lambda: runner.hung == 0)
    assert "returned after" in caplog.text
    assert await runner.run(lambda: 42, {}, 1, "call 3") == 42


async def test_the_functions_own_timeout_error_is_not_a_timeout_of_ours():
    def own() -> None:
        raise TimeoutError("the socket's")

    runner = _runner()
    with pytest.raises(TimeoutError, match="the socket's") as raised:
        await runner.run(own, {}, 5, "own")
    assert not isinstance(raised.value, CallTimeoutError) and runner.hung == 0
