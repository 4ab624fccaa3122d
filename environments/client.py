"""An environment server called over HTTP, protocol ``asyncgrpo.env/v1`` (``environments/protocol.py``): the
generator's half of the protocol, ``environments/server.py`` (or any server in any language) the other.

Every call goes through :class:`shared.resilience.HttpEndpoint`: ``timeout_s`` per attempt; transport errors,
timeouts, 5xx, 408 and 429 retried ``retries`` times with exponential backoff (each retry counted in
``stats.calls["retried"]``); one breaker per environment, open after ``breaker_failures`` consecutive failed
calls, refusing calls (and :meth:`HttpEnvironment.accepting` false) until a half-open trial succeeds. Whatever
still fails, or answers something that is not the protocol, is an :class:`~environments.session.EnvFault`.

Retries are safe: a create carries the session key (the server replaces a live session of that key), and a step
carries its index (the server answers a repeated index from the stored response, never running it twice).
``DELETE`` closes on every path, outside the breaker (closing is worth trying even while it is open); 404
counts as closed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, ClassVar, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from environments.protocol import (
    PROTOCOL,
    CreateSession,
    CreateSessionResponse,
    RewardResponse,
    Step,
    StepResponse,
    ToolCallIn,
    ToolSchema,
)
from environments.session import EnvFault, EnvStats, close_with_retries, timed
from shared.resilience import OPEN, CircuitOpenError, HttpCallError, HttpEndpoint, body_excerpt

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


class EnvCallError(HttpCallError):
    """The environment server gave no usable answer; the message names the status and quotes the body."""


def parse_body(model: type[M]) -> Callable[[httpx.Response], M]:
    """A parser of an ``ok`` answer into ``model``; EnvCallError (not retried) when it is not the protocol."""

    def parse(reply: httpx.Response) -> M:
        try:
            return model.model_validate_json(reply.content)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            raise EnvCallError(
                f"HTTP {reply.status_code} with a malformed {model.__name__} ({where}: {error['msg']}); "
                f"{body_excerpt(reply.text)}",
                reply.status_code,
            ) from None

    return parse


def schema_dict(tool: ToolSchema) -> dict[str, Any]:
    """A tool as ``get_json_schema`` writes it (``return`` only when the server gave one)."""
    function = tool.function.model_dump(by_alias=True)
    if function.get("return") is None:
        function.pop("return", None)
    return {"type": tool.type, "function": function}


def create_body(row: dict[str, Any], key: str) -> bytes:
    """The create request; EnvFault when the row cannot be sent (not plain JSON, no 'prompt')."""
    try:
        return CreateSession(protocol=PROTOCOL, session_key=key, row=row).model_dump_json().encode()
    except (ValidationError, TypeError, ValueError) as exc:
        raise EnvFault(f"create {key}: the row cannot be sent to the environment server: {exc}") from None


class HttpSession:
    """One session on the server: steps numbered 0, 1, ... here, each retried under the same index."""

    def __init__(self, environment: HttpEnvironment, created: CreateSessionResponse, latencies: list[float]) -> None:
        self.environment, self.session_id = environment, created.session_id
        self.observation = created.observation
        self.tools = tuple(schema_dict(tool) for tool in created.tools)
        self.latencies_s = latencies
        self.steps = 0

    @property
    def url(self) -> str:
        return f"{self.environment.url}/sessions/{self.session_id}"

    async def step(self, calls: Sequence[ToolCallIn]) -> StepResponse:
        step = Step(protocol=PROTOCOL, step=self.steps, tool_calls=list(calls))
        body = step.model_dump_json().encode()
        context = f"session {self.session_id} step {self.steps}"
        response = await timed(
            self.latencies_s, self.environment.checked(parse_body(StepResponse), f"{self.url}/step", body, context)
        )
        try:
            response.check_answers(step)
        except ValueError as exc:
            self.environment.stats.calls["fault"] += 1
            raise EnvFault(f"{context}: {exc}") from None
        self.steps += 1
        self.environment.stats.count_results(response)
        return response

    async def reward(self) -> float | None:
        context = f"session {self.session_id} reward"
        answer = await timed(
            self.latencies_s, self.environment.checked(parse_body(RewardResponse), f"{self.url}/reward", b"{}", context)
        )
        return answer.reward


class HttpEnvironment(HttpEndpoint):
    """An :class:`~environments.session.Environment` served over HTTP. ``url`` is the server's base URL; the
    ``client`` is owned (closed by :meth:`aclose`) when ``owns_client``."""

    error_type = EnvCallError
    label: ClassVar[str] = "environment server"
    wait_for_trial: ClassVar[bool] = True  # a prompt's G sessions open at once: the others wait for a trial

    def __init__(self, url: str, client: httpx.AsyncClient, *, owns_client: bool = False, **endpoint: Any) -> None:
        base = url.rstrip("/")
        super().__init__(base, base, client, subject="environment", logger=log, health_url=f"{base}/health", **endpoint)
        self.stats = EnvStats()
        self._owns_client = owns_client

    def tool_schemas(self) -> None:
        return None  # the server says, per session

    async def checked(self, parse: Callable[[httpx.Response], M], url: str, body: bytes, context: str, ok=(200,)) -> M:
        """POST through the breaker; EnvFault for whatever gives no usable answer (counted as a fault)."""
        try:
            async with self.semaphore:
                answer = await self.call(parse, url=url, body=body, ok=ok, context=context)
        except (HttpCallError, CircuitOpenError) as exc:
            self.stats.calls["fault"] += 1
            raise EnvFault(f"{context}: {exc}") from exc
        self.stats.calls["ok"] += 1
        return answer

    @contextlib.asynccontextmanager
    async def session(self, row: dict[str, Any], key: str) -> AsyncIterator[HttpSession]:
        """POST /sessions on enter; DELETE on exit, on every path (a failed close is counted, never raised)."""
        latencies: list[float] = []
        body = create_body(row, key)
        created = await timed(
            latencies,
            self.checked(parse_body(CreateSessionResponse), f"{self.url}/sessions", body, f"create {key}", (201,)),
        )
        self.stats.sessions_opened += 1
        session = HttpSession(self, created, latencies)
        try:
            yield session
        finally:
            await close_with_retries(lambda: self._delete(session), self.stats, f"session {key}", log)

    async def _delete(self, session: HttpSession) -> None:
        await self.request(
            lambda reply: None, url=session.url, ok=(204, 404), method="DELETE", context=f"close {session.session_id}"
        )

    def accepting(self) -> bool:
        return self.breaker.refresh() != OPEN

    def describe(self) -> str:
        return self.breaker.describe()

    def on_retry(self, exc: BaseException | None, attempt: int, delay_s: float, context: str) -> None:
        self.stats.calls["retried"] += 1
        super().on_retry(exc, attempt, delay_s, context)

    async def aclose(self) -> None:
        if self._owns_client:
            await self.client.aclose()
