"""Planted secrets never come out: a scorer whose HTTP reward's URL carries credentials, whose headers and bearer
token are secrets, and whose plugin is down (its breaker opens at the health probe, the scorer pauses). Its whole
output (the settings line, the breaker's warning, the "paused" line), ``/ready``, ``/metrics`` and the dead
letters hold none of them; ``tests/integration/test_redis_acl.py`` checks redis-server's command lines."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from shared.keys import Keys
from tests.integration.test_reward_outages import FAST, _feed, _ready, _scorer
from tests.support.redis_server import free_port

pytestmark = pytest.mark.integration

SECRETS = ("PLANTED-url-pass-4b1d", "PLANTED-header-77aa", "PLANTED-bearer-0123456789abcdef0123456789")


async def test_a_scorer_says_no_secret_of_its_reward_plugin_anywhere(redis_url, redis_client, keys):
    keys = Keys(keys.prefix)
    dead = free_port()  # nothing listens: the health probe fails, the required reward's breaker opens
    judge = {
        "name": "judge",
        "url": f"http://judge-user:{SECRETS[0]}@127.0.0.1:{dead}/score",
        "headers": {"X-Api-Key": SECRETS[1]},
        "bearer_token": SECRETS[2],
        **FAST,
    }
    scorer = _scorer("scorer-secrets", redis_url, keys, [judge])
    try:
        paused = await asyncio.to_thread(scorer.wait_for_line, "scorer-secrets paused", 90)
        await _feed(redis_client, keys, 1)
        await asyncio.sleep(1.0)  # a trial call after breaker_reset_s fails again and is logged
        ready = _ready(scorer)
        metrics = httpx.get(f"{scorer.url}/metrics", timeout=5).text
    finally:
        scorer.stop()
    output = scorer.output()
    assert "judge-user:***@127.0.0.1" in paused, paused  # the paused line names the endpoint, masked
    assert "breaker open" in output and ready.status_code == 503
    letters = [str(fields) for _, fields in await redis_client.xrange(keys.dead_letter)]
    for where, text in (("output", output), ("/ready", ready.text), ("/metrics", metrics), ("dead", str(letters))):
        leaked = [secret for secret in SECRETS if secret in text]
        assert not leaked, f"{where} says {leaked}"
