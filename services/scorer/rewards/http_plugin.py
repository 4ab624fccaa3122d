"""HTTP reward plugins: protocol ``asyncgrpo.reward/v1`` (``shared/reward_protocol.py``), retries, auth.

    POST <url>   {"protocol": "asyncgrpo.reward/v1", "items": [{"prompt", "completion", "completion_ids",
                  "columns"}, ...]}  ->  200 {"rewards": [float | null, ...], "extra": {...}}
    GET <health_url>  -> 200 when the plugin can score (probed once at start)

Within one call, transport errors, timeouts, 5xx, 408 and 429 are retried ``retries`` times with
exponential backoff (each retry counted and logged at DEBUG); other answers are not, since the same bytes
would get the same answer. Whatever still fails raises :class:`PluginCallError` with the HTTP status and an
excerpt of the body; the caller (``functions.run_function``) counts it against the reward's breaker, and
the scoring loop holds the group back (required reward) or uses NaN (optional). ``headers`` (including a
bearer token) go with every request and are never logged.

The request is built and encoded once per group, before anything is sent, with the protocol's own model: a
group it cannot carry (a column that is not plain JSON, one named after a reward-function argument, more
items than the protocol allows) raises :class:`RewardInputError`, a bad record rather than an outage, so
the plugin's breaker and ``/ready`` are left alone.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
from pydantic import ValidationError
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential

from services.scorer.rewards.breaker import CircuitBreaker
from services.scorer.rewards.functions import RewardBatch, RewardError, RewardFunction, RewardInputError, RewardStats
from shared.reward_protocol import PROTOCOL, RewardRequest, RewardResponse

log = logging.getLogger(__name__)

_BODY_EXCERPT_CHARS = 200
_RETRYABLE_STATUS = {408, 429}  # besides 5xx: the plugin asks to be called again later


class PluginCallError(RewardError):
    """The plugin gave no usable answer; the message names the status and quotes the body."""

    def __init__(self, message: str, status: int | None = None, retryable: bool = False) -> None:
        super().__init__(message)
        self.status, self.retryable = status, retryable


def body_excerpt(text: str, limit: int = _BODY_EXCERPT_CHARS) -> str:
    """``body '...'`` with at most ``limit`` characters, or ``empty body``."""
    if not text:
        return "empty body"
    cut = text[:limit]
    return f"body {cut!r}" + (f" (first {limit} of {len(text)} chars)" if len(text) > limit else "")


def transport_detail(exc: httpx.HTTPError, timeout_s: float) -> str:
    """Never an empty ``ReadTimeout:``: httpx's timeouts usually carry no message."""
    text = str(exc).strip()
    if isinstance(exc, httpx.TimeoutException):
        return f"{type(exc).__name__}: no answer within timeout_s={timeout_s:g}" + (f" ({text})" if text else "")
    return f"{type(exc).__name__}: {text or 'no detail from httpx'}"


def parse_answer(reply: httpx.Response, expected: int) -> list[float | None]:
    """The rewards of a 200 answer, or PluginCallError saying what is wrong with it."""
    try:
        body = RewardResponse.model_validate_json(reply.content)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        problem = f"{where}: {error['msg']}" if where else error["msg"]
        raise PluginCallError(
            f"HTTP 200 with a malformed answer ({problem}); {body_excerpt(reply.text)}", reply.status_code
        ) from None
    if len(body.rewards) != expected:
        raise PluginCallError(
            f"HTTP 200 with {len(body.rewards)} rewards for {expected} items; {body_excerpt(reply.text)}", 200
        )
    return list(body.rewards)


class HttpRewardPlugin:
    def __init__(
        self,
        name: str,
        url: str,
        client: httpx.AsyncClient,
        *,
        timeout_s: float = 10.0,
        retries: int = 2,
        backoff_s: float = 0.2,
        concurrency: int = 8,
        breaker_failures: int = 5,
        breaker_reset_s: float = 30.0,
        health_url: str | None = None,
        headers: dict[str, str] | None = None,
        required: bool = True,
    ) -> None:
        self.name, self.url, self.client = name, url, client
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.health_url = health_url or url.rsplit("/", 1)[0] + "/health"
        self._headers = dict(headers or {})  # may hold secrets: never logged or exported
        self.semaphore = asyncio.Semaphore(concurrency)
        self.breaker = CircuitBreaker(name, breaker_failures, breaker_reset_s)
        self.stats = RewardStats()
        self.function = RewardFunction(name, self.score, self.stats, required=required, breaker=self.breaker)

    def as_function(self) -> RewardFunction:
        return self.function

    async def probe(self, attempts: int = 5, delay_s: float = 1.0) -> bool:
        """GET the health URL until it answers 200; if it never does, open the breaker and return False.

        The scorer still starts: it is not ready, takes no rollouts while a required plugin's breaker is
        open, and lets one rollout through as the trial once ``breaker_reset_s`` has passed.
        """
        reason = "not probed"
        for attempt in range(attempts):
            try:
                reply = await self.client.get(self.health_url, timeout=self.timeout_s, headers=self._headers)
                if reply.status_code == 200:
                    log.info("reward plugin %s is healthy at %s", self.name, self.health_url)
                    return True
                reason = f"HTTP {reply.status_code}; {body_excerpt(reply.text)}"
            except httpx.HTTPError as exc:
                reason = transport_detail(exc, self.timeout_s)
            if attempt + 1 < attempts:
                await asyncio.sleep(delay_s)
        self.breaker.force_open(f"health probe of {self.health_url} failed {attempts} times: {reason}")
        return False

    async def score(self, batch: RewardBatch) -> list[float | None]:
        body = request_body(batch)
        async with self.semaphore:
            return await self._post_with_retries(body, len(batch), batch.group_id)

    async def _post_with_retries(self, body: bytes, expected: int, group_id: str) -> list[float | None]:
        retrying = AsyncRetrying(
            retry=retry_if_exception(_is_retryable),
            stop=stop_after_attempt(self.retries + 1),
            wait=wait_exponential(multiplier=self.backoff_s, max=10 * self.backoff_s),
            before_sleep=lambda state: self._count_retry(state, group_id),
            reraise=True,
        )
        attempts = 0
        try:
            async for attempt in retrying:
                with attempt:
                    attempts += 1
                    return await self._post(body, expected)
        except PluginCallError as exc:
            if attempts > 1:
                raise PluginCallError(f"{exc} (after {attempts} attempts)", exc.status) from exc
            raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _count_retry(self, state: RetryCallState, group_id: str) -> None:
        exc = state.outcome.exception() if state.outcome else None
        status = getattr(exc, "status", None)
        if status is not None and status >= 500:
            self.stats.retried_5xx += 1
        else:
            self.stats.retried_transport += 1
        delay = state.next_action.sleep if state.next_action else 0.0
        log.debug(
            "reward %s, group %s: %s; retry %d of %d in %.2f s",
            self.name, group_id, exc, state.attempt_number, self.retries, delay,
        )  # fmt: skip

    async def _post(self, body: bytes, expected: int) -> list[float | None]:
        headers = {"Content-Type": "application/json", **self._headers}
        try:
            reply = await self.client.post(self.url, content=body, timeout=self.timeout_s, headers=headers)
        except httpx.HTTPError as exc:
            raise PluginCallError(transport_detail(exc, self.timeout_s), retryable=True) from exc
        status = reply.status_code
        if status != 200:
            raise PluginCallError(
                f"HTTP {status}; {body_excerpt(reply.text)}",
                status,
                retryable=status >= 500 or status in _RETRYABLE_STATUS,
            )
        return parse_answer(reply, expected)


def _is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, PluginCallError) and exc.retryable


def request_body(batch: RewardBatch) -> bytes:
    """The group's request as JSON bytes, checked by the protocol's model; RewardInputError saying why the
    group cannot be sent (the record's fault: retrying would send the same bytes)."""
    try:
        request = RewardRequest.model_validate({"protocol": PROTOCOL, "items": _items(batch)})
        return request.model_dump_json().encode()
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise RewardInputError(f"the group cannot be sent to the plugin: {where}: {error['msg']}") from None
    except (TypeError, ValueError) as exc:  # what serialising a value pydantic let through may raise
        raise RewardInputError(f"the group cannot be encoded as JSON: {type(exc).__name__}: {exc}") from None


def _items(batch: RewardBatch) -> list[dict[str, Any]]:
    return [
        {
            "prompt": batch.prompts[i],
            "completion": batch.completions[i],
            "completion_ids": list(batch.completion_ids[i]),
            "columns": {key: values[i] for key, values in batch.columns.items()},
        }
        for i in range(len(batch))
    ]
