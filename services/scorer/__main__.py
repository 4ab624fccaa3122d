"""Scorer process: ``python -m services.scorer [--config FILE]``. Wiring only."""

from __future__ import annotations

import asyncio
import logging
import sys

import httpx
from prometheus_client import CollectorRegistry

from services.scorer.app import build_app
from services.scorer.scoring import build_functions
from services.scorer.scoring_loop import ScoringLoop
from shared.config.scorer import ScorerSettings
from shared.keys import Keys
from shared.redis_conn import connect
from shared.service import http_server, main, stop_on_signals
from shared.streams import StreamConsumer, StreamProducer
from shared.telemetry import CallbackCollector

log = logging.getLogger("services.scorer")


def _collector(loop: ScoringLoop, consumer: StreamConsumer) -> CallbackCollector:
    def counters() -> dict[str, float]:
        out: dict[str, float] = {
            "scorer/groups": loop.stats.groups_scored,
            "scorer/groups_zero_std": loop.stats.groups_zero_std,
            "scorer/groups_dropped": loop.stats.groups_dropped,
            "scorer/groups_dead_lettered": loop.stats.groups_dead_lettered,
            "scorer/group_retries": loop.stats.group_retries,
            "scorer/failures": loop.stats.failures,
            "scorer/rejected": loop.stats.rejected,
            "stream/rollouts/claimed": consumer.stats.claimed,
            "stream/rollouts/dead_lettered": consumer.stats.dead_lettered,
            "stream/rollouts/duplicates": consumer.stats.duplicates,
        }
        for function in loop.functions:
            out.update(function.stats.as_metrics(function.name))
        return out

    def gauges() -> dict[str, float]:
        out = {k: v for k, v in loop.stats.last_metrics.items() if v == v}  # last group's figures, NaN left out
        out["scorer/groups_held"] = loop.stats.groups_held
        out["scorer/intake_paused"] = float(bool(loop.not_ready_reason()))
        for function in loop.functions:
            if function.breaker is not None:
                out[f"rewards/{function.name}/breaker_open"] = float(function.breaker.state != "closed")
        return out

    return CallbackCollector(counters, gauges)


async def serve(settings: ScorerSettings) -> int:
    keys = Keys(settings.stream_prefix)
    client = await connect(settings.redis_url)
    stop = stop_on_signals()
    registry = CollectorRegistry()
    try:
        async with httpx.AsyncClient() as http:
            functions, plugins = build_functions(settings.rewards, http)
            app = build_app(
                api_token=settings.api_token.get_secret_value(), registry=registry, stop=stop, functions=functions
            )
            async with http_server(app, settings.host, settings.port):
                await asyncio.gather(*(plugin.probe() for plugin in plugins))
                consumer = StreamConsumer(
                    client,
                    keys,
                    keys.rollouts,
                    Keys.SCORERS,
                    settings.scorer_id,
                    claim_idle_ms=settings.claim_idle_ms,
                    max_deliveries=settings.max_deliveries,
                    batch_size=settings.max_groups_in_flight,
                )
                await consumer.start()
                scored = StreamProducer(client, keys.scored, max_backlog=settings.max_scored_backlog)
                loop = ScoringLoop(
                    consumer,
                    scored,
                    functions,
                    [r.weight for r in settings.rewards],
                    settings.advantage_spec,
                    drop_zero_std=settings.drop_zero_std_groups,
                    max_in_flight=settings.max_groups_in_flight,
                    max_reward_wait_s=settings.max_reward_wait_s,
                    retry_backoff_s=settings.retry_backoff_s,
                    retry_backoff_max_s=settings.retry_backoff_max_s,
                )
                registry.register(_collector(loop, consumer))
                app.state.not_ready_reason = loop.not_ready_reason
                app.state.running = True
                keepalive = asyncio.create_task(consumer.run_keepalive(stop))
                paused = loop.not_ready_reason()
                state = f"paused until a trial call succeeds: {paused}" if paused else "ready"
                print(f"scorer {settings.scorer_id} {state}: rewards {', '.join(loop.names)}", flush=True)
                await loop.run(stop)
                stop.set()
                await keepalive
        return 0
    except Exception:
        log.exception("scorer stopped on an error")
        return 1
    finally:
        await client.aclose()


if __name__ == "__main__":
    sys.exit(main("scorer", ScorerSettings, serve, __doc__))
