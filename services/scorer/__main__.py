"""Scorer process: ``python -m services.scorer [--config FILE]``. Wiring only: probe the reward plugins, then
score rollouts into groups with advantages (held-out ones for evaluation) until stopped."""

import asyncio
import sys

import httpx

from services.scorer.app import ScorerAppState, build_app
from services.scorer.scoring_loop import ScoringLoop, scorer_collector
from services.scorer.startup import build_rewards
from shared.config.scorer import ScorerSettings
from shared.keys import Keys
from shared.lifecycle import Service, run_service
from shared.service import main


async def start(service: Service[ScorerSettings]) -> None:
    settings, keys = service.settings, service.keys
    functions, plugins = build_rewards(settings.rewards, await service.enter(httpx.AsyncClient()))
    state = service.app_state(ScorerAppState, functions=functions)
    await service.serve_http(build_app(state))
    await asyncio.gather(*(plugin.probe() for plugin in plugins))
    consumer = await service.consumer(
        keys.rollouts, Keys.SCORERS, settings.scorer_id, batch_size=settings.max_groups_in_flight
    )
    scored = service.producer(keys.scored, settings.max_scored_backlog)
    loop = ScoringLoop.from_settings(consumer, scored, functions, settings, service.producer(keys.evaluated, None))
    service.prometheus.register(scorer_collector(loop))
    state.not_ready_reason = loop.not_ready_reason
    service.announce(f"scorer {settings.scorer_id} {loop.intake_summary()}")
    await service.run_until_stopped(loop.run)


async def serve(settings: ScorerSettings) -> int:
    return await run_service("scorer", settings, start)


if __name__ == "__main__":
    sys.exit(main("scorer", ScorerSettings, serve, __doc__))
