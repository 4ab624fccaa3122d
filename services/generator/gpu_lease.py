"""A replica's GPU lease and heartbeat (its registration itself is in :mod:`shared.registry`).

* GPU lease: ``docker compose --scale generator=N`` gives every replica the same devices, so each replica
  takes free GPU indices with ``SET NX PX`` before CUDA starts, renews them every ``ttl / 3`` from a thread
  of its own (:class:`LeaseKeeper`: vLLM's engine start blocks the event loop for minutes, longer than the
  TTL, and a lease renewed on the loop would lapse meanwhile and let the next replica take the same GPU) and
  releases them on exit. A replica that finds its GPU held by another stops with an error. The keys live in
  one lease namespace per host (``generator.gpu_host_key``), which every replica that sees those GPUs must
  share; which indices a replica may take is :func:`shared.gpu_placement.leasable_gpus`. No free GPU: no start,
  with a message naming the fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence

import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry

from shared.gpu_placement import PlacementError, no_free_gpu_message
from shared.keys import Keys

log = logging.getLogger(__name__)


class NoFreeGpuError(RuntimeError):
    pass


class LeaseLost(RuntimeError):
    """Another replica holds a GPU this replica leased (its lease lapsed: Redis was out of reach for a TTL)."""


# Renew one lease key atomically: set it again unless another replica holds it; returns that holder, else nil.
_RENEW = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return holder end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
"""


# Delete one lease key only if this replica holds it.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def host_gpu_count() -> int:
    """GPUs this process can see, counted through NVML: it ignores ``CUDA_VISIBLE_DEVICES`` and starts no
    CUDA context, so it is safe before the lease sets the visible devices."""
    try:
        from vllm.third_party import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVMLError_LibraryNotFound and friends: no driver here
        raise PlacementError(
            f"generator.gpu_count is 'auto' but NVML cannot count the GPUs ({type(exc).__name__}: {exc}); "
            "run on a GPU host with the NVIDIA driver, or set GENERATOR_GPU_COUNT to a number (0: no GPU)"
        ) from exc


class GpuLease:
    """Indices of GPUs in one lease namespace held by one replica, through keys with a TTL."""

    def __init__(self, client: aioredis.Redis, keys: Keys, host: str, owner: str, ttl_s: float) -> None:
        self.client, self.keys, self.host, self.owner = client, keys, host, owner
        self.ttl_ms = int(ttl_s * 1000)
        self.indices: list[int] = []
        self.keeper: LeaseKeeper | None = None

    async def acquire(
        self, candidates: Sequence[int], needed: int, learner_gpus: Sequence[int] = (), colocated: bool = False
    ) -> list[int]:
        """Take the first ``needed`` free indices of ``candidates``; raises NoFreeGpuError, naming the
        holders and the fix, if too few are free."""
        for index in candidates:
            if len(self.indices) == needed:
                break
            key = self.keys.gpu_lease(self.host, index)
            if await self.client.set(key, self.owner, nx=True, px=self.ttl_ms) or await self._reclaim(key):
                self.indices.append(index)
        if len(self.indices) < needed:
            await self.release()
            held = await self.holders(candidates)
            raise NoFreeGpuError(no_free_gpu_message(self.host, candidates, held, needed, learner_gpus, colocated))
        return self.indices

    async def _reclaim(self, key: str) -> bool:
        """A key this replica's name still holds (it restarted in the same container before the TTL ran out),
        renewed; False if another replica holds it."""
        return await self.client.eval(_RENEW, 1, key, self.owner, self.ttl_ms) is None

    async def holders(self, candidates: Sequence[int]) -> dict[int, str]:
        """index -> the replica holding it, for the leased ones among ``candidates``."""
        values = await self.client.mget([self.keys.gpu_lease(self.host, i) for i in candidates])
        return {
            i: v.decode(errors="backslashreplace") for i, v in zip(candidates, values, strict=True) if v is not None
        }

    def keep_alive(self, redis_url: str, on_lost: Callable[[LeaseLost], None]) -> None:
        """Renew the held keys from a :class:`LeaseKeeper` thread until :meth:`release`."""
        self.keeper = LeaseKeeper(self, redis_url, on_lost)
        self.keeper.start()

    async def release(self) -> None:
        if self.keeper is not None:
            await asyncio.to_thread(self.keeper.stop)
            self.keeper = None
        for index in self.indices:
            await self.client.eval(_RELEASE, 1, self.keys.gpu_lease(self.host, index), self.owner)
        self.indices = []


class LeaseKeeper:
    """Renews a lease's keys every ``ttl / 3`` from a daemon thread with its own Redis connection, so the lease
    lives while the event loop is blocked (vLLM's engine start blocks it for minutes). Redis errors are logged
    and counted (``errors``) and the renewal is tried again; a key another replica holds ends the keeping and
    goes to ``on_lost`` (called on this thread)."""

    def __init__(self, lease: GpuLease, redis_url: str, on_lost: Callable[[LeaseLost], None]) -> None:
        self.lease, self.on_lost = lease, on_lost
        self.interval_s = lease.ttl_ms / 3000
        self.errors = 0
        # One try per renewal (no retries, whatever redis-py's default), bounded by the interval: a Redis that
        # does not answer costs one interval, and the next renewal comes one interval later.
        self._client = redis.Redis.from_url(
            redis_url,
            socket_timeout=self.interval_s,
            socket_connect_timeout=self.interval_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-lease-keeper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the renewals: at most one renewal in flight, which the socket timeout bounds."""
        self._stopped.set()
        self._thread.join(timeout=2 * self.interval_s + 1)
        self._client.close()

    def renew(self) -> None:
        """One renewal of every held key; raises LeaseLost, or Redis's error."""
        lease = self.lease
        for index in list(lease.indices):
            holder = self._client.eval(_RENEW, 1, lease.keys.gpu_lease(lease.host, index), lease.owner, lease.ttl_ms)
            if holder is not None:
                taken_by = holder.decode(errors="backslashreplace")
                raise LeaseLost(f"GPU {index} lease was taken by {taken_by} (this replica's lease lapsed)")

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            try:
                self.renew()
            except LeaseLost as exc:
                log.error("%s", exc)
                self.on_lost(exc)
                return
            except Exception as exc:  # Redis out of reach or silent: try again next interval
                self.errors += 1
                log.error("could not renew the GPU lease (%d errors so far): %s", self.errors, exc)


async def heartbeat_forever(beat, interval_s: float, stop: asyncio.Event, on_error) -> None:
    """Call ``beat()`` every ``interval_s`` until ``stop``; errors go to ``on_error`` (logged and counted)."""
    while not stop.is_set():
        try:
            await beat()
        except Exception as exc:
            on_error(exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
