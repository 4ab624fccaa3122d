"""The environment server and its client over real HTTP (docs/concepts/multi-turn-design.md §3 step 6): the server
(``python -m services.env_server``) in a process of its own, bearer auth, ``/health``, ``/schema``, exactly-once
creates and steps, the idle TTL; and the client against ``tests/support/fault_env.py``: retries, timeouts and
the breaker."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from transformers.utils import get_json_schema

from environments.build import build_environment
from environments.protocol import PROTOCOL, SCHEMA_PATH, ToolCallIn
from environments.session import EnvFault
from shared.config.environment import EnvironmentSettings
from tests.support.processes import ServiceProcess, start_service, wait_http_ok
from tests.support.redis_server import free_port
from tests.support.tool_envs import IncrementEnv

pytestmark = pytest.mark.integration

TOKEN = "t" * 40
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _start_server(*extra: str) -> ServiceProcess:
    port = free_port()
    args = ["--environment", "tests.support.tool_envs:IncrementEnv", "--port", str(port), *extra]
    service = start_service("env-server", "services.env_server", {"ENV_SERVER_API_TOKEN": TOKEN}, args)
    service.port = port
    try:
        wait_http_ok(f"{service.url}/health", 60)
    except TimeoutError:
        service.stop()
        raise AssertionError(service.output()) from None
    return service


@pytest.fixture(scope="module")
def server():
    service = _start_server("--session-idle-ttl-s", "1.5")
    yield service
    assert service.stop() == 0, service.output()


@pytest.fixture
def fault_env():
    port = free_port()
    service = start_service("fault-env", "tests.support.fault_env", {}, ["--port", str(port), "--token", TOKEN])
    service.port = port
    wait_http_ok(f"{service.url}/health", 30)
    yield service
    service.stop()


def _create(server: ServiceProcess, key: str, **row) -> httpx.Response:
    body = {"protocol": PROTOCOL, "session_key": key, "row": {"prompt": "p", **row}}
    return httpx.post(f"{server.url}/sessions", json=body, headers=AUTH)


def _step(server: ServiceProcess, session_id: str, index: int, step: int) -> httpx.Response:
    call = {"id": f"c{index}", "name": "increment", "arguments": {"step": step}}
    body = {"protocol": PROTOCOL, "step": index, "tool_calls": [call]}
    return httpx.post(f"{server.url}/sessions/{session_id}/step", json=body, headers=AUTH)


def _open(server: ServiceProcess) -> int:
    return httpx.get(f"{server.url}/sessions/count", headers=AUTH).json()["open"]


def test_bearer_on_every_path_but_health_and_the_schema_is_the_committed_one(server):
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok", "protocol": PROTOCOL}
    for method, path in (
        ("GET", "/schema"),
        ("POST", "/sessions"),
        ("GET", "/sessions/count"),
        ("DELETE", "/sessions/x"),
    ):
        assert httpx.request(method, f"{server.url}{path}").status_code == 401, path
        wrong = {"Authorization": "Bearer " + "x" * 40}
        assert httpx.request(method, f"{server.url}{path}", headers=wrong).status_code == 401, path
    schema = httpx.get(f"{server.url}/schema", headers=AUTH)
    assert schema.status_code == 200 and schema.json() == json.loads(SCHEMA_PATH.read_text())


def test_a_retried_create_leaves_one_live_session_and_a_retried_step_runs_once(server):
    first = _create(server, "task-1/0", start=10)
    again = _create(server, "task-1/0", start=10)
    assert first.status_code == again.status_code == 201
    assert first.json()["tools"] == again.json()["tools"]
    assert _step(server, first.json()["session_id"], 0, 1).status_code == 404  # replaced
    session_id = again.json()["session_id"]
    answers = [_step(server, session_id, 0, 5).json() for _ in range(3)]
    assert answers[0] == answers[1] == answers[2] and answers[0]["results"][0]["content"] == "15"
    assert _step(server, session_id, 1, 1).json()["results"][0]["content"] == "16"  # 15 + 1: step 0 ran once
    conflict = _step(server, session_id, 5, 1)
    assert conflict.status_code == 409 and "out of order" in conflict.json()["detail"]
    assert _open(server) == 1
    assert httpx.delete(f"{server.url}/sessions/{session_id}", headers=AUTH).status_code == 204
    assert httpx.delete(f"{server.url}/sessions/{session_id}", headers=AUTH).status_code == 404
    assert _open(server) == 0


def test_idle_sessions_are_reclaimed_after_the_ttl(server):
    session_id = _create(server, "task-2/0").json()["session_id"]
    assert _open(server) == 1
    deadline = time.monotonic() + 10
    while _open(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _open(server) == 0
    assert _step(server, session_id, 0, 1).status_code == 404


def test_creates_past_max_sessions_get_429_and_are_counted_and_a_replacement_takes_no_place():
    """The issue's 30,000 creates, in small: with --max-sessions 3 the fourth open session is refused (429,
    naming the setting) and counted; a create that replaces its key's live session, and one after a close,
    are let in."""
    service = _start_server("--max-sessions", "3")
    try:
        opened = [_create(service, f"task-{i}/0") for i in range(3)]
        assert [r.status_code for r in opened] == [201, 201, 201]
        refused = _create(service, "task-3/0")
        assert refused.status_code == 429 and "max_sessions (3)" in refused.json()["detail"]
        assert _create(service, "task-0/0").status_code == 201  # replaces task-0/0's session
        assert httpx.delete(f"{service.url}/sessions/{opened[1].json()['session_id']}", headers=AUTH).status_code == 204
        assert _create(service, "task-3/0").status_code == 201
        count = httpx.get(f"{service.url}/sessions/count", headers=AUTH).json()
        assert count == {"open": 3, "reaped": 0, "refused": 1}
    finally:
        assert service.stop() == 0, service.output()


async def test_the_client_against_the_real_server(server):
    env = build_environment(EnvironmentSettings(url=server.url, bearer_token=TOKEN))
    try:
        async with env.session({"prompt": "p", "greet": True, "start": 2}, "task-3/0") as session:
            probe = IncrementEnv()
            names = ("divide", "double", "hang", "increment", "whoami")
            assert list(session.tools) == [get_json_schema(getattr(probe, name)) for name in names]
            assert session.observation == "The counter starts at 2."
            calls = [
                ToolCallIn(id="a", name="increment", arguments={"step": 3}),
                ToolCallIn(id="b", name="x", arguments={}),
            ]
            response = await session.step(calls)
            assert response.results[0].content == "5" and response.results[1].error
            assert await session.reward() == 5.0 and len(session.latencies_s) == 3
            assert _open(server) == 1
        assert _open(server) == 0
        with pytest.raises(EnvFault, match=r"HTTP 500.*reset raised"):
            async with env.session({"prompt": "p", "start": "not a number"}, "task-3/1"):
                pass
        assert env.stats.sessions_opened == env.stats.sessions_closed == 1 and env.stats.calls["tool_error"] == 1
    finally:
        await env.aclose()


def _faults(service: ServiceProcess, mode: str, count: int) -> None:
    httpx.post(f"{service.url}/faults", json={"mode": mode, "count": count}).raise_for_status()


def _client(service: ServiceProcess, **options):
    settings = {"backoff_s": 0.05, "timeout_s": 1.0, "bearer_token": TOKEN, **options}
    return build_environment(EnvironmentSettings(url=service.url, **settings))


async def test_5xx_twice_then_200_succeeds_with_two_retries_counted(fault_env):
    env = _client(fault_env)
    try:
        _faults(fault_env, "error", 2)
        async with env.session({"prompt": "q"}, "k/0") as session:
            assert session.observation == "row q"
            step = await session.step([ToolCallIn(id="a", name="echo", arguments={"text": "hi"})])
            assert step.results[0].content == "hi"
        assert env.stats.calls["retried"] == 2 and env.stats.calls["ok"] == 2 and env.stats.calls["fault"] == 0
        calls = httpx.get(f"{fault_env.url}/calls").json()
        assert calls["create:error"] == 2 and calls["create:ok"] == 1 and calls["delete"] == 1
        assert httpx.get(f"{fault_env.url}/sessions/count").json() == {"open": 0}
    finally:
        await env.aclose()


async def test_a_timeout_is_retried(fault_env):
    env = _client(fault_env)
    try:
        async with env.session({"prompt": "q"}, "k/0") as session:
            _faults(fault_env, "timeout", 1)
            started = time.monotonic()
            assert await session.reward() == 1.0
        assert 1.0 <= time.monotonic() - started < 3.0  # the 3 s answer was not waited for
        assert env.stats.calls["retried"] == 1 and env.stats.calls["fault"] == 0
    finally:
        await env.aclose()


async def test_the_breaker_opens_after_n_faults_and_half_opens(fault_env):
    env = _client(fault_env, retries=0, breaker_failures=2, breaker_reset_s=0.5)
    try:
        _faults(fault_env, "error", -1)
        for _ in range(2):
            with pytest.raises(EnvFault, match="HTTP 503"):
                async with env.session({"prompt": "q"}, "k/0"):
                    pass
        assert not env.accepting() and "breaker open" in env.describe()
        with pytest.raises(EnvFault, match="breaker open"):
            async with env.session({"prompt": "q"}, "k/0"):
                pass
        assert httpx.get(f"{fault_env.url}/calls").json()["create:error"] == 2  # refused without a call
        _faults(fault_env, "ok", 0)
        await asyncio.sleep(0.6)
        assert env.accepting() and "half-open" in env.describe()
        async with env.session({"prompt": "q"}, "k/0"):
            pass
        assert env.accepting() and "breaker closed" in env.describe()
        assert env.stats.calls["fault"] == 3 and env.stats.sessions_opened == env.stats.sessions_closed == 1
    finally:
        await env.aclose()


async def test_a_cancelled_trajectory_closes_its_http_session(fault_env):
    env = _client(fault_env, timeout_s=5.0)
    entered = asyncio.Event()

    async def trajectory() -> None:
        async with env.session({"prompt": "q"}, "k/0") as session:
            _faults(fault_env, "timeout", 1)
            entered.set()
            await session.step([ToolCallIn(id="a", name="echo", arguments={"text": "hi"})])

    try:
        task = asyncio.create_task(trajectory())
        await entered.wait()
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert env.stats.sessions_opened == env.stats.sessions_closed == 1
        assert httpx.get(f"{fault_env.url}/sessions/count").json() == {"open": 0}
    finally:
        await env.aclose()


@pytest.mark.parametrize(("token", "problem"), [("", "is not set"), ("short", "at least 32")])
def test_the_server_refuses_to_start_without_a_strong_token(token, problem):
    args = ["--environment", "tests.support.tool_envs:IncrementEnv", "--port", str(free_port())]
    service = start_service("env-server", "services.env_server", {"ENV_SERVER_API_TOKEN": token}, args)
    assert service.process.wait(60) == 2
    time.sleep(0.2)  # the output pump catches up
    assert problem in service.output() and "ENV_SERVER_API_TOKEN" in service.output()
