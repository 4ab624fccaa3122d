"""A replica's GPU lease and heartbeat (its registration itself is in :mod:`shared.registry`).

* GPU lease: ``docker compose --scale generator=N`` gives every replica the same devices, so each replica
  takes free GPU indices with ``SET NX PX`` before CUDA starts, renews them with its heartbeat and releases
  them on exit. The keys live in one lease namespace per host (``generator.gpu_host_key``), which every
  replica that sees those GPUs must share; which indices a replica may take is
  :func:`shared.placement.leasable_gpus`. No free GPU: no start, with a message naming the fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import redis.asyncio as aioredis

from shared.keys import Keys
from shared.placement import PlacementError, no_free_gpu_message

log = logging.getLogger(__name__)


class NoFreeGpuError(RuntimeError):
    pass


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

    async def acquire(self, candidates: Sequence[int], needed: int, learner_gpus: Sequence[int] = ()) -> list[int]:
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
            raise NoFreeGpuError(no_free_gpu_message(self.host, candidates, held, needed, learner_gpus))
        return self.indices

    async def _reclaim(self, key: str) -> bool:
        """A key this replica's name still holds (it restarted in the same container before the TTL ran out)."""
        if (await self.client.get(key) or b"").decode() != self.owner:
            return False
        return bool(await self.client.set(key, self.owner, xx=True, px=self.ttl_ms))

    async def holders(self, candidates: Sequence[int]) -> dict[int, str]:
        """index -> the replica holding it, for the leased ones among ``candidates``."""
        values = await self.client.mget([self.keys.gpu_lease(self.host, i) for i in candidates])
        return {i: v.decode() for i, v in zip(candidates, values, strict=True) if v is not None}

    async def renew(self) -> None:
        for index in self.indices:
            key = self.keys.gpu_lease(self.host, index)
            holder = await self.client.get(key)
            if holder is not None and holder.decode() != self.owner:
                raise RuntimeError(f"GPU {index} lease was taken by {holder.decode()} (heartbeat too slow?)")
            await self.client.set(key, self.owner, px=self.ttl_ms)

    async def release(self) -> None:
        for index in self.indices:
            key = self.keys.gpu_lease(self.host, index)
            if (await self.client.get(key) or b"").decode() == self.owner:
                await self.client.delete(key)
        self.indices = []


async def heartbeat_forever(beat, interval_s: float, stop: asyncio.Event, on_error) -> None:
    """Call ``beat()`` every ``interval_s`` until ``stop``; errors go to ``on_error`` (logged and counted)."""
    while not stop.is_set():
        try:
            await beat()
        except Exception as exc:
            on_error(exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
