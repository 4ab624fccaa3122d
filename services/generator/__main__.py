"""Generator process: ``python -m services.generator [--config FILE]``. Wiring only."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from shared.config.generator import GeneratorSettings
from shared.keys import Keys
from shared.redis_conn import connect
from shared.service import http_server, main, stop_on_signals

if TYPE_CHECKING:
    from services.generator.registry import GpuLease

log = logging.getLogger("services.generator")


async def lease_gpus(settings: GeneratorSettings, lease: GpuLease) -> None:
    """Take this replica's GPU(s) in the host's lease namespace and make them the only ones CUDA sees."""
    from services.generator.registry import host_gpu_count
    from shared.placement import leasable_gpus

    total = host_gpu_count() if settings.gpu_count == "auto" else settings.gpu_count
    learner = settings.learner_gpu_indices
    candidates = leasable_gpus(total, learner, settings.colocated)
    indices = await lease.acquire(candidates, settings.tensor_parallel_size, learner)
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # the order NVML counted and nvidia-smi shows
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, indices))
    log.info(
        "leased GPU(s) %s of %d in lease namespace %r (learner's GPUs %s%s)",
        indices,
        total,
        lease.host,
        list(learner),
        ", shared: colocated" if settings.colocated else "",
    )


async def serve(settings: GeneratorSettings) -> int:
    from services.generator.app import build_app
    from services.generator.engine import Engine
    from services.generator.registry import GpuLease, NoFreeGpuError
    from services.generator.rollout_loop import RolloutLoop
    from services.generator.telemetry import GeneratorTelemetry
    from shared.placement import PlacementError
    from shared.registry import latest_checkpoint, latest_weights_version
    from shared.streams import StreamConsumer, StreamProducer

    keys = Keys(settings.stream_prefix)
    client = await connect(settings.redis_url)
    lease = GpuLease(client, keys, settings.gpu_host_key, settings.generator_id, settings.heartbeat_ttl_s)
    try:
        if settings.gpu_count:
            await lease_gpus(settings, lease)
    except (PlacementError, NoFreeGpuError) as exc:
        log.error("not starting: %s", exc)
        await client.aclose()
        return 2
    stop = stop_on_signals()
    registry = CollectorRegistry()
    app = build_app(
        api_token=settings.api_token.get_secret_value(),
        generator_id=settings.generator_id,
        registry=registry,
        stop=stop,
        announced_version=lambda: latest_weights_version(client, keys),
    )
    engine = telemetry = None
    try:
        async with http_server(app, settings.host, settings.port) as port:
            log.info("HTTP on port %d; loading the engine", port)
            model_path, version = settings.model, 0
            checkpoint = await latest_checkpoint(client, keys)
            if checkpoint is not None and Path(checkpoint.path).exists():
                model_path, version = checkpoint.path, checkpoint.policy_version
                log.info("joining late: loading checkpoint %s (policy version %d)", model_path, version)
            engine = Engine.start(settings, model_path, version)
            app.state.engine = engine
            consumer = StreamConsumer(
                client,
                keys,
                keys.prompts,
                Keys.GENERATORS,
                settings.generator_id,
                batch_size=settings.max_prompts_in_flight,
                claim_idle_ms=settings.claim_idle_ms,
                max_deliveries=settings.max_deliveries,
            )
            await consumer.start()
            rollouts = StreamProducer(client, keys.rollouts, max_backlog=settings.max_rollout_backlog)
            loop = RolloutLoop(engine, consumer, rollouts, settings.generator_id, settings.max_prompts_in_flight)
            telemetry = GeneratorTelemetry(client, keys, settings, engine, loop, consumer, lease, settings.url(port))
            registry.register(telemetry.collector())
            background = [asyncio.create_task(telemetry.run(stop)), asyncio.create_task(consumer.run_keepalive(stop))]
            print(f"generator {settings.generator_id} ready on port {port}", flush=True)
            await loop.run(stop)
            stop.set()
            await asyncio.gather(*background)
        return 0
    except Exception:
        log.exception("generator stopped on an error")
        return 1
    finally:
        if telemetry is not None:
            await telemetry.leave()
        await lease.release()
        if engine is not None:
            engine.shutdown()
        await client.aclose()


if __name__ == "__main__":
    sys.exit(main("generator", GeneratorSettings, serve, __doc__))
