"""Learner process: ``python -m services.learner [--config FILE]``. Wiring only."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from prometheus_client import CollectorRegistry

from services.learner.settings import LearnerSettings
from shared.redis_conn import connect
from shared.settings import load_or_exit
from shared.telemetry import setup_logging

log = logging.getLogger("services.learner")


async def serve(settings: LearnerSettings) -> int:
    import httpx
    import uvicorn

    from services.learner.app import build_app
    from services.learner.setup import build_learner

    client = await connect(settings.redis_url)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    registry = CollectorRegistry()
    app = build_app(api_token=settings.api_token.get_secret_value(), registry=registry, stop=stop)
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning"))
    server_task = asyncio.create_task(server.serve())
    loop = None
    try:
        async with httpx.AsyncClient() as http:
            loop, resumed = await build_learner(settings, client, http, registry)
            app.state.loop = loop
            keepalive = asyncio.create_task(loop.consumer.run_keepalive(stop))
            print(f"learner ready: step {loop.trainer.step}, weight store on port {loop.pusher.port}", flush=True)
            await loop.run(stop, resumed=resumed)
            stop.set()
            await keepalive
        print(
            f"learner finished: step {loop.trainer.step}, checkpoint {loop.last_checkpoint}, metrics {loop.sink.path}",
            flush=True,
        )
        return 0
    except Exception:
        log.exception("learner stopped on an error")
        return 1
    finally:
        if loop is not None:
            loop.sink.close()
        server.should_exit = True
        await server_task
        await client.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.learner", description=__doc__)
    parser.add_argument("--config", help="TOML file (else $ASYNCGRPO_CONFIG); [learner], [data], [common] are read")
    args = parser.parse_args(argv)
    settings = load_or_exit(LearnerSettings, args.config, "learner")
    setup_logging("learner", settings.log_level)
    log.info("settings: %s", settings.masked())
    return asyncio.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
