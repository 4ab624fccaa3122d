"""Generator registrations and the learner's latest announcements in Redis: who serves, what to load.

Written by generators (each its own registration, with a TTL that is its liveness) and the learner (weights and
checkpoint announcements); read by both. Lives in ``shared`` because both sides use it.

A registration is a capability. Each replica makes a secret at start and keeps its registration under a key
whose name holds it (``Keys.registration``), filing that name once in an index (``Keys.registrations``, a
list) that generators may append to but never read (``shared.redis_acl``). No generator may read the index or
enumerate keys, so none can name, and so overwrite or delete, another's registration; what it may write under
the names it knows is its own. The learner lists the index in filing order, so the first live registration
of a ``generator_id`` holds it: a later one claiming that id (a forgery, or a restarted replica whose old
key has not expired yet) is refused with a warning until the first is gone.

Whoever can write to Redis can put arbitrary bytes here, so a reader never raises on what it finds:

* An index entry that is not a registration key, or whose registration does not decode (bytes that are not the
  record, a value over ``MAX_REGISTRATION_BYTES``), is removed from the index and its bytes (at most the limit
  and one more) moved to the dead-letter stream with the reason, logged and counted once. The learner reads no
  more than that: the ACL bounds no value a generator writes under its own name, so the size limit is the
  reader's. An entry whose key has expired or was deleted is removed silently.
* A hash field whose value does not decode (the learner's saved feeder position) is set aside: moved to the
  dead-letter stream with its reason and its exact bytes and removed from the hash, in one script that first
  checks the value is still the one read.
* An announcement that does not decode is read as absent, logged and counted. Its readers (generators) may
  only read it; the learner's next announcement replaces it.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared.codec import WireError, decode, encode
from shared.keys import Keys
from shared.records import CheckpointAnnouncement, GeneratorRegistration, WeightVersionAnnouncement, WireModel
from shared.streams.dead_letter import dead_letter_fields, raw_fields
from shared.streams.entries import Delivery, escaped, shown

log = logging.getLogger(__name__)

R = TypeVar("R", bound=WireModel)

_DEAD_LETTER_MAXLEN = 100_000  # as a stream consumer's dead-letter stream
# A registration is a few hundred bytes (a URL, versions, device ids, the engine's layer names); one far larger
# is not one, and is refused before it is decoded (the learner reads no more than this and one byte).
MAX_REGISTRATION_BYTES = 64 * 1024
_SECRET_BYTES = 16  # 128 random bits: no replica guesses another's registration key
_SHOWN_SECRET = 8  # hex digits of a secret a log line shows: enough to tell keys apart, too few to name one
# KEYS: the hash, the dead-letter stream. ARGV: the field, the value read, the dead-letter stream's cap, then
# the dead letter's fields and values. Returns 1 when set aside, 0 when the field changed meanwhile.
_SET_ASIDE = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', unpack(ARGV, 4))
return 1
"""


@dataclass
class RegistryStats:
    """Counters of a registry reader; a service exports them beside its stream counters."""

    invalid: int = 0  # values refused: set aside or dropped (registrations, fields) or read as absent (announcements)
    # Registration keys refused for claiming a generator id a live one holds, each counted once while filed.
    refused_claims: set[bytes] = field(default_factory=set)


def new_registration_key(keys: Keys) -> str:
    """A replica's own registration key, made once at start: its name holds a fresh secret."""
    return keys.registration(secrets.token_hex(_SECRET_BYTES))


async def register(
    client: aioredis.Redis, keys: Keys, key: str, registration: GeneratorRegistration, ttl_s: float
) -> None:
    """Write (or refresh) a replica's registration under its own ``key``, live for ``ttl_s``. A key that is
    new, or that expired meanwhile (the learner then dropped its index entry), is filed in the index again."""
    payload, ttl_ms = encode(registration), int(ttl_s * 1000)
    if await client.set(key, payload, px=ttl_ms, xx=True):
        return
    async with client.pipeline(transaction=True) as pipe:
        pipe.set(key, payload, px=ttl_ms)
        pipe.rpush(keys.registrations, key)
        await pipe.execute()


async def deregister(client: aioredis.Redis, key: str) -> None:
    """Remove a replica's registration at once (the learner drops its index entry at its next listing)."""
    await client.delete(key)


async def live_generators(client: aioredis.Redis, keys: Keys, stats: RegistryStats) -> list[GeneratorRegistration]:
    """The live registrations, in filing order, one per generator id (the first filed); expired ones are
    dropped from the index, invalid ones dropped and set aside (see the module docstring)."""
    filed = Counter(_bytes(name) for name in await client.lrange(keys.registrations, 0, -1))
    payloads = await _read_registrations(client, keys, list(filed))
    holders: dict[str, tuple[bytes, GeneratorRegistration]] = {}
    for name, payload in payloads.items():
        try:
            registration = _registration(payload)
        except (ResponseError, WireError) as exc:
            reason = f"registration key {_shown_name(keys, name)}: {type(exc).__name__}: {exc}"
            await _drop_entry(client, keys, name, filed[name], payload, reason, stats)
            continue
        if registration is None:
            await _unfile(client, keys, name, filed[name])  # expired or deregistered
        elif (holder := holders.setdefault(registration.generator_id, (name, registration))[0]) != name:
            _refuse_claim(registration.generator_id, holder, name, stats)
    stats.refused_claims &= set(filed)
    return [registration for _, registration in holders.values()]


async def _read_registrations(
    client: aioredis.Redis, keys: Keys, names: list[bytes]
) -> dict[bytes, bytes | Exception | None]:
    """Each filed name's value, at most ``MAX_REGISTRATION_BYTES`` and one byte of it (None: no such key, or an
    empty one; an exception: a name that is no registration key, or a key that is no string)."""
    read = [name for name in names if _is_registration_key(keys, name)]
    async with client.pipeline(transaction=False) as pipe:
        for name in read:
            pipe.strlen(name)
            pipe.getrange(name, 0, MAX_REGISTRATION_BYTES)
        replies = await pipe.execute(raise_on_error=False)
    found: dict[bytes, bytes | Exception | None] = {
        name: ResponseError("not a registration key") for name in names if name not in read
    }
    for name, length, value in zip(read, replies[::2], replies[1::2], strict=True):
        found[name] = length if isinstance(length, Exception) else (_bytes(value) if length else None)
    return {name: found[name] for name in names}


def _unfile(commands: Any, keys: Keys, name: bytes, count: int) -> Any:
    """``LREM`` the first ``count`` index entries of ``name``, those the learner read: a filing since is at the
    tail. (``Any``: redis-py types the value as ``str``, but an entry may be any bytes, sent as they are.)"""
    return commands.lrem(keys.registrations, count, name)


def _is_registration_key(keys: Keys, name: bytes) -> bool:
    """Whether ``name`` is a key ``new_registration_key`` makes: the learner reads no other key a generator names."""
    prefix = re.escape(keys.registration("").encode())
    return re.fullmatch(prefix + rb"[0-9a-f]{%d}" % (2 * _SECRET_BYTES), name) is not None


def _registration(payload: bytes | Exception | None) -> GeneratorRegistration | None:
    """The registration ``payload`` holds (None: none); raises when it is an error, is over
    ``MAX_REGISTRATION_BYTES`` or does not decode."""
    if isinstance(payload, Exception):
        raise payload
    if payload is None:
        return None
    if len(payload) > MAX_REGISTRATION_BYTES:
        raise WireError(f"over the {MAX_REGISTRATION_BYTES} bytes a registration may take", "size")
    return decode(payload, GeneratorRegistration)


def _refuse_claim(generator_id: str, holder: bytes, claimant: bytes, stats: RegistryStats) -> None:
    """A second live registration of ``generator_id``: refused while the first filed holds it, warned and
    counted once. Its entry stays filed, so a restarted replica is accepted once its old key has expired."""
    if claimant in stats.refused_claims:
        return
    stats.refused_claims.add(claimant)
    stats.invalid += 1
    log.warning(
        "refusing registration %s: it claims generator id %r, which live registration %s holds",
        _shown_key(claimant), generator_id, _shown_key(holder),
    )  # fmt: skip


def _shown_key(name: bytes) -> str:
    """A registration key for a log line, its secret cut short: logs are read by more than the learner."""
    text = name.decode()
    return text[: len(text) - 2 * _SECRET_BYTES + _SHOWN_SECRET] + "…"


def _shown_name(keys: Keys, name: bytes) -> str:
    """An index entry for a log line: a registration key cut short, anything else as it is (escaped)."""
    return _shown_key(name) if _is_registration_key(keys, name) else shown(name)


async def _drop_entry(
    client: aioredis.Redis, keys: Keys, name: bytes, filed: int, payload: object, reason: str, stats: RegistryStats
) -> None:
    """Remove the ``filed`` index entries of ``name`` that were read and set what was read aside, logged and
    counted; entries filed since stay (LREM counts from the head, new ones are at the tail)."""
    value = payload if isinstance(payload, bytes) else b""
    letter = dead_letter_fields(keys.registrations, "", "", Delivery("", escaped(name), value, 1), reason)
    letter[b"raw"] = raw_fields({name: value})
    async with client.pipeline(transaction=True) as pipe:
        _unfile(pipe, keys, name, filed)
        pipe.xadd(keys.dead_letter, letter, maxlen=_DEAD_LETTER_MAXLEN, approximate=True)
        removed, _ = await pipe.execute()
    if removed:
        log.warning("dropped an invalid registration and set it aside in the dead-letter stream: %s", reason)
        stats.invalid += 1


async def latest_checkpoint(client: aioredis.Redis, keys: Keys, stats: RegistryStats) -> CheckpointAnnouncement | None:
    """The learner's latest checkpoint announcement; None when there is none, or it does not decode."""
    return await _announcement(client, keys.checkpoint, CheckpointAnnouncement, stats)


async def latest_weights_version(client: aioredis.Redis, keys: Keys, stats: RegistryStats) -> int | None:
    """The policy version the learner last announced; None when there is none, or it does not decode."""
    announcement = await _announcement(client, keys.weights, WeightVersionAnnouncement, stats)
    return None if announcement is None else announcement.policy_version


async def _announcement(client: aioredis.Redis, key: str, record_type: type[R], stats: RegistryStats) -> R | None:
    """The record under ``key``; None when there is none, or when it does not decode (logged and counted)."""
    raw = await client.get(key)
    if raw is None:
        return None
    try:
        return decode(_bytes(raw), record_type)
    except WireError as exc:
        log.warning(
            "ignoring the %s under %s, which does not decode (%s): %s", record_type.kind, key, exc, shown(_bytes(raw))
        )
        stats.invalid += 1
        return None


async def set_aside(
    client: aioredis.Redis,
    keys: Keys,
    key: str,
    field_value: tuple[bytes, bytes],
    reason: str,
    stats: RegistryStats,
) -> bool:
    """Move the hash ``key``'s ``(field, value)`` to the dead-letter stream with ``reason`` and remove it, if
    the field still holds that value; False when someone changed it meanwhile (the next read looks again)."""
    field, value = field_value
    letter = dead_letter_fields(key, "", "", Delivery("", escaped(field), value, 1), reason)
    letter[b"raw"] = raw_fields({field: value})
    arguments = [field, value, _DEAD_LETTER_MAXLEN, *(part for pair in letter.items() for part in pair)]
    moved = bool(await client.eval(_SET_ASIDE, 2, key, keys.dead_letter, *arguments))
    if moved:
        log.warning("set aside an invalid value of %s in the dead-letter stream: %s", key, reason)
        stats.invalid += 1
    return moved


def _bytes(value: bytes | str) -> bytes:
    """Replies are bytes (clients are made with ``decode_responses=False``)."""
    return value if isinstance(value, bytes) else value.encode()
