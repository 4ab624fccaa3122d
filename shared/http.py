"""Pieces every service's FastAPI shell shares: the typed app state, bearer-token auth, ``/metrics`` and
``/shutdown``.

Each service keeps what its routes read in one dataclass, a subclass of :class:`ServiceState`, stored once
as ``app.state.service`` and read through a typed dependency (:func:`state_dependency`), never through
ad-hoc ``app.state`` attributes. Control endpoints depend on :func:`require_token`; it compares in
constant time and answers 401 with a ``WWW-Authenticate`` header, never echoing the token. (FastAPI is a
service dependency, imported lazily by the services; ``shared``'s wire modules do not need it.)
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, TypeVar

from fastapi import APIRouter, Depends, HTTPException, Request, status
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel

_bearer = HTTPBearer(auto_error=False, description="The pipeline's API token (settings: api_token / API_TOKEN).")


@dataclass(kw_only=True)
class ServiceState:
    """What every service's routes read: its API token, its metrics and the event that stops it."""

    api_token: str
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)


S = TypeVar("S", bound=ServiceState)


def state_dependency(cls: type[S]) -> Callable[[Request], S]:
    """A FastAPI dependency returning the app's state as ``cls``: ``Annotated[cls, Depends(...)]``."""

    def get_state(request: Request) -> S:
        state = request.app.state.service
        if not isinstance(state, cls):
            raise TypeError(f"the app's state is a {type(state).__name__}, not a {cls.__name__}")
        return state

    get_state.__name__ = f"get_{cls.__name__}"
    return get_state


get_service_state = state_dependency(ServiceState)
ServiceStateDep = Annotated[ServiceState, Depends(get_service_state)]


def bearer_matches(given: str, expected: str) -> bool:
    """Constant-time comparison; an empty expected token matches nothing."""
    return bool(expected) and secrets.compare_digest(given.encode(), expected.encode())


def unauthorized() -> HTTPException:
    return HTTPException(
        status_code=status.HTTP_401_UNAUTHORIZED,
        detail="missing or wrong bearer token",
        headers={"WWW-Authenticate": "Bearer"},
    )


def require_token(
    state: ServiceStateDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    given = credentials.credentials if credentials is not None else ""
    if not bearer_matches(given, state.api_token):
        raise unauthorized()


Authorized = Depends(require_token)


def metrics_response(registry: CollectorRegistry) -> Response:
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


class Stopping(BaseModel):
    status: str = "stopping"


common_router = APIRouter()


@common_router.get("/metrics", summary="Prometheus metrics")
async def metrics(state: ServiceStateDep) -> Response:
    return metrics_response(state.registry)


@common_router.post(
    "/shutdown",
    response_model=Stopping,
    dependencies=[Authorized],
    summary="Stop gracefully (work in flight is finished first)",
)
async def shutdown(state: ServiceStateDep) -> Stopping:
    state.stop.set()
    return Stopping()
