"""Fixtures shared by every test: a real Redis and a key prefix of the test's own."""

from __future__ import annotations

import uuid

import pytest

from shared.keys import Keys
from shared.redis_conn import make_client
from tests.support.redis_server import use_or_start_redis


@pytest.fixture(scope="session")
def redis_url():
    """The Redis at $REDIS_URL if it answers, else a redis-server started on a free port for this run."""
    url, server = use_or_start_redis()
    try:
        yield url
    finally:
        if server is not None:
            server.stop()


@pytest.fixture
def keys() -> Keys:
    return Keys(prefix=f"test-{uuid.uuid4().hex[:10]}")


@pytest.fixture
async def redis_client(redis_url, keys):
    client = make_client(redis_url)
    yield client
    doomed = [key async for key in client.scan_iter(match=f"{keys.prefix}:*", count=1000)]
    if doomed:
        await client.delete(*doomed)
    await client.aclose()
