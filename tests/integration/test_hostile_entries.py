"""Hostile bytes in Redis never stop a reader (real Redis, hypothesis over arbitrary bytes).

Every stream entry whose fields are not exactly a UTF-8 record id and a payload - whichever way it reaches the
consumer: its own pending entries after a restart, entries claimed from a dead consumer, new ones - is
dead-lettered once, with its reason and its exact fields, and every valid entry around it is delivered once.
Every registration that is not one (an index entry naming no registration key, a value that does not decode
or is over the size limit) is dropped from the index and set aside the same way, as is a learner's saved
feeder position that does not decode; an announcement that does not decode reads as absent, and the reader goes
on. A real scorer process fed such entries keeps
scoring and answering ``/health``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.codec import decode, encode
from shared.keys import Keys
from shared.records import CheckpointAnnouncement, GeneratorRegistration, ScoredGroup, WeightVersionAnnouncement
from shared.redis_conn import make_client
from shared.registry import (
    MAX_REGISTRATION_BYTES,
    RegistryStats,
    latest_checkpoint,
    latest_weights_version,
    live_generators,
    new_registration_key,
    register,
    set_aside,
)
from shared.streams import Output, StreamConsumer, StreamProducer, group_backlog
from tests.support.factories import make_rollout, make_task
from tests.support.hostile import EDGE_ENTRIES, decoded_raw, expected_reason, text_fields_of
from tests.support.processes import start_service, wait_http_ok
from tests.support.redis_server import free_port

pytestmark = pytest.mark.integration

GROUP = "workers"
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Valid entries that look odd: delivered like any other.
ODD_VALID = [
    {b"id": b"\x00 nul", b"data": b""},
    {b"id": "🙂 ünïcode".encode(), b"data": b"\xff\xfe"},
    {b"id": b"big", b"data": b"\x00" * 2_000_000},
]


malformed_entries = st.one_of(
    st.sampled_from(EDGE_ENTRIES[:-2]),
    st.dictionaries(st.binary(max_size=12), st.binary(max_size=64), min_size=1, max_size=4),
    st.fixed_dictionaries({b"id": st.binary(max_size=24), b"data": st.binary(max_size=64)}),
    st.fixed_dictionaries({b"id": st.binary(max_size=8), b"data": st.binary(max_size=8), b"x": st.binary()}),
).filter(lambda fields: expected_reason(fields) is not None)


valid_entries = st.builds(
    lambda record_id, data: {b"id": record_id.encode(), b"data": data},
    st.text(min_size=1, max_size=24),
    st.binary(max_size=128),
)


def _numbered(entries: list[dict[bytes, bytes]]) -> list[dict[bytes, bytes]]:
    """Valid entries get unique record ids (the same id twice is a duplicate, applied once by design)."""
    out = []
    for i, fields in enumerate(entries):
        if expected_reason(fields) is None:
            fields = {**fields, b"id": fields[b"id"] + f"#{i}".encode()}
        out.append(fields)
    return out


# Streams -----------------------------------------------------------------------------------------------


async def _drain(consumer: StreamConsumer, sink: StreamProducer, timeout_s: float = 30.0) -> None:
    """Read and commit until the group has nothing left, undelivered or pending."""
    deadline = time.monotonic() + timeout_s
    while await group_backlog(consumer.client, consumer.stream, GROUP) > 0:
        assert time.monotonic() < deadline, "the consumer did not get through the stream"
        for delivery in await consumer.read():
            await consumer.commit(delivery, [Output(sink, delivery.record_id, delivery.payload)])


async def _consume_and_check(redis_url: str, entries: list[dict[bytes, bytes]]) -> None:
    """Add ``entries``; a third is pending with the consumer under test (it "restarted"), a third with a dead
    consumer, the rest new. Every malformed one is dead-lettered once, every valid one delivered once."""
    keys = Keys(f"test-hostile-{uuid.uuid4().hex[:10]}")
    client = make_client(redis_url)
    source = f"{keys.prefix}:in"
    try:
        await client.xgroup_create(source, GROUP, id="0", mkstream=True)
        entry_ids = [(await client.xadd(source, fields)).decode() for fields in entries]
        third = len(entries) // 3
        if third:
            await client.xreadgroup(GROUP, "tested", {source: ">"}, count=third)
            await client.xreadgroup(GROUP, "dead", {source: ">"}, count=third)
        consumer = StreamConsumer(
            client, keys, source, GROUP, "tested", batch_size=4, block_ms=10, claim_idle_ms=50, max_deliveries=5
        )
        await _drain(consumer, StreamProducer(client, f"{keys.prefix}:out"))
        letters = [fields for _, fields in await client.xrange(keys.dead_letter)]
        delivered = Counter(fields[b"id"] for _, fields in await client.xrange(f"{keys.prefix}:out"))
    finally:
        doomed = [key async for key in client.scan_iter(match=f"{keys.prefix}:*", count=1000)]
        if doomed:
            await client.delete(*doomed)
        await client.aclose()

    bad = {entry_id: fields for entry_id, fields in zip(entry_ids, entries, strict=True) if expected_reason(fields)}
    by_entry = {letter[b"entry_id"].decode(): letter for letter in letters}
    assert len(letters) == len(by_entry) == len(bad), "every malformed entry dead-lettered exactly once"
    assert set(by_entry) == set(bad)
    for entry_id, fields in bad.items():
        letter = by_entry[entry_id]
        assert expected_reason(fields) in letter[b"reason"].decode(), (fields, letter[b"reason"])
        assert decoded_raw(letter) == fields, "the dead letter keeps the entry's fields exactly"
        assert letter[b"data"] == fields.get(b"data", b"")
        text = text_fields_of(letter)
        assert text["stream"] == source and text["group"] == GROUP
        assert text["id"] == fields.get(b"id", b"").decode("utf-8", "backslashreplace")
        position = entry_ids.index(entry_id)
        assert text["deliveries"] == ("2" if position < 2 * third else "1")
    valid = [fields[b"id"] for fields in entries if expected_reason(fields) is None]
    assert delivered == Counter(valid), "every valid entry delivered exactly once"
    assert consumer.stats.malformed == consumer.stats.dead_lettered == len(bad)
    assert consumer.stats.committed == len(valid)


@PROPERTY
@given(st.lists(st.one_of(malformed_entries, valid_entries), min_size=1, max_size=12))
def test_arbitrary_bytes_in_any_field_never_stop_the_consumer(redis_url, entries):
    asyncio.run(_consume_and_check(redis_url, _numbered(entries)))


def test_edge_cases_through_every_read_path(redis_url):
    """Each hand-picked entry between valid ones, in all three thirds (own pending, claimed, new)."""
    entries: list[dict[bytes, bytes]] = []
    for rotation in range(3):
        for i, fields in enumerate(EDGE_ENTRIES[rotation:] + EDGE_ENTRIES[:rotation]):
            entries += [fields, {b"id": f"valid-{rotation}-{i}".encode(), b"data": b"payload"}]
    asyncio.run(_consume_and_check(redis_url, entries + ODD_VALID))


# Registry ----------------------------------------------------------------------------------------------

hostile_values = st.lists(st.binary(min_size=1, max_size=64), max_size=4)  # under real registration keys
hostile_names = st.sets(st.binary(max_size=40), max_size=4)  # index entries naming no registration key


def _registration(generator_id: str) -> GeneratorRegistration:
    return GeneratorRegistration(generator_id=generator_id, url="http://127.0.0.1:1", policy_version=0)


async def _file(client, keys: Keys, value: bytes) -> str:
    """A registration key holding ``value``, filed in the index (as a generator's ``register`` files one)."""
    key = new_registration_key(keys)
    await client.set(key, value, px=60_000)
    await client.rpush(keys.registrations, key)
    return key


async def _registry_check(redis_url: str, values: list[bytes], names: set[bytes], live: int, keys: Keys) -> None:
    """``live`` valid replicas, one whose key expired, one claiming the first's id, and ``values`` under
    registration keys of their own and ``names`` that are none in the index."""
    client = make_client(redis_url)
    stats = RegistryStats()
    try:
        valid = [new_registration_key(keys) for _ in range(live)]
        for i, key in enumerate(valid):
            await register(client, keys, key, _registration(f"valid-{i}"), ttl_s=60)
        await client.rpush(keys.registrations, new_registration_key(keys))  # its key expired
        imposter = [await _file(client, keys, encode(_registration("valid-0")))] if live else []
        hostile = [(await _file(client, keys, value)).encode() for value in values]
        if names:
            await client.rpush(keys.registrations, *names)
        first = await live_generators(client, keys, stats)
        again = await live_generators(client, keys, stats)
        remaining = await client.lrange(keys.registrations, 0, -1)
        letters = [fields for _, fields in await client.xrange(keys.dead_letter)]
    finally:
        doomed = [key async for key in client.scan_iter(match=f"{keys.prefix}:*", count=1000)]
        if doomed:
            await client.delete(*doomed)
        await client.aclose()

    ids = [f"valid-{i}" for i in range(live)]
    assert [r.generator_id for r in first] == [r.generator_id for r in again] == ids
    assert remaining == [key.encode() for key in valid + imposter], "expired and invalid ones removed"
    assert stats.invalid == len(letters) + len(imposter) == len(values) + len(names) + len(imposter)
    read = [(name, value[: MAX_REGISTRATION_BYTES + 1]) for name, value in zip(hostile, values, strict=True)]
    read += [(name, b"") for name in names]
    assert sorted(pair for letter in letters for pair in decoded_raw(letter).items()) == sorted(read)
    for letter in letters:
        text = text_fields_of(letter)
        assert text["stream"] == keys.registrations and text["reason"].startswith("registration key ")


@PROPERTY
@given(hostile_values, hostile_names, st.integers(0, 3))
def test_arbitrary_registrations_never_stop_the_reader(redis_url, values, names, live):
    asyncio.run(_registry_check(redis_url, values, names, live, Keys(f"test-registry-{uuid.uuid4().hex[:10]}")))


def test_registration_edge_cases(redis_url):
    keys = Keys(f"test-registry-{uuid.uuid4().hex[:10]}")
    values = [b"\x93not a record", b"\xff" * 1_000_000, encode(make_task())]  # the last: a record of another kind
    names = {
        b"\xff",
        b"",
        keys.registration("short").encode(),
        keys.registration("A" * 32).encode(),  # hex, but not as new_registration_key writes it
        keys.registration("*").encode(),
        keys.weights.encode(),  # another key: never read as a registration
    }
    asyncio.run(_registry_check(redis_url, values, names, 2, keys))


async def test_a_valid_registration_over_the_size_limit_is_refused(redis_client, keys):
    """A generator may write a registration of any size under its own key (the ACL bounds no value): the
    learner reads at most ``MAX_REGISTRATION_BYTES`` and one byte of it and refuses one over the limit before
    decoding it, however valid its record."""
    huge = GeneratorRegistration(
        generator_id="gen-huge", url="http://127.0.0.1:1", policy_version=0, device_uuids=("GPU-" + "0" * 64,) * 2000
    )
    assert len(encode(huge)) > MAX_REGISTRATION_BYTES
    stats = RegistryStats()
    await register(redis_client, keys, huge_key := new_registration_key(keys), huge, ttl_s=60)
    await register(redis_client, keys, ok_key := new_registration_key(keys), _registration("gen-ok"), ttl_s=60)
    assert [r.generator_id for r in await live_generators(redis_client, keys, stats)] == ["gen-ok"]
    [(_, letter)] = await redis_client.xrange(keys.dead_letter)
    assert f"over the {MAX_REGISTRATION_BYTES} bytes a registration may take" in letter[b"reason"].decode()
    assert len(decoded_raw(letter)[huge_key.encode()]) == MAX_REGISTRATION_BYTES + 1  # all the learner read
    assert stats.invalid == 1 and await redis_client.lrange(keys.registrations, 0, -1) == [ok_key.encode()]


async def test_bad_announcements_are_read_as_absent_and_counted(redis_client, keys):
    """Generators may only read the announcements: a bad one is left for the learner to replace."""
    stats = RegistryStats()
    for garbage in (b"\xff", b"", encode(make_task())):
        await redis_client.set(keys.weights, garbage)
        await redis_client.set(keys.checkpoint, garbage)
        assert await latest_weights_version(redis_client, keys, stats) is None
        assert await latest_checkpoint(redis_client, keys, stats) is None
        assert await redis_client.get(keys.weights) == await redis_client.get(keys.checkpoint) == garbage
    assert stats.invalid == 6 and await redis_client.xlen(keys.dead_letter) == 0
    weights = WeightVersionAnnouncement(policy_version=7, layout=(), num_buckets=0)
    await redis_client.set(keys.weights, encode(weights))
    checkpoint = CheckpointAnnouncement(path="/checkpoints/step-7", policy_version=7, step=7)
    await redis_client.set(keys.checkpoint, encode(checkpoint))
    assert await latest_weights_version(redis_client, keys, stats) == 7
    assert await latest_checkpoint(redis_client, keys, stats) == checkpoint
    assert stats.invalid == 6


async def test_a_value_changed_or_removed_meanwhile_is_not_set_aside(redis_client, keys):
    await redis_client.hset(keys.learner_state, b"g", b"new value")
    assert not await set_aside(redis_client, keys, keys.learner_state, (b"g", b"old value"), "stale", RegistryStats())
    assert not await set_aside(
        redis_client, keys, keys.learner_state, (b"gone", b"old value"), "stale read", RegistryStats()
    )
    assert await redis_client.hgetall(keys.learner_state) == {b"g": b"new value"}
    assert await redis_client.xlen(keys.dead_letter) == 0


@pytest.mark.parametrize("saved", [b"\xff", b"", b"[]", b'{"epoch": -1, "index": 0}', b'{"epoch": 0}'])
async def test_a_bad_saved_feeder_position_is_set_aside(redis_client, keys, saved):
    from services.learner.data.admission import FEEDER_POSITION
    from services.learner.startup import saved_feeder_position

    await redis_client.hset(keys.learner_state, FEEDER_POSITION, saved)
    assert await saved_feeder_position(redis_client, keys, RegistryStats()) is None
    assert await redis_client.hexists(keys.learner_state, FEEDER_POSITION) == 0
    [(_, letter)] = await redis_client.xrange(keys.dead_letter)
    assert letter[b"reason"].startswith(b"feeder position: ValidationError") and decoded_raw(letter) == {
        FEEDER_POSITION: saved
    }
    await redis_client.hset(keys.learner_state, FEEDER_POSITION, b'{"epoch": 1, "index": 5}')
    position = await saved_feeder_position(redis_client, keys, RegistryStats())
    assert (position.epoch, position.index) == (1, 5)


# A real scorer process ---------------------------------------------------------------------------------


async def test_a_scorer_fed_hostile_entries_keeps_scoring_and_stays_healthy(redis_url, redis_client, keys):
    port = free_port()
    scorer = start_service(
        "scorer",
        "services.scorer",
        {
            "REDIS_URL": redis_url,
            "STREAM_PREFIX": keys.prefix,
            "SCORER_PORT": str(port),
            "SCORER_REWARDS": '[{"name": "digit"}]',
            "SCORER_CLAIM_IDLE_MS": "500",
        },
    )
    try:
        await asyncio.to_thread(scorer.wait_for_line, "ready", 120)
        rollouts = [make_rollout(make_task(group_size=4), seed=i) for i in range(len(EDGE_ENTRIES) + 1)]
        valid_ids, bad_ids = [], []
        for i, rollout in enumerate(rollouts):
            valid_ids.append(rollout.group_id)
            await redis_client.xadd(keys.rollouts, {b"id": rollout.group_id.encode(), b"data": encode(rollout)})
            if i < len(EDGE_ENTRIES):
                bad_ids.append((await redis_client.xadd(keys.rollouts, EDGE_ENTRIES[i])).decode())
        bad_ids.append((await redis_client.xadd(keys.rollouts, {b"id": b"bad-payload", b"data": b"\x93"})).decode())
        deadline = time.monotonic() + 60
        while await redis_client.xlen(keys.scored) < len(valid_ids) or await redis_client.xlen(keys.dead_letter) < len(
            bad_ids
        ):
            assert scorer.process.poll() is None, scorer.output()[-4000:]
            assert time.monotonic() < deadline, scorer.output()[-4000:]
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # anything dead-lettered twice would show up by now
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        assert health.status_code == 200 and scorer.process.poll() is None, health.text
        metrics = wait_http_ok(f"http://127.0.0.1:{port}/metrics", 10).text
    finally:
        code = scorer.stop()
    assert code == 0, scorer.output()[-4000:]
    scored = [decode(fields[b"data"], ScoredGroup).group_id for _, fields in await redis_client.xrange(keys.scored)]
    assert Counter(scored) == Counter(valid_ids)
    letters = {fields[b"entry_id"].decode(): fields for _, fields in await redis_client.xrange(keys.dead_letter)}
    assert len(letters) == len(bad_ids) and set(letters) == set(bad_ids)
    assert letters[bad_ids[-1]][b"reason"].startswith(b"WireError: not a msgpack record")
    for entry_id, fields in zip(bad_ids, EDGE_ENTRIES, strict=False):
        assert expected_reason(fields) in letters[entry_id][b"reason"].decode()
    assert f"asyncgrpo_stream_rollouts_dead_lettered_total {float(len(bad_ids))}" in metrics


async def test_an_entry_deleted_while_pending_is_dead_lettered_with_that_reason(redis_client, keys):
    source = f"{keys.prefix}:in"
    await redis_client.xgroup_create(source, GROUP, id="0", mkstream=True)
    entry_id = (await redis_client.xadd(source, {b"id": b"r1", b"data": b"x"})).decode()
    await redis_client.xreadgroup(GROUP, "tested", {source: ">"})
    await redis_client.xdel(source, entry_id)
    consumer = StreamConsumer(redis_client, keys, source, GROUP, "tested", block_ms=10)
    assert await consumer.read() == []
    [(_, letter)] = await redis_client.xrange(keys.dead_letter)
    assert letter[b"entry_id"].decode() == entry_id and b"deleted while pending" in letter[b"reason"]
    assert decoded_raw(letter) == {} and (await redis_client.xpending(source, GROUP))["pending"] == 0


async def test_many_extra_fields_make_a_short_reason(redis_client, keys):
    source = f"{keys.prefix}:in"
    fields = {b"id": b"r1", b"data": b"x", **{f"extra-{i}".encode(): b"" for i in range(1000)}}
    await redis_client.xadd(source, fields)
    consumer = StreamConsumer(redis_client, keys, source, GROUP, "tested", block_ms=10)
    await consumer.start()
    assert await consumer.read() == []
    [(_, letter)] = await redis_client.xrange(keys.dead_letter)
    assert letter[b"reason"].endswith(b"and 996 more") and decoded_raw(letter) == fields
