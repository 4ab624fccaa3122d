"""Reward-plugin faults against real Redis and a real plugin process: one test per fault.

Every test feeds groups and ends with the same accounting (printed): groups fed = groups scored exactly
once (no NaN from a required reward, except an explicit null) + groups dead-lettered with a reason; none
lost, none scored twice, nothing pending. Most tests run the scoring loop in-process (to read its logs and
counters); the outage and cold-start tests run the scorer process itself (to read /ready, /metrics, logs).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import numpy as np
import pytest

from services.scorer.rewards.functions import RewardBugError
from services.scorer.scoring import build_functions
from services.scorer.scoring_loop import ScoringLoop
from shared.codec import decode, encode
from shared.config.scorer import RewardSpec
from shared.keys import Keys
from shared.records import AdvantageSpec, ScoredGroup
from shared.streams import StreamConsumer, StreamProducer
from tests.support import fault_plugin
from tests.support.factories import make_rollout, make_task, make_trajectory_rollout
from tests.support.processes import ServiceProcess, start_service, wait_http_ok
from tests.support.redis_server import free_port

pytestmark = pytest.mark.integration

FAST = dict(timeout_s=0.3, retries=1, backoff_s=0.02, breaker_failures=3, breaker_reset_s=0.5)


def _start_plugin(port: int, token: str = "") -> ServiceProcess:
    service = start_service("fault-plugin", "tests.support.fault_plugin", {}, ["--port", str(port), "--token", token])
    service.port = port
    return service


@pytest.fixture
def plugin():
    service = _start_plugin(free_port())
    try:
        wait_http_ok(f"{service.url}/health", 60)
        yield service
    finally:
        service.stop()


def _faults(plugin: ServiceProcess, mode: str, count: int, **extra) -> None:
    httpx.post(f"{plugin.url}/faults", json={"mode": mode, "count": count, **extra}).raise_for_status()


async def _feed(client, keys: Keys, n: int, first: int = 0) -> list[str]:
    rollouts = [make_rollout(make_task(group_size=4), tokens=3 + i, seed=i) for i in range(first, first + n)]
    await StreamProducer(client, keys.rollouts).add_many([(r.group_id, encode(r)) for r in rollouts])
    return [r.group_id for r in rollouts]


@dataclass
class Accounting:
    fed: int
    scored: Counter
    dead: dict[str, str]  # group id -> reason
    pending: int
    undelivered: int

    def check(self, fed_ids: list[str]) -> None:
        print(
            f"\ncounts: fed={self.fed} scored={len(self.scored)} dead_lettered={len(self.dead)} "
            f"scored_twice={sum(n > 1 for n in self.scored.values())} pending={self.pending} "
            f"undelivered={self.undelivered}"
        )
        assert set(self.scored) | set(self.dead) == set(fed_ids), "a group was lost"
        assert not set(self.scored) & set(self.dead)
        assert max(self.scored.values(), default=1) == 1, "a group was scored twice"
        assert len(self.scored) + len(self.dead) == self.fed
        assert self.pending == 0 and self.undelivered == 0
        assert all(reason for reason in self.dead.values())


async def _account(client, keys: Keys, fed: int) -> tuple[Accounting, list[ScoredGroup]]:
    groups = [decode(fields[b"data"], ScoredGroup) for _, fields in await client.xrange(keys.scored)]
    dead = {f[b"id"].decode(): f[b"reason"].decode() for _, f in await client.xrange(keys.dead_letter)}
    info = {i["name"].decode(): i for i in await client.xinfo_groups(keys.rollouts)}[Keys.SCORERS]
    accounting = Accounting(fed, Counter(g.group_id for g in groups), dead, info["pending"], info["lag"] or 0)
    return accounting, groups


async def _wait_done(client, keys: Keys, n: int, timeout_s: float, alive=lambda: True) -> None:
    deadline = time.monotonic() + timeout_s
    while await client.xlen(keys.scored) + await client.xlen(keys.dead_letter) < n:
        assert alive(), "the scorer stopped"
        assert time.monotonic() < deadline, f"not all {n} groups finished in {timeout_s} s"
        await asyncio.sleep(0.1)


async def _score_in_process(
    client, keys, specs, fed: list[str], *, max_wait_s=30.0, during=None, in_flight=4, bounds=None
):
    """Run the scoring loop until every fed group is scored or dead-lettered (``during`` runs meanwhile;
    ``bounds``: the loop's entry bounds, None for the defaults)."""
    async with httpx.AsyncClient() as http:
        functions, plugins = build_functions(specs, http)
        await asyncio.gather(*(p.probe(attempts=1) for p in plugins))
        consumer = StreamConsumer(client, keys, keys.rollouts, Keys.SCORERS, "s1", block_ms=100)
        await consumer.start()
        loop = ScoringLoop(
            consumer,
            StreamProducer(client, keys.scored),
            functions,
            [s.weight for s in specs],
            AdvantageSpec(),
            drop_zero_std=False,
            max_in_flight=in_flight,
            max_reward_wait_s=max_wait_s,
            retry_backoff_s=0.05,
            retry_backoff_max_s=0.5,
            bounds=bounds,
        )
        stop = asyncio.Event()
        runner = asyncio.create_task(loop.run(stop))
        if during is not None:
            await during()
        await _wait_done(client, keys, len(fed), 60, alive=lambda: not runner.done())
        stop.set()
        await runner
    accounting, groups = await _account(client, keys, len(fed))
    accounting.check(fed)
    assert loop.stats.groups_held == 0
    return accounting, groups, loop


def _required_column_is_complete(groups: list[ScoredGroup], name: str) -> None:
    for group in groups:
        column = group.rewards_per_func[:, list(group.reward_names).index(name)]
        assert column.tolist() == [len(c.token_ids) for c in group.rollout.completions], group.group_id


async def test_timeout_then_answers(plugin, redis_client, keys, caplog):
    keys = Keys(keys.prefix)
    _faults(plugin, "timeout", 3)
    fed = await _feed(redis_client, keys, 4)
    spec = RewardSpec(name="judge", url=f"{plugin.url}/score", **FAST)
    # One group at a time, so the first exhausts its in-call retry and is held.
    accounting, groups, loop = await _score_in_process(redis_client, keys, [spec], fed, in_flight=1)
    _required_column_is_complete(groups, "judge")
    calls = httpx.get(f"{plugin.url}/calls").json()
    stats = loop.functions[0].stats
    print("plugin calls:", calls, "errors:", stats.errors, "retried_transport:", stats.retried_transport)
    assert calls["timeout"] == 3 and len(accounting.dead) == 0
    assert stats.retried_transport >= 1 and stats.errors >= 1
    assert "ReadTimeout: no answer within timeout_s=0.3" in caplog.text
    assert any(f"on group {g}" in caplog.text for g in fed)


async def test_5xx_then_recovery_opens_and_closes_the_breaker(plugin, redis_client, keys, caplog):
    keys = Keys(keys.prefix)
    caplog.set_level(logging.DEBUG, logger="services.scorer")
    _faults(plugin, "error", 8, status=503)
    fed = await _feed(redis_client, keys, 6)
    spec = RewardSpec(name="judge", url=f"{plugin.url}/score", **FAST)
    accounting, groups, loop = await _score_in_process(redis_client, keys, [spec], fed)
    _required_column_is_complete(groups, "judge")
    stats, breaker = loop.functions[0].stats, loop.functions[0].breaker
    print("retried_5xx:", stats.retried_5xx, "errors:", stats.errors, "trips:", breaker.trips)
    assert len(accounting.dead) == 0 and stats.retried_5xx >= 1 and breaker.trips >= 1
    assert "HTTP 503; body 'overloaded'" in caplog.text
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and "retry 1 of 1" in r.getMessage()]
    assert debug and "HTTP 503" in debug[0]
    transitions = [r.getMessage() for r in caplog.records if "breaker" in r.getMessage() and r.levelname == "WARNING"]
    for state in ("open", "half-open", "closed"):
        assert any(f"reward judge: breaker {state} (" in m for m in transitions), state
    assert "last error: group " in transitions[0]


async def test_wrong_length_is_held_then_dead_lettered_and_recovers(plugin, redis_client, keys):
    keys = Keys(keys.prefix)
    _faults(plugin, "wrong-count", -1)
    fed = await _feed(redis_client, keys, 3)
    spec = RewardSpec(name="judge", url=f"{plugin.url}/score", **FAST)

    async def recover_after_dead_letters() -> None:
        await _wait_done(redis_client, keys, 3, 30)
        _faults(plugin, "ok", 0)
        fed.extend(await _feed(redis_client, keys, 3, first=3))

    accounting, groups, _ = await _score_in_process(
        redis_client, keys, [spec], fed, max_wait_s=1.0, during=recover_after_dead_letters, in_flight=3
    )
    _required_column_is_complete(groups, "judge")
    assert len(accounting.dead) == 3 and len(accounting.scored) == 3
    for reason in accounting.dead.values():
        assert "max_reward_wait_s=1" in reason and "HTTP 200 with 3 rewards for 4 items" in reason


async def test_non_json_answers_are_retried_until_the_plugin_answers(plugin, redis_client, keys, caplog):
    keys = Keys(keys.prefix)
    _faults(plugin, "malformed", 5)
    fed = await _feed(redis_client, keys, 4)
    spec = RewardSpec(name="judge", url=f"{plugin.url}/score", **FAST)
    accounting, groups, loop = await _score_in_process(redis_client, keys, [spec], fed)
    _required_column_is_complete(groups, "judge")
    print("plugin calls:", httpx.get(f"{plugin.url}/calls").json())
    assert len(accounting.dead) == 0 and loop.stats.group_retries >= 1
    assert "HTTP 200 with a malformed answer" in caplog.text and "body '{\"rewards\": [1.0,'" in caplog.text


async def test_null_for_one_item_stays_nan_and_is_not_a_failure(plugin, redis_client, keys):
    keys = Keys(keys.prefix)
    _faults(plugin, "null", 1)
    fed = await _feed(redis_client, keys, 4)
    spec = RewardSpec(name="judge", url=f"{plugin.url}/score", **FAST)
    accounting, groups, loop = await _score_in_process(redis_client, keys, [spec], fed, in_flight=1)
    nan_groups = [g for g in groups if np.isnan(g.rewards_per_func).any()]
    print("groups with a null:", len(nan_groups), "errors:", loop.functions[0].stats.errors)
    assert len(accounting.dead) == 0 and len(nan_groups) == 1 and loop.functions[0].stats.errors == 0
    column = nan_groups[0].rewards_per_func[:, 0]
    assert math.isnan(column[0]) and np.isfinite(column[1:]).all()
    _required_column_is_complete([g for g in groups if g not in nan_groups], "judge")


async def test_python_reward_outage_is_held_and_its_bug_is_nan_or_stops_the_scorer(redis_client, keys):
    """A Python reward's ConnectionError is an outage (held, retried); its ValueError is a bug: NaN when the
    reward is optional, and for a required reward the loop stops with the traceback's summary, leaving the
    group unacknowledged for after the fix."""
    keys = Keys(keys.prefix)
    fault_plugin.python_calls.clear()
    fed = await _feed(redis_client, keys, 3)
    specs = [
        RewardSpec(name="flaky", function="tests.support.fault_plugin:flaky_length", breaker_failures=10),
        RewardSpec(name="buggy", function="tests.support.fault_plugin:always_raises", required=False),
    ]
    accounting, groups, loop = await _score_in_process(redis_client, keys, specs, fed)
    _required_column_is_complete(groups, "flaky")
    assert all(np.isnan(g.rewards_per_func[:, 1]).all() for g in groups)  # optional: NaN
    assert len(accounting.scored) == 3 and fault_plugin.python_calls["flaky"] == 6
    assert loop.functions[1].stats.bugs == 3 and loop.functions[0].stats.bugs == 0

    keys2 = Keys(keys.prefix + "-b")
    fed = await _feed(redis_client, keys2, 2)
    specs = [RewardSpec(name="buggy", function="tests.support.fault_plugin:always_raises", breaker_failures=10)]
    async with httpx.AsyncClient() as http:
        functions, _ = build_functions(specs, http)
        consumer = StreamConsumer(redis_client, keys2, keys2.rollouts, Keys.SCORERS, "s1", block_ms=100)
        await consumer.start()
        loop = ScoringLoop(
            consumer, StreamProducer(redis_client, keys2.scored), functions, [1.0], AdvantageSpec(),
            drop_zero_std=False, max_in_flight=1, max_reward_wait_s=60,
        )  # fmt: skip
        with pytest.raises(RewardBugError) as stopped:
            await asyncio.wait_for(loop.run(asyncio.Event()), 30)
    assert "ValueError: this reward has a bug (at fault_plugin.py:" in str(stopped.value)
    assert "in always_raises" in str(stopped.value) and "set required = false" in str(stopped.value)
    accounting, _ = await _account(redis_client, keys2, len(fed))
    print(f"\nrequired bug: scored={len(accounting.scored)} dead={len(accounting.dead)} pending={accounting.pending}")
    assert not accounting.scored and not accounting.dead  # nothing scored, nothing thrown away
    assert accounting.pending + accounting.undelivered == 2  # left for a scorer with the fixed function


def _scorer(name: str, redis_url: str, keys: Keys, rewards: list[dict], env: dict | None = None) -> ServiceProcess:
    port = free_port()
    service = start_service(
        name,
        "services.scorer",
        {
            "REDIS_URL": redis_url,
            "STREAM_PREFIX": keys.prefix,
            "SCORER_SCORER_ID": name,
            "SCORER_REWARDS": json.dumps(rewards),
            "SCORER_PORT": str(port),
            "SCORER_RETRY_BACKOFF_S": "0.1",
            "SCORER_RETRY_BACKOFF_MAX_S": "1",
            "SCORER_MAX_REWARD_WAIT_S": "120",
            **(env or {}),
        },
    )
    service.port = port
    return service


def _ready(scorer: ServiceProcess) -> httpx.Response:
    return httpx.get(f"{scorer.url}/ready", timeout=5)


async def test_plugin_down_10_s_then_back_delays_groups_and_pauses_the_scorer(redis_url, redis_client, keys):
    keys = Keys(keys.prefix)
    port = free_port()
    plugin = _start_plugin(port)
    rewards = [{"name": "judge", "url": f"http://127.0.0.1:{port}/score", **FAST, "breaker_reset_s": 1.0}]
    scorer = _scorer("scorer-outage", redis_url, keys, rewards)
    fed: list[str] = []
    try:
        wait_http_ok(f"{plugin.url}/health", 60)
        await asyncio.to_thread(scorer.wait_for_line, "scorer-outage ready", 90)
        fed += await _feed(redis_client, keys, 2)
        await _wait_done(redis_client, keys, 2, 30)
        plugin.stop()
        down_at = time.monotonic()
        paused, undelivered = None, 0
        for i in range(6):  # six groups arrive during a ~10 s outage
            fed += await _feed(redis_client, keys, 1, first=2 + i)
            await asyncio.sleep(1.5)
            reply = _ready(scorer)
            paused = reply if reply.status_code == 503 else paused
            undelivered = max(undelivered, (await _account(redis_client, keys, len(fed)))[0].undelivered)
        plugin = _start_plugin(port)
        print(f"plugin down for {time.monotonic() - down_at:.1f} s; most rollouts left unread: {undelivered}")
        assert paused is not None, "/ready never reported the open breaker"
        assert undelivered >= 3, "the scorer kept taking rollouts while the breaker was open"
        detail = paused.json()["detail"]
        assert detail.startswith("reward judge: breaker ") and "ConnectError" in detail
        await _wait_done(redis_client, keys, len(fed), 60, alive=lambda: scorer.process.poll() is None)
        await asyncio.sleep(0.5)
        assert _ready(scorer).status_code == 200
        metrics = httpx.get(f"{scorer.url}/metrics").text
    finally:
        plugin.stop()
        assert scorer.stop() == 0, scorer.output()[-3000:]
    accounting, groups = await _account(redis_client, keys, len(fed))
    accounting.check(fed)
    _required_column_is_complete(groups, "judge")
    output = scorer.output()
    for state in ("open", "half-open", "closed"):
        assert f"reward judge: breaker {state} (" in output, state
    assert "asyncgrpo_scorer_groups_held 0.0" in metrics
    assert 'asyncgrpo_rewards_errors_total{function="judge"}' in metrics


async def test_plugin_down_at_scorer_start_holds_groups_until_it_comes_up(redis_url, redis_client, keys):
    """Decided behaviour: the scorer starts, is not ready, takes no rollouts; the first trial after the
    plugin comes up closes the breaker. Also: the bearer token reaches the plugin and no log or metric."""
    keys = Keys(keys.prefix)
    token = "plugin-secret-5be1c9"
    port = free_port()
    rewards = [{"name": "judge", "url": f"http://127.0.0.1:{port}/score", **FAST, "bearer_token_env": "JUDGE_TOKEN"}]
    env = {"JUDGE_TOKEN": token, "LOG_LEVEL": "DEBUG"}
    scorer = _scorer("scorer-cold", redis_url, keys, rewards, env)
    plugin = None
    try:
        await asyncio.to_thread(scorer.wait_for_line, "scorer-cold paused until a trial call succeeds", 90)
        reply = _ready(scorer)
        assert reply.status_code == 503 and "health probe of" in reply.json()["detail"]
        fed = await _feed(redis_client, keys, 4)
        await asyncio.sleep(2)
        assert await redis_client.xlen(keys.scored) == 0
        plugin = _start_plugin(port, token=token)
        await _wait_done(redis_client, keys, len(fed), 60, alive=lambda: scorer.process.poll() is None)
        await asyncio.sleep(0.5)
        assert _ready(scorer).status_code == 200
        metrics = httpx.get(f"{scorer.url}/metrics").text
        calls = httpx.get(f"{plugin.url}/calls").json()
    finally:
        if plugin is not None:
            plugin.stop()
        assert scorer.stop() == 0, scorer.output()[-3000:]
    accounting, groups = await _account(redis_client, keys, len(fed))
    accounting.check(fed)
    _required_column_is_complete(groups, "judge")
    print("plugin calls:", calls)
    assert "unauthorized" not in calls and calls["ok"] >= 4
    output = scorer.output()
    assert "reward judge: breaker open (" in output and "reward judge: breaker closed (" in output
    assert token not in output and token not in metrics


async def test_a_function_plugin_process_scores_tool_groups_by_v2_beside_single_turn_v1(redis_client, keys):
    """The real ``services.reward_plugin`` process (brevity, 10 characters) takes a tool-use group (protocol v2)
    and a single-turn group (v1) from the same scorer; brevity reads the final assistant turn of the tool group
    (18 characters: 0.2), not its first (an empty tool-calling turn: 1.0)."""
    port = free_port()
    args = ["--port", str(port), "--allow-no-token", "--target-chars", "10"]
    service = start_service("reward-plugin", "services.reward_plugin", {}, args)
    service.port = port
    try:
        wait_http_ok(f"{service.url}/health", 60)
        rollouts = [make_trajectory_rollout(group_size=2), make_rollout(make_task(group_size=2), tokens=3)]
        await StreamProducer(redis_client, keys.rollouts).add_many([(r.group_id, encode(r)) for r in rollouts])
        spec = RewardSpec(name="brevity", url=f"{service.url}/score", **FAST)
        fed = [r.group_id for r in rollouts]
        accounting, groups, loop = await _score_in_process(redis_client, keys, [spec], fed)
    finally:
        service.stop()
    assert not accounting.dead and loop.functions[0].stats.errors == 0
    by_id = {g.group_id: g.rewards_per_func[:, 0].tolist() for g in groups}
    assert by_id == {fed[0]: pytest.approx([0.2, 0.2]), fed[1]: pytest.approx([0.2, 0.2])}
