"""How the scorer holds a group whose required reward failed: when it tries again, and when it gives up.

The loop (:mod:`services.scorer.scoring_loop`, whose docstring states the policy) calls again only the failed
required rewards of a held group: after a doubling backoff, or exactly when an open breaker lets a trial
through, woken early by any change of those breakers; past ``max_wait_s`` the group is given up with a reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from services.scorer.rewards.functions import RewardFailure
from shared.resilience import CircuitBreaker

log = logging.getLogger(__name__)


class Released(Exception):
    """The scorer is stopping while the group waits for a required reward."""


def retry_delay(attempt: int, first_s: float, max_s: float, until_trial_s: float | None, remaining_s: float) -> float:
    """Seconds before a held group's next try, never past its deadline (the last try is at the deadline).

    While the reward's breaker is open (``until_trial_s`` given) the try is due exactly when the breaker
    lets a trial through: the group may be that trial, and trying earlier is refused anyway. Otherwise
    exponential backoff: ``first_s * 2**attempt``, at most ``max_s``.
    """
    wait = until_trial_s if until_trial_s is not None else min(first_s * 2**attempt, max_s)
    return max(0.0, min(wait, remaining_s))


@dataclass(frozen=True)
class HoldPolicy:
    """A held group's deadline (``max_wait_s``) and backoff (``backoff_s`` doubling to ``backoff_max_s``)."""

    max_wait_s: float
    backoff_s: float
    backoff_max_s: float

    def give_up_reason(self, failures: Sequence[RewardFailure], waited: float) -> str:
        details = "; ".join(str(failure) for failure in failures)
        return f"required reward failed for {waited:.1f} s (max_reward_wait_s={self.max_wait_s:g}): {details}"

    async def wait(
        self,
        group_id: str,
        attempt: int,
        failures: Sequence[RewardFailure],
        breakers: Sequence[CircuitBreaker],
        remaining_s: float,
        stop: asyncio.Event,
    ) -> None:
        """Sleep until the next try of the failed rewards; :class:`Released` when ``stop`` is set meanwhile."""
        delay = min(
            retry_delay(
                attempt,
                self.backoff_s,
                self.backoff_max_s,
                b.seconds_until_trial() if b.refresh() == "open" else None,
                remaining_s,
            )
            for b in breakers
        )
        # Refused by an open breaker: nothing new to say (the breaker's transitions are logged).
        level = logging.DEBUG if all(f.short_circuited for f in failures) else logging.INFO
        log.log(
            level,
            "group %s held: required reward %s failed (try %d); next try in %.1f s, dead-lettered in %.0f s",
            group_id, ", ".join(f.reward for f in failures), attempt + 1, delay, remaining_s,
        )  # fmt: skip
        waiters: list[asyncio.Future] = [asyncio.ensure_future(stop.wait())]
        waiters += [asyncio.ensure_future(b.wait_for_change(delay)) for b in breakers]
        try:
            await asyncio.wait(waiters, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
        if stop.is_set():
            raise Released
