"""The one FastAPI app factory of the pipeline's services: ``/health``, ``/ready``, ``/metrics``,
``/shutdown`` and the service's own routers around its typed state, behind the request guard.

``/health`` says the process is alive; ``/ready`` says it can do work, answering 503 with the reason
otherwise. What "ready" means is the service's: it passes ``ready(state) -> Readiness``. The state is
stored once as ``app.state.service``; routes read it through ``Annotated[X, Depends(state_dependency(X))]``.

The probes and ``/metrics`` are public; every other path needs the bearer token, checked before the body is
read, and the body is capped at the state's ``max_request_bytes`` (:class:`shared.http.RequestGuard`).
``/docs`` and ``/openapi.json`` exist only when the service's ``api_docs`` setting is on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from shared.http import PUBLIC_PROBES, FiniteJsonRoute, ServiceState, check_routes, common_router, guarded_app

S = TypeVar("S", bound=ServiceState)


@dataclass(frozen=True)
class Readiness:
    """The answer of ``/ready``: 200 with ``status`` when ``ready``, else 503 with it."""

    ready: bool
    status: BaseModel


@dataclass(frozen=True)
class Probes(Generic[S]):
    """How a service answers ``/health`` and ``/ready`` (both answer with ``model``)."""

    model: type[BaseModel]
    ready: Callable[[S], Awaitable[Readiness]]
    ready_summary: str
    health: Callable[[S], BaseModel] | None = None  # default: ``model(status="alive")``


def service_app(
    state: S,
    probes: Probes[S],
    *,
    title: str,
    description: str,
    routers: Sequence[APIRouter] = (),
) -> FastAPI:
    """A FastAPI app serving ``probes``, ``/metrics``, ``/shutdown`` and ``routers`` over ``state``. The
    routers are built with ``route_class=FiniteJsonRoute`` (TypeError otherwise)."""
    app = guarded_app(
        title=title,
        description=description,
        token=state.api_token,
        public=PUBLIC_PROBES,
        max_request_bytes=state.max_request_bytes,
        limit_setting="max_request_bytes",
        api_docs=state.api_docs,
    )
    app.state.service = state
    app.include_router(_probe_router(state, probes))
    for router in routers:
        app.include_router(router)
    app.include_router(common_router)
    check_routes(app)
    return app


def _probe_router(state: S, probes: Probes[S]) -> APIRouter:
    router = APIRouter(route_class=FiniteJsonRoute)

    @router.get("/health", response_model=probes.model, summary="The process is alive")
    async def health() -> Any:
        return probes.health(state) if probes.health else probes.model(status="alive")

    @router.get(
        "/ready",
        response_model=probes.model,
        summary=probes.ready_summary,
        responses={503: {"model": probes.model, "description": "Not ready, with the reason"}},
    )
    async def ready() -> Any:
        answer = await probes.ready(state)
        if answer.ready:
            return answer.status
        return JSONResponse(answer.status.model_dump(), status_code=503)

    return router
