"""Learner process: ``python -m services.learner [--config FILE]``. Wiring only."""

from __future__ import annotations

import asyncio
import logging
import sys

from prometheus_client import CollectorRegistry

from shared.config.learner import LearnerSettings
from shared.redis_conn import connect
from shared.service import http_server, main, stop_on_signals

log = logging.getLogger("services.learner")


async def follow(settings: LearnerSettings, topology) -> int:
    """A rank other than 0 under torchrun: no port, no Redis; it runs the leader's commands."""
    from services.learner import distributed
    from services.learner.setup import build_trainer

    try:
        trainer, _, _, _ = build_trainer(settings, topology)
        steps = distributed.follow(trainer)
    except Exception:
        log.exception("learner rank %d stopped on an error", topology.rank)
        return 1
    print(f"learner rank {topology.rank} finished: step {steps}", flush=True)
    return 0


async def serve(settings: LearnerSettings) -> int:
    import httpx

    from services.learner import distributed
    from services.learner.app import build_app
    from services.learner.setup import build_learner

    topology = distributed.topology_from_env()
    settings = settings.model_copy(update={"device": distributed.start(topology, settings.device)})
    if settings.device.startswith("cuda") and settings.gpu_memory_share < 1:
        import torch

        torch.cuda.set_per_process_memory_fraction(settings.gpu_memory_share, torch.device(settings.device).index)
    if not topology.is_leader:
        return await follow(settings, topology)
    client = await connect(settings.redis_url)
    stop = stop_on_signals()
    registry = CollectorRegistry()
    app = build_app(api_token=settings.api_token.get_secret_value(), registry=registry, stop=stop)
    loop = None
    try:
        async with http_server(app, settings.host, settings.port), httpx.AsyncClient() as http:
            loop, resumed = await build_learner(settings, client, http, registry, topology)
            app.state.loop = loop
            keepalive = asyncio.create_task(loop.consumer.run_keepalive(stop))
            print(f"learner ready: step {loop.trainer.step}, weight store on port {loop.pusher.port}", flush=True)
            await loop.run(stop, resumed=resumed)
            loop.trainer.stop_followers()
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
