"""Fixtures shared by every test: a real Redis and a key prefix of the test's own."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from shared.keys import Keys
from shared.redis_conn import make_client
from tests.support.redis_server import use_or_start_redis
from tests.support.tiers import TIERS, tier


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


def pytest_configure(config):
    for name in TIERS:
        config.addinivalue_line("markers", f"{name}: the {name} tier (tests/support/tiers.py decides it)")


def pytest_collection_modifyitems(config, items):
    """Each test's tier marker, from its folder and from what it starts (tests/support/tiers.py)."""
    for item in items:
        function = item.cls.__name__ if getattr(item, "cls", None) else getattr(item, "originalname", item.name)
        item.add_marker(tier(Path(str(item.path)), function, item.fixturenames))
    items[:] = longest_first(items)


# The slow tiers start first, so with two workers (``-n 2``) the last minutes are short unit tests, not one
# worker finishing a bench run alone. A module keeps its tests together (its module fixtures are built once).
START_ORDER = ("bench", "e2e", "vllm", "integration", "process", "unit", "gpu")


def _start_rank(item) -> int:
    marks = {mark.name for mark in item.iter_markers()}
    return min((START_ORDER.index(name) for name in marks if name in START_ORDER), default=len(START_ORDER))


def longest_first(items: list) -> list:
    """``items`` with whole modules reordered by their slowest test's tier, in collection order otherwise."""
    rank: dict[Path, int] = {}
    for item in items:
        rank[item.path] = min(rank.get(item.path, len(START_ORDER)), _start_rank(item))
    return sorted(items, key=lambda item: rank[item.path])


DURATIONS = Path(__file__).resolve().parents[1] / "build" / "test-durations.txt"
_durations: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """Every test's seconds (setup, call and teardown), slowest first, in build/test-durations.txt: where the
    suite's time goes, kept after the run (CI's output keeps pytest's --durations lines too)."""
    if not _durations or hasattr(session.config, "workerinput"):
        return
    DURATIONS.parent.mkdir(exist_ok=True)
    ranked = sorted(_durations.items(), key=lambda item: -item[1])
    lines = [f"{seconds:9.2f}  {nodeid}" for nodeid, seconds in ranked]
    total = f"{sum(_durations.values()):9.2f}  total of {len(ranked)} tests (exit status {exitstatus})"
    DURATIONS.write_text("\n".join([total, *lines]) + "\n")
