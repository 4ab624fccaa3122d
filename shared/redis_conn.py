"""Connecting to Redis: one client per process, retried with backoff at start (a process boundary).

Password and TLS come from the URL (``redis://:password@host:6379/0``, ``rediss://...``); the URL is never
logged unmasked.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.config.base import mask_url

log = logging.getLogger(__name__)

TRANSIENT_ERRORS = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


def make_client(url: str) -> aioredis.Redis:
    """A client for binary payloads (``decode_responses=False``) with keep-alive and health checks."""
    return aioredis.Redis.from_url(
        url,
        decode_responses=False,
        socket_keepalive=True,
        health_check_interval=15,
        retry_on_timeout=True,
    )


async def connect(url: str, *, timeout_s: float = 60.0) -> aioredis.Redis:
    """Return a client once Redis answers PING; retry with exponential backoff up to ``timeout_s``."""
    client = make_client(url)
    deadline = time.monotonic() + timeout_s
    delay = 0.1
    while True:
        try:
            await client.ping()
            return client
        except TRANSIENT_ERRORS as exc:
            if time.monotonic() + delay > deadline:
                await client.aclose()
                raise ConnectionError(
                    f"Redis at {mask_url(url)} did not answer within {timeout_s:.0f} s: {exc}"
                ) from exc
            log.warning("Redis at %s not answering (%s); retrying in %.1f s", mask_url(url), exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


class RedisRetry:
    """Carries an I/O loop through a Redis outage (a restart, a failover, a network blip).

    ``await retry.run(lambda: consumer.read(), "reading prompts")`` retries transient connection errors with
    exponential backoff, logging and counting each retry, and gives up (re-raising) after ``give_up_s`` of
    continuous failure. Only operations that are safe to repeat are wrapped: reads, and commits, which are
    idempotent through their applied keys.
    """

    def __init__(self, give_up_s: float = 300.0) -> None:
        self.give_up_s = give_up_s
        self.retries = 0

    async def run(self, operation, what: str):
        delay = 0.2
        deadline: float | None = None
        while True:
            try:
                return await operation()
            except TRANSIENT_ERRORS as exc:
                self.retries += 1
                now = time.monotonic()
                deadline = deadline or now + self.give_up_s
                if now > deadline:
                    log.error("Redis unavailable for %.0f s during %s; giving up", self.give_up_s, what)
                    raise
                log.warning("Redis unavailable during %s (%s); retrying in %.1f s", what, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
