"""The scorer's HTTP shell: health, readiness (required rewards' breakers), Prometheus metrics, shutdown.

``/ready`` answers 503 while the scorer starts and while a required reward's breaker is open or half-open
(the scorer then takes no new rollouts); the detail names the reward and its last error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from shared.http import common_router

router = APIRouter()


class Status(BaseModel):
    status: str
    detail: str = ""
    plugins: dict[str, str] = {}


@router.get("/health", response_model=Status, summary="The process is alive")
async def health() -> Status:
    return Status(status="alive")


@router.get(
    "/ready",
    response_model=Status,
    summary="Scoring; lists every reward's breaker state",
    responses={503: {"model": Status}},
)
async def ready(request: Request):
    if not request.app.state.running:
        return JSONResponse(Status(status="starting").model_dump(), status_code=503)
    functions = request.app.state.functions
    breakers = {f.name: f.breaker.refresh() for f in functions if f.breaker is not None}
    reason = request.app.state.not_ready_reason()
    if reason:
        return JSONResponse(Status(status="paused", detail=reason, plugins=breakers).model_dump(), status_code=503)
    return Status(status="ready", plugins=breakers)


def build_app(*, api_token: str, registry, stop: asyncio.Event, functions: Sequence) -> FastAPI:
    app = FastAPI(title="asyncgrpo scorer", description="Scores rollouts and computes group advantages.")
    app.state.api_token = api_token
    app.state.registry = registry
    app.state.stop = stop
    app.state.functions = functions
    app.state.not_ready_reason = lambda: ""  # the scoring loop's, once it runs
    app.state.running = False
    app.include_router(router)
    app.include_router(common_router)
    return app
