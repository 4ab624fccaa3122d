"""HTTP reward plugins: a versioned JSON protocol, retries with backoff, a concurrency limit, a breaker.

Protocol ``asyncgrpo.reward/v1`` (documented in the README, served by ``services/reward_plugin``):

    POST <url>
    {"protocol": "asyncgrpo.reward/v1",
     "items": [{"prompt": <str | chat messages>, "completion": <str | chat messages>,
                "completion_ids": [int, ...], "columns": {<name>: <value>, ...}}, ...]}
    -> 200 {"rewards": [float | null, ...], "extra": {...}}     (one reward per item, in order)

    GET <health_url>  -> 200 when the plugin can score

Transport errors, timeouts and 5xx answers are retried (tenacity, exponential backoff); 4xx answers,
malformed JSON and a wrong number of rewards are not. Every failure gives NaN for that function on that
group and is counted; after ``breaker_failures`` consecutive failures the breaker opens and calls fail fast
for ``breaker_reset_s``, then one trial call decides whether it closes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, ValidationError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from services.scorer.rewards.functions import CircuitOpenError, RewardBatch, RewardError, RewardFunction

log = logging.getLogger(__name__)

PROTOCOL = "asyncgrpo.reward/v1"


class PluginResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rewards: list[float | None]
    extra: dict[str, Any] = {}


class _Retryable(RewardError):
    pass


class CircuitBreaker:
    """Closed -> open after ``threshold`` consecutive failures -> half-open after ``reset_s`` -> closed
    on one success (or open again on a failure)."""

    def __init__(self, threshold: int, reset_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold, self.reset_s, self.clock = threshold, reset_s, clock
        self.failures = 0
        self.opened_at: float | None = None
        self.trips = 0

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if self.clock() - self.opened_at >= self.reset_s else "open"

    def allow(self) -> bool:
        return self.state != "open"

    def success(self) -> None:
        self.failures = 0
        self.opened_at = None

    def failure(self) -> None:
        self.failures += 1
        if self.state == "half_open" or (self.opened_at is None and self.failures >= self.threshold):
            self.trips += 1
            self.opened_at = self.clock()


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
    ) -> None:
        self.name, self.url, self.client = name, url, client
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.health_url = health_url or url.rsplit("/", 1)[0] + "/health"
        self.headers = headers or {}
        self.semaphore = asyncio.Semaphore(concurrency)
        self.breaker = CircuitBreaker(breaker_failures, breaker_reset_s)

    def as_function(self) -> RewardFunction:
        return RewardFunction(self.name, self.score)

    async def probe(self, attempts: int = 5, delay_s: float = 1.0) -> bool:
        """GET the health URL until it answers 200; False (and the breaker opened) if it never does."""
        for attempt in range(attempts):
            try:
                reply = await self.client.get(self.health_url, timeout=self.timeout_s, headers=self.headers)
                if reply.status_code == 200:
                    log.info("reward plugin %s is healthy at %s", self.name, self.health_url)
                    return True
                reason = f"HTTP {reply.status_code}"
            except httpx.HTTPError as exc:
                reason = f"{type(exc).__name__}: {exc}"
            if attempt + 1 < attempts:
                await asyncio.sleep(delay_s)
        log.error(
            "reward plugin %s failed its health probe (%s); its rewards are NaN until it recovers",
            self.name,
            reason,
        )
        for _ in range(self.breaker.threshold):
            self.breaker.failure()
        return False

    async def score(self, batch: RewardBatch) -> list[float | None]:
        if not self.breaker.allow():
            raise CircuitOpenError(f"{self.name}: circuit open after {self.breaker.failures} failures")
        payload = {"protocol": PROTOCOL, "items": _items(batch)}
        try:
            async with self.semaphore:
                rewards = await self._post_with_retries(payload, len(batch))
        except Exception:
            self.breaker.failure()
            raise
        self.breaker.success()
        return rewards

    async def _post_with_retries(self, payload: dict, expected: int) -> list[float | None]:
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(_Retryable),
            stop=stop_after_attempt(self.retries + 1),
            wait=wait_exponential(multiplier=self.backoff_s, max=10 * self.backoff_s),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self._post(payload, expected)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _post(self, payload: dict, expected: int) -> list[float | None]:
        try:
            reply = await self.client.post(self.url, json=payload, timeout=self.timeout_s, headers=self.headers)
        except (httpx.TransportError, httpx.TimeoutException) as exc:
            raise _Retryable(f"{self.name}: {type(exc).__name__}: {exc}") from exc
        if reply.status_code >= 500:
            raise _Retryable(f"{self.name}: HTTP {reply.status_code}")
        if reply.status_code != 200:
            raise RewardError(f"{self.name}: HTTP {reply.status_code}: {reply.text[:200]}")
        try:
            body = PluginResponse.model_validate_json(reply.content)
        except ValidationError as exc:
            raise RewardError(f"{self.name}: malformed response: {exc.errors()[0]['msg']}") from None
        if len(body.rewards) != expected:
            raise RewardError(f"{self.name}: {len(body.rewards)} rewards for {expected} items")
        return body.rewards


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
