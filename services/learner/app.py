"""The learner's HTTP shell: health, readiness, status, Prometheus metrics, shutdown.

``/health`` and ``/ready`` report the step, the policy version and the groups in flight once the learner
loop is built; ``/ready`` answers 503 until the loop runs. The last step's metrics are on ``GET /status``,
behind the bearer token like every non-probe path (they describe the training run: rewards, losses, what the
policy learned).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import APIRouter, Depends, FastAPI
from pydantic import BaseModel

from shared.app import Probes, Readiness, service_app
from shared.http import Authorized, FiniteJsonRoute, ServiceState, state_dependency

if TYPE_CHECKING:
    from services.learner.train_loop import LearnerLoop


class Status(BaseModel):
    status: str
    step: int = 0
    policy_version: int = 0
    groups_in_flight: int = 0


class Progress(Status):
    last_metrics: dict[str, float] = {}


@dataclass(kw_only=True)
class LearnerAppState(ServiceState):
    loop: LearnerLoop | None = None  # set once built (the model loaded, the streams opened)

    def status(self, status: str) -> Status:
        return Status(**self.progress(status).model_dump(exclude={"last_metrics"}))

    def progress(self, status: str) -> Progress:
        loop = self.loop
        if loop is None:
            return Progress(status=status)
        return Progress(
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

router = APIRouter(route_class=FiniteJsonRoute)


@router.get("/status", response_model=Progress, dependencies=[Authorized], summary="Progress and last metrics")
async def progress(state: Annotated[LearnerAppState, Depends(state_dependency(LearnerAppState))]) -> Progress:
    running = state.loop is not None and state.loop.running
    return state.progress("ready" if running else "starting")


def build_app(state: LearnerAppState) -> FastAPI:
    return service_app(
        state,
        PROBES,
        title="asyncgrpo learner",
        description="Trains the policy with GRPO on scored groups.",
        routers=[router],
    )
