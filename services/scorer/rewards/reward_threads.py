"""Worker threads for Python reward functions, with a timeout per call (:mod:`shared.threads` does the work).

A call that gives no answer within ``timeout_s`` is abandoned: the caller gets a :class:`RewardTimeoutError`,
an outage like an HTTP plugin's timeout (the group is held or gets NaN, the breaker counts it), but the thread
runs on until the function returns. Each reward has threads of its own, at most ``size`` at once, freed only
when a thread really ends: a reward whose every thread hangs times out on every call (its breaker opens and
``/ready`` says why). Hung threads are counted (``hung``, a gauge) and logged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shared.threads import CallTimeoutError, DaemonThreads


class RewardTimeoutError(CallTimeoutError):
    """A Python reward call gave no answer within its ``timeout_s`` and was abandoned (an outage)."""


class RewardThreads(DaemonThreads):
    """Runs one reward function's calls in daemon threads named ``reward-<name>``, at most ``size`` at once."""

    def __init__(self, name: str, size: int) -> None:
        super().__init__(name, size, subject="reward", thread_prefix="reward", error=RewardTimeoutError)

    async def run(
        self, function: Callable[..., Any], kwargs: dict[str, Any], timeout_s: float | None, group_id: str
    ) -> Any:
        """``function(**kwargs)`` in a thread of this reward; :class:`RewardTimeoutError` after ``timeout_s``
        (waiting for a free thread included; None: no limit)."""
        return await super().run(function, kwargs, timeout_s, f"group {group_id}")
