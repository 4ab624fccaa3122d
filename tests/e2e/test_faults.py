"""Fault injection on the whole pipeline (tiny model, vLLM-CPU, real Redis with AOF, gloo):

SIGKILL a generator mid-batch, SIGKILL a scorer, stall the learner (backpressure), take the HTTP reward
plugin down for 30 s, restart Redis, SIGKILL the learner between a checkpoint and the next step - in one
run. An "audit" consumer group on each stream sees every record id; at the end every admitted group must be
trained exactly once, or dropped with a logged reason, or dead-lettered, or still waiting in a stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections import Counter
from pathlib import Path

import pytest

from shared.keys import Keys
from shared.redis_conn import RedisRetry, make_client
from tests.support.e2e_config import learner_tables
from tests.support.e2e_watch import audit_streams, wait_until
from tests.support.processes import ServiceProcess, start_service, wait_http_ok
from tests.support.redis_server import free_port, start_redis
from tests.support.tiny_model import build_tiny_llama

# Every service starts its own vLLM or torch on 2 cores: minutes on an idle machine, more under load.
pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

STEPS = 90  # enough that every fault below lands while training runs (about 1.2 s per step)
PLUGIN_DOWN_S = 30


def _config(tmp: Path, model: Path, plugin_port: int) -> Path:
    learner = learner_tables(
        model,
        STEPS,
        lr=1e-2,
        max_completion_length=12,
        max_prompt_length=128,
        run_name="faults",  # the restarted learner continues this run
        checkpoint_dir=f"{tmp}/checkpoints",
        checkpoint_every=4,
        log_dir=f"{tmp}/logs",
        weight_sync_port=0,
        port=0,
    )
    text = f"""
[common]
log_level = "INFO"

[generator]
model = "{model}"
dtype = "float32"
max_model_len = 256
claim_idle_ms = 3000
heartbeat_ttl_s = 3
max_prompts_in_flight = 4

[scorer]
claim_idle_ms = 3000
port = 0

[[scorer.rewards]]
name = "letter_a"
function = "tests.support.e2e_rewards:letter_a"

[[scorer.rewards]]
name = "brevity"
url = "http://127.0.0.1:{plugin_port}/score"
weight = 0.1
timeout_s = 1
retries = 1
backoff_s = 0.05
breaker_failures = 2
breaker_reset_s = 3

{learner}
"""
    path = tmp / "faults.toml"
    path.write_text(text)
    return path


class Audit:
    """Reads every stream through a consumer group of its own and records each record id it sees."""

    def __init__(self, client, keys: Keys) -> None:
        self.client, self.keys = client, keys
        self.seen: dict[str, Counter] = {name: Counter() for name in ("prompts", "rollouts", "scored")}
        self.retry = RedisRetry(give_up_s=120)

    async def run(self, stop: asyncio.Event) -> None:
        streams = {getattr(self.keys, name): name for name in self.seen}

        def record(stream: str, delivery) -> None:
            self.seen[streams[stream]][delivery.record_id] += 1

        await audit_streams(self.client, self.keys, list(streams), record, stop, retry=self.retry)


def _steps(log_dir: Path) -> int:
    path = log_dir / "batches.jsonl"
    if not path.exists():
        return 0
    return max((json.loads(line)["step"] for line in path.read_text().splitlines()), default=0)


async def _wait(condition, what: str, timeout_s: float, services: list[ServiceProcess]) -> None:
    """Until ``condition()``; fails when a service but the learner killed on purpose exits meanwhile."""
    await wait_until(condition, what, timeout_s, services, killed=("learner-killed",))


async def test_nothing_is_lost_or_trained_twice_under_faults(tmp_path, request):
    model = build_tiny_llama(tmp_path / "tiny", seed=5, logit_scale=1.0)
    redis_server = start_redis(appendonly=True)
    request.addfinalizer(redis_server.stop)  # also when the run fails before the accounting below
    plugin_port = free_port()
    config = _config(tmp_path, model, plugin_port)
    prefix = "faults"
    keys = Keys(prefix)
    env = {
        "ASYNCGRPO_CONFIG": str(config),
        "REDIS_URL": redis_server.url,
        "STREAM_PREFIX": prefix,
        "API_TOKEN": "fault-token-" + "x" * 32,
    }
    log_dir = tmp_path / "logs"
    client = make_client(redis_server.url)
    stop_audit = asyncio.Event()
    audit = Audit(client, keys)
    audit_task = asyncio.create_task(audit.run(stop_audit))
    await asyncio.sleep(0.5)

    def generator(i: int) -> ServiceProcess:
        port = free_port()
        return start_service(
            f"gen-{i}",
            "services.generator",
            {
                **env,
                "GENERATOR_GENERATOR_ID": f"gen-{i}",
                "GENERATOR_PORT": str(port),
                "GENERATOR_PUBLIC_URL": f"http://127.0.0.1:{port}",
                "GENERATOR_OMP_CPUS": str(i),
            },
        )

    def plugin() -> ServiceProcess:
        return start_service(
            "plugin",
            "services.reward_plugin",
            {},
            ["--port", str(plugin_port), "--target-chars", "8", "--allow-no-token"],
        )

    def learner(name: str) -> ServiceProcess:
        return start_service(name, "services.learner", env)

    services = [
        plugin(),
        generator(0),
        generator(1),
        start_service("scorer-0", "services.scorer", {**env, "SCORER_SCORER_ID": "scorer-0"}),
        start_service("scorer-1", "services.scorer", {**env, "SCORER_SCORER_ID": "scorer-1"}),
    ]
    by_name = {s.name: s for s in services}
    events: list[str] = []
    try:
        wait_http_ok(f"http://127.0.0.1:{plugin_port}/health", 60)
        for name in ("gen-0", "gen-1"):
            await asyncio.to_thread(by_name[name].wait_for_line, "ready on port", 300)
        the_learner = learner("learner")
        services.append(the_learner)

        await _wait(lambda: _steps(log_dir) >= 3, "step 3", 300, services)
        by_name["gen-1"].kill()
        events.append(f"SIGKILL gen-1 at step {_steps(log_dir)}")

        await _wait(lambda: _steps(log_dir) >= 6, "step 6", 300, [s for s in services if s.name != "gen-1"])
        by_name["scorer-1"].kill()
        events.append(f"SIGKILL scorer-1 at step {_steps(log_dir)}")
        alive = [s for s in services if s.name not in ("gen-1", "scorer-1")]

        # Backpressure: a stalled learner admits nothing; backlogs stay bounded and the generator idles.
        await _wait(lambda: _steps(log_dir) >= 8, "step 8", 300, alive)
        os.kill(the_learner.process.pid, signal.SIGSTOP)
        await asyncio.sleep(3)
        memory_before = (await client.info("memory"))["used_memory"]
        backlog_before = sum([await client.xlen(getattr(keys, n)) for n in ("prompts", "rollouts", "scored")])
        await asyncio.sleep(8)
        memory_after = (await client.info("memory"))["used_memory"]
        backlog_after = sum([await client.xlen(getattr(keys, n)) for n in ("prompts", "rollouts", "scored")])
        os.kill(the_learner.process.pid, signal.SIGCONT)
        events.append(
            f"learner stalled 11 s: stream entries {backlog_before} -> {backlog_after}, Redis memory "
            f"{memory_before} -> {memory_after} bytes"
        )
        assert backlog_after == backlog_before, "nothing may be admitted while the learner is stalled"
        assert memory_after - memory_before < 1_000_000

        await _wait(lambda: _steps(log_dir) >= 10, "step 10", 300, alive)
        by_name["plugin"].stop()
        events.append(f"plugin down at step {_steps(log_dir)}")
        await asyncio.sleep(PLUGIN_DOWN_S)
        replacement = plugin()
        services.append(replacement)
        wait_http_ok(f"http://127.0.0.1:{plugin_port}/health", 60)
        events.append(f"plugin back at step {_steps(log_dir)} after {PLUGIN_DOWN_S} s")
        alive = [s for s in services if s.name not in ("gen-1", "scorer-1") and s is not by_name["plugin"]]

        redis_at = max(40, _steps(log_dir) + 3)
        await _wait(lambda: _steps(log_dir) >= redis_at, f"step {redis_at}", 300, alive)
        redis_server.stop()
        await asyncio.sleep(2)
        redis_server.start()
        events.append(f"Redis restarted (AOF) at step {_steps(log_dir)}")

        def between_checkpoint_and_next_step() -> bool:
            checkpoints = [
                int(p.name.split("-")[1])
                for p in (tmp_path / "checkpoints").glob("step-*")
                if not p.name.endswith(".tmp")
            ]
            latest = max(checkpoints, default=0)
            return latest >= redis_at + 4 and _steps(log_dir) == latest + 1

        await _wait(between_checkpoint_and_next_step, "a checkpoint and the next step", 300, alive)
        the_learner.kill()
        the_learner.name = "learner-killed"
        events.append(f"SIGKILL learner during step {_steps(log_dir)}")
        restarted = learner("learner-2")
        services.append(restarted)
        alive = [s for s in alive if s is not the_learner] + [restarted]
        line = await asyncio.to_thread(restarted.wait_for_line, "learner ready", 120)
        events.append(f"learner restarted: {line.strip()}")
        last = await asyncio.to_thread(restarted.wait_for_line, "learner finished", 600)
        assert f"learner finished: step {STEPS} of {STEPS};" in last, restarted.output()[-3000:]
        assert await asyncio.to_thread(restarted.process.wait, 120) == 0, restarted.output()[-3000:]
        await asyncio.sleep(1.0)  # let the audit read the last entries
    finally:
        stop_audit.set()
        await asyncio.wait_for(audit_task, 60)
        codes = {s.name: s.stop() for s in services if s.name not in ("gen-1", "scorer-1", "learner-killed")}
        for service in services:  # what a failure left running: gen-1 and scorer-1 before their SIGKILL
            service.kill()

    # Accounting ----------------------------------------------------------------------------------------
    admitted = set(audit.seen["prompts"])
    state = json.loads((tmp_path / "checkpoints" / f"step-{STEPS}" / "state.json").read_text())
    trained = Counter(state["trained_group_ids"])
    drops = (
        [json.loads(line) for line in (log_dir / "dropped.jsonl").read_text().splitlines()]
        if (log_dir / "dropped.jsonl").exists()
        else []
    )
    dropped = {d["group_id"] for d in drops}
    dead = {fields[b"id"].decode() for _, fields in await client.xrange(keys.dead_letter)}
    waiting = set()
    for name in ("prompts", "rollouts", "scored"):
        waiting |= {fields[b"id"].decode() for _, fields in await client.xrange(getattr(keys, name))}
    await client.aclose()
    redis_server.stop()

    lost = admitted - set(trained) - dropped - dead - waiting
    counts = {
        "admitted": len(admitted),
        "rolled_out": len(audit.seen["rollouts"]),
        "scored": len(audit.seen["scored"]),
        "trained": len(trained),
        "dropped": dict(Counter(d["reason"] for d in drops)),
        "dead_lettered": len(dead),
        "still_in_streams": len(waiting & admitted - set(trained)),
        "lost": len(lost),
        "trained_twice": sum(1 for n in trained.values() if n > 1),
    }
    print("\nfault events:\n  " + "\n  ".join(events))
    print("counts:", json.dumps(counts))
    print("exit codes:", codes)
    assert counts["trained_twice"] == 0
    assert not lost, f"{len(lost)} admitted groups were lost"
    assert max(audit.seen["rollouts"].values()) == 1 and max(audit.seen["scored"].values()) == 1
    assert len(trained) == STEPS * 2
    assert all(code == 0 for code in codes.values()), codes
    assert events[-1].startswith("learner restarted") and _steps(log_dir) == STEPS
