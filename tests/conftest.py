"""Fixtures shared by every test: a real Redis and a key prefix of the test's own."""

from __future__ import annotations

import os
import uuid

import pytest

from shared.keys import Keys
from shared.redis_conn import make_client
from tests.support.redis_server import answers, start_redis

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="session")
def redis_url():
    """The Redis at $REDIS_URL if it answers, else a redis-server started on a free port for this run."""
    url = os.environ.get("REDIS_URL", DEFAULT_REDIS_URL)
    if answers(url):
        yield url
        return
    server = start_redis()
    try:
        yield server.url
    finally:
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
