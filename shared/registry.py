"""Generator registrations and the learner's latest announcements in Redis: who serves, what to load.

Written by generators (registration + liveness key with a TTL) and the learner (weights and checkpoint
announcements); read by both. Lives in ``shared`` because both sides use it.
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis

from shared.codec import WireError, decode, encode
from shared.keys import Keys
from shared.records import CheckpointAnnouncement, GeneratorRegistration, WeightVersionAnnouncement

log = logging.getLogger(__name__)


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


async def live_generators(client: aioredis.Redis, keys: Keys) -> list[GeneratorRegistration]:
    """Registered replicas whose heartbeat has not expired; expired ones are removed from the hash."""
    entries = await client.hgetall(keys.generators)
    alive = []
    for raw_id, payload in sorted(entries.items()):
        generator_id = _bytes(raw_id).decode()
        if not await client.exists(keys.generator_alive(generator_id)):
            log.info("generator %s missed its heartbeat; dropping its registration", generator_id)
            await client.hdel(keys.generators, generator_id)
            continue
        try:
            alive.append(decode(_bytes(payload), GeneratorRegistration))
        except WireError as exc:
            log.error("ignoring malformed registration of %s: %s", generator_id, exc)
    return alive


async def latest_checkpoint(client: aioredis.Redis, keys: Keys) -> CheckpointAnnouncement | None:
    raw = await client.get(keys.checkpoint)
    return decode(_bytes(raw), CheckpointAnnouncement) if raw else None


async def latest_weights_version(client: aioredis.Redis, keys: Keys) -> int | None:
    raw = await client.get(keys.weights)
    return decode(_bytes(raw), WeightVersionAnnouncement).policy_version if raw else None


def _bytes(value: bytes | str) -> bytes:
    """Replies are bytes (clients are made with ``decode_responses=False``)."""
    return value if isinstance(value, bytes) else value.encode()
