"""The learner's HTTP shell: health, readiness, status, Prometheus metrics, shutdown."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from shared.http import common_router

router = APIRouter()


class Status(BaseModel):
    status: str
    step: int = 0
    policy_version: int = 0
    groups_in_flight: int = 0
    last_metrics: dict[str, float] = {}


def _status(request: Request, status: str) -> Status:
    loop = request.app.state.loop
    if loop is None:
        return Status(status=status)
    return Status(
        status=status,
        step=loop.trainer.step,
        policy_version=loop.policy_version,
        groups_in_flight=loop.in_flight,
        last_metrics=loop.sink.last,
    )


@router.get("/health", response_model=Status, summary="The process is alive")
async def health(request: Request) -> Status:
    return _status(request, "alive")


@router.get(
    "/ready",
    response_model=Status,
    summary="Training (generators found, loop running)",
    responses={503: {"model": Status}},
)
async def ready(request: Request):
    loop = request.app.state.loop
    if loop is None or not loop.running:
        return JSONResponse(_status(request, "starting").model_dump(), status_code=503)
    return _status(request, "ready")


def build_app(*, api_token: str, registry, stop: asyncio.Event) -> FastAPI:
    app = FastAPI(title="asyncgrpo learner", description="Trains the policy with GRPO on scored groups.")
    app.state.api_token = api_token
    app.state.registry = registry
    app.state.stop = stop
    app.state.loop = None
    app.include_router(router)
    app.include_router(common_router)
    return app
