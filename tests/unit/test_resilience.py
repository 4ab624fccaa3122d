"""``shared.resilience.HttpEndpoint`` against a real local HTTP server: retries with backoff on 5xx, none on
4xx, the breaker opening after N failed calls, refusing without a request, and closing on a half-open trial.

The server is the standard library's, on a free port in a thread; it answers from a script of statuses and
records every request's path and Authorization header.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from shared.resilience import CircuitBreaker, CircuitOpenError, HttpCallError, HttpEndpoint


class _Script:
    """Statuses to answer, in order (the last one repeats), and the requests seen."""

    def __init__(self) -> None:
        self.statuses: list[int] = [200]
        self.seen: list[tuple[str, str | None]] = []

    def next_status(self) -> int:
        return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]


@pytest.fixture
def server() -> Iterator[tuple[str, _Script]]:
    script = _Script()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            script.seen.append((self.path, self.headers.get("Authorization")))
            status = script.next_status()
            body = b'{"ok": true}' if status == 200 else b"busy"
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # keep the test output clean
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/call", script
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


class _Counting(HttpEndpoint):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.retries_seen: list[tuple[int | None, int, float]] = []

    def on_retry(self, exc, attempt, delay_s, context) -> None:
        self.retries_seen.append((getattr(exc, "status", None), attempt, delay_s))
        super().on_retry(exc, attempt, delay_s, context)


def _json(reply: httpx.Response) -> dict:
    return reply.json()


async def test_5xx_twice_then_200_succeeds_after_two_backed_off_retries(server):
    url, script = server
    script.statuses = [503, 503, 200]
    async with httpx.AsyncClient() as client:
        endpoint = _Counting("env", url, client, retries=2, backoff_s=0.01, bearer_token="s3cret")
        assert await endpoint.call(_json, body=b"{}") == {"ok": True}
    assert [(status, attempt) for status, attempt, _ in endpoint.retries_seen] == [(503, 1), (503, 2)]
    delays = [delay for _, _, delay in endpoint.retries_seen]
    assert delays[1] >= delays[0] > 0  # exponential backoff
    assert script.seen == [("/call", "Bearer s3cret")] * 3
    assert endpoint.breaker.state == "closed" and endpoint.breaker.failures == 0


async def test_4xx_is_not_retried_and_quotes_the_body(server):
    url, script = server
    script.statuses = [404]
    async with httpx.AsyncClient() as client:
        endpoint = _Counting("env", url, client, retries=3, backoff_s=0.01)
        with pytest.raises(HttpCallError, match=r"^HTTP 404; body 'busy'$") as caught:
            await endpoint.request(_json, body=b"{}")
    assert caught.value.status == 404 and not endpoint.retries_seen and len(script.seen) == 1


async def test_breaker_opens_after_n_failed_calls_refuses_then_a_trial_closes_it(server):
    url, script = server
    script.statuses = [503]
    async with httpx.AsyncClient() as client:
        endpoint = HttpEndpoint(
            "env",
            url,
            client,
            retries=1,
            backoff_s=0.01,
            breaker_failures=2,
            breaker_reset_s=0.2,
            subject="environment",
        )
        for _ in range(2):
            with pytest.raises(HttpCallError, match=r"HTTP 503; body 'busy' \(after 2 attempts\)"):
                await endpoint.call(_json, body=b"{}", context="session s1")
        assert endpoint.breaker.state == "open" and len(script.seen) == 4
        with pytest.raises(CircuitOpenError, match=r"environment env: breaker open after 2 consecutive failures"):
            await endpoint.call(_json, body=b"{}")
        assert len(script.seen) == 4  # refused without a request
        assert "session s1: HTTP 503" in endpoint.breaker.last_error

        await asyncio.sleep(endpoint.breaker.seconds_until_trial() + 0.01)
        assert endpoint.breaker.refresh() == "half_open"
        script.statuses = [200]
        assert await endpoint.call(_json, body=b"{}") == {"ok": True}
    assert endpoint.breaker.state == "closed" and endpoint.breaker.trips == 1


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("trial_succeeds", [True, False])
async def test_calls_made_while_the_half_open_trial_is_in_flight_wait_for_its_outcome(trial_succeeds):
    """A prompt opens its G environment sessions at once: if the G-1 that are not the trial were refused, each
    refusal would cancel the prompt and its trial, and the breaker would never close (found by the multi-turn
    fault test)."""
    clock = _Clock()
    breaker = CircuitBreaker("env", threshold=1, reset_s=5.0, clock=clock, subject="environment")
    breaker.failure("down")
    clock.now = 5.0  # half-open
    trial_done = asyncio.Event()

    async def caller(first: bool) -> str:
        try:
            trial = await breaker.admit()
        except CircuitOpenError:
            return "refused"
        if first:
            assert trial
            await trial_done.wait()
            if trial_succeeds:
                breaker.success(trial)
            else:
                breaker.failure("still down", trial)
        else:
            assert not trial
        return "called"

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(caller(i == 0)) for i in range(4)]
        await asyncio.sleep(0.01)
        assert not any(t.done() for t in tasks)  # the three others wait instead of being refused
        trial_done.set()
    outcomes = [t.result() for t in tasks]
    assert outcomes == (["called"] * 4 if trial_succeeds else ["called", "refused", "refused", "refused"])


async def test_a_cancelled_trial_lets_a_waiting_call_become_the_trial():
    clock = _Clock()
    breaker = CircuitBreaker("env", threshold=1, reset_s=5.0, clock=clock)
    breaker.failure("down")
    clock.now = 5.0
    assert await breaker.admit() is True  # the trial, then cancelled without a verdict
    waiting = asyncio.create_task(breaker.admit())
    await asyncio.sleep(0.01)
    assert not waiting.done()
    breaker.release_trial(True)
    assert await asyncio.wait_for(waiting, 1) is True
