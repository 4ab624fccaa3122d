"""Applied markers: how a consumer group knows a record was applied, so a redelivered entry is acknowledged
without effect (nothing trained twice). A commit makes its markers in the same transaction as its outputs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from shared.keys import Keys


@dataclass
class AppliedMarkers:
    """The applied markers of one stream's group: a record's marker exists once a commit applied it. A marker is
    a counter made by INCR and given a time to live (its user is granted INCR and EXPIRE there, never SET), so no
    consumer can store a value of its own choosing, large or small, under the marker pattern."""

    client: aioredis.Redis
    keys: Keys
    stream: str
    group: str
    ttl_s: int

    def key(self, record_id: str) -> str:
        return self.keys.applied(self.stream, self.group, record_id)

    async def flags(self, record_ids: list[str]) -> list[bool]:
        async with self.client.pipeline(transaction=False) as pipe:
            for record_id in record_ids:
                pipe.exists(self.key(record_id))
            return [bool(flag) for flag in await pipe.execute()]

    def queue_marks(self, pipe: Any, marker_keys: Sequence[str]) -> None:
        for key in marker_keys:
            pipe.incr(key)
            pipe.expire(key, self.ttl_s)
