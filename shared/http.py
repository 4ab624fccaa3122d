"""Pieces every service's FastAPI shell shares: bearer-token auth, ``/metrics`` and ``/shutdown``.

Control endpoints depend on :func:`require_token`; it compares in constant time and answers 401 with a
``WWW-Authenticate`` header, never echoing the token. (FastAPI is a service dependency, imported lazily by
the services; ``shared``'s wire modules do not need it.)
"""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Request, status
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel

_bearer = HTTPBearer(auto_error=False, description="The pipeline's API token (settings: api_token / API_TOKEN).")


def require_token(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    expected: str = request.app.state.api_token
    given = credentials.credentials if credentials is not None else ""
    if not expected or not secrets.compare_digest(given.encode(), expected.encode()):
        raise HTTPException(
            status_code=status.HTTP_401_UNAUTHORIZED,
            detail="missing or wrong bearer token",
            headers={"WWW-Authenticate": "Bearer"},
        )


Authorized = Depends(require_token)


def metrics_response(registry: CollectorRegistry) -> Response:
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


class Stopping(BaseModel):
    status: str = "stopping"


common_router = APIRouter()


@common_router.get("/metrics", summary="Prometheus metrics")
async def metrics(request: Request) -> Response:
    return metrics_response(request.app.state.registry)


@common_router.post(
    "/shutdown",
    response_model=Stopping,
    dependencies=[Authorized],
    summary="Stop gracefully (work in flight is finished first)",
)
async def shutdown(request: Request) -> Stopping:
    request.app.state.stop.set()
    return Stopping()
