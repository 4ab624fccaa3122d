"""Daemon worker threads for sync user code (reward functions, environment tools), with a timeout per call.

A thread cannot be stopped. A call that gives no answer within ``timeout_s`` is abandoned: the caller gets a
:class:`CallTimeoutError` (or the subclass it asked for), but the thread runs on until the function returns. So
each runner has threads of its own, at most ``size`` at once, and a thread's slot is freed only when the thread
really ends: code whose every thread hangs times out on every call instead of piling up threads or starving the
event loop's default executor, where DNS lookups for Redis and the plugins run. The threads are daemons, so a
hung one never keeps the process from exiting. Hung threads are counted (``hung``, a gauge) and logged when a
call is abandoned and when it finally returns. The scorer (``services/scorer/rewards/reward_threads.py``) and the
Python environments (``environments/python_env.py``) both run user code here.
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


class CallTimeoutError(TimeoutError):
    """A call gave no answer within its ``timeout_s`` and was abandoned (its thread runs on)."""


@dataclass
class _Call:
    """One call's state, read and written on the event loop's thread only."""

    future: asyncio.Future
    started: float = field(default_factory=time.monotonic)
    finished: bool = False
    abandoned: bool = False
    result: Any = None
    error: BaseException | None = None

    def outcome(self) -> Any:
        """The function's result, or its exception raised again."""
        if self.error is not None:
            raise self.error
        return self.result


class DaemonThreads:
    """Runs one piece of user code's calls in daemon threads, at most ``size`` at once.

    ``subject`` names the code's kind in logs and errors ("reward", "environment"); threads are named
    ``<thread_prefix>-<name>``; a timed-out call raises ``error(message)``.
    """

    def __init__(
        self,
        name: str,
        size: int,
        *,
        subject: str,
        thread_prefix: str,
        error: type[CallTimeoutError] = CallTimeoutError,
    ) -> None:
        self.name, self.size, self.subject = name, size, subject
        self.thread_prefix, self.error = thread_prefix, error
        self.hung = 0  # threads still running a call that was abandoned (a gauge)
        self._slots: asyncio.Semaphore | None = None  # made on first use, inside the running loop

    async def run(
        self, function: Callable[..., Any], kwargs: dict[str, Any], timeout_s: float | None, what: str
    ) -> Any:
        """``function(**kwargs)`` in a thread; ``error`` after ``timeout_s`` (waiting for a free thread included;
        None: no limit). ``what`` names the call in the log ("group g1", "tool add")."""
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
                raise  # the function's own TimeoutError (a socket's, say): the caller decides what it means
            assert timeout_s is not None  # only a deadline expires
            if call is not None and call.finished:
                return call.outcome()  # it answered in time; the loop woke too late to see it
            raise self.error(self._abandon(call, timeout_s, what)) from None

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
            with contextlib.suppress(RuntimeError):  # the loop is closed: the process is going
                loop.call_soon_threadsafe(self._finished, call, result, error)

        try:
            threading.Thread(target=work, name=f"{self.thread_prefix}-{self.name}", daemon=True).start()
        except BaseException:
            assert self._slots is not None
            self._slots.release()
            raise
        return call

    def _finished(self, call: _Call, result: Any, error: BaseException | None) -> None:
        assert self._slots is not None
        call.finished, call.result, call.error = True, result, error
        self._slots.release()
        if call.abandoned:
            self.hung -= 1
            log.warning(
                "%s %s: a call abandoned at its timeout returned after %.1f s; its thread is free again "
                "(%d of %d threads still hung)",
                self.subject, self.name, time.monotonic() - call.started, self.hung, self.size,
            )  # fmt: skip
        elif not call.future.done():  # a cancelled caller's future is done: nobody waits for the answer
            if error is not None:
                call.future.set_exception(error)
            else:
                call.future.set_result(result)

    def _abandon(self, call: _Call | None, timeout_s: float, what: str) -> str:
        """Mark a timed-out call's thread hung (it cannot be stopped), log it, and say what happened."""
        if call is None:
            return (
                f"no answer within timeout_s={timeout_s:g}: all {self.size} threads of {self.subject} {self.name} "
                f"were busy ({self.hung} hung on earlier calls)"
            )
        call.abandoned = True
        self.hung += 1
        log.warning(
            "%s %s, %s: no answer within timeout_s=%g; the call is abandoned, but its thread cannot be stopped and "
            "stays busy until the function returns (%d of %d threads hung)",
            self.subject, self.name, what, timeout_s, self.hung, self.size,
        )  # fmt: skip
        if self.hung == self.size:
            log.error(
                "%s %s: all %d of its threads are hung, so every call times out until one returns; the function "
                "hangs (fix it, or give it a larger timeout_s)",
                self.subject, self.name, self.size,
            )  # fmt: skip
        return f"no answer within timeout_s={timeout_s:g}"
