"""What the generator's trajectory runner sees of an environment, whatever provides it
(docs/concepts/multi-turn-design.md §2.3, §2.8): an :class:`Environment` opens one :class:`Session` per
trajectory, ``async with environment.session(row, key) as session``, and the session's ``step`` runs one
assistant turn's tool calls.

Two implementations: ``environments/python_env.py`` (a TRL environment class or plain tool functions, in this
process) and ``environments/client.py`` (an ``asyncgrpo.env/v1`` server); ``environments/build.py`` picks one
from the settings. Every way an environment can fail to answer is one exception, :class:`EnvFault`: the prompt
is abandoned and redelivered, never trained on. A tool that *raises* is not a fault: the model reads the error.

Sessions are closed on every path (:func:`close_with_retries`): a close that fails is tried twice more, then
logged and counted (``close_failures``); the server's idle TTL reclaims what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from environments.protocol import StepResponse, ToolCallIn

CLOSE_ATTEMPTS = 3  # one close and two retries; then the server's TTL takes over
OUTCOMES = ("ok", "retried", "fault", "tool_error")  # the keys of EnvStats.calls


class EnvFault(RuntimeError):
    """The environment failed: transport error / timeout / 408 / 429 / 5xx past the retries, any other 4xx (a bad
    request), a Python timeout, or an exception in reset() or get_reward(). The prompt is abandoned and
    redelivered, never trained."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class EnvStats:
    """Counters of one environment, for the generator's ``/metrics``: ``calls`` by outcome (``ok``: a call that
    answered; ``retried``: each retry within a call; ``fault``: a call that raised :class:`EnvFault`;
    ``tool_error``: a tool result with ``error`` set), and the sessions opened, closed and failed to close."""

    calls: Counter[str] = field(default_factory=Counter)
    sessions_opened: int = 0
    sessions_closed: int = 0
    close_failures: int = 0

    @property
    def sessions_open(self) -> int:
        return self.sessions_opened - self.sessions_closed - self.close_failures

    def count_results(self, response: StepResponse) -> None:
        errors = sum(result.error for result in response.results)
        if errors:
            self.calls["tool_error"] += errors


class Session(Protocol):
    """One trajectory's session: its first observation and tools, then steps until the trajectory ends."""

    observation: str | None  # what reset()/create returned (None: nothing to append)
    tools: tuple[dict[str, Any], ...]  # get_json_schema's shape, ready for apply_chat_template(tools=...)
    latencies_s: list[float]  # seconds of every environment call of this session (create, each step, reward)

    async def step(self, calls: Sequence[ToolCallIn]) -> StepResponse:
        """Run one assistant turn's calls in order (steps are numbered 0, 1, ... by the session)."""
        ...

    async def reward(self) -> float | None:
        """The environment's get_reward(); None when it has none."""
        ...


class Environment(Protocol):
    """A source of sessions, with one breaker counting consecutive faults."""

    name: str  # "mod:Class", "tools mod:fn,...", or the URL, for logs
    stats: EnvStats

    def tool_schemas(self) -> tuple[dict[str, Any], ...] | None:
        """The tools, known without a session (Python); None when only a session says (HTTP)."""
        ...

    def session(self, row: dict[str, Any], key: str) -> contextlib.AbstractAsyncContextManager[Session]:
        """Creates on enter (may raise EnvFault), closes on exit on every path (never raises for the close)."""
        ...

    def accepting(self) -> bool:
        """False while the breaker is open."""
        ...

    def describe(self) -> str:
        """One line for /ready, e.g. 'environment x: breaker open ...; last error: ...'."""
        ...

    async def aclose(self) -> None: ...


async def close_with_retries(
    close: Callable[[], Awaitable[None]], stats: EnvStats, what: str, log: logging.Logger
) -> bool:
    """Run ``close`` up to :data:`CLOSE_ATTEMPTS` times; count and log a close that never succeeds (never raise,
    except the caller's cancellation). True when it closed."""
    error: BaseException | None = None
    for _ in range(CLOSE_ATTEMPTS):
        try:
            await close()
        except (EnvFault, OSError, RuntimeError, ValueError) as exc:
            error = exc
            continue
        stats.sessions_closed += 1
        return True
    stats.close_failures += 1
    log.warning("%s: close failed %d times (%s); the server's idle TTL will reclaim it", what, CLOSE_ATTEMPTS, error)
    return False


async def timed(latencies: list[float], call: Awaitable[Any]) -> Any:
    """Await ``call``, appending its duration in seconds to ``latencies`` (on every path)."""
    started = asyncio.get_running_loop().time()
    try:
        return await call
    finally:
        latencies.append(asyncio.get_running_loop().time() - started)
