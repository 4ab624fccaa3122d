"""Learner process: ``python -m services.learner [--config FILE]``; under torchrun ranks > 0 follow. Wiring only."""

import httpx

from services.learner.host_memory import configure_malloc
from shared.config.learner import LearnerSettings
from shared.lifecycle import Service, run_service
from shared.runs import startup_summary
from shared.service import main


async def lead(service: Service[LearnerSettings], topology) -> None:
    from services.learner import app, startup  # startup imports torch: after the config check

    state = service.app_state(app.LearnerAppState)
    await service.serve_http(app.build_app(state))
    http = await service.enter(httpx.AsyncClient())
    loop, resumed = await startup.build_learner(
        service.settings, service.client, http, service.prometheus, topology, service.registry_stats
    )
    service.on_exit(loop.sink.close)
    service.on_exit(loop.pusher.close)
    state.loop = loop
    service.spawn(loop.consumer.run_keepalive)
    service.announce(f"learner ready: step {loop.trainer.step}, weight store on port {loop.pusher.port}")
    ended = await service.run_until_stopped(lambda stop: loop.run(stop, resumed=resumed))  # raises unless it may end
    loop.trainer.stop_followers()
    service.announce(f"{ended.describe()}; checkpoint {loop.last_checkpoint}, metrics {loop.sink.path}")


async def serve(settings: LearnerSettings) -> int:
    configure_malloc(settings)  # before the threads that train allocate (numpy's idle OpenBLAS workers have not)
    from services.learner.startup import run_rank

    return await run_rank(settings, lambda s, topology: run_service("learner", s, lambda svc: lead(svc, topology)))


if __name__ == "__main__":
    raise SystemExit(main("learner", LearnerSettings, serve, __doc__, summary=startup_summary))
