"""Learner process: ``python -m services.learner [--config FILE]``. Wiring only."""

from __future__ import annotations

import asyncio
import logging
import sys

from prometheus_client import CollectorRegistry

from services.learner.settings import LearnerSettings
from shared.redis_conn import connect
from shared.service import http_server, main, stop_on_signals

log = logging.getLogger("services.learner")


async def serve(settings: LearnerSettings) -> int:
    import httpx

    from services.learner.app import build_app
    from services.learner.setup import build_learner

    client = await connect(settings.redis_url)
    stop = stop_on_signals()
    registry = CollectorRegistry()
    app = build_app(api_token=settings.api_token.get_secret_value(), registry=registry, stop=stop)
    loop = None
    try:
        async with http_server(app, settings.host, settings.port), httpx.AsyncClient() as http:
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
        await client.aclose()


if __name__ == "__main__":
    sys.exit(main("learner", LearnerSettings, serve, __doc__))
