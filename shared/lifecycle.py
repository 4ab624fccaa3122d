"""One service run, the same for every service: connect, serve, run the I/O loop, clean up in order.

:func:`run_service` connects to Redis, makes SIGTERM and SIGINT set the stop event, and hands a
:class:`Service` to the service's ``start(service)``, which builds its pieces through it (HTTP server,
stream consumers with their keepalive, producers, background tasks) and runs its I/O loop. Every piece
that needs cleaning up is registered as it is made; at the end the HTTP server stops first (no request
reaches a piece being closed), then the background tasks, then the pieces in reverse order of creation
(the engine before the GPU lease it runs on), the Redis client last.

Exit statuses: 0 after a stop (signal or ``/shutdown``) or when the work is done, 1 when the service
stopped on an error (logged with its traceback), 2 when it refused to start (:class:`NotStarting`, logged
as one line naming the fix). The stop event remembers what set it first (:class:`StopEvent`), and a signal
is logged as it arrives, so a service that stops can say why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, Generic, Protocol, TypeVar

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from shared.config.base import ServiceSettings
from shared.config.stream_consumer import StreamConsumerSettings
from shared.http import ServiceState
from shared.keys import Keys
from shared.redis_conn import connect
from shared.registry import RegistryStats
from shared.streams import StreamConsumer, StreamProducer
from shared.telemetry import CallbackCollector

S = TypeVar("S", bound=ServiceSettings)
T = TypeVar("T")
A = TypeVar("A", bound=ServiceState)


log = logging.getLogger(__name__)


class StopEvent(asyncio.Event):
    """A service's stop event that remembers what set it first (``reason``: a signal's name, ...), so the
    service can say why it stopped. ``set()`` without a reason is a stop request (``POST /shutdown``, or
    the service's own code)."""

    def __init__(self) -> None:
        super().__init__()
        self.reason: str | None = None

    def set(self, reason: str = "a stop request") -> None:
        if not self.is_set():
            self.reason = reason
        super().set()


def stop_reason(stop: asyncio.Event) -> str:
    """What set ``stop`` ("SIGTERM", "a stop request"), as far as it is known."""
    return (stop.reason if isinstance(stop, StopEvent) else None) or "a stop request"


def stop_on_signals() -> StopEvent:
    """An event set by SIGTERM or SIGINT (the service then finishes its work in flight and exits 0); each
    signal is logged as it arrives."""
    stop = StopEvent()

    def received(signum: signal.Signals) -> None:
        log.info("%s received: stopping once the work in flight is done", signum.name)
        stop.set(signum.name)

    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, received, signum)
    return stop


@contextlib.asynccontextmanager
async def http_server(app: Any, host: str, port: int) -> AsyncIterator[int]:
    """Serve ``app`` while the block runs; yields the bound port (``port = 0`` picks a free one)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            raise RuntimeError(f"the HTTP server could not start on {host}:{port} (is the port in use?)")
        await asyncio.sleep(0.05)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await task


class NotStarting(RuntimeError):
    """The service refuses to start (no free GPU, an impossible placement); the message names the fix."""


class HttpSettings(Protocol):
    host: str
    port: int
    max_request_bytes: int
    api_docs: bool


async def start_consumer(
    client: aioredis.Redis,
    keys: Keys,
    settings: StreamConsumerSettings,
    *,
    stream: str,
    group: str,
    name: str,
    batch_size: int,
) -> StreamConsumer:
    """A consumer of ``stream`` in ``group`` as ``name``, configured from ``settings``, its group made."""
    consumer = StreamConsumer(
        client,
        keys,
        stream,
        group,
        name,
        batch_size=batch_size,
        claim_idle_ms=settings.claim_idle_ms,
        max_deliveries=settings.max_deliveries,
    )
    await consumer.start()
    return consumer


class Service(Generic[S]):
    """What a service builds itself with: its settings, keys, Redis client, stop event and metrics, plus
    the cleanups and background tasks of the pieces it made.

    Leaving it (``async with``) stops taking requests (the HTTP server), stops the background tasks, then
    closes the pieces in reverse order of creation, the Redis client last.
    """

    def __init__(self, name: str, settings: S, client: aioredis.Redis) -> None:
        self.name, self.settings, self.client = name, settings, client
        self.keys = Keys(settings.stream_prefix)
        self.stop = stop_on_signals()
        self.prometheus = CollectorRegistry()
        self.registry_stats = RegistryStats()  # what this process's registry reads found invalid
        self.prometheus.register(CallbackCollector(counters=lambda: {"registry/invalid": self.registry_stats.invalid}))
        self.log = logging.getLogger(f"services.{name}")
        self._front = contextlib.AsyncExitStack()  # the HTTP server: closed first
        self._exits = contextlib.AsyncExitStack()
        self._exits.push_async_callback(client.aclose)
        self._tasks: list[asyncio.Task] = []

    @classmethod
    async def connect(cls, name: str, settings: S) -> Service[S]:
        return cls(name, settings, await connect(settings.redis_url))

    async def __aenter__(self) -> Service[S]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.stop.set("the service is ending")
        try:
            await self._front.aclose()
            for task in self._tasks:
                task.cancel()  # still running only when the service ends on an error
            await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:
            await self._exits.aclose()

    def on_exit(self, callback: Callable[[], Any]) -> None:
        """Call ``callback`` (sync or async) when the service ends, before what was registered earlier."""

        async def call() -> None:
            result = callback()
            if asyncio.iscoroutine(result):
                await result

        self._exits.push_async_callback(call)

    async def enter(self, context: contextlib.AbstractAsyncContextManager[T]) -> T:
        """Enter ``context`` for the rest of the service's life."""
        return await self._exits.enter_async_context(context)

    def app_state(self, cls: type[A], **fields: Any) -> A:
        """The typed state of the service's HTTP app: its token, HTTP limits, stop event and metrics, plus
        ``fields``."""
        settings: HttpSettings = self.settings  # type: ignore[assignment]
        return cls(
            api_token=self.settings.api_token.get_secret_value(),
            max_request_bytes=settings.max_request_bytes,
            api_docs=settings.api_docs,
            stop=self.stop,
            prometheus=self.prometheus,
            **fields,
        )

    async def serve_http(self, app: Any) -> int:
        """Serve ``app`` on the settings' host and port until the service ends; returns the bound port."""
        settings: HttpSettings = self.settings  # type: ignore[assignment]
        port = await self._front.enter_async_context(http_server(app, settings.host, settings.port))
        self.log.info("HTTP on port %d", port)
        return port

    def spawn(self, work: Callable[[asyncio.Event], Coroutine[Any, Any, None]]) -> None:
        """Run ``work(stop)`` in the background; it must return soon after ``stop`` is set."""
        self._tasks.append(asyncio.create_task(work(self.stop)))

    async def consumer(self, stream: str, group: str, name: str, *, batch_size: int) -> StreamConsumer:
        """A started consumer built from the settings, whose in-flight entries are kept alive meanwhile."""
        settings: StreamConsumerSettings = self.settings  # type: ignore[assignment]
        consumer = await start_consumer(
            self.client, self.keys, settings, stream=stream, group=group, name=name, batch_size=batch_size
        )
        self.spawn(consumer.run_keepalive)
        return consumer

    def producer(self, stream: str, max_backlog: int | None) -> StreamProducer:
        return StreamProducer(self.client, stream, max_backlog=max_backlog)

    def announce(self, line: str) -> None:
        """A state change operators and supervisors wait for ("... ready on port 8001"), on stdout."""
        print(line, flush=True)

    async def run_until_stopped(self, run: Callable[[StopEvent], Awaitable[T]]) -> T:
        """Run the I/O loop ``run(stop)``; when it returns, stop and join the background tasks. Returns what
        ``run`` returned (how it ended, for a loop that says)."""
        ended = await run(self.stop)
        await self.finish()
        return ended

    async def finish(self) -> None:
        """Stop and join the background tasks; raises what one of them raised (the service then ends with an
        error). For a service stopped before its I/O loop began, too."""
        self.stop.set("the service is ending")
        await asyncio.gather(*self._tasks)


async def run_service(name: str, settings: S, start: Callable[[Service[S]], Awaitable[None]]) -> int:
    """Run one service: ``start(service)`` builds it and runs its I/O loop. Returns the exit status."""
    log = logging.getLogger(f"services.{name}")
    try:
        async with await Service.connect(name, settings) as service:
            return await _run_started(service, start, log)
    except Exception:  # Redis never answered, or a cleanup failed
        log.exception("%s stopped on an error", name)
        return 1


async def _run_started(service: Service[S], start: Callable[[Service[S]], Awaitable[None]], log: logging.Logger) -> int:
    """``start(service)``'s exit status, logged before the service's pieces are closed."""
    try:
        await start(service)
        return 0
    except NotStarting as exc:
        log.error("not starting: %s", exc)
        return 2
    except Exception:
        log.exception("%s stopped on an error", service.name)
        return 1
