"""Generator registrations and the learner's latest announcements in Redis: who serves, what to load.

Written by generators (registration + liveness key with a TTL) and the learner (weights and checkpoint
announcements); read by both. Lives in ``shared`` because both sides use it.

Whoever can write to Redis can put arbitrary bytes here, so a reader never raises on what it finds:

* A hash field whose value does not decode (a field that is not UTF-8, bytes that are not the record, a
  registration filed under another generator's id or over ``MAX_REGISTRATION_BYTES``, a feeder position that
  is not one) is set aside: moved to
  the dead-letter stream with its reason and its exact bytes and removed from the hash, in one script that
  first checks the value is still the one read. It is logged and counted once, and the reader goes on as if
  it were absent. Only the hashes' readers (the learner) may write them, so only they set values aside.
* An announcement that does not decode is read as absent, logged and counted. Its readers (generators) may
  only read it; the learner's next announcement replaces it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TypeVar

import redis.asyncio as aioredis

from shared.codec import WireError, decode, encode
from shared.keys import Keys
from shared.records import CheckpointAnnouncement, GeneratorRegistration, WeightVersionAnnouncement, WireModel
from shared.streams.dead_letter import dead_letter_fields, raw_fields
from shared.streams.entries import Delivery, escaped, shown

log = logging.getLogger(__name__)

R = TypeVar("R", bound=WireModel)

_DEAD_LETTER_MAXLEN = 100_000  # as a stream consumer's dead-letter stream
# A registration is a few hundred bytes (a URL, versions, device ids, the engine's layer names); one far larger
# is not one, and is set aside before it is decoded.
MAX_REGISTRATION_BYTES = 64 * 1024
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

    invalid: int = 0  # values that did not decode: set aside (hash fields) or read as absent (announcements)


async def register(client: aioredis.Redis, keys: Keys, registration: GeneratorRegistration, ttl_s: float) -> None:
    """Write (or refresh) a replica's registration and liveness key."""
    async with client.pipeline(transaction=True) as pipe:
        pipe.hset(keys.generators, registration.generator_id, encode(registration))
        pipe.set(keys.generator_alive(registration.generator_id), b"1", px=int(ttl_s * 1000))
        await pipe.execute()


async def deregister(client: aioredis.Redis, keys: Keys, generator_id: str) -> None:
    async with client.pipeline(transaction=True) as pipe:
        pipe.hdel(keys.generators, generator_id)
        pipe.delete(keys.generator_alive(generator_id))
        await pipe.execute()


async def live_generators(client: aioredis.Redis, keys: Keys, stats: RegistryStats) -> list[GeneratorRegistration]:
    """Registered replicas whose heartbeat has not expired; expired ones are removed from the hash, ones that
    do not decode are set aside (see the module docstring)."""
    entries = await client.hgetall(keys.generators)
    alive = []
    for raw_id, payload in sorted((_bytes(field), _bytes(value)) for field, value in entries.items()):
        try:
            registration = _registration(raw_id, payload)
        except (UnicodeDecodeError, WireError) as exc:
            reason = f"registration {shown(raw_id)}: {type(exc).__name__}: {exc}"
            await set_aside(client, keys, keys.generators, (raw_id, payload), reason, stats)
            continue
        if not await client.exists(keys.generator_alive(registration.generator_id)):
            log.info("generator %s missed its heartbeat; dropping its registration", registration.generator_id)
            await client.hdel(keys.generators, raw_id)
            continue
        alive.append(registration)
    return alive


def _registration(raw_id: bytes, payload: bytes) -> GeneratorRegistration:
    """The registration filed under ``raw_id``; raises when either does not decode, they disagree, or the
    value is over ``MAX_REGISTRATION_BYTES``."""
    generator_id = raw_id.decode("utf-8")
    if len(payload) > MAX_REGISTRATION_BYTES:
        raise WireError(f"{len(payload)} bytes, over the {MAX_REGISTRATION_BYTES} a registration may take", "size")
    registration = decode(payload, GeneratorRegistration)
    if registration.generator_id != generator_id:
        raise WireError(f"filed under {generator_id!r} but registers {registration.generator_id!r}", "generator_id")
    return registration


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
