"""Access: Redis password and TLS through REDIS_URL, no secrets in logs or metrics, malformed entries
dead-lettered with their reason, an invalid configuration refused at start with the field named."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from services.scorer.scoring import build_functions
from services.scorer.scoring_loop import ScoringLoop
from shared.config.scorer import RewardSpec
from shared.keys import Keys
from shared.records import AdvantageSpec
from shared.redis_conn import connect
from shared.streams import Output, StreamConsumer, StreamProducer
from tests.support.processes import ROOT, start_service
from tests.support.redis_server import free_port, start_redis

pytestmark = pytest.mark.integration

PASSWORD = "s3cr3t-pa55"
TOKEN = "t0ken-value-123-" + "x" * 32


async def _round_trip(url: str, keys: Keys) -> None:
    client = await connect(url, timeout_s=10)
    try:
        stream = f"{keys.prefix}:in"
        await StreamProducer(client, stream).add("r1", b"payload")
        consumer = StreamConsumer(client, keys, stream, "g", "c", block_ms=100)
        await consumer.start()
        [delivery] = await consumer.read()
        assert await consumer.commit(delivery, [Output(StreamProducer(client, f"{keys.prefix}:out"), "r1", b"p")])
    finally:
        await client.aclose()


async def test_password_in_the_url_and_a_wrong_one_fails_without_leaking_it(keys):
    server = start_redis(password=PASSWORD)
    try:
        await _round_trip(server.url, keys)
        wrong = server.url.replace(PASSWORD, "wrong-password")
        with pytest.raises(Exception) as error:  # redis-py raises AuthenticationError, not retried
            await connect(wrong, timeout_s=2)
        assert "wrong-password" not in str(error.value)
    finally:
        server.stop()


@pytest.fixture
def certificates(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key), str(cert)


async def test_tls_through_a_rediss_url(certificates, keys):
    server = start_redis(password=PASSWORD, tls=certificates)
    try:
        assert server.url.startswith("rediss://")
        await _round_trip(server.url, keys)
    finally:
        server.stop()


async def test_no_secrets_in_logs_or_metrics(keys):
    server = start_redis(password=PASSWORD)
    port = free_port()
    scorer = start_service(
        "scorer",
        "services.scorer",
        {
            "REDIS_URL": server.url,
            "API_TOKEN": TOKEN,
            "STREAM_PREFIX": keys.prefix,
            "SCORER_PORT": str(port),
            "SCORER_REWARDS": '[{"name": "digit"}]',
            "LOG_LEVEL": "DEBUG",
        },
    )
    try:
        await asyncio.to_thread(scorer.wait_for_line, "ready", 60)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert httpx.post(f"http://127.0.0.1:{port}/shutdown", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        scorer.process.wait(30)
        output = scorer.output()
        assert "redis://:***@127.0.0.1" in output  # the resolved settings are logged, masked
        for secret in (PASSWORD, TOKEN):
            assert secret not in output and secret not in metrics
    finally:
        scorer.stop()
        server.stop()


async def test_malformed_rollout_goes_to_the_dead_letter_stream_with_its_reason(redis_client, keys):
    keys = Keys(keys.prefix)
    await redis_client.xadd(keys.rollouts, {b"id": b"bad-1", b"data": b"\x93not a record"})
    async with httpx.AsyncClient() as http:
        functions, _ = build_functions([RewardSpec(name="digit")], http)
        consumer = StreamConsumer(redis_client, keys, keys.rollouts, Keys.SCORERS, "s1", block_ms=100)
        await consumer.start()
        loop = ScoringLoop(
            consumer,
            StreamProducer(redis_client, keys.scored),
            functions,
            [1.0],
            AdvantageSpec(),
            drop_zero_std=False,
            max_in_flight=2,
        )
        stop = asyncio.Event()
        runner = asyncio.create_task(loop.run(stop))
        deadline = time.monotonic() + 20
        while await redis_client.xlen(keys.dead_letter) == 0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        stop.set()
        await runner
    [(_, fields)] = await redis_client.xrange(keys.dead_letter)
    assert fields[b"id"] == b"bad-1" and fields[b"data"] == b"\x93not a record"
    assert fields[b"reason"].startswith(b"WireError: not a msgpack record")
    assert loop.stats.rejected == 1 and np.isclose(loop.stats.groups_scored, 0)


def test_invalid_configuration_stops_the_service_naming_the_field():
    result = subprocess.run(
        [sys.executable, "-m", "services.learner"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={
            "PATH": "/usr/bin:/bin",
            "LEARNER_MODEL": "/m",
            "LEARNER_GROUP_SIZE": "4",
            "LEARNER_GROUPS_PER_STEP": "3",
            "LEARNER_MICRO_BATCH_SIZE": "8",
        },
        timeout=60,
    )
    assert result.returncode == 2
    assert "learner: invalid configuration" in result.stderr
    assert "must be a multiple of micro_batch_size (8); e.g. micro_batch_size = 6" in result.stderr
    assert "Traceback" not in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "services.scorer"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "SCORER_REWARDS": '[{"name": "judge", "url": "ftp://x"}]'},
        timeout=60,
    )
    assert result.returncode == 2 and "scorer.rewards.0" in result.stderr and "http://" in result.stderr
