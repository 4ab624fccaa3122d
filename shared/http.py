"""Pieces every HTTP app of the pipeline shares (the services and the reward plugin): the request guard, the
typed app state, ``/metrics`` and ``/shutdown``.

The guard (:class:`RequestGuard`, pure ASGI) runs before FastAPI reads a byte of the body: it checks the
bearer token from the headers (one case-insensitive ``Bearer`` scheme check, a constant-time compare) on
every path but the app's public probes, answering 401 with ``WWW-Authenticate: Bearer`` and never echoing the
token; then it caps the body, refusing a declared ``Content-Length`` over the limit at once and counting the
bytes as the app reads them, with 413. Request JSON is parsed strictly (:class:`FiniteJsonRoute`: ``NaN``,
``Infinity`` and numbers that overflow a float are a 422), and a 422 lists what is wrong without quoting the
input back (:func:`validation_error_response`). :func:`guarded_app` puts the three together.

Each service keeps what its routes read in one dataclass, a subclass of :class:`ServiceState`, stored once
as ``app.state.service`` and read through a typed dependency (:func:`state_dependency`), never through
ad-hoc ``app.state`` attributes. (FastAPI is a service dependency, imported lazily by the services;
``shared``'s wire modules do not need it.)
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
from collections.abc import Awaitable, Callable, Collection, MutableMapping
from dataclasses import dataclass, field
from typing import Annotated, Any, NoReturn, TypeVar

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request, status
from fastapi.datastructures import Headers
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel

# Declares the scheme in the OpenAPI document; the check itself is the guard's (and require_token's).
_bearer = HTTPBearer(auto_error=False, description="The pipeline's API token (settings: api_token / API_TOKEN).")

# ASGI's shapes (the spec's names), spelled out here rather than imported from starlette, FastAPI's internals.
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

UNAUTHORIZED_DETAIL = "missing or wrong bearer token"
# The probes a load balancer, an orchestrator or Prometheus reads without a token; every other path needs it.
PUBLIC_PROBES = frozenset({"/health", "/ready", "/metrics"})
_READ_METHODS = frozenset({"GET", "HEAD"})
# A 422 explains this many problems at most: a body of a million bad items gets a short answer, not a
# million-line one; and no problem quotes the input back (it may be megabytes, or a NaN JSON cannot carry).
MAX_REPORTED_ERRORS = 20
_MAX_CONTEXT_CHARS = 200
_MAX_MESSAGE_CHARS = 300  # a 422 message longer than this quotes input; the rest is cut


def bearer_matches(given: str, expected: str) -> bool:
    """Constant-time comparison; an empty expected token matches nothing."""
    return bool(expected) and secrets.compare_digest(given.encode(), expected.encode())


def authorized(authorization: str | None, expected: str) -> bool:
    """Whether an ``Authorization`` header carries ``expected``: the scheme ``Bearer`` in any case (RFC 7235),
    then the credentials compared in constant time. The one check of every app."""
    scheme, _, given = (authorization or "").strip().partition(" ")
    return scheme.lower() == "bearer" and bearer_matches(given.strip(), expected)


def unauthorized() -> HTTPException:
    return HTTPException(
        status_code=status.HTTP_401_UNAUTHORIZED,
        detail=UNAUTHORIZED_DETAIL,
        headers={"WWW-Authenticate": "Bearer"},
    )


class BodyTooLarge(HTTPException):
    """Raised by the guard's ``receive`` once the body passes the limit; FastAPI answers it as a 413."""

    def __init__(self, limit: int, setting: str) -> None:
        detail = f"the request body is over {limit} bytes; this service's limit is its {setting} setting"
        super().__init__(status.HTTP_413_CONTENT_TOO_LARGE, detail)


class RequestGuard:
    """Pure ASGI middleware: authorise from the headers, then cap the body while it streams in.

    ``token=None`` opens every path (the reward plugin's explicit ``--allow-no-token``); an empty token
    opens none but the public ones. ``public``: paths a GET or HEAD reaches without the token."""

    def __init__(
        self, app: ASGIApp, *, token: str | None, public: Collection[str], max_body_bytes: int, setting: str
    ) -> None:
        self.app, self.token, self.public = app, token, frozenset(public)
        self.max_body_bytes, self.setting = max_body_bytes, setting

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan; the apps serve no websockets
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if not self._allowed(scope, headers):
            await _send_json(send, 401, {"detail": UNAUTHORIZED_DETAIL}, {"www-authenticate": "Bearer"})
            return
        too_large = BodyTooLarge(self.max_body_bytes, self.setting)
        if _declared_length(headers) > self.max_body_bytes:
            await _send_json(send, too_large.status_code, {"detail": too_large.detail})
            return
        await self._limited(scope, receive, send, too_large)

    def _allowed(self, scope: Scope, headers: Headers) -> bool:
        if self.token is None or (scope["method"] in _READ_METHODS and scope["path"] in self.public):
            return True
        return authorized(headers.get("authorization"), self.token)

    async def _limited(self, scope: Scope, receive: Receive, send: Send, too_large: BodyTooLarge) -> None:
        """Run the app with a ``receive`` that raises ``too_large`` past the limit (FastAPI answers it 413;
        a route reading the body itself is answered here, unless its response has started)."""
        received, started = 0, False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise too_large
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except BodyTooLarge:
            if started:
                raise
            await _send_json(send, too_large.status_code, {"detail": too_large.detail})


def _declared_length(headers: Headers) -> int:
    """The ``Content-Length`` header's value, 0 without one (the server refuses a malformed one first)."""
    value = headers.get("content-length", "")
    return int(value) if value.isdigit() else 0


async def _send_json(send: Send, code: int, content: dict[str, Any], headers: dict[str, str] | None = None) -> None:
    body = json.dumps(content).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(name.encode(), value.encode()) for name, value in (headers or {}).items()]
    await send({"type": "http.response.start", "status": code, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class _NotFinite(ValueError):
    pass


def _no_constant(name: str) -> NoReturn:
    raise _NotFinite(name)


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):  # 1e999 overflows to inf
        raise _NotFinite(literal[:40])
    return value


def loads_finite(body: bytes | str) -> Any:
    """``json.loads`` without Python's extensions: ``NaN``, ``Infinity`` and overflowing numbers raise
    ``json.JSONDecodeError`` (FastAPI answers it 422), as RFC 8259 has no such numbers."""
    try:
        return json.loads(body, parse_constant=_no_constant, parse_float=_finite_float)
    except _NotFinite as exc:
        raise json.JSONDecodeError(f"{exc} is not a finite number", "", 0) from None


class _FiniteJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads_finite(await self.body())
        return self._json


class FiniteJsonRoute(APIRoute):
    """A route whose JSON body is parsed by :func:`loads_finite`. Every router of a guarded app uses it
    (``APIRouter(route_class=FiniteJsonRoute)``; :func:`check_routes` enforces it)."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def finite(request: Request) -> Response:
            return await handler(_FiniteJsonRequest(request.scope, request.receive))

        return finite


def check_routes(app: FastAPI) -> None:
    """TypeError naming every API route of ``app`` that is not a :class:`FiniteJsonRoute`."""
    loose = [r.path for r in app.routes if isinstance(r, APIRoute) and not isinstance(r, FiniteJsonRoute)]
    if loose:
        raise TypeError(f"routes {loose} parse JSON leniently: build their router with route_class=FiniteJsonRoute")


async def validation_error_response(request: Request, exc: Exception) -> JSONResponse:
    """422 with each problem's type, location and message (the first :data:`MAX_REPORTED_ERRORS`), never
    the input itself."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    detail = [_problem(error) for error in errors[:MAX_REPORTED_ERRORS]]
    content: dict[str, Any] = {"detail": detail}
    if len(errors) > MAX_REPORTED_ERRORS:
        content["more_errors"] = len(errors) - MAX_REPORTED_ERRORS
    return JSONResponse(content, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)


def _problem(error: Any) -> dict[str, Any]:
    # A message may quote the input (a discriminated union's "Input tag '...'"): cut like the context.
    message = str(error.get("msg", ""))
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[:_MAX_MESSAGE_CHARS] + "..."
    problem = {"type": error.get("type"), "loc": [str(part) for part in error.get("loc", ())], "msg": message}
    if error.get("ctx"):
        problem["ctx"] = {key: str(value)[:_MAX_CONTEXT_CHARS] for key, value in error["ctx"].items()}
    return problem


def guarded_app(
    *,
    title: str,
    description: str,
    token: str | None,
    public: Collection[str],
    max_request_bytes: int,
    limit_setting: str,
    api_docs: bool,
) -> FastAPI:
    """A FastAPI app behind :class:`RequestGuard`, with strict JSON and short 422s. ``/docs``, ``/redoc`` and
    ``/openapi.json`` exist only with ``api_docs`` (and need the token like any non-public path)."""
    docs: dict[str, Any] = {} if api_docs else {"openapi_url": None, "docs_url": None, "redoc_url": None}
    app = FastAPI(title=title, description=description, **docs)
    app.router.route_class = FiniteJsonRoute
    app.add_exception_handler(RequestValidationError, validation_error_response)
    app.add_middleware(
        RequestGuard, token=token, public=public, max_body_bytes=max_request_bytes, setting=limit_setting
    )
    return app


@dataclass(kw_only=True)
class ServiceState:
    """What every service's routes read: its API token and HTTP limits, its metrics and the event that stops
    it. ``max_request_bytes`` and ``api_docs`` come from the service's settings of those names."""

    api_token: str
    max_request_bytes: int
    api_docs: bool = False
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    prometheus: CollectorRegistry = field(default_factory=CollectorRegistry)


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


def require_token(request: Request, state: ServiceStateDep, _: Annotated[Any, Depends(_bearer)]) -> None:
    """The guard's check again, on the routes that declare it (they show the scheme in the OpenAPI document)."""
    if not authorized(request.headers.get("authorization"), state.api_token):
        raise unauthorized()


Authorized = Depends(require_token)


def metrics_response(prometheus: CollectorRegistry) -> Response:
    return Response(generate_latest(prometheus), media_type=CONTENT_TYPE_LATEST)


class Stopping(BaseModel):
    status: str = "stopping"


common_router = APIRouter(route_class=FiniteJsonRoute)


@common_router.get("/metrics", summary="Prometheus metrics")
async def metrics(state: ServiceStateDep) -> Response:
    return metrics_response(state.prometheus)


@common_router.post(
    "/shutdown",
    response_model=Stopping,
    dependencies=[Authorized],
    summary="Stop gracefully (work in flight is finished first)",
)
async def shutdown(state: ServiceStateDep) -> Stopping:
    state.stop.set()
    return Stopping()
