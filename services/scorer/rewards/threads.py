"""Worker threads for Python reward functions, with a timeout per call.

A thread cannot be stopped. A call that gives no answer within ``timeout_s`` is abandoned: the caller gets a
``TimeoutError``, an outage like an HTTP plugin's timeout (the group is held or gets NaN, the breaker counts
it), but the thread runs on until the function returns. So each reward has threads of its own, at most
``size`` at once, and a thread's slot is freed only when the thread really ends: a reward whose every thread
hangs times out on every call (its breaker opens and ``/ready`` says why) instead of piling up threads or
starving the event loop's default executor, where DNS lookups for Redis and the plugins run. The threads are
daemons, so a hung one never keeps the scorer from exiting. Hung threads are counted (``hung``) and logged
when a call is abandoned and when it finally returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


class RewardTimeoutError(TimeoutError):
    """A Python reward call gave no answer within its ``timeout_s`` and was abandoned (an outage)."""


@dataclass
class _Call:
    """One call's state, read and written on the event loop's thread only."""

    future: asyncio.Future
    started: float = field(default_factory=time.monotonic)
    finished: bool = False
    abandoned: bool = False


class RewardThreads:
    """Runs one reward function's calls in daemon threads, at most ``size`` at once."""

    def __init__(self, name: str, size: int) -> None:
        self.name, self.size = name, size
        self.hung = 0  # threads still running a call that was abandoned (a gauge)
        self._slots: asyncio.Semaphore | None = None  # made on first use, inside the running loop

    async def run(
        self, function: Callable[..., Any], kwargs: dict[str, Any], timeout_s: float | None, group_id: str
    ) -> Any:
        """``function(**kwargs)`` in a thread of this reward; :class:`RewardTimeoutError` after ``timeout_s``
        (waiting for a free thread included; None: no limit)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.size)
        call: _Call | None = None
        deadline = asyncio.timeout(timeout_s)
        try:
            async with deadline:
                await self._slots.acquire()
                call = self._start(function, kwargs)
                return await call.future
        except TimeoutError:
            if not deadline.expired():
                raise  # the function's own TimeoutError (a socket's, say): an outage it reports itself
            assert timeout_s is not None  # only a deadline expires
            if call is not None and call.future.done() and not call.future.cancelled():
                return call.future.result()  # it answered in time; the loop woke too late to see it
            raise RewardTimeoutError(self._abandon(call, timeout_s, group_id)) from None

    def _start(self, function: Callable[..., Any], kwargs: dict[str, Any]) -> _Call:
        loop = asyncio.get_running_loop()
        call = _Call(loop.create_future())

        def work() -> None:
            result: Any = None
            error: BaseException | None = None
            try:
                result = function(**kwargs)
            except BaseException as exc:  # handed to the caller, who decides what it means
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop is closed: the scorer is gone
                loop.call_soon_threadsafe(self._finished, call, result, error)

        try:
            threading.Thread(target=work, name=f"reward-{self.name}", daemon=True).start()
        except BaseException:
            assert self._slots is not None
            self._slots.release()
            raise
        return call

    def _finished(self, call: _Call, result: Any, error: BaseException | None) -> None:
        assert self._slots is not None
        call.finished = True
        self._slots.release()
        if call.abandoned:
            self.hung -= 1
            log.warning(
                "reward %s: a call abandoned at its timeout returned after %.1f s; its thread is free again "
                "(%d of %d threads still hung)",
                self.name, time.monotonic() - call.started, self.hung, self.size,
            )  # fmt: skip
        elif not call.future.done():
            if error is not None:
                call.future.set_exception(error)
            else:
                call.future.set_result(result)

    def _abandon(self, call: _Call | None, timeout_s: float, group_id: str) -> str:
        """Mark a timed-out call's thread hung (it cannot be stopped), log it, and say what happened."""
        if call is None:
            return (
                f"no answer within timeout_s={timeout_s:g}: all {self.size} threads of reward {self.name} were busy "
                f"({self.hung} hung on earlier calls)"
            )
        if not call.finished:
            call.abandoned = True
            self.hung += 1
            log.warning(
                "reward %s, group %s: no answer within timeout_s=%g; the call is abandoned, but its thread cannot be "
                "stopped and stays busy until the function returns (%d of %d threads hung)",
                self.name, group_id, timeout_s, self.hung, self.size,
            )  # fmt: skip
            if self.hung == self.size:
                log.error(
                    "reward %s: all %d of its threads are hung, so every call times out until one returns; "
                    "the function hangs (fix it, or give it a larger timeout_s)",
                    self.name, self.size,
                )  # fmt: skip
        return f"no answer within timeout_s={timeout_s:g}"
