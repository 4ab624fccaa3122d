"""Hostile input against the real servers (uvicorn, each in a process of its own, measured from outside):
a request without the right token is refused before its body is read, whatever the body; a body past the
limit gets 413 while it streams in; a NaN is a 422; no answer quotes the input or is a 500. And no service,
nor the reward plugin, starts with a placeholder or a short token.

The generator, scorer and learner serve their real apps over hand-written states
(``tests/support/guarded_server.py``); the reward plugin is its real command line."""

from __future__ import annotations

import functools
import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.processes import ROOT, ServiceProcess, start_service, wait_http_ok
from tests.support.redis_server import free_port

pytestmark = pytest.mark.integration

TOKEN = secrets.token_urlsafe(32)
LIMIT = 1 << 20  # each server's max_request_bytes here: the attack's 50 MB is far past it
HOSTILE_BYTES = 50 << 20  # the attacker's body
MAX_GROWTH = 50 << 20  # a refused request may not cost the server this much memory
# Each server's endpoint that takes a body (the scorer and learner take none: /shutdown is their one POST).
BODY_ROUTES = {"generator": "/generate", "reward_plugin": "/score"}
ROUTES = {**BODY_ROUTES, "scorer": "/shutdown", "learner": "/shutdown"}
WRONG = ("Bearer wrong", f"Bearer {TOKEN[:-1]}", f"bearer {TOKEN[:-1]}", f"Basic {TOKEN}", TOKEN, f"Bearer{TOKEN}")


@pytest.fixture(scope="module")
def servers():
    """The four servers, started together."""
    started: dict[str, ServiceProcess] = {}
    try:
        for name in ("generator", "scorer", "learner"):
            port = free_port()
            args = [name, str(port), str(LIMIT)]
            started[name] = start_service(name, "tests.support.guarded_server", {"GUARD_TOKEN": TOKEN}, args)
            started[name].port = port
        port = free_port()
        args = ["--port", str(port), "--max-request-bytes", str(LIMIT)]
        started["reward_plugin"] = start_service(
            "reward_plugin", "services.reward_plugin", {"PLUGIN_TOKEN": TOKEN}, args
        )
        started["reward_plugin"].port = port
        for service in started.values():
            wait_http_ok(f"{service.url}/health", 60)
        yield started
    finally:
        for service in started.values():
            service.stop()


@functools.cache
def _hostile_body() -> bytes:
    """50 MB of JSON no route accepts, with a NaN in it: what the attacker sent."""
    return b'{"protocol": NaN, "prompts": [' + b'"x",' * (HOSTILE_BYTES // 4) + b'"x"]}'


def _post(service: ServiceProcess, path: str, body, authorization: str | None = None) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if authorization is not None:
        headers["authorization"] = authorization
    return httpx.post(f"{service.url}{path}", content=body, headers=headers, timeout=120)


def _peak_rss_since_reset(service: ServiceProcess) -> int:
    """The server's peak resident memory (VmHWM) after resetting it to the current RSS: what reading a body
    would cost at its worst, which the RSS after the request (memory given back) does not show."""
    pid = service.process.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # 5: reset the peak RSS to the current RSS (Linux 4.0)
    return psutil.Process(pid).memory_info().rss


def _peak_rss(service: ServiceProcess) -> int:
    status = Path(f"/proc/{service.process.pid}/status").read_text()
    [line] = [line for line in status.splitlines() if line.startswith("VmHWM:")]
    return int(line.split()[1]) * 1024


@pytest.mark.parametrize("name", list(ROUTES))
def test_a_request_without_the_token_is_refused_before_its_body_is_read(servers, name):
    service, path = servers[name], ROUTES[name]
    before = _peak_rss_since_reset(service)
    for authorization in (None, *WRONG):
        reply = _post(service, path, _hostile_body(), authorization)
        assert reply.status_code == 401, (authorization, reply.status_code, reply.text[:300])
        assert reply.headers["www-authenticate"] == "Bearer" and reply.json() == {
            "detail": "missing or wrong bearer token"
        }
    grown = _peak_rss(service) - before
    assert grown < MAX_GROWTH, f"{name} peaked {grown >> 20} MiB higher refusing {len(WRONG) + 1} requests"


@pytest.mark.parametrize("name", list(ROUTES))
def test_the_401_comes_before_the_body_is_sent(servers, name):
    """Headers and the first 64 KiB of a 50 MB body: a server that reads the body before the token would wait
    for the rest; ours answers 401 at once."""
    head = (
        f"POST {ROUTES[name]} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {HOSTILE_BYTES}\r\nAuthorization: Bearer wrong\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", servers[name].port), timeout=10) as connection:
        connection.sendall(head + _hostile_body()[: 64 << 10])
        answer = connection.recv(4096)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]


@pytest.mark.parametrize("name", list(ROUTES))
def test_a_body_past_the_limit_gets_413_as_it_streams_in(servers, name):
    service, path = servers[name], ROUTES[name]
    authorization = f"Bearer {TOKEN}"
    before = _peak_rss_since_reset(service)
    declared = _post(service, path, _hostile_body(), authorization)  # Content-Length: refused before reading
    assert declared.status_code == 413, declared.text[:300]
    setting = "--max-request-bytes" if name == "reward_plugin" else "max_request_bytes setting"
    assert f"over {LIMIT} bytes" in declared.json()["detail"] and setting in declared.json()["detail"]
    if name in BODY_ROUTES:  # chunked, no Content-Length: counted as the route reads it

        def chunks():
            for _ in range(HOSTILE_BYTES >> 20):
                yield b" " * (1 << 20)

        streamed = _post(service, path, chunks(), authorization)
        assert streamed.status_code == 413, streamed.text[:300]
    grown = _peak_rss(service) - before
    assert grown < MAX_GROWTH, f"{name} peaked {grown >> 20} MiB higher refusing bodies past {LIMIT} bytes"
    assert httpx.get(f"{service.url}/health").status_code == 200  # still serving (and /shutdown never ran)


NON_FINITE = ("NaN", "Infinity", "-Infinity", "1e999")
_ITEM = '{{"prompt": {prompt}, "completion": {completion}, "completion_ids": {ids}, "columns": {{}}}}'
OUT_OF_RANGE = {
    "generator": [
        '{"prompts": ["hi"], "sampling": {"temperature": "Infinity"}}',  # a string pydantic would read as inf
        '{"prompts": ["hi"], "sampling": {"repetition_penalty": "nan"}}',
        '{"prompts": ["hi"], "sampling": {"seed": 100000000000000000000000}}',
    ],
    "reward_plugin": [
        '{"protocol": "asyncgrpo.reward/v1", "items": ['
        + _ITEM.format(prompt='"p"', completion="[]", ids="[1]")
        + "]}",
        '{"protocol": "asyncgrpo.reward/v1", "items": ['
        + _ITEM.format(prompt="[]", completion='"c"', ids="[1]")
        + "]}",
        '{"protocol": "asyncgrpo.reward/v1", "items": ['
        + _ITEM.format(prompt='"p"', completion='"c"', ids="[-1]")
        + "]}",
    ],
}


@pytest.mark.parametrize("name", list(BODY_ROUTES))
def test_non_finite_numbers_and_invalid_bodies_get_a_short_422(servers, name):
    service, path = servers[name], BODY_ROUTES[name]
    authorization = f"bearer {TOKEN}"  # the scheme is case-insensitive
    for number in NON_FINITE:
        if name == "generator":
            body = f'{{"prompts": ["hi"], "sampling": {{"temperature": {number}}}}}'
        else:
            item = f'{{"prompt": "p", "completion": "c", "completion_ids": [1], "columns": {{"score": {number}}}}}'
            body = f'{{"protocol": "asyncgrpo.reward/v1", "items": [{item}]}}'
        reply = _post(service, path, body.encode(), authorization)
        assert reply.status_code == 422, (number, reply.status_code, reply.text[:300])
        assert "not a finite number" in reply.text, reply.text
    for body in OUT_OF_RANGE[name]:  # numbers JSON can carry that no valid request holds: 422 too
        reply = _post(service, path, body.encode(), authorization)
        assert reply.status_code == 422, (body, reply.status_code, reply.text[:300])
    invalid = b'{"prompts": 3, "items": 3, "protocol": "' + b"x" * (LIMIT // 2) + b'"}'  # wrong, and large
    reply = _post(service, path, invalid, authorization)
    assert reply.status_code == 422 and len(reply.content) < 2000, (reply.status_code, len(reply.content))
    many = b"[" + b"1," * 200 + b"1]"  # a list of 201 numbers where strings or objects go: 201 problems or more
    many = (
        b'{"prompts": ' + many + b"}"
        if name == "generator"
        else b'{"protocol": "asyncgrpo.reward/v1", "items": ' + many + b"}"
    )
    reply = _post(service, path, many, authorization)
    assert reply.status_code == 422 and len(reply.json()["detail"]) <= 20 and reply.json()["more_errors"] > 0


@pytest.mark.parametrize("name", list(ROUTES))
def test_api_docs_are_off_and_need_the_token(servers, name):
    service = servers[name]
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{service.url}{path}").status_code == 401, path
        assert httpx.get(f"{service.url}{path}", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 404
    public = ("/health", "/schema") if name == "reward_plugin" else ("/health", "/metrics")
    for path in public:
        assert httpx.get(f"{service.url}{path}").status_code == 200, path


def test_the_learners_metrics_need_the_token(servers):
    url = servers["learner"].url
    assert "last_metrics" not in httpx.get(f"{url}/health").json()
    assert "last_metrics" not in httpx.get(f"{url}/ready").json()
    assert httpx.get(f"{url}/status").status_code == 401
    status = httpx.get(f"{url}/status", headers={"Authorization": f"Bearer {TOKEN}"})
    assert status.status_code == 200 and status.json()["last_metrics"] == {}


# Weak secrets -------------------------------------------------------------------------------------------------

PLACEHOLDER = "Change-Me-to-a-long-random-string"  # .env.example's, in another case
FIX = 'generate one with: python -c "import secrets; print(secrets.token_urlsafe(32))"'


def _start_refused(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if k not in {"ASYNCGRPO_CONFIG", "API_TOKEN", "PLUGIN_TOKEN"}}
    return subprocess.Popen(
        [sys.executable, "-m", *argv],
        cwd=ROOT,
        env={**clean, "REDIS_URL": "redis://127.0.0.1:1/0", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_no_service_nor_the_plugin_starts_with_a_placeholder_or_short_token():
    """Each real command line, its start checks refusing (exit 2) with the fix named; the token never printed."""
    services = {
        "generator": (["services.generator"], {"GENERATOR_MODEL": "/m"}, "API_TOKEN"),
        "scorer": (["services.scorer"], {}, "API_TOKEN"),
        "learner": (["services.learner"], {"LEARNER_MODEL": "/m"}, "API_TOKEN"),
        "reward_plugin": (["services.reward_plugin", "--port", "0"], {}, "PLUGIN_TOKEN"),
    }
    runs = {
        (name, token): _start_refused(argv, {**env, variable: token})
        for name, (argv, env, variable) in services.items()
        for token in (PLACEHOLDER, "x")
    }
    runs[("reward_plugin", "")] = _start_refused(["services.reward_plugin", "--port", "0"], {})
    runs[("reward_plugin --allow-no-token on 0.0.0.0", "")] = _start_refused(
        ["services.reward_plugin", "--port", "0", "--allow-no-token", "--host", "0.0.0.0"], {}
    )
    for (name, token), process in runs.items():
        out, err = process.communicate(timeout=120)
        assert process.returncode == 2, (name, token, out[-2000:], err[-2000:])
        if "0.0.0.0" in name:
            assert "--allow-no-token would serve /score to anyone" in err, err
            continue
        assert FIX in err, (name, token, err)
        if token:
            assert (PLACEHOLDER not in err) and (
                "placeholder" in err if token == PLACEHOLDER else "1 characters" in err
            )
