"""A replica's GPU lease and heartbeat (its registration itself is in :mod:`shared.registry`).

* GPU lease: ``docker compose --scale generator=N`` gives every replica the same devices, so each replica
  takes free GPU indices with ``SET NX EX`` before CUDA starts, renews them with its heartbeat and releases
  them on exit. No free GPU: no start, with a message saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis

from shared.keys import Keys

log = logging.getLogger(__name__)


class NoFreeGpuError(RuntimeError):
    pass


class GpuLease:
    """Indices of GPUs on one host held by one replica, through keys with a TTL."""

    def __init__(self, client: aioredis.Redis, keys: Keys, host: str, owner: str, ttl_s: float) -> None:
        self.client, self.keys, self.host, self.owner = client, keys, host, owner
        self.ttl_ms = int(ttl_s * 1000)
        self.indices: list[int] = []

    async def acquire(self, gpu_count: int, needed: int) -> list[int]:
        """Take ``needed`` free indices out of ``gpu_count``; raises NoFreeGpuError if too few are free."""
        for index in range(gpu_count):
            if len(self.indices) == needed:
                break
            if await self.client.set(self.keys.gpu_lease(self.host, index), self.owner, nx=True, px=self.ttl_ms):
                self.indices.append(index)
        if len(self.indices) < needed:
            await self.release()
            raise NoFreeGpuError(
                f"no free GPU on {self.host}: {needed} needed, all {gpu_count} leased by other replicas "
                f"(keys {self.keys.gpu_lease(self.host, 0)}...); scale down or raise generator.gpu_count"
            )
        return self.indices

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
