"""The scorer's HTTP shell: health, readiness (plugins' breakers), Prometheus metrics, shutdown."""

from __future__ import annotations

import asyncio

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
    summary="Scoring; lists each HTTP plugin's breaker state",
    responses={503: {"model": Status}},
)
async def ready(request: Request):
    if not request.app.state.running:
        return JSONResponse(Status(status="starting").model_dump(), status_code=503)
    plugins = {plugin.name: plugin.breaker.state for plugin in request.app.state.plugins}
    return Status(status="ready", plugins=plugins)


def build_app(*, api_token: str, registry, stop: asyncio.Event, plugins) -> FastAPI:
    app = FastAPI(title="asyncgrpo scorer", description="Scores rollouts and computes group advantages.")
    app.state.api_token = api_token
    app.state.registry = registry
    app.state.stop = stop
    app.state.plugins = plugins
    app.state.running = False
    app.include_router(router)
    app.include_router(common_router)
    return app
