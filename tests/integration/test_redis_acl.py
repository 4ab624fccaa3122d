"""Least privilege in Redis (``shared.redis_acl``), on a real redis-server that ``asyncgrpo run`` starts
itself (``redis_for_run``): every service does its whole job as its own user through the project's own code
(streams, registry, leases, announcements), and is refused every command and key it does not need - a scorer
cannot register a generator, a generator cannot write scored groups, nobody but the administrator can
``FLUSHALL``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import subprocess
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from services.generator.gpu_lease import GpuLease
from services.launcher import local_redis
from services.launcher.local_redis import (
    RedisWithoutAuth,
    free_port,
    redis_for_run,
    start_redis,
    takes_commands_without_auth,
)
from shared.codec import encode
from shared.config.scorer import ScorerSettings
from shared.keys import Keys
from shared.records import CheckpointAnnouncement, GeneratorRegistration, WeightVersionAnnouncement
from shared.redis_acl import ROLES, config_lines, deploy_script, grants, secret_name
from shared.redis_conn import connect, make_client
from shared.registry import (
    RegistryStats,
    deregister,
    latest_checkpoint,
    latest_weights_version,
    live_generators,
    new_registration_key,
    register,
    set_aside,
)
from shared.streams import Output, StreamConsumer, StreamProducer, group_backlog, stream_backlog, trim_processed

pytestmark = pytest.mark.integration

NOTHING_ANSWERS = "redis://127.0.0.1:1/0"  # so redis_for_run starts its own server, with the ACL users


@pytest.fixture
async def users():
    """``(keys, {role: client}, admin client)`` on a Redis started as ``asyncgrpo run`` starts one."""
    keys = Keys(f"acl-{uuid.uuid4().hex[:8]}")
    urls, server = redis_for_run(keys.prefix, NOTHING_ANSWERS)
    assert server is not None
    clients = {}
    try:
        for role in ROLES:
            url = urls[f"{role.upper()}_REDIS_URL"]
            assert url.startswith(f"redis://{role}:") and server.password not in url
            clients[role] = await connect(url, timeout_s=10)
        admin = await connect(server.url, timeout_s=10)
        yield keys, clients, admin
        await admin.aclose()
    finally:
        for client in clients.values():
            await client.aclose()
        server.stop()


def _consumer(client, keys: Keys, stream: str, group: str, name: str) -> StreamConsumer:
    return StreamConsumer(client, keys, stream, group, name, block_ms=50, claim_idle_ms=100, max_deliveries=5)


async def _learner_admits(learner, keys: Keys, task_ids: list[str]) -> None:
    """As the learner's admission does: the task and the feeder's position in one transaction."""
    prompts = StreamProducer(learner, keys.prompts)
    for task_id in task_ids:
        async with learner.pipeline(transaction=True) as pipe:
            prompts.queue(pipe, task_id, b"task " + task_id.encode())
            pipe.hset(keys.learner_state, "feeder_position", b"{}")
            await pipe.execute()
    assert await learner.hget(keys.learner_state, "feeder_position") == b"{}"
    assert await learner.hexists(keys.learner_state, "feeder_position")  # its check that Redis kept its state
    await learner.set(keys.weights, encode(WeightVersionAnnouncement(policy_version=1)))
    await learner.set(keys.checkpoint, encode(CheckpointAnnouncement(policy_version=1, step=1, path="/ckpt/1")))


async def _generator_works(generator, keys: Keys) -> str:
    """The generator's whole job; returns its registration key."""
    lease = GpuLease(generator, keys, "box", "gen-0", ttl_s=5)
    assert await lease.acquire([0, 1], 1) == [0]
    again = GpuLease(generator, keys, "box", "gen-0", ttl_s=5)  # the same replica, restarted: EVAL reclaims
    assert await again.acquire([0], 1) == [0] and await again.holders([0, 1]) == {0: "gen-0"}
    await again.release()
    registration = GeneratorRegistration(generator_id="gen-0", url="http://127.0.0.1:8001", policy_version=1)
    key = new_registration_key(keys)
    for _ in range(2):  # registers (SET, RPUSH), then refreshes (SET XX)
        await register(generator, keys, key, registration, ttl_s=30)
    assert await latest_weights_version(generator, keys, RegistryStats()) == 1
    assert (await latest_checkpoint(generator, keys, RegistryStats())).path == "/ckpt/1"
    assert await stream_backlog(generator, keys.prompts) == 3
    rollouts = StreamProducer(generator, keys.rollouts, max_backlog=8)
    first = _consumer(generator, keys, keys.prompts, Keys.GENERATORS, "gen-a")
    await first.start()
    taken = await first.read(count=3)  # gen-a dies holding them; gen-b claims them (XAUTOCLAIM, XPENDING)
    await first.keepalive()
    assert len(taken) == 3
    second = _consumer(generator, keys, keys.prompts, Keys.GENERATORS, "gen-b")
    claimed = []
    while len(claimed) < 3:
        claimed += await second.read(count=3)
    outputs = [Output(rollouts, d.record_id, b"rollout " + d.payload) for d in claimed[:2]]
    assert await second.commit_many([(claimed[0], outputs[:1]), (claimed[1], outputs[1:])]) == [True, True]
    await second.dead_letter(claimed[2], "a prompt this test gives up on")
    return key


async def _scorer_works(scorer, admin, keys: Keys) -> None:
    scored = StreamProducer(scorer, keys.scored, max_backlog=8)
    evaluated = StreamProducer(scorer, keys.evaluated)
    consumer = _consumer(scorer, keys, keys.rollouts, Keys.SCORERS, "scorer-0")
    await consumer.start()
    [first] = await consumer.read(count=1)
    await admin.xreadgroup(Keys.SCORERS, "scorer-0", {keys.rollouts: ">"}, count=1)  # a reply that got lost
    assert await consumer.recover_lost() == 1  # XPENDING
    [second] = await consumer.read(count=1)  # EVAL: XPENDING, XCLAIM
    assert consumer.stats.recovered == 1
    assert await consumer.commit(first, [Output(scored, first.record_id, b"scored")])
    assert await consumer.commit(second, [Output(evaluated, second.record_id, b"evaluated")])


async def _learner_works(learner, admin, keys: Keys) -> None:
    assert await group_backlog(learner, keys.prompts, Keys.GENERATORS) == 0
    assert await group_backlog(learner, keys.rollouts, Keys.SCORERS) == 0
    for stream in (keys.scored, keys.evaluated):
        consumer = _consumer(learner, keys, stream, Keys.LEARNER, "learner")
        await consumer.start()
        [delivery] = await consumer.read()
        assert await consumer.commit(delivery)
    for stream in (keys.prompts, keys.rollouts, keys.scored, keys.evaluated):
        await trim_processed(learner, stream)  # the learner trims what every group finished (XTRIM MINID)
    assert [await admin.xlen(s) for s in (keys.prompts, keys.rollouts, keys.scored)] == [0, 0, 0]  # all finished
    bad = new_registration_key(keys)
    await admin.set(bad, b"not a registration")
    await admin.rpush(keys.registrations, bad, keys.weights)  # set aside (LREM, XADD), the second never read
    assert [g.generator_id for g in await live_generators(learner, keys, RegistryStats())] == ["gen-0"]
    assert await admin.llen(keys.registrations) == 1


async def test_every_service_does_its_whole_job_as_its_own_user(users):
    keys, clients, admin = users
    await _learner_admits(clients["learner"], keys, ["t1", "t2", "t3"])
    registration = await _generator_works(clients["generator"], keys)
    await _scorer_works(clients["scorer"], admin, keys)
    await _learner_works(clients["learner"], admin, keys)
    await deregister(clients["generator"], registration)
    assert await live_generators(clients["learner"], keys, RegistryStats()) == []
    assert await admin.llen(keys.registrations) == 0
    reasons = [fields[b"reason"] for _, fields in await admin.xrange(keys.dead_letter)]
    assert reasons[0] == b"a prompt this test gives up on" and len(reasons) == 3


async def test_the_learner_sets_a_bad_saved_feeder_position_aside_as_its_own_user(users):
    """The set-aside script (HGET, HDEL, XADD) runs as the learner: its saved position that does not decode goes
    to the dead letters, so the learner starts from the beginning of its data instead of failing."""
    keys, clients, admin = users
    await admin.hset(keys.learner_state, "feeder_position", b"\xff")
    stats = RegistryStats()
    aside = await set_aside(clients["learner"], keys, keys.learner_state, (b"feeder_position", b"\xff"), "bad", stats)
    assert aside and stats.invalid == 1 and not await admin.hexists(keys.learner_state, "feeder_position")
    [(_, letter)] = await admin.xrange(keys.dead_letter)
    assert letter[b"reason"] == b"bad" and letter[b"stream"] == keys.learner_state.encode()


REFUSED = {
    "scorer": [
        ("SET", "{registration}", "registration"),  # would register a generator URL
        ("RPUSH", "{registrations}", "{registration}"),
        ("XADD", "{prompts}", "*", "id", "x"),
        ("SET", "{weights}", "x"),
        ("XRANGE", "{dead}", "-", "+"),  # dead letters are written, never read
        ("HGETALL", "{learner_state}"),
    ],
    "generator": [
        ("XADD", "{scored}", "*", "id", "x", "data", "x"),  # would put groups of its own in training
        ("XADD", "{evaluated}", "*", "id", "x", "data", "x"),
        ("SET", "{weights}", "x"),
        ("SET", "{checkpoint}", "x"),
        ("LRANGE", "{registrations}", "0", "-1"),  # writes its own registration, reads nobody's
        ("GETRANGE", "{registration}", "0", "-1"),
        ("HSET", "{learner_state}", "runtime", "x"),
        ("XADD", "other:rollouts", "*", "id", "x"),  # another pipeline's keys
    ],
    "learner": [
        ("XADD", "{rollouts}", "*", "id", "x", "data", "x"),
        ("SET", "{gpu}", "x"),
        ("SET", "{registration}", "1"),  # reads registrations, writes none
        ("RPUSH", "{registrations}", "x"),
        ("XADD", "other:prompts", "*", "id", "x"),
    ],
}
EVERYONE_REFUSED = [
    ("FLUSHALL",),
    ("CONFIG", "GET", "*"),
    ("KEYS", "*"),
    ("SCAN", "0"),
    ("ACL", "LIST"),
    ("SCRIPT", "FLUSH"),
    ("PUBLISH", "news", "x"),
]


def _key(name: str, keys: Keys) -> str:
    named = {
        "{registrations}": keys.registrations,
        "{registration}": keys.registration("0" * 32),
        "{prompts}": keys.prompts,
        "{rollouts}": keys.rollouts,
        "{scored}": keys.scored,
        "{evaluated}": keys.evaluated,
        "{weights}": keys.weights,
        "{checkpoint}": keys.checkpoint,
        "{dead}": keys.dead_letter,
        "{learner_state}": keys.learner_state,
        "{gpu}": keys.gpu_lease("box", 0),
    }
    return named.get(name, name)


async def test_every_user_is_refused_what_it_does_not_need(users):
    keys, clients, admin = users
    for role, refused in REFUSED.items():
        for command in [*refused, *EVERYONE_REFUSED]:
            args = [_key(part, keys) for part in command]
            with pytest.raises(NoPermissionError):
                await clients[role].execute_command(*args)
    assert await admin.exists(keys.registrations, keys.registration("0" * 32), keys.scored, keys.weights) == 0


# Every command by which a generator could read, or change otherwise than by SET and DEL, another replica's
# registration ``{k}`` or the index ``{i}``, or learn a key's name. SET and DEL need the name, and nothing here
# may reveal one: its secret is what makes a registration its replica's own.
NAMING = [
    *((command, "{k}") for command in ("GET", "GETDEL", "STRLEN", "DUMP", "TTL", "PTTL", "TYPE", "EXISTS", "TOUCH")),
    *((command, "{k}", "1") for command in ("EXPIRE", "PEXPIRE", "EXPIREAT", "MOVE", "APPEND")),
    ("SETRANGE", "{k}", "0", "x"),
    ("PERSIST", "{k}"),
    ("GETEX", "{k}", "PX", "1"),
    ("GETRANGE", "{k}", "0", "-1"),
    ("SET", "{k}", "x", "GET"),
    ("RENAME", "{k}", "{k}-mine"),
    ("RENAMENX", "{k}", "{k}-mine"),
    ("COPY", "{k}", "{k}-mine"),
    ("OBJECT", "ENCODING", "{k}"),
    ("MEMORY", "USAGE", "{k}"),
    ("EVAL", "return redis.call('GET', KEYS[1])", "1", "{k}"),
    *((command, "{i}") for command in ("LLEN", "LPOP", "RPOP", "DEL", "UNLINK", "DUMP", "TYPE", "SORT")),
    ("LRANGE", "{i}", "0", "-1"),
    ("LINDEX", "{i}", "0"),
    ("LPOS", "{i}", "{k}"),
    ("LREM", "{i}", "0", "{k}"),
    ("LSET", "{i}", "0", "x"),
    ("LTRIM", "{i}", "1", "0"),
    ("LMOVE", "{i}", "{i}-mine", "LEFT", "LEFT"),
    ("RPOPLPUSH", "{i}", "{i}-mine"),
    ("EXPIRE", "{i}", "1"),
    ("RENAME", "{i}", "{i}-mine"),
    ("EVAL", "return redis.call('LRANGE', KEYS[1], 0, -1)", "1", "{i}"),
    ("KEYS", "*"),
    ("SCAN", "0", "MATCH", "*registration*"),
    ("RANDOMKEY",),
    ("MONITOR",),
    ("PSUBSCRIBE", "__key*__:*"),  # keyspace notifications name every key written
    ("CLIENT", "LIST"),
    ("SLOWLOG", "GET"),
]


async def test_a_generator_can_name_no_registration_but_its_own(users):
    """Logged in as the generator user, a replica registers and refreshes its own registration, and is refused
    every command that would change another's by its generator id (the registrations are no longer one hash
    of ids) or read, expire, rename or move another's, read the index or list key names; the other replica's
    registration and its index entry are left as they were, and the learner lists both."""
    keys, clients, admin = users
    generator = clients["generator"]
    by_id = [
        ("HSET", f"{keys.prefix}:generators", "gen-1", "forged"),
        ("HDEL", f"{keys.prefix}:generators", "gen-1"),
        ("SET", f"{keys.prefix}:generator:gen-1:alive", "1"),
        ("DEL", f"{keys.prefix}:generator:gen-1:alive"),
    ]
    for command in by_id:
        with pytest.raises(NoPermissionError):
            await generator.execute_command(*command)
    other, own = new_registration_key(keys), new_registration_key(keys)
    for key, generator_id in ((other, "gen-1"), (own, "gen-0"), (own, "gen-0")):  # own: registers, refreshes
        url = f"http://127.0.0.1:800{generator_id[-1]}"
        registration = GeneratorRegistration(generator_id=generator_id, url=url, policy_version=0)
        await register(generator, keys, key, registration, ttl_s=30)
    before = (await admin.get(other), await admin.lrange(keys.registrations, 0, -1))
    allowed = []
    for template in NAMING:
        command = [part.format(k=other, i=keys.registrations) for part in template]
        try:
            await generator.execute_command(*command)
            allowed.append(command[0])
        except ResponseError as exc:
            if not _is_refusal(exc):
                allowed.append(f"{command[0]}: {exc}")
    assert not allowed, allowed
    assert (await admin.get(other), await admin.lrange(keys.registrations, 0, -1)) == before
    assert before[1] == [other.encode(), own.encode()] and await admin.pttl(other) > 0
    listed = await live_generators(clients["learner"], keys, RegistryStats())
    assert [g.generator_id for g in listed] == ["gen-1", "gen-0"]


async def test_the_default_user_needs_the_administrator_password_and_a_wrong_one_fails(users):
    _, _, admin = users
    port = admin.connection_pool.connection_kwargs["port"]
    for url in (f"redis://127.0.0.1:{port}/0", f"redis://scorer:wrong-password@127.0.0.1:{port}/0"):
        client = make_client(url)
        try:
            with pytest.raises((AuthenticationError, ResponseError)):  # no password, or a wrong one: nothing
                await client.ping()
        finally:
            await client.aclose()


def test_the_rules_are_made_from_the_key_names_and_escape_a_prefix_that_globs():
    rules = grants(Keys("run-1"))["scorer"].rules()
    assert rules[:3] == ["resetkeys", "resetchannels", "-@all"] and not any("hset" in rule for rule in rules)
    assert "(~run-1:rollouts:applied:scorers:* +exists +incrby +expire +watch)" in rules
    assert "(%W~run-1:dead +xadd)" in rules
    assert "(~a\\*b:scored +xadd +xinfo|groups +xlen)" in grants(Keys("a*b"))["scorer"].rules()  # never widens
    lines = config_lines({role: f"pw-{role}" for role in ROLES}, Keys("run-1"))
    assert [line.split()[:4] for line in lines] == [["user", role, "on", f'">pw-{role}"'] for role in ROLES]


def test_the_launcher_uses_an_operators_redis_as_its_url_says(redis_url, monkeypatch):
    urls, server = redis_for_run("any-prefix", redis_url, allow_no_auth=True)
    assert server is None and urls == {f"{role.upper()}_REDIS_URL": redis_url for role in ROLES}
    monkeypatch.setenv("REDIS_URL", "redis://elsewhere:6379/0")
    monkeypatch.setenv("SCORER_REDIS_URL", "redis://scorer:pw@127.0.0.1:6379/0")
    assert ScorerSettings().redis_url == "redis://scorer:pw@127.0.0.1:6379/0"  # the service's own wins


# Every key of a pipeline (and one of another pipeline's), by a short name.
def _every_key(keys: Keys) -> dict[str, str]:
    return {
        "prompts": keys.prompts,
        "rollouts": keys.rollouts,
        "scored": keys.scored,
        "evaluated": keys.evaluated,
        "dead": keys.dead_letter,
        "registrations": keys.registrations,
        "registration": keys.registration("0" * 32),
        "weights": keys.weights,
        "checkpoint": keys.checkpoint,
        "learner_state": keys.learner_state,
        "gpu": keys.gpu_lease("box", 0),
        "prompts_applied": keys.applied(keys.prompts, Keys.GENERATORS, "r"),
        "rollouts_applied": keys.applied(keys.rollouts, Keys.SCORERS, "r"),
        "scored_applied": keys.applied(keys.scored, Keys.LEARNER, "r"),
        "evaluated_applied": keys.applied(keys.evaluated, Keys.LEARNER, "r"),
        "other_pipeline": "other:prompts",
    }


# Destructive or retyping commands on one key ``k`` (``k2``: a second key beside it).
DESTRUCTIVE = {
    "DEL": ("DEL", "{k}"),
    "UNLINK": ("UNLINK", "{k}"),
    "SET": ("SET", "{k}", "x"),
    "RENAME": ("RENAME", "{k}", "{k2}"),
    "EXPIRE": ("EXPIRE", "{k}", "1"),
    "XTRIM": ("XTRIM", "{k}", "MAXLEN", "0"),
    "XDEL": ("XDEL", "{k}", "1-1"),
    "LREM": ("LREM", "{k}", "0", "x"),
    "LTRIM": ("LTRIM", "{k}", "1", "0"),
    "XGROUP DESTROY": ("XGROUP", "DESTROY", "{k}", "g"),
    "XGROUP SETID": ("XGROUP", "SETID", "{k}", "g", "0"),
    "XGROUP DELCONSUMER": ("XGROUP", "DELCONSUMER", "{k}", "g", "c"),
    "RESTORE": ("RESTORE", "{k}", "0", "\x00not a dump", "REPLACE"),
    "COPY": ("COPY", "{k2}", "{k}", "REPLACE"),
    "EVAL DEL": ("EVAL", "return redis.call('DEL', KEYS[1])", "1", "{k}"),
    "EVAL SET": ("EVAL", "return redis.call('SET', KEYS[1], 'x')", "1", "{k}"),
    "EVAL XTRIM": ("EVAL", "return redis.call('XTRIM', KEYS[1], 'MAXLEN', 0)", "1", "{k}"),
    "FCALL": ("FCALL", "f", "1", "{k}"),
}
# What each user owns and may do there by design, (command, key): its registration, under the name only it
# knows (test_a_generator_can_name_no_registration_but_its_own), and the GPU leases (a generator), its own
# applied markers' expiry (every consumer: INCR and EXPIRE, never SET), the announcements it makes, the
# registrations' index entries it drops and the streams' retention (the learner). Every other destructive
# command on every key is refused.
OWNED = {
    "generator": {
        *(("SET", k) for k in ("registration", "gpu")),
        ("EXPIRE", "prompts_applied"),
        ("DEL", "registration"),
        *((c, "gpu") for c in ("DEL", "EVAL DEL", "EVAL SET")),
    },
    "scorer": {("EXPIRE", "rollouts_applied")},
    "learner": {
        *(("SET", k) for k in ("weights", "checkpoint")),
        ("LREM", "registrations"),  # drops dead or invalid registrations' entries
        *(("EXPIRE", k) for k in ("scored_applied", "evaluated_applied")),
        *(("XTRIM", k) for k in ("prompts", "rollouts", "scored", "evaluated")),
        *(("EVAL XTRIM", k) for k in ("scored", "evaluated")),  # it reads them (EVAL) and trims them
    },
}


def _is_refusal(exc: BaseException) -> bool:
    """An ACL refusal: NOPERM, or a script's command refused for a key its user may not touch."""
    message = str(exc)
    return isinstance(exc, NoPermissionError) or any(
        words in message for words in ("can't access", "can't run", "no permissions")
    )


async def test_no_user_can_destroy_or_retype_a_key_it_does_not_own(users):
    """Each user, each key of the pipeline, each destructive or retyping command: refused by the ACL unless
    the user owns that key for that command (``OWNED``). The keys exist and hold their real types first, so
    a refusal cannot be a type error or a missing key."""
    keys, clients, admin = users
    every = _every_key(keys)
    for name in ("prompts", "rollouts", "scored", "evaluated", "dead"):
        await admin.xadd(every[name], {"id": "x", "data": "x"})
        await admin.xgroup_create(every[name], "g", id="0")
    await admin.rpush(keys.registrations, every["registration"])
    await admin.hset(keys.learner_state, "runtime", b"x")
    for name in ("registration", "weights", "checkpoint", "gpu", "other_pipeline"):
        await admin.set(every[name], b"x")
    wrongly_allowed, wrongly_refused = [], []
    for role, client in clients.items():
        for key_name, key in every.items():
            for command_name, template in DESTRUCTIVE.items():
                args = [part.format(k=key, k2=f"{keys.prefix}:copy") for part in template]
                try:
                    await client.execute_command(*args)
                    refused = False
                except ResponseError as exc:
                    refused = _is_refusal(exc)
                    if not refused and (command_name, key_name) not in OWNED[role]:
                        wrongly_allowed.append((role, command_name, key_name, str(exc)))
                    continue
                if not refused and (command_name, key_name) not in OWNED[role]:
                    wrongly_allowed.append((role, command_name, key_name, "ran"))
        for command_name, key_name in OWNED[role]:
            args = [part.format(k=every[key_name], k2="-") for part in DESTRUCTIVE[command_name]]
            try:
                await client.execute_command(*args)
            except ResponseError as exc:
                if _is_refusal(exc):
                    wrongly_refused.append((role, command_name, key_name))
    assert not wrongly_allowed, wrongly_allowed
    assert not wrongly_refused, wrongly_refused
    # Nothing another user owns was touched: every stream and its group are still there.
    for name in ("prompts", "rollouts", "scored", "evaluated", "dead"):
        assert await admin.type(every[name]) == b"stream", name
    assert await admin.lrange(keys.registrations, 0, -1) == [every["registration"].encode()]
    assert await admin.get(every["other_pipeline"]) == b"x"


# Every command that stores a value it is sent, on a string key (RESTORE: a serialized one).
VALUE_WRITES = [
    ("SET", "{k}", "{v}"),
    ("SETEX", "{k}", "60", "{v}"),
    ("PSETEX", "{k}", "60000", "{v}"),
    ("SETNX", "{k}", "{v}"),
    ("GETSET", "{k}", "{v}"),
    ("APPEND", "{k}", "{v}"),
    ("SETRANGE", "{k}", "0", "{v}"),
    ("MSET", "{k}", "{v}"),
    ("MSETNX", "{k}", "{v}"),
    ("RESTORE", "{k}", "0", "{v}", "REPLACE"),
    ("EVAL", "return redis.call('SET', KEYS[1], ARGV[1])", "1", "{k}", "{v}"),
]
_MARKER_BOUND = 20  # bytes: the longest integer INCR can leave (a 64-bit signed number in decimal)


async def test_an_applied_marker_holds_a_counter_and_no_user_can_store_a_value_there(users):
    """Each consumer's own applied markers, as its own user: a 64 MB value (``SET``), or any value through
    any command that stores one, is refused; the commit's own marker (INCR) is an integer of a few bytes."""
    keys, clients, admin = users
    big = b"x" * (64 * 1024 * 1024)
    markers = {
        "generator": keys.applied(keys.prompts, Keys.GENERATORS, "r-big"),
        "scorer": keys.applied(keys.rollouts, Keys.SCORERS, "r-big"),
        "learner": keys.applied(keys.scored, Keys.LEARNER, "r-big"),
    }
    for role, marker in markers.items():
        with pytest.raises(NoPermissionError):
            await clients[role].set(marker, big)
        for template in VALUE_WRITES:
            args = [part.format(k=marker, v="x" * 1024) if isinstance(part, str) else part for part in template]
            with pytest.raises(ResponseError) as refused:
                await clients[role].execute_command(*args)
            assert _is_refusal(refused.value), (role, template[0], str(refused.value))
        assert not await admin.exists(marker)
    generator = clients["generator"]
    await _learner_admits(clients["learner"], keys, ["t-marker"])
    consumer = _consumer(generator, keys, keys.prompts, Keys.GENERATORS, "gen-m")
    await consumer.start()
    [delivery] = await consumer.read(count=1)
    assert await consumer.commit(delivery, [Output(StreamProducer(generator, keys.rollouts), "t-marker", b"r")])
    marker = keys.applied(keys.prompts, Keys.GENERATORS, "t-marker")
    value = await admin.get(marker)
    assert value == b"1" and len(value) <= _MARKER_BOUND and await admin.ttl(marker) > 0


@pytest.mark.parametrize("kind", ["compose", "k8s"])
async def test_the_deployments_script_starts_redis_with_every_user_and_no_password_in_its_arguments(kind, tmp_path):
    """The redis container's script (docker-compose.yml, redis.yaml), run by ``sh`` as the container runs it,
    with the passwords in its environment: every service logs in as its own user and is refused what it does
    not own, and redis-server's arguments (recorded by a stand-in on PATH that then runs the real one) hold
    no password."""
    port = free_port()
    passwords = {"REDIS_PASSWORD": f"admin-{uuid.uuid4().hex}"} | {
        secret_name(r): f"{r}-{uuid.uuid4().hex}" for r in ROLES
    }
    stand_in = tmp_path / "bin" / "redis-server"
    stand_in.parent.mkdir()
    stand_in.write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/argv\n'
        f'exec {shutil.which("redis-server")} "$@" --port {port} --dir {tmp_path} --bind 127.0.0.1\n'
    )
    stand_in.chmod(0o755)
    script = deploy_script(kind).replace("$$", "$")  # what compose hands the shell
    env = {"PATH": f"{stand_in.parent}:/usr/bin:/bin", "STREAM_PREFIX": "grpo", **passwords}
    process = subprocess.Popen(["sh", "-c", script], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    admin = make_client(f"redis://:{passwords['REDIS_PASSWORD']}@127.0.0.1:{port}/0")
    try:
        for _ in range(200):
            with contextlib.suppress(Exception):
                if await admin.ping():
                    break
            assert process.poll() is None, "redis-server stopped"
            await asyncio.sleep(0.05)
        arguments = (tmp_path / "argv").read_text()
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes().decode(errors="replace")
        assert not [p for p in passwords.values() if p in arguments or p in cmdline], arguments
        keys = Keys("grpo")
        for role in ROLES:
            client = make_client(f"redis://{role}:{passwords[secret_name(role)]}@127.0.0.1:{port}/0")
            try:
                assert await client.ping()
                with pytest.raises(NoPermissionError):
                    await client.execute_command("DEL", keys.prompts if role != "learner" else keys.rollouts)
            finally:
                await client.aclose()
    finally:
        await admin.aclose()
        process.terminate()
        process.wait(10)


def test_the_launchers_redis_gets_no_password_on_its_command_line():
    """``asyncgrpo run``'s own Redis: the administrator's and every service's password reach redis-server on its
    standard input; neither the arguments it was started with nor its /proc/<pid>/cmdline hold one."""
    urls, server = redis_for_run(f"argv-{uuid.uuid4().hex[:8]}", NOTHING_ANSWERS)
    assert server is not None and server.process is not None
    try:
        secrets = [server.password, *(urlsplit(url).password for url in urls.values())]
        assert all(secrets) and len(set(secrets)) == 4
        started_with = " ".join(str(arg) for arg in server.process.args)
        cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes().decode(errors="replace")
        assert not [s for s in secrets if s in started_with or s in cmdline], started_with
    finally:
        server.stop()


def test_the_launcher_refuses_a_named_redis_without_a_password_unless_allowed_with_a_warning(redis_url, caplog):
    """The test Redis takes commands from anyone: refused when ``redis_allow_no_auth`` is false, used with a
    warning at every start when it is true; a Redis with a password is used without one."""
    assert takes_commands_without_auth(redis_url)
    with pytest.raises(RedisWithoutAuth, match=r"takes commands without a password.*redis_allow_no_auth = true"):
        redis_for_run("any-prefix", redis_url, allow_no_auth=False)
    with caplog.at_level(logging.WARNING, logger="services.launcher.local_redis"):
        for _ in range(2):
            assert redis_for_run("any-prefix", redis_url, allow_no_auth=True)[1] is None
    assert sum("takes commands without a password" in r.getMessage() for r in caplog.records) == 2
    protected = start_redis(password="pw-" + uuid.uuid4().hex)
    try:
        assert not takes_commands_without_auth(protected.url)
        caplog.clear()
        urls, server = redis_for_run("any-prefix", protected.url, allow_no_auth=False)
        assert server is None and set(urls.values()) == {protected.url} and not caplog.records
    finally:
        protected.stop()


def test_the_launcher_starts_its_own_redis_when_none_is_named_whatever_answers(redis_url, monkeypatch):
    """Nothing named (no ``$REDIS_URL``): a Redis of its own with a password, even with one answering on the
    default port (the test Redis stands for it)."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setattr(local_redis, "DEFAULT_URL", redis_url)
    urls, server = redis_for_run(f"own-{uuid.uuid4().hex[:8]}")
    try:
        assert server is not None and server.password and redis_url not in urls.values()
        assert all(url.startswith(f"redis://{role}:") for role, url in zip(ROLES, urls.values(), strict=True))
    finally:
        server.stop()
