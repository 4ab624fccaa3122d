"""The environment server's app: any in-process :class:`~environments.session.Environment` (a TRL class or tool
functions, ``environments/python_env.py``) served over HTTP, protocol ``asyncgrpo.env/v1``
(``environments/protocol.py``, which lists the routes). ``python -m services.env_server`` runs it.

Exactly once under the client's retries:

- a create whose ``session_key`` is live closes that session first, so a retried create (or a redelivered
  prompt) leaves exactly one live session per key;
- each session keeps its last step's response: a step retried with the same index is answered from it, never
  run twice (stateful tools); a step that is neither the last index nor the next is a 409;
- a session with no request for ``session_idle_ttl_s`` is closed (what a SIGKILLed generator left open);
- at most ``max_sessions`` are open (or opening) at once: a create past it is a 429, counted in
  ``GET /sessions/count`` (``refused``), so the memory sessions hold is bounded whoever holds the token (a
  create that replaces a live session of its key takes no new place).

An :class:`~environments.session.EnvFault` (a timeout, an exception in ``reset`` or ``get_reward``) answers 500
with the reason; a step or reward that faulted closes its session, so a retry of it gets 404 (a fault too).
Every path but ``GET /health`` needs the bearer token (:class:`shared.http.RequestGuard`), ``GET
/sessions/count`` among them: the open sessions, which return to 0 when every generator has closed its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, HTTPException, Response, status

from environments.protocol import (
    PROTOCOL,
    CreateSession,
    CreateSessionResponse,
    Health,
    RewardResponse,
    Step,
    StepResponse,
    json_schema,
)
from environments.session import EnvFault, Environment, Session
from shared.http import check_routes, guarded_app

log = logging.getLogger("environments.server")

PUBLIC_PATHS = frozenset({"/health"})
_REAP_EVERY_S = 5.0  # at most; a short TTL is checked four times per TTL


@dataclass
class LiveSession:
    """One open session and what exactly-once needs: its last step index and response, and a lock."""

    session_id: str
    key: str
    session: Session
    stack: contextlib.AsyncExitStack
    last_used: float
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_step: int = -1
    last_response: StepResponse | None = None


class SessionTable:
    """The open sessions by id and by key; every method runs on the event loop."""

    def __init__(
        self,
        environment: Environment,
        idle_ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_sessions: int,
    ):
        self.environment, self.idle_ttl_s, self.clock = environment, idle_ttl_s, clock
        self.max_sessions = max_sessions
        self.by_id: dict[str, LiveSession] = {}
        self.by_key: dict[str, str] = {}
        self.reaped = 0
        self.refused = 0  # creates past max_sessions (429)
        self.opening = 0  # creates between their check and their session's entry in by_id

    def __len__(self) -> int:
        return len(self.by_id)

    async def create(self, key: str, row: dict[str, Any]) -> LiveSession:
        """Open a session for ``key``, closing the live one of that key (before and, for a concurrent twin,
        after opening); a 429 when ``max_sessions`` are open or opening."""
        await self._close_key(key, "replaced by a new create with the same session_key")
        if len(self.by_id) + self.opening >= self.max_sessions:
            self.refused += 1
            log.warning("refused a session: %d open or opening, max_sessions=%d", len(self.by_id), self.max_sessions)
            raise HTTPException(
                status.HTTP_429_TOO_MANY_REQUESTS,
                f"{len(self.by_id) + self.opening} sessions are open or opening, the server's max_sessions "
                f"({self.max_sessions}): close finished ones (DELETE /sessions/<id>) or raise --max-sessions",
            )
        self.opening += 1
        try:
            stack = contextlib.AsyncExitStack()
            session = await stack.enter_async_context(self.environment.session(row, key))
        finally:
            self.opening -= 1
        await self._close_key(key, "replaced by a concurrent create with the same session_key")
        live = LiveSession(uuid.uuid4().hex, key, session, stack, self.clock())
        self.by_id[live.session_id] = live
        self.by_key[key] = live.session_id
        return live

    def get(self, session_id: str) -> LiveSession:
        live = self.by_id.get(session_id)
        if live is None:
            raise HTTPException(
                status.HTTP_404_NOT_FOUND,
                f"no open session {session_id!r}: closed, replaced by a create with its key, faulted, or reclaimed "
                f"after session_idle_ttl_s={self.idle_ttl_s:g} idle",
            )
        live.last_used = self.clock()
        return live

    async def step(self, live: LiveSession, step: Step) -> StepResponse:
        """Run ``step`` once; its retry (same index) gets the stored response."""
        async with live.lock:
            if step.step == live.last_step and live.last_response is not None:
                return live.last_response
            if step.step != live.last_step + 1:
                raise HTTPException(
                    status.HTTP_409_CONFLICT,
                    f"step {step.step} is out of order: the session's next step is {live.last_step + 1} "
                    f"(or {live.last_step} again, answered from the stored response)",
                )
            response = await self._run(live, live.session.step(step.tool_calls))
            live.last_step, live.last_response = step.step, response
            return response

    async def reward(self, live: LiveSession) -> float | None:
        async with live.lock:
            return await self._run(live, live.session.reward())

    async def _run(self, live: LiveSession, call: Any) -> Any:
        try:
            return await call
        except EnvFault as exc:
            await self.close(live.session_id, f"faulted: {exc.reason}")
            raise
        finally:
            live.last_used = self.clock()

    async def close(self, session_id: str, why: str) -> bool:
        """Close one session (the environment's close never raises); False when it was not open."""
        live = self.by_id.pop(session_id, None)
        if live is None:
            return False
        if self.by_key.get(live.key) == session_id:
            del self.by_key[live.key]
        log.debug("session %s (%s) closed: %s", session_id, live.key, why)
        await live.stack.aclose()
        return True

    async def _close_key(self, key: str, why: str) -> None:
        session_id = self.by_key.get(key)
        if session_id is not None:
            await self.close(session_id, why)

    async def reap_idle(self) -> int:
        """Close every session idle past the TTL (not one busy in a step); how many were closed."""
        now = self.clock()
        idle = [
            live.session_id
            for live in self.by_id.values()
            if now - live.last_used > self.idle_ttl_s and not live.lock.locked()
        ]
        for session_id in idle:
            await self.close(session_id, f"idle for more than session_idle_ttl_s={self.idle_ttl_s:g}")
        if idle:
            self.reaped += len(idle)
            log.info("closed %d sessions idle for more than %g s (%d open)", len(idle), self.idle_ttl_s, len(self))
        return len(idle)

    async def close_all(self) -> None:
        for session_id in list(self.by_id):
            await self.close(session_id, "the server is stopping")

    async def reap_forever(self) -> None:
        period = min(_REAP_EVERY_S, self.idle_ttl_s / 4)
        while True:
            await asyncio.sleep(period)
            await self.reap_idle()


def fault_response(exc: EnvFault) -> HTTPException:
    return HTTPException(status.HTTP_500_INTERNAL_SERVER_ERROR, f"environment fault: {exc.reason}")


def build_app(
    environment: Environment,
    *,
    token: str,
    session_idle_ttl_s: float,
    max_request_bytes: int,
    max_sessions: int,
    api_docs: bool = False,
) -> FastAPI:
    """The server app around ``environment`` (the app closes it at shutdown); every path but ``/health`` needs
    ``token``."""
    app = guarded_app(
        title=f"asyncgrpo environment server: {environment.name}",
        description=__doc__ or "",
        token=token,
        public=PUBLIC_PATHS,
        max_request_bytes=max_request_bytes,
        limit_setting="--max-request-bytes",
        api_docs=api_docs,
    )
    table = SessionTable(environment, session_idle_ttl_s, max_sessions=max_sessions)
    app.state.sessions = table
    app.router.lifespan_context = _lifespan(table)
    _routes(app, table)
    check_routes(app)
    return app


def _lifespan(table: SessionTable) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        reaper = asyncio.create_task(table.reap_forever())
        try:
            yield
        finally:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
            await table.close_all()
            await table.environment.aclose()

    return lifespan


def _routes(app: FastAPI, table: SessionTable) -> None:
    schema = json_schema()  # equal to the committed shared/schemas/env_v1.json (tested)

    @app.get("/health", response_model=Health, summary="200 while the server runs")
    async def health() -> Health:
        return Health(status="ok", protocol=PROTOCOL)

    @app.get("/schema", summary="The protocol's JSON Schema (asyncgrpo.env/v1)")
    async def get_schema() -> dict[str, Any]:
        return schema

    @app.get("/sessions/count", summary="Open sessions")
    async def count() -> dict[str, int]:
        return {"open": len(table), "reaped": table.reaped, "refused": table.refused}

    @app.post("/sessions", status_code=201, response_model=CreateSessionResponse, summary="Open a session (reset)")
    async def create(request: CreateSession) -> CreateSessionResponse:
        try:
            live = await table.create(request.session_key, request.row)
        except EnvFault as exc:
            raise fault_response(exc) from None
        tools = list(live.session.tools)
        return CreateSessionResponse.model_validate(
            {"session_id": live.session_id, "observation": live.session.observation, "tools": tools}
        )

    @app.post("/sessions/{session_id}/step", response_model=StepResponse, summary="Run one turn's tool calls")
    async def step(session_id: str, request: Step) -> StepResponse:
        try:
            return await table.step(table.get(session_id), request)
        except EnvFault as exc:
            raise fault_response(exc) from None

    @app.post("/sessions/{session_id}/reward", response_model=RewardResponse, summary="get_reward()")
    async def reward(session_id: str) -> RewardResponse:
        try:
            return RewardResponse(reward=await table.reward(table.get(session_id)))
        except EnvFault as exc:
            raise fault_response(exc) from None

    @app.delete("/sessions/{session_id}", status_code=204, summary="Close a session (404: already closed)")
    async def close(session_id: str) -> Response:
        if not await table.close(session_id, "closed by the client"):
            table.get(session_id)  # raises the 404, which the client counts as closed
        return Response(status_code=204)
