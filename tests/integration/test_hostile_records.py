"""Hostile rollouts and hanging Python rewards against real Redis (issue 33).

A rollout whose columns take a reward-function argument's name, or hold what a plugin's JSON request cannot
carry, is dead-lettered at once as a bad record with its reason; so is a group the plugin protocol cannot
hold. The scorer keeps scoring the valid groups, the plugin's breaker stays closed and ``/ready`` blames no
one. A Python reward that hangs is abandoned at ``timeout_s`` and handled as an outage: the group is held
and retried, or dead-lettered after ``max_reward_wait_s``, and the abandoned call never becomes a reward.
"""

from __future__ import annotations

import asyncio
import math
import threading

import httpx
import msgpack
import pytest

from shared.codec import encode
from shared.config.scorer import RewardSpec
from shared.keys import Keys
from shared.records import Rollout
from shared.reward_protocol import MAX_ITEMS
from shared.streams import StreamProducer
from tests.integration.test_reward_outages import (
    FAST,
    _account,
    _feed,
    _ready,
    _required_column_is_complete,
    _score_in_process,
    _scorer,
    _start_plugin,
    _wait_done,
)
from tests.support import fault_plugin
from tests.support.factories import make_rollout, make_task
from tests.support.processes import wait_http_ok
from tests.support.redis_server import free_port

pytestmark = pytest.mark.integration


def _hostile(rollout: Rollout, **columns) -> bytes:
    """``rollout`` encoded with ``columns`` put into its task behind the record model's back."""
    envelope = msgpack.unpackb(encode(rollout), raw=False, strict_map_key=False)
    envelope["body"]["task"]["columns"].update(columns)
    return msgpack.packb(envelope, use_bin_type=True)


async def _feed_hostile(client, keys: Keys) -> dict[str, str]:
    """Four hostile rollouts and one too large for the plugin protocol; group id -> what its reason names."""
    entries, expected = [], {}
    for seed, (columns, named) in enumerate(
        [
            ({"completions": ["injected"] * 4}, "column completions has the name of a reward-function argument"),
            ({"prompts": "x"}, "column prompts has the name of a reward-function argument"),
            ({"blob": b"\x00\xff"}, "column 'blob' holds a value of type bytes"),
            ({"score": math.nan}, "column 'score' holds nan"),
        ]
    ):
        rollout = make_rollout(make_task(group_size=4), tokens=4, seed=100 + seed)
        entries.append((rollout.group_id, _hostile(rollout, **columns)))
        expected[rollout.group_id] = named
    huge = make_rollout(make_task(group_size=MAX_ITEMS + 1), tokens=1, seed=200)
    entries.append((huge.group_id, encode(huge)))
    expected[huge.group_id] = f"RewardInputError: reward judge on group {huge.group_id}: the group cannot be sent"
    await StreamProducer(client, keys.rollouts).add_many(entries)
    return expected


async def test_hostile_rollouts_are_dead_lettered_as_bad_records_and_the_plugin_stays_trusted(
    redis_url, redis_client, keys
):
    """The scorer process with a built-in (digit) and an HTTP plugin, both required: valid groups around the
    hostile ones are scored, the hostile ones dead-lettered with their reasons; the plugin is called for the
    valid groups only, its breaker stays closed, ``/ready`` stays 200 and the bad inputs are counted."""
    keys = Keys(keys.prefix)
    port = free_port()
    plugin = _start_plugin(port)
    rewards = [{"name": "digit"}, {"name": "judge", "url": f"http://127.0.0.1:{port}/score", **FAST}]
    # A group the plugin protocol cannot hold, within the scorer's own bound on group sizes.
    scorer = _scorer("scorer-hostile", redis_url, keys, rewards, {"SCORER_MAX_GROUP_SIZE": str(MAX_ITEMS + 1)})
    try:
        wait_http_ok(f"{plugin.url}/health", 60)
        await asyncio.to_thread(scorer.wait_for_line, "scorer-hostile ready", 90)
        fed = await _feed(redis_client, keys, 2)
        expected = await _feed_hostile(redis_client, keys)
        fed += list(expected) + await _feed(redis_client, keys, 2, first=2)
        await _wait_done(redis_client, keys, len(fed), 60, alive=lambda: scorer.process.poll() is None)
        ready = _ready(scorer)
        metrics = httpx.get(f"{scorer.url}/metrics").text
        calls = httpx.get(f"{plugin.url}/calls").json()
    finally:
        plugin.stop()
        assert scorer.stop() == 0, scorer.output()[-3000:]
    accounting, groups = await _account(redis_client, keys, len(fed))
    accounting.check(fed)
    print("plugin calls:", calls, "dead letters:", accounting.dead)
    assert set(accounting.dead) == set(expected) and len(accounting.scored) == 4
    for group_id, named in expected.items():
        assert named in accounting.dead[group_id], accounting.dead[group_id]
    _required_column_is_complete(groups, "judge")
    assert calls == {"ok": 4}  # never asked about a hostile group, never sent an injected column
    assert ready.status_code == 200 and ready.json()["plugins"] == {"digit": "closed", "judge": "closed"}
    assert 'asyncgrpo_rewards_bad_inputs_total{function="judge"} 1.0' in metrics
    assert 'asyncgrpo_rewards_errors_total{function="judge"} 0.0' in metrics
    assert "asyncgrpo_scorer_rejected_total 5.0" in metrics
    assert "asyncgrpo_scorer_groups_dead_lettered_total 0.0" in metrics  # no reward failed for these
    assert "a bug in the function" not in scorer.output()


async def test_a_hanging_python_reward_is_held_as_an_outage_and_never_gives_a_reward(redis_client, keys, caplog):
    """Required: its first two calls hang, are abandoned at timeout_s and counted; the group is held and
    retried, and every group is scored with the function's real answers. Always hanging: the group is
    dead-lettered after max_reward_wait_s with the timeout as the reason, never scored."""
    fault_plugin.python_calls.clear()
    fault_plugin.hang_script.update(calls=2, release=threading.Event())
    spec = RewardSpec(name="hang", function="tests.support.fault_plugin:hangs_first", timeout_s=1.0)
    try:
        keys = Keys(keys.prefix)
        fed = await _feed(redis_client, keys, 3)
        accounting, groups, loop = await _score_in_process(redis_client, keys, [spec], fed, in_flight=1)
        _required_column_is_complete(groups, "hang")
        function = loop.functions[0]
        assert len(accounting.scored) == 3 and not accounting.dead
        assert function.stats.timeouts == 2 and function.stats.bugs == 0 and loop.stats.group_retries >= 2
        assert function.threads is not None and function.threads.hung == 2
        assert "RewardTimeoutError: no answer within timeout_s=1" in caplog.text
        assert "the group waits and is retried" in caplog.text

        fault_plugin.hang_script["calls"] = 10**6
        keys2 = Keys(f"{keys.prefix}:always")  # under the prefix the fixture cleans
        fed = await _feed(redis_client, keys2, 2)
        accounting, groups, loop = await _score_in_process(
            redis_client, keys2, [spec], fed, max_wait_s=1.5, in_flight=2
        )
        assert not groups and len(accounting.dead) == 2
        for reason in accounting.dead.values():
            assert "max_reward_wait_s=1.5" in reason and "RewardTimeoutError: no answer within timeout_s=1" in reason
        assert loop.functions[0].stats.timeouts >= 2 and loop.functions[0].stats.bugs == 0
    finally:
        fault_plugin.hang_script["release"].set()
