"""The learner's HTTP shell: health, readiness, status, Prometheus metrics, shutdown.

``/health`` and ``/ready`` both report the step, the policy version, the groups in flight and the last
step's metrics once the learner loop is built; ``/ready`` answers 503 until the loop runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI
from pydantic import BaseModel

from shared.app import Probes, Readiness, service_app
from shared.http import ServiceState

if TYPE_CHECKING:
    from services.learner.train_loop import LearnerLoop


class Status(BaseModel):
    status: str
    step: int = 0
    policy_version: int = 0
    groups_in_flight: int = 0
    last_metrics: dict[str, float] = {}


@dataclass(kw_only=True)
class LearnerAppState(ServiceState):
    loop: LearnerLoop | None = None  # set once built (the model loaded, the streams opened)

    def status(self, status: str) -> Status:
        loop = self.loop
        if loop is None:
            return Status(status=status)
        return Status(
            status=status,
            step=loop.trainer.step,
            policy_version=loop.policy_version,
            groups_in_flight=loop.in_flight,
            last_metrics=loop.sink.last,
        )


async def readiness(state: LearnerAppState) -> Readiness:
    """Ready while the learner loop runs (generators found, training)."""
    if state.loop is None or not state.loop.running:
        return Readiness(False, state.status("starting"))
    return Readiness(True, state.status("ready"))


PROBES = Probes(
    model=Status,
    ready=readiness,
    ready_summary="Training (generators found, loop running)",
    health=lambda state: state.status("alive"),
)


def build_app(state: LearnerAppState) -> FastAPI:
    return service_app(
        state, PROBES, title="asyncgrpo learner", description="Trains the policy with GRPO on scored groups."
    )
