"""HTTP resilience for calls across a process boundary: a circuit breaker, retries with backoff, and
:class:`HttpEndpoint`, the base of the reward plugins' client (and the environments' client to come).

Circuit breaker, one per endpoint (or reward function), its transitions logged at WARNING:
closed -> open after ``threshold`` consecutive failures -> half-open once ``reset_s`` has passed, when one
trial call at a time is let through -> closed on its success, open again on its failure. While a *required*
reward's breaker is not closed the scorer takes no new rollouts (see ``scoring_loop``); groups it already
holds wait for :meth:`CircuitBreaker.wait_for_change` instead of polling.

Retries, within one call: transport errors, timeouts, 5xx, 408 and 429 are retried ``retries`` times with
exponential backoff (each retry logged at DEBUG); other answers are not, since the same bytes would get the
same answer. Whatever still fails raises :class:`HttpCallError` (or the endpoint's subclass of it) with the
HTTP status and an excerpt of the body. Headers (a bearer token among them) are never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential

from shared.redaction import redact

log = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
_BODY_EXCERPT_CHARS = 200
_RETRYABLE_STATUS = frozenset({408, 429})  # besides 5xx: the server asks to be called again later
_MAX_BACKOFF_FACTOR = 10  # the longest wait between tries, in units of backoff_s
# A transition as its service logs it, and the same line found in a log file: ``asyncgrpo run`` follows its
# services' logs with it and shows each open and close on its console (services.launcher.supervisor).
_TRANSITION = "%s %s: breaker %s (%s); last error: %s"
_TRANSITION_LINE = re.compile(
    r"(?P<subject>reward|environment) (?P<name>\S+): breaker (?P<state>open|closed|half-open) "
    r"\((?P<why>[^)]*)\); last error: (?P<error>.*)$"
)


@dataclass(frozen=True)
class BreakerTransition:
    """One logged breaker transition: what it guards (``subject``, ``name``), its new state and why."""

    subject: str
    name: str
    state: str  # "open", "closed" or "half-open", as logged
    why: str
    error: str  # the last error, redacted


def breaker_transition(line: str) -> BreakerTransition | None:
    """The breaker transition ``line`` of a service's log records, or None when it records none."""
    match = _TRANSITION_LINE.search(line.rstrip("\n"))
    if match is None:
        return None
    return BreakerTransition(**{**match.groupdict(), "error": redact(match["error"])})


class CircuitOpenError(RuntimeError):
    """The breaker is open (or its half-open trial is taken): the call was not made."""


class CircuitBreaker:
    """``subject`` names what the breaker guards in its messages: ``reward judge: breaker open ...``."""

    def __init__(
        self,
        name: str,
        threshold: int,
        reset_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        subject: str = "reward",
    ) -> None:
        self.name, self.threshold, self.reset_s, self.clock = name, threshold, reset_s, clock
        self.subject = subject
        self.failures = 0  # consecutive
        self.opened_at: float | None = None
        self.trips = 0
        self.last_error = ""
        self._trial_in_flight = False
        self._announced = CLOSED  # the last state logged, so the lazy open -> half-open step is logged once
        self._changed: asyncio.Event | None = None

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return CLOSED
        return HALF_OPEN if self.clock() - self.opened_at >= self.reset_s else OPEN

    def refresh(self) -> str:
        """The state, logging the open -> half-open step the first time it is seen."""
        state = self.state
        if state == HALF_OPEN and self._announced == OPEN:
            self._announce(HALF_OPEN, "the next call is a trial")
        return state

    def seconds_until_trial(self) -> float:
        if self.opened_at is None:
            return 0.0
        return max(0.0, self.opened_at + self.reset_s - self.clock())

    def before_call(self) -> bool:
        """Admit a call (True when it is the half-open trial) or raise :class:`CircuitOpenError`."""
        state = self.refresh()
        if state == CLOSED:
            return False
        if state == HALF_OPEN and not self._trial_in_flight:
            self._trial_in_flight = True
            return True
        raise CircuitOpenError(self.describe())

    async def admit(self) -> bool:
        """:meth:`before_call`, except that while the half-open trial is in flight a call waits for its outcome
        instead of being refused: a trial that succeeds lets the waiting calls through, one that fails refuses
        them. (Callers that open several calls at once, as a prompt's G environment sessions do, would otherwise
        refuse themselves for ever: each refusal cancels the prompt, and with it the trial.)"""
        while self.refresh() == HALF_OPEN and self._trial_in_flight:
            await self.wait_for_change(self.reset_s)
        return self.before_call()

    def release_trial(self, trial: bool) -> None:
        """A call ended without an answer either way (cancelled): let another call be the trial."""
        if trial:
            self._trial_in_flight = False
            self._wake()

    def success(self, trial: bool = False) -> None:
        if trial:
            self._trial_in_flight = False
        was_open = self.opened_at is not None
        self.failures = 0
        self.opened_at = None
        if was_open:
            self._announce(CLOSED, "a call succeeded")

    def failure(self, error: str, trial: bool = False) -> None:
        if trial:
            self._trial_in_flight = False
        self.failures += 1
        self.last_error = redact(error)  # said in warnings, /ready and the scorer's "paused" line
        reopen = trial or self.state == HALF_OPEN
        if reopen or (self.opened_at is None and self.failures >= self.threshold):
            self.trips += 1
            self.opened_at = self.clock()
            self._announce(OPEN, f"{self.failures} consecutive failures; a trial call in {self.reset_s:g} s")

    def force_open(self, error: str) -> None:
        """Open now (an endpoint that failed its health probe at start)."""
        self.failures = max(self.failures, self.threshold - 1)
        self.failure(error)

    def describe(self) -> str:
        """One line for /ready and for errors: state, failures, last error."""
        state = self.state
        if state == CLOSED:
            return f"{self.subject} {self.name}: breaker closed"
        when = f"trial in {self.seconds_until_trial():.1f} s" if state == OPEN else "the next call is a trial"
        return (
            f"{self.subject} {self.name}: breaker {state.replace('_', '-')} after {self.failures} consecutive failures "
            f"({when}); last error: {self.last_error}"
        )

    async def wait_for_change(self, timeout_s: float) -> None:
        """Return at the next transition (opened, closed; half-open is seen lazily), or after ``timeout_s``."""
        if self._changed is None:
            self._changed = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout=timeout_s)

    def _wake(self) -> None:
        """Wake whoever waits in :meth:`wait_for_change` (or :meth:`admit`)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _announce(self, state: str, why: str) -> None:
        self._announced = state
        self._wake()
        log.warning(
            _TRANSITION,
            self.subject,
            self.name,
            state.replace("_", "-"),
            why,
            self.last_error or "none",
        )


class HttpCallError(RuntimeError):
    """An endpoint gave no usable answer; the message names the status and quotes the body."""

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


def is_retryable_status(status: int) -> bool:
    """5xx, 408 and 429: the server may answer the same request differently later."""
    return status >= 500 or status in _RETRYABLE_STATUS


def is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, HttpCallError) and exc.retryable


def retry_policy(retries: int, backoff_s: float, before_sleep: Callable[[RetryCallState], None]) -> AsyncRetrying:
    """``retries`` more tries of a retryable :class:`HttpCallError`, waiting ``backoff_s`` doubling (at most
    ten times ``backoff_s``); the last error is re-raised as it is."""
    return AsyncRetrying(
        retry=retry_if_exception(is_retryable),
        stop=stop_after_attempt(retries + 1),
        wait=wait_exponential(multiplier=backoff_s, max=_MAX_BACKOFF_FACTOR * backoff_s),
        before_sleep=before_sleep,
        reraise=True,
    )


T = TypeVar("T")


class HttpEndpoint:
    """One HTTP server called with retries and backoff, behind its own circuit breaker.

    ``request`` retries within one call and raises ``error_type`` when no usable answer came; ``call`` does the
    same through the breaker (it refuses with :class:`CircuitOpenError` while open and counts the outcome).
    A caller that keeps its own breaker bookkeeping (the scorer's ``run_function``) uses ``request`` and
    passes ``breaker`` on. ``headers`` (with ``Authorization: Bearer <bearer_token>`` when one is given) go
    with every request and are never logged.
    """

    error_type: ClassVar[type[HttpCallError]] = HttpCallError
    label: ClassVar[str] = "endpoint"  # what the start-up log calls it: "reward plugin judge is healthy at ..."
    wait_for_trial: ClassVar[bool] = False  # see call()

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
        bearer_token: str | None = None,
        subject: str = "endpoint",
        logger: logging.Logger | None = None,
    ) -> None:
        self.name, self.url, self.client, self.subject = name, url, client, subject
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.health_url = health_url or url.rsplit("/", 1)[0] + "/health"
        self._headers = dict(headers or {})  # may hold secrets: never logged or exported
        if bearer_token:
            self._headers["Authorization"] = f"Bearer {bearer_token}"
        self.semaphore = asyncio.Semaphore(concurrency)
        self.breaker = CircuitBreaker(name, breaker_failures, breaker_reset_s, subject=subject)
        self.log = logger or log

    async def probe(self, attempts: int = 5, delay_s: float = 1.0) -> bool:
        """GET the health URL until it answers 200; if it never does, open the breaker and return False."""
        reason = "not probed"
        for attempt in range(attempts):
            try:
                reply = await self.client.get(self.health_url, timeout=self.timeout_s, headers=self._headers)
                if reply.status_code == 200:
                    self.log.info("%s %s is healthy at %s", self.label, self.name, redact(self.health_url))
                    return True
                reason = f"HTTP {reply.status_code}; {body_excerpt(reply.text)}"
            except httpx.HTTPError as exc:
                reason = transport_detail(exc, self.timeout_s)
            if attempt + 1 < attempts:
                await asyncio.sleep(delay_s)
        self.breaker.force_open(f"health probe of {self.health_url} failed {attempts} times: {reason}")
        return False

    async def call(
        self,
        parse: Callable[[httpx.Response], T],
        *,
        url: str | None = None,
        body: bytes | None = None,
        ok: Collection[int] = (200,),
        method: str | None = None,
        context: str = "",
    ) -> T:
        """:meth:`request` through the breaker: refused while it is open, its outcome counted. With
        ``wait_for_trial`` (class attribute) a call made while the half-open trial is in flight waits for it."""
        trial = await self.breaker.admit() if self.wait_for_trial else self.breaker.before_call()
        try:
            result = await self.request(parse, url=url, body=body, ok=ok, method=method, context=context)
        except HttpCallError as exc:
            self.breaker.failure(f"{context}: {exc}" if context else str(exc), trial=trial)
            raise
        except BaseException:
            self.breaker.release_trial(trial)  # no answer either way (cancelled): another call may be the trial
            raise
        self.breaker.success(trial)
        return result

    async def request(
        self,
        parse: Callable[[httpx.Response], T],
        *,
        url: str | None = None,
        body: bytes | None = None,
        ok: Collection[int] = (200,),
        method: str | None = None,
        context: str = "",
    ) -> T:
        """POST ``body`` (GET without one; or ``method``, e.g. DELETE) to ``url`` (default: the endpoint's),
        retrying what may pass later; ``parse`` turns an ``ok`` answer into the result or raises ``error_type``
        (not retried)."""
        attempts = 0
        try:
            async for attempt in retry_policy(self.retries, self.backoff_s, lambda s: self._count_retry(s, context)):
                with attempt:
                    attempts += 1
                    return await self._attempt(parse, url or self.url, body, ok, method)
        except HttpCallError as exc:
            if attempts > 1:
                raise self.error_type(f"{exc} (after {attempts} attempts)", exc.status) from exc
            raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _attempt(
        self,
        parse: Callable[[httpx.Response], T],
        url: str,
        body: bytes | None,
        ok: Collection[int],
        method: str | None = None,
    ) -> T:
        try:
            if method is not None:
                headers = self._headers if body is None else {"Content-Type": "application/json", **self._headers}
                reply = await self.client.request(method, url, content=body, timeout=self.timeout_s, headers=headers)
            elif body is None:
                reply = await self.client.get(url, timeout=self.timeout_s, headers=self._headers)
            else:
                headers = {"Content-Type": "application/json", **self._headers}
                reply = await self.client.post(url, content=body, timeout=self.timeout_s, headers=headers)
        except httpx.HTTPError as exc:
            raise self.error_type(transport_detail(exc, self.timeout_s), retryable=True) from exc
        status = reply.status_code
        if status not in ok:
            raise self.error_type(
                f"HTTP {status}; {body_excerpt(reply.text)}", status, retryable=is_retryable_status(status)
            )
        return parse(reply)

    def _count_retry(self, state: RetryCallState, context: str) -> None:
        exc = state.outcome.exception() if state.outcome else None
        delay = state.next_action.sleep if state.next_action else 0.0
        self.on_retry(exc, state.attempt_number, delay, context)

    def on_retry(self, exc: BaseException | None, attempt: int, delay_s: float, context: str) -> None:
        """Called before each retry's wait; logs it at DEBUG (a subclass may count it too)."""
        where = f", {context}" if context else ""
        self.log.debug(
            "%s %s%s: %s; retry %d of %d in %.2f s",
            self.subject, self.name, where, exc, attempt, self.retries, delay_s,
        )  # fmt: skip
