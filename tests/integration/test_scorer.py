"""The scorer against real Redis and real plugin processes: faulty optional plugins give NaN and counts,
every group is still scored; the example plugin speaks the protocol; two scorer replicas never score a group
twice. (Required rewards' faults: ``test_reward_outages.py``.)"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter

import httpx
import numpy as np
import pytest

from services.scorer.rewards.functions import RewardBatch, score_batch
from services.scorer.rewards.http_plugin import HttpRewardPlugin
from services.scorer.scoring import build_functions, reward_batch
from services.scorer.scoring_loop import ScoringLoop
from shared.codec import decode, encode
from shared.config.scorer import RewardSpec
from shared.keys import Keys
from shared.records import AdvantageSpec, ScoredGroup
from shared.streams import StreamConsumer, StreamProducer
from tests.support.factories import make_rollout, make_task
from tests.support.processes import start_service, wait_http_ok
from tests.support.redis_server import free_port

pytestmark = pytest.mark.integration

TAGGED = "<think>r</think><answer>5</answer>"
JUDGE_TOKEN = "judge-token-" + "x" * 32  # the plugin takes no shorter one


@pytest.fixture(scope="module")
def fault_plugin():
    port = free_port()
    service = start_service("fault-plugin", "tests.support.fault_plugin", {}, ["--port", str(port)])
    service.port = port
    try:
        wait_http_ok(f"{service.url}/ok/health", 60)
        yield service
    finally:
        service.stop()


async def _fill_rollouts(client, keys: Keys, n: int) -> list[str]:
    rollouts = [make_rollout(make_task(group_size=4), tokens=3 + i, seed=i) for i in range(n)]
    await StreamProducer(client, keys.rollouts).add_many([(r.group_id, encode(r)) for r in rollouts])
    return [r.group_id for r in rollouts]


async def _scored(client, keys: Keys) -> list[ScoredGroup]:
    return [decode(fields[b"data"], ScoredGroup) for _, fields in await client.xrange(keys.scored)]


async def test_faulty_optional_plugins_give_nan_and_counted_errors_and_every_group_is_scored(
    fault_plugin, redis_client, keys
):
    keys = Keys(keys.prefix)
    specs = [RewardSpec(name="digit")] + [
        RewardSpec(
            name=mode,
            url=f"{fault_plugin.url}/{mode}/score",
            timeout_s=0.5,
            retries=1,
            backoff_s=0.01,
            breaker_failures=100,
            required=mode == "ok",
        )
        for mode in ("ok", "slow", "error", "malformed", "wrong-count")
    ]
    group_ids = await _fill_rollouts(redis_client, keys, 6)
    async with httpx.AsyncClient() as http:
        functions, plugins = build_functions(specs, http)
        assert all(await asyncio.gather(*(p.probe(attempts=1) for p in plugins)))
        consumer = StreamConsumer(redis_client, keys, keys.rollouts, Keys.SCORERS, "s1", block_ms=100)
        await consumer.start()
        loop = ScoringLoop(
            consumer,
            StreamProducer(redis_client, keys.scored),
            functions,
            [1.0] * len(specs),
            AdvantageSpec(),
            drop_zero_std=False,
            max_in_flight=6,
        )
        stop = asyncio.Event()
        runner = asyncio.create_task(loop.run(stop))
        deadline = time.monotonic() + 60
        while await redis_client.xlen(keys.scored) < len(group_ids):
            assert time.monotonic() < deadline and not runner.done()
            await asyncio.sleep(0.1)
        stop.set()
        await runner
        calls = httpx.get(f"{fault_plugin.url}/calls").json()
    groups = await _scored(redis_client, keys)
    assert sorted(g.group_id for g in groups) == sorted(group_ids)
    names = list(groups[0].reward_names)
    for group in groups:
        matrix = group.rewards_per_func
        assert not np.isnan(matrix[:, names.index("digit")]).any()
        lengths = [len(c.token_ids) for c in group.rollout.completions]
        assert matrix[:, names.index("ok")].tolist() == lengths
        for broken in ("slow", "error", "malformed", "wrong-count"):
            assert np.isnan(matrix[:, names.index(broken)]).all(), broken
        assert np.isfinite(group.rewards).all()  # the working functions still give a combined reward
    stats = {f.name: f.stats for f in functions}
    for broken in ("slow", "error", "malformed", "wrong-count"):
        assert stats[broken].errors == len(group_ids), broken
    assert stats["ok"].errors == 0
    # Timeouts and 500s are retried once; malformed and wrong-count answers are not.
    assert calls["slow"] == calls["error"] == 2 * len(group_ids)
    assert calls["malformed"] == calls["wrong-count"] == len(group_ids)
    print("\nerrors per function:", {k: v.errors for k, v in stats.items()}, "calls:", calls)


async def test_held_out_rollouts_go_to_the_evaluated_stream_with_the_same_rewards(redis_client, keys):
    """A rollout of a held-out prompt (``eval_step`` set) is scored by the same functions and written to the
    evaluated stream, never to the training stream; a group of one is fine there (no advantage needed)."""
    keys = Keys(keys.prefix)
    training = [make_rollout(make_task(group_size=4), seed=i) for i in range(2)]
    held_out = [make_rollout(make_task(group_size=1, eval_step=3), seed=i) for i in range(3)]
    await StreamProducer(redis_client, keys.rollouts).add_many([(r.group_id, encode(r)) for r in training + held_out])
    async with httpx.AsyncClient() as http:
        functions, _ = build_functions([RewardSpec(name="correctness")], http)
        consumer = StreamConsumer(redis_client, keys, keys.rollouts, Keys.SCORERS, "s1", block_ms=100)
        await consumer.start()
        loop = ScoringLoop(
            consumer,
            StreamProducer(redis_client, keys.scored),
            functions,
            [1.0],
            AdvantageSpec(),
            evaluated=StreamProducer(redis_client, keys.evaluated),
            drop_zero_std=True,
            max_in_flight=4,
        )
        stop = asyncio.Event()
        runner = asyncio.create_task(loop.run(stop))
        deadline = time.monotonic() + 60
        while loop.stats.groups_scored + loop.stats.groups_evaluated < 5:
            assert time.monotonic() < deadline and not runner.done()
            await asyncio.sleep(0.05)
        stop.set()
        await runner
    scored = await _scored(redis_client, keys)
    evaluated = [decode(f[b"data"], ScoredGroup) for _, f in await redis_client.xrange(keys.evaluated)]
    assert sorted(g.group_id for g in scored) == sorted(r.group_id for r in training)
    assert sorted(g.group_id for g in evaluated) == sorted(r.group_id for r in held_out)
    for group in evaluated:
        text = group.rollout.completions[0].text  # "<answer>0</answer>"; the answer is 5
        assert group.rewards.tolist() == [0.0] and text == "<answer>0</answer>"
        assert group.advantages.tolist() == [0.0] and not group.dropped
    assert loop.stats.counters()["scorer/groups_evaluated"] == 3


async def test_open_breaker_short_circuits_and_down_plugin_fails_probe(redis_client):
    async with httpx.AsyncClient() as http:
        down = HttpRewardPlugin(
            "down",
            f"http://127.0.0.1:{free_port()}/score",
            http,
            timeout_s=0.2,
            retries=0,
            breaker_failures=2,
            breaker_reset_s=60,
            required=False,
        )
        assert await down.probe(attempts=2, delay_s=0.01) is False
        assert down.breaker.state == "open" and "health probe of" in down.breaker.last_error
        assert "ConnectError" in down.breaker.last_error
        functions, _ = build_functions([RewardSpec(name="digit")], http)
        function = down.as_function()
        batch = RewardBatch(["p"], ["<answer>1</answer>"], [[1]], {}, group_id="g")
        matrix = await score_batch([functions[0], function], batch)
        assert matrix[0, 0] == 1.0 and math.isnan(matrix[0, 1])
        assert function.stats.short_circuited == 1 and function.stats.calls == 0


def test_example_plugin_speaks_the_protocol():
    port = free_port()
    service = start_service(
        "example-plugin", "services.reward_plugin", {}, ["--port", str(port), "--target-chars", "5", "--allow-no-token"]
    )
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 60)
        body = {
            "protocol": "asyncgrpo.reward/v1",
            "items": [
                {"prompt": "p", "completion": "short", "completion_ids": [1], "columns": {}},
                {
                    "prompt": [{"role": "user", "content": "p"}],
                    "completion": [{"role": "assistant", "content": "x" * 8}],
                    "completion_ids": [1, 2],
                    "columns": {"answer": "1"},
                },
            ],
        }
        reply = httpx.post(f"http://127.0.0.1:{port}/score", json=body)
        assert reply.status_code == 200
        assert reply.json()["rewards"] == [1.0, pytest.approx(0.4)]
        bad = httpx.post(f"http://127.0.0.1:{port}/score", json={**body, "protocol": "v0"})
        assert bad.status_code == 422
        assert httpx.get(f"http://127.0.0.1:{port}/schema").json()["title"] == "asyncgrpo.reward/v1"
    finally:
        service.stop()


async def test_one_command_plugin_serves_a_trl_function_to_the_scorer(redis_client, keys):
    """``python -m services.reward_plugin --function module:function`` with a bearer token, scored through
    the scorer's HTTP client: the same values as the function called in-process."""
    port = free_port()
    service = start_service(
        "function-plugin",
        "services.reward_plugin",
        {"JUDGE_TOKEN": JUDGE_TOKEN},
        ["--port", str(port), "--function", "tests.support.trl_doc_rewards:reward_len", "--token-env", "JUDGE_TOKEN"],
    )
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 60)
        rollout = make_rollout(make_task(group_size=4, prompt="2+3?"))
        spec = RewardSpec(name="len", url=f"http://127.0.0.1:{port}/score", bearer_token=JUDGE_TOKEN)
        wrong = RewardSpec(name="len", url=f"http://127.0.0.1:{port}/score", bearer_token="nope", required=False)
        async with httpx.AsyncClient() as http:
            (function,), _ = build_functions([spec], http)
            (refused,), _ = build_functions([wrong], http)
            batch = reward_batch(rollout)
            matrix = await score_batch([function, refused], batch)
        expected = [-abs(20 - len(c.text)) for c in rollout.completions]
        assert matrix[:, 0].tolist() == expected
        assert np.isnan(matrix[:, 1]).all() and "HTTP 401" in refused.stats.last_error
    finally:
        service.stop()


@pytest.mark.smokes("python -m services.scorer")
async def test_two_scorer_replicas_never_score_twice_and_finish_a_killed_ones_groups(redis_url, redis_client, keys):
    keys = Keys(keys.prefix)
    group_ids = await _fill_rollouts(redis_client, keys, 30)
    rewards = json.dumps([{"name": "slow_len", "function": "tests.support.trl_doc_rewards:slow_length_reward"}])

    def start(name: str):
        return start_service(
            name,
            "services.scorer",
            {
                "REDIS_URL": redis_url,
                "STREAM_PREFIX": keys.prefix,
                "SCORER_SCORER_ID": name,
                "SCORER_REWARDS": rewards,
                "SCORER_PORT": str(free_port()),
                "SCORER_CLAIM_IDLE_MS": "1500",
                "SCORER_MAX_GROUPS_IN_FLIGHT": "2",
            },
        )

    survivor, victim = start("scorer-a"), start("scorer-b")
    try:
        for service in (survivor, victim):
            await asyncio.to_thread(service.wait_for_line, "ready", 60)
        deadline = time.monotonic() + 120
        while sum(g.scorer_id == "scorer-b" for g in await _scored(redis_client, keys)) < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        victim.kill()
        while await redis_client.xlen(keys.scored) < len(group_ids):
            assert time.monotonic() < deadline, survivor.output()[-3000:]
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.5)
        groups = await _scored(redis_client, keys)
        counts = Counter(g.group_id for g in groups)
        assert set(counts) == set(group_ids) and max(counts.values()) == 1
        assert (await redis_client.xpending(keys.rollouts, Keys.SCORERS))["pending"] == 0
        print(f"\nscored={len(groups)} unique={len(counts)}")
    finally:
        victim.kill()
        assert survivor.stop() == 0, survivor.output()[-3000:]
