"""A circuit breaker per reward function, whose transitions are logged at WARNING.

closed -> open after ``threshold`` consecutive failures -> half-open once ``reset_s`` has passed, when one
trial call at a time is let through -> closed on its success, open again on its failure. While a *required*
reward's breaker is not closed the scorer takes no new rollouts (see ``scoring_loop``); groups it already
holds wait for :meth:`CircuitBreaker.wait_for_change` instead of polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitOpenError(RuntimeError):
    """The reward's breaker is open (or its half-open trial is taken): the call was not made."""


class CircuitBreaker:
    def __init__(self, name: str, threshold: int, reset_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.name, self.threshold, self.reset_s, self.clock = name, threshold, reset_s, clock
        self.failures = 0  # consecutive
        self.opened_at: float | None = None
        self.trips = 0
        self.last_error = ""
        self._trial_in_flight = False
        self._announced = CLOSED  # the last state logged, so the lazy open -> half-open step is logged once
        self._changed: asyncio.Event | None = None

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return CLOSED
        return HALF_OPEN if self.clock() - self.opened_at >= self.reset_s else OPEN

    def refresh(self) -> str:
        """The state, logging the open -> half-open step the first time it is seen."""
        state = self.state
        if state == HALF_OPEN and self._announced == OPEN:
            self._announce(HALF_OPEN, "the next call is a trial")
        return state

    def seconds_until_trial(self) -> float:
        if self.opened_at is None:
            return 0.0
        return max(0.0, self.opened_at + self.reset_s - self.clock())

    def before_call(self) -> bool:
        """Admit a call (True when it is the half-open trial) or raise :class:`CircuitOpenError`."""
        state = self.refresh()
        if state == CLOSED:
            return False
        if state == HALF_OPEN and not self._trial_in_flight:
            self._trial_in_flight = True
            return True
        raise CircuitOpenError(self.describe())

    def release_trial(self, trial: bool) -> None:
        """A call ended without an answer either way (cancelled): let another call be the trial."""
        if trial:
            self._trial_in_flight = False

    def success(self, trial: bool = False) -> None:
        if trial:
            self._trial_in_flight = False
        was_open = self.opened_at is not None
        self.failures = 0
        self.opened_at = None
        if was_open:
            self._announce(CLOSED, "a call succeeded")

    def failure(self, error: str, trial: bool = False) -> None:
        if trial:
            self._trial_in_flight = False
        self.failures += 1
        self.last_error = error
        reopen = trial or self.state == HALF_OPEN
        if reopen or (self.opened_at is None and self.failures >= self.threshold):
            self.trips += 1
            self.opened_at = self.clock()
            self._announce(OPEN, f"{self.failures} consecutive failures; a trial call in {self.reset_s:g} s")

    def force_open(self, error: str) -> None:
        """Open now (a plugin that failed its health probe at start)."""
        self.failures = max(self.failures, self.threshold - 1)
        self.failure(error)

    def describe(self) -> str:
        """One line for /ready and for errors: state, failures, last error."""
        state = self.state
        if state == CLOSED:
            return f"reward {self.name}: breaker closed"
        when = f"trial in {self.seconds_until_trial():.1f} s" if state == OPEN else "the next call is a trial"
        return (
            f"reward {self.name}: breaker {state.replace('_', '-')} after {self.failures} consecutive failures "
            f"({when}); last error: {self.last_error}"
        )

    async def wait_for_change(self, timeout_s: float) -> None:
        """Return at the next transition (opened, closed; half-open is seen lazily), or after ``timeout_s``."""
        if self._changed is None:
            self._changed = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout=timeout_s)

    def _announce(self, state: str, why: str) -> None:
        self._announced = state
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        log.warning(
            "reward %s: breaker %s (%s); last error: %s",
            self.name,
            state.replace("_", "-"),
            why,
            self.last_error or "none",
        )
