"""The one service skeleton: the app factory (probes, metrics, auth, typed state), the lifecycle (exit
statuses, clean-up order, background tasks) and the dead-letter intake, with hand-written fakes for Redis."""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Annotated

import pytest
from fastapi import APIRouter, Depends, FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel, SecretStr

import shared.lifecycle
from shared.app import Probes, Readiness, service_app
from shared.codec import encode
from shared.http import FiniteJsonRoute, ServiceState, state_dependency
from shared.intake import decode_or_reject, reject
from shared.lifecycle import NotStarting, Service, run_service
from shared.records import PromptTask, Rollout
from shared.redis_conn import RedisRetry
from tests.support.factories import make_task


class Status(BaseModel):
    status: str
    detail: str = ""


@dataclass(kw_only=True)
class ToyState(ServiceState):
    ready: bool = False


async def _readiness(state: ToyState) -> Readiness:
    if state.ready:
        return Readiness(True, Status(status="ready"))
    return Readiness(False, Status(status="starting", detail="still loading"))


_router = APIRouter(route_class=FiniteJsonRoute)


@_router.get("/whoami")
async def whoami(state: Annotated[ToyState, Depends(state_dependency(ToyState))]) -> dict[str, bool]:
    return {"ready": state.ready}


PROBES = Probes(model=Status, ready=_readiness, ready_summary="toy")


def _app(state: ServiceState) -> FastAPI:
    return service_app(state, PROBES, title="toy", description="toy service", routers=[_router])


def test_every_app_has_health_ready_metrics_and_token_guarded_shutdown():
    state = ToyState(api_token="s3cret", max_request_bytes=1024)
    client = TestClient(_app(state))
    assert client.get("/health").json() == {"status": "alive", "detail": ""}
    starting = client.get("/ready")
    assert starting.status_code == 503 and starting.json()["detail"] == "still loading"
    state.ready = True
    assert client.get("/ready").json()["status"] == "ready" and client.get("/metrics").status_code == 200
    assert client.get("/whoami").status_code == 401  # every path but the probes needs the token
    assert client.get("/whoami", headers={"Authorization": "bearer s3cret"}).json() == {"ready": True}
    assert client.post("/shutdown").status_code == 401
    assert client.post("/shutdown", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert not state.stop.is_set()
    assert client.post("/shutdown", headers={"Authorization": "Bearer s3cret"}).json() == {"status": "stopping"}
    assert state.stop.is_set()


def test_an_empty_token_opens_no_control_endpoint():
    client = TestClient(_app(ToyState(api_token="", max_request_bytes=1024)))
    assert client.post("/shutdown", headers={"Authorization": "Bearer "}).status_code == 401
    assert client.post("/shutdown").status_code == 401


def test_the_state_dependency_refuses_another_services_state():
    client = TestClient(_app(ServiceState(api_token="t", max_request_bytes=1024)), raise_server_exceptions=True)
    with pytest.raises(TypeError, match="not a ToyState"):
        client.get("/whoami", headers={"Authorization": "Bearer t"})


def test_a_router_that_parses_json_leniently_is_refused():
    loose = APIRouter()
    loose.add_api_route("/loose", whoami)
    with pytest.raises(TypeError, match=r"\['/loose'\] parse JSON leniently.*route_class=FiniteJsonRoute"):
        service_app(ToyState(api_token="t", max_request_bytes=1024), PROBES, title="t", description="", routers=[loose])


# Lifecycle ------------------------------------------------------------------------------------------------


class FakeRedis:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    async def aclose(self) -> None:
        self.events.append("redis closed")


@pytest.fixture
def events(monkeypatch) -> list[str]:
    events: list[str] = []

    async def connect(url: str) -> FakeRedis:
        events.append(f"connected to {url}")
        return FakeRedis(events)

    monkeypatch.setattr(shared.lifecycle, "connect", connect)
    return events


def _settings() -> SimpleNamespace:
    return SimpleNamespace(
        redis_url="redis://fake",
        stream_prefix="toy",
        api_token=SecretStr("t"),
        host="127.0.0.1",
        port=0,
        max_request_bytes=1024,
        api_docs=False,
    )


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


async def test_a_service_cleans_up_in_reverse_order_after_its_http_server_and_background(events):
    async def start(service: Service) -> None:
        port = await service.serve_http(_app(service.app_state(ToyState)))
        service.on_exit(lambda: events.append(f"engine shut down, HTTP open: {_port_open(port)}"))

        async def beat(stop: asyncio.Event) -> None:
            await stop.wait()
            events.append("heartbeat stopped")

        service.spawn(beat)
        service.on_exit(lambda: events.append("deregistered"))

        async def loop(stop: asyncio.Event) -> None:
            events.append("loop ran")

        await service.run_until_stopped(loop)

    assert await run_service("toy", _settings(), start) == 0
    assert events == [
        "connected to redis://fake",
        "loop ran",
        "heartbeat stopped",  # joined when the loop returned
        "deregistered",
        "engine shut down, HTTP open: False",  # the HTTP server stops first
        "redis closed",
    ]


async def test_a_refusal_exits_2_and_an_error_exits_1_with_background_cancelled(events, caplog):
    async def refuse(service: Service) -> None:
        service.on_exit(lambda: events.append("lease released"))
        raise NotStarting("no free GPU; scale down")

    with caplog.at_level(logging.ERROR):
        assert await run_service("toy", _settings(), refuse) == 2
    assert "not starting: no free GPU; scale down" in caplog.text and "Traceback" not in caplog.text
    assert events[-2:] == ["lease released", "redis closed"]

    events.clear()

    async def fail(service: Service) -> None:
        async def forever(stop: asyncio.Event) -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                events.append("background cancelled")
                raise

        service.spawn(forever)
        await asyncio.sleep(0)
        raise RuntimeError("the engine died")

    caplog.clear()
    with caplog.at_level(logging.ERROR):
        assert await run_service("toy", _settings(), fail) == 1
    assert "toy stopped on an error" in caplog.text and "the engine died" in caplog.text
    assert events[-2:] == ["background cancelled", "redis closed"]


async def test_redis_that_never_answers_exits_1(monkeypatch, caplog):
    async def connect(url: str) -> None:
        raise ConnectionError("Redis at redis://fake did not answer within 60 s")

    monkeypatch.setattr(shared.lifecycle, "connect", connect)
    with caplog.at_level(logging.ERROR):
        assert await run_service("toy", _settings(), lambda service: asyncio.sleep(0)) == 1
    assert "did not answer" in caplog.text


# Intake -----------------------------------------------------------------------------------------------------


class FakeConsumer:
    def __init__(self) -> None:
        self.dead: list[tuple[str, str]] = []

    async def dead_letter(self, delivery, reason: str) -> None:
        self.dead.append((delivery.record_id, reason))


async def test_undecodable_records_are_dead_lettered_with_their_reason():
    consumer, retry = FakeConsumer(), RedisRetry()
    task = make_task()
    good = SimpleNamespace(record_id="good", payload=encode(task))
    bad = SimpleNamespace(record_id="bad", payload=b"\x93not a record")
    assert await decode_or_reject(consumer, retry, good, PromptTask, "a prompt") == task
    assert await decode_or_reject(consumer, retry, good, Rollout, "a rollout") is None  # the wrong kind
    assert await decode_or_reject(consumer, retry, bad, PromptTask, "a prompt") is None
    await reject(consumer, retry, good, ValueError("prompt too long"), "a prompt")
    assert [record_id for record_id, _ in consumer.dead] == ["good", "bad", "good"]
    assert consumer.dead[0][1] == "WireError: kind: expected a rollout record, got prompt_task"
    assert consumer.dead[1][1].startswith("WireError: not a msgpack record")
    assert consumer.dead[2][1] == "ValueError: prompt too long"


async def test_every_service_counts_and_exports_the_invalid_registry_values_it_reads(events):
    """A service's registry reads count what they set aside or ignore; /metrics shows it."""
    from prometheus_client import generate_latest

    service = Service("toy", _settings(), FakeRedis(events))
    assert b"asyncgrpo_registry_invalid_total 0.0" in generate_latest(service.prometheus)
    service.registry_stats.invalid += 2
    assert b"asyncgrpo_registry_invalid_total 2.0" in generate_latest(service.prometheus)
