"""A replica's GPU lease lives while its event loop is blocked, against a real Redis.

vLLM's engine start blocks the generator's event loop for minutes, longer than the lease's TTL
(``heartbeat_ttl_s``). Renewed on the loop (by the heartbeat, which starts after the engine), the lease lapsed
meanwhile and the next replica to start took the same GPU. The lease is now renewed from a thread of its own
(:class:`services.generator.gpu_lease.LeaseKeeper`); a replica whose GPU another holds anyway stops with an error.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from services.generator.gpu_lease import GpuLease, LeaseLost, NoFreeGpuError
from services.generator.startup import fail_when_lost, take_gpus
from shared.config.generator import GeneratorSettings
from shared.lifecycle import Service

pytestmark = pytest.mark.integration

TTL_S = 0.6  # renewed every 0.2 s


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_the_lease_outlives_a_blocked_event_loop(redis_client, redis_url, keys):
    lease = GpuLease(redis_client, keys, "box", "gen-a", TTL_S)
    assert await lease.acquire([1, 2], 1) == [1]
    lost: list[LeaseLost] = []
    lease.keep_alive(redis_url, lost.append)
    time.sleep(4 * TTL_S)  # the loop is blocked, as while vLLM loads
    with pytest.raises(NoFreeGpuError, match="GPU 1: gen-a"):
        await GpuLease(redis_client, keys, "box", "gen-b", TTL_S).acquire([1], 1)
    assert await redis_client.pttl(keys.gpu_lease("box", 1)) > 0
    assert lost == [] and lease.keeper is not None and lease.keeper.errors == 0
    keeper = lease.keeper
    await lease.release()
    assert not keeper._thread.is_alive()
    assert await redis_client.get(keys.gpu_lease("box", 1)) is None


async def test_without_the_keeper_the_lease_lapses_while_the_loop_is_blocked(redis_client, keys):
    """What happened before: nothing renewed the lease during the engine's start."""
    lease = GpuLease(redis_client, keys, "box", "gen-a", TTL_S)
    assert await lease.acquire([1], 1) == [1]
    time.sleep(2 * TTL_S)
    assert await GpuLease(redis_client, keys, "box", "gen-b", TTL_S).acquire([1], 1) == [1]


async def test_a_gpu_another_replica_holds_is_reported_lost_and_not_released(redis_client, redis_url, keys):
    lease = GpuLease(redis_client, keys, "box", "gen-a", TTL_S)
    await lease.acquire([1], 1)
    reported = threading.Event()
    lost: list[LeaseLost] = []
    lease.keep_alive(redis_url, lambda exc: (lost.append(exc), reported.set()))
    await redis_client.set(keys.gpu_lease("box", 1), "gen-b")  # its lease lapsed and gen-b took the GPU
    assert await asyncio.to_thread(reported.wait, 5)
    assert "GPU 1 lease was taken by gen-b" in str(lost[0])
    await lease.release()
    assert await redis_client.get(keys.gpu_lease("box", 1)) == b"gen-b"


async def test_redis_out_of_reach_is_counted_and_retried(redis_client, keys):
    lease = GpuLease(redis_client, keys, "box", "gen-a", TTL_S)
    await lease.acquire([1], 1)
    lost: list[LeaseLost] = []
    lease.keep_alive(f"redis://127.0.0.1:{_free_port()}/0", lost.append)  # nothing listens there
    await asyncio.sleep(5 * TTL_S / 3)
    assert lease.keeper is not None and lease.keeper.errors >= 2 and lost == []
    await lease.release()


async def test_a_silent_redis_costs_one_interval_per_renewal_and_release_does_not_wait(redis_client, keys):
    """A Redis that accepts connections and never answers: each renewal gives up after one interval (no
    retries), and releasing the lease waits for one renewal in flight at most."""
    lease = GpuLease(redis_client, keys, "box", "gen-a", TTL_S)
    await lease.acquire([1], 1)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # connections complete in the backlog; nothing is ever read or answered
        lease.keep_alive(f"redis://127.0.0.1:{silent.getsockname()[1]}/0", lambda exc: None)
        await asyncio.sleep(8 * TTL_S / 3)  # 8 intervals: a renewal and its timeout take two
        assert lease.keeper is not None and lease.keeper.errors >= 3, lease.keeper.errors
        started = time.perf_counter()
        await lease.release()
        assert time.perf_counter() - started < 2 * TTL_S / 3 + 0.5


async def test_fail_when_lost_stops_the_service_with_an_error():
    stop = asyncio.Event()
    lost: asyncio.Future[LeaseLost] = asyncio.get_running_loop().create_future()
    watch = asyncio.create_task(fail_when_lost(lost, stop))
    await asyncio.sleep(0.05)
    assert not watch.done()
    lost.set_result(LeaseLost("GPU 1 lease was taken by gen-b"))
    with pytest.raises(RuntimeError, match="stopping this replica: GPU 1 lease was taken by gen-b"):
        await watch
    assert stop.is_set()
    # After a stop, it returns without an error.
    stop = asyncio.Event()
    watch = asyncio.create_task(fail_when_lost(asyncio.get_running_loop().create_future(), stop))
    stop.set()
    await asyncio.wait_for(watch, 1)


async def test_a_replica_whose_gpu_is_taken_stops_with_an_error(redis_client, redis_url, keys, monkeypatch):
    """The generator's own start-up (:func:`take_gpus`) in a real Service: the GPU is taken from under it."""
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):  # leasing sets them: restored after the test
        monkeypatch.setenv(name, "")
    settings = GeneratorSettings(
        model="/m",
        api_token="t",
        redis_url=redis_url,
        stream_prefix=keys.prefix,
        generator_id="gen-a",
        gpu_count=2,
        learner_gpus="0",
        gpu_host_key="box",
        heartbeat_ttl_s=TTL_S,
    )
    async with Service("generator", settings, redis_client) as service:
        lease = await take_gpus(service)
        assert lease.indices == [1] and lease.keeper is not None
        await redis_client.set(keys.gpu_lease("box", 1), "gen-b")
        await asyncio.wait_for(service.stop.wait(), 5)
        with pytest.raises(RuntimeError, match="stopping this replica: GPU 1 lease was taken by gen-b"):
            await asyncio.gather(*service._tasks)
        service._tasks.clear()
    assert lease.keeper is None and lease.indices == []
    assert await redis_client.get(keys.gpu_lease("box", 1)) == b"gen-b"  # not released: it is gen-b's
