"""Consumer groups of a stream: creating them, measuring what they have not finished, trimming what they have.

A stream that does not exist yet has no backlog and nothing to trim; every other Redis error is raised.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared.streams.entries import entry_key, text


async def ensure_group(client: aioredis.Redis, stream: str, group: str) -> None:
    """Create ``group`` on ``stream`` (and the stream) if missing; starts from the first entry."""
    try:
        await client.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def _groups(client: aioredis.Redis, stream: str) -> list[dict[str, Any]] | None:
    """``XINFO GROUPS`` of ``stream``; None for a stream that does not exist."""
    try:
        return await client.xinfo_groups(stream)
    except ResponseError as exc:
        if "no such key" in str(exc).lower():
            return None
        raise


async def stream_backlog(client: aioredis.Redis, stream: str) -> int:
    """Entries not yet done by the busiest consumer group (undelivered + pending); XLEN without groups."""
    groups = await _groups(client, stream)
    if groups is None:
        return 0
    if not groups:
        return int(await client.xlen(stream))
    worst = 0
    length: int | None = None
    for info in groups:
        lag = info.get("lag")
        if lag is None:  # Redis cannot compute the lag after some deletions: count conservatively
            if length is None:
                length = int(await client.xlen(stream))
            lag = length
        worst = max(worst, int(lag) + int(info.get("pending", 0)))
    return worst


async def group_backlog(client: aioredis.Redis, stream: str, group: str, *, include_pending: bool = True) -> int:
    """Entries of ``stream`` that ``group`` has not finished: undelivered (lag), plus pending if asked.

    A stream or group that does not exist yet counts every entry as undelivered.
    """
    groups = await _groups(client, stream)
    if groups is None:
        return 0
    for info in groups:
        if text(info["name"]) == group:
            lag = info.get("lag")
            if lag is None:
                lag = int(await client.xlen(stream))
            return int(lag) + (int(info.get("pending", 0)) if include_pending else 0)
    return int(await client.xlen(stream))


async def trim_processed(client: aioredis.Redis, stream: str) -> int:
    """Remove entries every consumer group is done with; returns how many were removed.

    The cut is the smallest of, per group, its oldest pending entry and the entry after its last delivered
    one; ``XTRIM MINID`` keeps everything at or above it. Without groups nothing is trimmed.
    """
    groups = await _groups(client, stream)
    if not groups:
        return 0
    cut = min([await _oldest_needed(client, stream, info) for info in groups])
    return int(await client.xtrim(stream, minid=f"{cut[0]}-{cut[1]}", approximate=False))


async def _oldest_needed(client: aioredis.Redis, stream: str, info: dict[str, Any]) -> tuple[int, int]:
    """The oldest entry one group still needs: its oldest pending one, else the one after its last delivered."""
    last = entry_key(text(info["last-delivered-id"]))
    needed = (last[0], last[1] + 1)
    if int(info.get("pending", 0)) > 0:
        oldest = (await client.xpending(stream, text(info["name"]))).get("min")
        if oldest is not None:
            needed = min(needed, entry_key(text(oldest)))
    return needed
