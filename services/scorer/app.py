"""The scorer's HTTP shell: health, readiness (required rewards' breakers), Prometheus metrics, shutdown.

``/ready`` answers 503 while the scorer starts and while a required reward's breaker is open or half-open
(the scorer then takes no new rollouts); the detail names the reward and its last error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fastapi import FastAPI
from pydantic import BaseModel

from services.scorer.rewards.functions import RewardFunction
from shared.app import Probes, Readiness, service_app
from shared.http import ServiceState


class Status(BaseModel):
    status: str
    detail: str = ""
    plugins: dict[str, str] = {}


@dataclass(kw_only=True)
class ScorerAppState(ServiceState):
    functions: Sequence[RewardFunction] = ()
    # Why the scoring loop takes no (or only trial) rollouts, "" when it takes them; None until it runs.
    not_ready_reason: Callable[[], str] | None = None


async def readiness(state: ScorerAppState) -> Readiness:
    """Ready while the loop runs and no required reward's breaker holds intake back."""
    if state.not_ready_reason is None:
        return Readiness(False, Status(status="starting"))
    breakers = {f.name: f.breaker.refresh() for f in state.functions if f.breaker is not None}
    reason = state.not_ready_reason()
    if reason:
        return Readiness(False, Status(status="paused", detail=reason, plugins=breakers))
    return Readiness(True, Status(status="ready", plugins=breakers))


PROBES = Probes(model=Status, ready=readiness, ready_summary="Scoring; lists every reward's breaker state")


def build_app(state: ScorerAppState) -> FastAPI:
    return service_app(
        state, PROBES, title="asyncgrpo scorer", description="Scores rollouts and computes group advantages."
    )
