"""What every service process does the same way: its command line, stop signals, and its HTTP server.

``main(...)`` parses ``--config``, validates the whole configuration file across services (a clear message and
exit status 2 when invalid), takes the service's own table, sets up logging, logs the resolved settings with
secrets masked, and runs the service's ``serve(settings)``. :func:`http_server` runs a FastAPI app in the
service's own event loop next to its I/O loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar, cast

from shared.config.base import ServiceSettings
from shared.config.pipeline import load_or_exit
from shared.telemetry import setup_logging

S = TypeVar("S", bound=ServiceSettings)

log = logging.getLogger(__name__)


def main(
    name: str,
    settings_cls: type[S],
    serve: Callable[[S], Coroutine[Any, Any, int]],
    description: str,
    argv: list[str] | None = None,
) -> int:
    tables = ", ".join(f"[{t}]" for t in (settings_cls.toml_table, *settings_cls.extra_toml_tables))
    parser = argparse.ArgumentParser(prog=f"python -m services.{name}", description=description)
    parser.add_argument("--config", help=f"TOML file (else $ASYNCGRPO_CONFIG); {tables} and [common] are read")
    args = parser.parse_args(argv)
    settings = cast(S, load_or_exit(args.config, name))  # its table, checked with the file, and its start checks
    setup_logging(name, settings.log_level)
    logging.getLogger(f"services.{name}").info("settings: %s", settings.masked())
    return asyncio.run(serve(settings))


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (the service then finishes its work in flight and exits 0)."""
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    return stop


@contextlib.asynccontextmanager
async def http_server(app, host: str, port: int) -> AsyncIterator[int]:
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
