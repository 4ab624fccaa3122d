"""The learner's listing of generator registrations (``shared.registry``), on a real Redis: a generator id is
held by the first live registration filed for it, so a forged second one is refused while the real one lives,
and a restarted replica (the same id, a new secret) is accepted once its old key has expired."""

from __future__ import annotations

import asyncio
import logging

import pytest

from shared.records import GeneratorRegistration
from shared.registry import RegistryStats, deregister, live_generators, new_registration_key, register

pytestmark = pytest.mark.integration

_SHORT_TTL_S = 0.3  # long enough to list once before the key expires, short enough to wait for


def _registration(generator_id: str, url: str) -> GeneratorRegistration:
    return GeneratorRegistration(generator_id=generator_id, url=url, policy_version=0)


async def _urls(client, keys, stats: RegistryStats) -> list[str]:
    return [registration.url for registration in await live_generators(client, keys, stats)]


async def _expired(client, key: str) -> None:
    """Until Redis has expired ``key`` (its TTL is short)."""
    for _ in range(100):
        if not await client.exists(key):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{key} did not expire")


async def test_a_forged_registration_claiming_a_live_generators_id_is_refused_and_the_real_one_stays(
    redis_client, keys, caplog
):
    real, forged = new_registration_key(keys), new_registration_key(keys)
    await register(redis_client, keys, real, _registration("gen-0", "http://10.0.0.1:8000"), ttl_s=60)
    await register(redis_client, keys, forged, _registration("gen-0", "http://attacker:8000"), ttl_s=60)
    stats = RegistryStats()
    with caplog.at_level(logging.WARNING, logger="shared.registry"):
        for _ in range(2):  # refused at every listing, warned and counted once
            assert await _urls(redis_client, keys, stats) == ["http://10.0.0.1:8000"]
    [warning] = [record.getMessage() for record in caplog.records if "refusing registration" in record.getMessage()]
    shown_forged, shown_real = forged[: -(32 - 8)], real[: -(32 - 8)]  # the secrets cut short, as logged
    assert warning.index(shown_forged) < warning.index(shown_real) and "'gen-0'" in warning
    assert forged not in warning and real not in warning  # a log line never names a whole key
    assert stats.invalid == 1
    assert await redis_client.lrange(keys.registrations, 0, -1) == [real.encode(), forged.encode()]


async def test_a_restarted_replica_is_accepted_once_its_old_key_has_expired(redis_client, keys):
    old, new = new_registration_key(keys), new_registration_key(keys)
    await register(redis_client, keys, old, _registration("gen-0", "http://10.0.0.1:8000"), ttl_s=_SHORT_TTL_S)
    await register(redis_client, keys, new, _registration("gen-0", "http://10.0.0.1:8001"), ttl_s=60)
    stats = RegistryStats()
    assert await _urls(redis_client, keys, stats) == ["http://10.0.0.1:8000"]  # the old one still lives
    await _expired(redis_client, old)
    assert await _urls(redis_client, keys, stats) == ["http://10.0.0.1:8001"]
    assert await redis_client.lrange(keys.registrations, 0, -1) == [new.encode()]  # the expired entry dropped


async def test_a_replica_whose_key_expired_is_filed_again_at_its_next_beat_and_leaving_drops_it(redis_client, keys):
    key = new_registration_key(keys)
    registration = _registration("gen-0", "http://10.0.0.1:8000")
    await register(redis_client, keys, key, registration, ttl_s=_SHORT_TTL_S)
    await _expired(redis_client, key)
    stats = RegistryStats()
    assert await _urls(redis_client, keys, stats) == [] and await redis_client.llen(keys.registrations) == 0
    for _ in range(2):  # the first beat files it again, the second only refreshes it
        await register(redis_client, keys, key, registration, ttl_s=60)
    assert await _urls(redis_client, keys, stats) == ["http://10.0.0.1:8000"]
    assert await redis_client.lrange(keys.registrations, 0, -1) == [key.encode()]
    await deregister(redis_client, key)
    assert await _urls(redis_client, keys, stats) == [] and await redis_client.llen(keys.registrations) == 0
    assert stats.invalid == 0
