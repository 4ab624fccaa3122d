"""The generator's heartbeat (registration, prompt-stream lag) and its Prometheus figures.

The registration carries what the learner needs to push weights here: the engine workers' GPU UUIDs (the
transport: CUDA IPC on the learner's own GPU, NCCL elsewhere), the engine dtype (the learner casts to it
while packing) and torch/NCCL/vLLM versions (a group with different versions is refused, not hung). It lives
under a key whose name holds a secret this process makes at start (``shared.registry``), so no other replica
can name it.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from services.generator.engine import Engine
from services.generator.gpu_lease import GpuLease, heartbeat_forever
from services.generator.rollout_loop import RolloutLoop
from shared.config.generator import GeneratorSettings
from shared.keys import Keys
from shared.lifecycle import Service
from shared.records import GeneratorRegistration, RuntimeVersions, ShmProbe
from shared.registry import deregister, new_registration_key, register
from shared.streams import StreamConsumer, stream_backlog
from shared.telemetry import CallbackCollector

log = logging.getLogger(__name__)


class GeneratorTelemetry:
    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        settings: GeneratorSettings,
        engine: Engine,
        loop: RolloutLoop,
        consumer: StreamConsumer,
        lease: GpuLease,
        url: str,
        shm_probe: ShmProbe | None = None,
    ) -> None:
        self.client, self.keys, self.settings = client, keys, settings
        self.engine, self.loop, self.consumer, self.lease = engine, loop, consumer, lease
        self.url = url
        self.registration_key = new_registration_key(keys)  # this process's own: a restart makes a new one
        self.prompt_backlog = 0
        self.heartbeat_errors = 0
        self._registration = GeneratorRegistration(
            generator_id=settings.generator_id,
            url=url,
            engine_world_size=settings.tensor_parallel_size,
            policy_version=engine.policy_version,
            device=f"cuda:{','.join(map(str, lease.indices))}" if lease.indices else "cpu",
            shm_probe=shm_probe,
        )

    async def _with_runtime(self) -> GeneratorRegistration:
        """The registration with the engine's device UUIDs, dtype and versions (asked once)."""
        if not self._registration.versions.torch:
            runtime = await self.engine.describe_runtime()
            self._registration = GeneratorRegistration.model_validate(
                {
                    **self._registration.model_dump(),
                    "device_uuids": runtime["device_uuids"],
                    "engine_dtype": runtime["dtype"],
                    "transposed_linear": runtime["transposed_linear"],
                    "stacked_linear": runtime["stacked_linear"],
                    "versions": RuntimeVersions(**runtime["versions"]),
                }
            )
        return self._registration

    async def beat(self) -> None:
        registration = (await self._with_runtime()).model_copy(
            update={"policy_version": self.engine.policy_version, "heartbeat_at": time.time()}
        )
        await register(self.client, self.keys, self.registration_key, registration, self.settings.heartbeat_ttl_s)
        self.prompt_backlog = await stream_backlog(self.client, self.keys.prompts)

    def _error(self, exc: Exception) -> None:
        self.heartbeat_errors += 1
        log.error("heartbeat failed (%d so far): %s", self.heartbeat_errors, exc)

    @classmethod
    def attach(
        cls,
        service: Service[GeneratorSettings],
        engine: Engine,
        loop: RolloutLoop,
        consumer: StreamConsumer,
        lease: GpuLease,
        url: str,
    ) -> GeneratorTelemetry:
        """Telemetry of ``service``: figures exported, beating in the background, deregistered at the end; a CPU
        replica's registration names its shared-memory probe."""
        from services.generator.startup import leave_shm_probe

        probe = leave_shm_probe(service, lease)
        telemetry = cls(service.client, service.keys, service.settings, engine, loop, consumer, lease, url, probe)
        service.prometheus.register(telemetry.collector())
        service.on_exit(telemetry.leave)
        service.spawn(telemetry.run)
        return telemetry

    async def run(self, stop: asyncio.Event) -> None:
        await heartbeat_forever(self.beat, self.settings.heartbeat_ttl_s / 3, stop, self._error)

    async def leave(self) -> None:
        try:
            await deregister(self.client, self.registration_key)
        except Exception as exc:
            log.error("could not deregister (the heartbeat will expire): %s", exc)

    def collector(self) -> CallbackCollector:
        def counters() -> dict[str, float]:
            stats, stream = self.loop.stats, self.consumer.stats
            return {
                "generator/prompts": stats.prompts_done,
                "generator/completions": stats.completions_done,
                "generator/tokens": stats.tokens_generated,
                "generator/failures": stats.failures,
                "generator/rejected": stats.rejected,
                "generator/nonfinite_groups": stats.nonfinite,
                "generator/rolled_back": stats.rolled_back,
                "generator/heartbeat_errors": self.heartbeat_errors,
                "generator/gpu_lease_errors": self.lease.keeper.errors if self.lease.keeper else 0,
                "stream/prompts/claimed": stream.claimed,
                "stream/prompts/recovered": stream.recovered,
                "stream/prompts/dead_lettered": stream.dead_lettered,
                "stream/prompts/malformed": stream.malformed,
                "stream/prompts/duplicates": stream.duplicates,
                **self._environment_counters(),
            }

        def gauges() -> dict[str, float]:
            return {
                "generator/tokens_per_second": self.loop.stats.tokens_per_second(),
                "generator/requests_in_flight": self.loop.in_flight,
                "generator/engine_requests": self.engine.active_requests,
                "generator/prompt_stream_lag": self.prompt_backlog,
                "generator/policy_version": self.engine.policy_version,
                "generator/weights_ok": float(self.engine.weights_ok),
                **self._environment_gauges(),
            }

        return CallbackCollector(counters, gauges)

    def _environment_counters(self) -> dict[str, float]:
        """Multi-turn: abandoned prompts, template breaks, environment calls by outcome, failed closes."""
        runner = self.loop.trajectories
        if runner is None:
            return {}
        stats = runner.environment.stats
        return {
            "generator/abandoned": self.loop.stats.abandoned,
            "trajectories/template_breaks": runner.template_breaks,
            "env/close_failures": stats.close_failures,
            "env/sessions_opened": stats.sessions_opened,
            **{f"env/calls/{outcome}": count for outcome, count in stats.calls.items()},
        }

    def _environment_gauges(self) -> dict[str, float]:
        runner = self.loop.trajectories
        if runner is None:
            return {}
        environment = runner.environment
        return {"env/sessions_open": environment.stats.sessions_open, "env/accepting": float(environment.accepting())}
