"""Hostile input to the reward path (issue 33): columns named after a reward-function argument, columns a
plugin's JSON request cannot carry, and Python rewards that never answer.

A bad column is refused where records are made (the feeder, at load), where they are read (the record
model, so a hostile entry is dead-lettered as a bad record) and by the plugin protocol's model; a group an
HTTP plugin cannot be sent is a bad input, never an outage that counts against the breaker. A Python reward
that hangs is abandoned at ``timeout_s`` as an outage, and its thread is counted as hung until it returns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time

import httpx
import msgpack
import pytest
from pydantic import ValidationError

from services.learner.data.feeder import load_rows
from services.scorer.rewards.functions import RewardBatch, RewardFailure, run_function
from services.scorer.rewards.http_plugin import HttpRewardPlugin, request_body
from services.scorer.rewards.reward_threads import RewardThreads
from services.scorer.rewards.trl_convention import trl_style
from services.scorer.scoring import build_functions, reward_batch
from shared.codec import WireError, decode, encode
from shared.columns import RESERVED_COLUMNS, column_problem
from shared.config.data import DataSettings
from shared.config.scorer import RewardSpec
from shared.dataset.sources import DataError
from shared.records import PromptTask, Rollout
from shared.reward_protocol import RewardItem
from tests.support.factories import make_rollout, make_task


def hostile(rollout: Rollout, **columns) -> bytes:
    """``rollout`` encoded with ``columns`` put into its task behind the record model's back."""
    envelope = msgpack.unpackb(encode(rollout), raw=False, strict_map_key=False)
    envelope["body"]["task"]["columns"].update(columns)
    return msgpack.packb(envelope, use_bin_type=True)


@pytest.mark.parametrize("name", RESERVED_COLUMNS)
def test_no_record_carries_a_column_named_after_a_reward_argument(name):
    with pytest.raises(ValidationError, match=f"column {name} has the name of a reward-function argument"):
        make_task(columns={"answer": "5", name: "x"})
    with pytest.raises(WireError, match=f"task.columns: .*column {name} has the name.*rename_columns"):
        decode(hostile(make_rollout(), **{name: ["x"] * 4}), Rollout)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (b"\x00\xff", "a value of type bytes"),
        (math.nan, "nan (JSON has no NaN or infinity)"),
        ([1, {"k": math.inf}], "inf (JSON has no NaN or infinity)"),
        ({1: "a"}, "a map with a key that is not a string"),
        (2**70, "beyond 64 bits"),
        ({1, 2}, "a value of type set"),
    ],
)
def test_a_column_json_cannot_carry_is_refused_with_what_it_holds(value, problem):
    found = column_problem("blob", value)
    assert found is not None and problem in found and "column 'blob' holds" in found
    with pytest.raises(ValidationError, match="JSON request cannot carry"):
        make_task(columns={"blob": value})


def test_deep_nesting_and_the_budget_column_are_checked():
    deep: list = []
    for _ in range(40):
        deep = [deep]
    assert "nested deeper than 32" in (column_problem("deep", deep) or "")
    assert column_problem("max_completion_length", 64) is None
    assert column_problem("max_completion_length", 64.0) is None  # a parquet int column with gaps is float
    for bad in ("64", 0, True, 1.5, None):
        assert "positive integer" in (column_problem("max_completion_length", bad) or ""), bad
    plain = {"answer": "5", "meta": {"level": [1, 2.5, None, True]}, "t": (1, 2)}
    assert make_task(columns=plain).columns == plain


def test_a_bytes_column_in_a_hostile_entry_is_a_wire_error_naming_it():
    with pytest.raises(WireError, match="column 'blob' holds a value of type bytes"):
        decode(hostile(make_rollout(), blob=b"\x00\xff"), Rollout)


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_the_feeder_refuses_a_reserved_or_unsendable_column_at_load_naming_it_and_the_fix(tmp_path):
    source = _jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "answer": "1"}, {"prompt": "r", "completion_ids": [1]}])
    with pytest.raises(DataError) as refused:
        load_rows(DataSettings(source=source))
    message = str(refused.value)
    assert "d.jsonl, row 0: column completion_ids has the name of a reward-function argument" in message
    assert "rename it with data.rename_columns" in message
    renamed = load_rows(DataSettings(source=source, rename_columns={"completion_ids": "reference_ids"}))
    assert renamed[1].columns["reference_ids"] == [1]
    infinite = tmp_path / "i.jsonl"
    infinite.write_text('{"prompt": "q", "score": Infinity}\n')
    with pytest.raises(DataError, match="column 'score' holds inf"):
        load_rows(DataSettings(source=str(infinite)))
    budget = _jsonl(tmp_path / "b.jsonl", [{"prompt": "q", "max_completion_length": "long"}])
    with pytest.raises(DataError, match="max_completion_length is the token budget"):
        load_rows(DataSettings(source=budget))


def test_the_plugin_protocol_refuses_reserved_and_non_json_columns():
    item = {"prompt": "p", "completion": "c", "completion_ids": [1]}
    with pytest.raises(ValidationError, match="column completions has the name of a reward-function argument"):
        RewardItem.model_validate({**item, "columns": {"completions": ["x"]}})
    with pytest.raises(ValidationError, match="column 'x' holds nan"):
        RewardItem.model_validate({**item, "columns": {"x": math.nan}})
    assert RewardItem.model_validate({**item, "columns": {"max_completion_length": 8}}).columns


def _unsendable_batch() -> RewardBatch:
    batch = reward_batch(make_rollout(make_task(group_size=2)))
    return RewardBatch(batch.prompts, batch.completions, batch.completion_ids, {"blob": [b"\xff", b"\xff"]}, "g1")


async def test_a_group_a_plugin_cannot_be_sent_is_a_bad_input_not_an_outage(caplog):
    sent: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json={"rewards": [1.0, 1.0]})

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        plugin = HttpRewardPlugin("judge", "http://judge/score", client, breaker_failures=1)
        for _ in range(3):
            failure = await run_function(plugin.as_function(), _unsendable_batch())
            assert isinstance(failure, RewardFailure) and failure.bad_input and not failure.bug
        assert "column 'blob' holds a value of type bytes" in failure.detail
        assert plugin.breaker.state == "closed" and plugin.breaker.failures == 0
        assert plugin.stats.bad_inputs == 3 and plugin.stats.errors == 0 and not sent
        good = reward_batch(make_rollout(make_task(group_size=2)))
        assert await run_function(plugin.as_function(), good) == [1.0, 1.0]
    body = sent[0].content
    assert sent[0].headers["content-type"] == "application/json" and body == request_body(good)
    assert b'"max_completion_length":32' in body and b'"answer":"5"' in body
    assert "cannot be sent, so it is dead-lettered as a bad record" in caplog.text


def _hanging(release: threading.Event, calls: list[float]):
    def reward(completions, **columns):
        calls.append(time.monotonic())
        release.wait(30)
        return [1.0] * len(completions)

    return reward


async def _until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


async def test_a_hanging_python_reward_is_abandoned_at_timeout_s_as_an_outage(caplog):
    release, calls = threading.Event(), []
    function = trl_style("hang", _hanging(release, calls), in_thread=True, required=True, timeout_s=0.2, threads=2)
    batch = reward_batch(make_rollout(make_task(group_size=2)))
    try:
        started = time.monotonic()
        failure = await run_function(function, batch)
        elapsed = time.monotonic() - started
        assert isinstance(failure, RewardFailure) and not failure.bug and not failure.bad_input
        assert 0.2 <= elapsed < 1.0, elapsed
        assert failure.detail == "RewardTimeoutError: no answer within timeout_s=0.2"
        assert function.stats.timeouts == 1 and function.stats.errors == 1 and function.breaker.failures == 1
        assert function.threads is not None and function.threads.hung == 1
        assert "its thread cannot be stopped and stays busy until the function returns (1 of 2" in caplog.text
        await run_function(function, batch)
        assert function.threads.hung == 2 and "all 2 of its threads are hung" in caplog.text
        # No thread is free: the next call is not even started, and says why.
        failure = await run_function(function, batch)
        assert isinstance(failure, RewardFailure) and "all 2 threads of reward hang were busy (2 hung" in failure.detail
        assert len(calls) == 2
    finally:
        release.set()
    await _until(lambda: function.threads.hung == 0)
    assert "returned after" in caplog.text and "thread is free again" in caplog.text
    assert await run_function(function, batch) == [1.0, 1.0]  # the late answers were thrown away; this one counts


async def test_a_coroutine_reward_is_cancelled_at_timeout_s_and_its_own_timeout_is_not_ours():
    async def sleeper(completions, **columns):
        await asyncio.sleep(10)

    def own_timeout(completions, **columns):
        raise TimeoutError("the judge's socket timed out")

    batch = reward_batch(make_rollout(make_task(group_size=2)))
    slow = trl_style("slow", sleeper, in_thread=True, timeout_s=0.1)
    failure = await run_function(slow, batch)
    assert isinstance(failure, RewardFailure) and failure.detail == "RewardTimeoutError: no answer within timeout_s=0.1"
    assert not failure.bug and slow.stats.timeouts == 1
    sock = trl_style("sock", own_timeout, in_thread=True, timeout_s=5)
    failure = await run_function(sock, batch)
    assert isinstance(failure, RewardFailure) and "the judge's socket timed out" in failure.detail
    assert not failure.bug and sock.stats.timeouts == 0 and sock.threads is not None and sock.threads.hung == 0


async def test_python_rewards_get_the_specs_timeout_and_threads_the_built_ins_run_inline():
    specs = [
        RewardSpec(name="hang", function="tests.support.fault_plugin:hangs_first", timeout_s=2.5, concurrency=3),
        RewardSpec(name="digit"),
    ]
    async with httpx.AsyncClient() as http:
        (python, builtin), _ = build_functions(specs, http)
    assert isinstance(python.threads, RewardThreads) and python.threads.size == 3
    assert builtin.threads is None
    assert RewardSpec(name="x", function="m:f").timeout_s == RewardSpec(name="y", url="http://p/score").timeout_s


def test_the_threads_are_daemons_so_a_hung_one_never_blocks_exit(caplog):
    caplog.set_level(logging.WARNING)
    release = threading.Event()
    runner = RewardThreads("hang", 1)

    async def one() -> None:
        with pytest.raises(TimeoutError):
            await runner.run(lambda: release.wait(30), {}, 0.05, "g")

    asyncio.run(one())  # the loop closes while the thread still runs: its late report is dropped quietly
    hung = [t for t in threading.enumerate() if t.name == "reward-hang"]
    assert hung and all(t.daemon for t in hung)
    release.set()
    for thread in hung:
        thread.join(5)


def test_prompt_task_columns_survive_the_wire():
    task = make_task(columns={"answer": "5", "meta": {"k": [1, None]}, "max_completion_length": 16})
    assert decode(encode(task), PromptTask).columns == task.columns
