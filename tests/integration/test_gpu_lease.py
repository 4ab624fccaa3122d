"""GPU leases of compose replicas against a real Redis: each replica gets the environment ``docker-compose
config`` resolves for the generator service and its own container host name, then leases through the
generator's own start-up code (:func:`services.generator.startup.lease_gpus`).

Before the compose file passed a shared lease namespace, the namespace defaulted to the container's host
name, so every replica leased GPU 0 (reproduced with this test)."""

from __future__ import annotations

import os
import socket

import pytest

from services.generator.gpu_lease import GpuLease, NoFreeGpuError
from services.generator.startup import lease_gpus
from shared.config.generator import GeneratorSettings
from shared.config.pipeline import PipelineConfig, PipelineError
from shared.gpu_placement import parse_gpu_list
from tests.support import compose
from tests.support.processes import start_service

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(compose.compose_command() is None, reason=compose.SKIP_REASON),
]

DEFAULT = ["docker-compose.yml"]
ONE_GPU = ["docker-compose.yml", "deploy/one-gpu.yml"]


def _services(files: list[str], **env: str) -> tuple[dict[str, str], tuple[int, ...]]:
    """The generator's environment and the learner's GPUs, as compose resolves them."""
    services = compose.resolved(files, env)["services"]
    learner = compose.environment(services["learner"])["CUDA_VISIBLE_DEVICES"]
    return compose.environment(services["generator"]), parse_gpu_list(learner)


class Replicas:
    """Generator replicas started one after another, each in a container with its own host name."""

    def __init__(self, monkeypatch, client, keys, env: dict[str, str]) -> None:
        self.monkeypatch, self.client, self.keys = monkeypatch, client, keys
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        # /config in the containers is the repository's configs/.
        monkeypatch.setenv(
            "ASYNCGRPO_CONFIG", env["ASYNCGRPO_CONFIG"].replace("/config", str(compose.ROOT / "configs"))
        )
        for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):  # leasing sets them: restored after the test
            monkeypatch.setenv(name, "")
        self.leases: list[GpuLease] = []

    async def start(self, container: str) -> tuple[int, ...]:
        self.monkeypatch.setattr(socket, "gethostname", lambda: container)
        settings = GeneratorSettings.load()
        lease = GpuLease(self.client, self.keys, settings.gpu_host_key, settings.generator_id, 30.0)
        await lease_gpus(settings, lease)
        self.leases.append(lease)
        return parse_gpu_list(os.environ["CUDA_VISIBLE_DEVICES"])


@pytest.mark.parametrize("gpus", [2, 4, 8])
async def test_compose_replicas_lease_distinct_gpus_beside_the_learner(gpus, monkeypatch, redis_client, keys):
    env, learner = _services(DEFAULT, GPU_COUNT=str(gpus))
    assert learner == (0,)
    replicas = Replicas(monkeypatch, redis_client, keys, env)
    taken = [await replicas.start(f"c0ffee{n:06x}") for n in range(gpus - 1)]
    assert sorted(i for t in taken for i in t) == list(range(1, gpus))  # distinct, none the learner's
    with pytest.raises(NoFreeGpuError, match=rf"--scale generator={gpus - 1}\b"):
        await replicas.start("deadbeef0000")


async def test_a_two_rank_learner_keeps_both_its_gpus(monkeypatch, redis_client, keys):
    env, learner = _services(DEFAULT, GPU_COUNT="8", LEARNER_GPUS="0,1")
    assert learner == (0, 1)
    replicas = Replicas(monkeypatch, redis_client, keys, env)
    taken = [await replicas.start(f"c0ffee{n:06x}") for n in range(6)]
    assert [t[0] for t in taken] == [2, 3, 4, 5, 6, 7]


async def test_a_released_gpu_is_taken_by_the_next_replica(monkeypatch, redis_client, keys):
    env, _ = _services(DEFAULT, GPU_COUNT="3")
    replicas = Replicas(monkeypatch, redis_client, keys, env)
    assert [await replicas.start("aaa"), await replicas.start("bbb")] == [(1,), (2,)]
    await replicas.leases[0].release()
    assert await replicas.start("ccc") == (1,)


async def test_a_replica_restarted_in_its_container_takes_its_own_lease_back(monkeypatch, redis_client, keys):
    env, _ = _services(DEFAULT, GPU_COUNT="3")
    replicas = Replicas(monkeypatch, redis_client, keys, env)
    assert [await replicas.start("aaa"), await replicas.start("bbb")] == [(1,), (2,)]
    # "aaa" crashed without releasing; restarted in the same container (same name) within the lease's TTL.
    assert await replicas.start("aaa") == (1,)
    with pytest.raises(NoFreeGpuError, match="GPU 1: gen-aaa, GPU 2: gen-bbb"):
        await replicas.start("ccc")


async def test_one_gpu_override_shares_the_learners_gpu(monkeypatch, redis_client, keys):
    env, learner = _services(ONE_GPU)
    assert learner == (0,)
    replicas = Replicas(monkeypatch, redis_client, keys, env)
    assert await replicas.start("aaa") == (0,)  # configs/gpu-1.toml: 0.4 + 0.5 of the GPU
    with pytest.raises(NoFreeGpuError, match=r"shared with the learner.*deploy/one-gpu.yml up --scale generator=1\b"):
        await replicas.start("bbb")


def test_one_gpu_override_refuses_shares_over_the_whole_gpu(monkeypatch):
    """Refused by the pipeline config, which every service loads before anything else (no GPU leased)."""
    env, _ = _services(ONE_GPU)
    Replicas(monkeypatch, None, None, {**env, "GENERATOR_GPU_MEMORY_UTILIZATION": "0.6"})  # the replica's environment
    with pytest.raises(PipelineError, match=r"gpu_memory_utilization \(0.6\).*learner.gpu_memory_share \(0.5\)"):
        PipelineConfig.load(os.environ["ASYNCGRPO_CONFIG"])


def test_a_replica_with_no_free_gpu_exits_with_the_fix(redis_url, keys):
    """The real process: GPU 1 of a 2-GPU box is held by another replica, so this one must not start."""
    import redis

    env, _ = _services(DEFAULT, GPU_COUNT="2")
    other = redis.Redis.from_url(redis_url)
    other.set(f"{keys.prefix}:gpu:{env['GENERATOR_GPU_HOST_KEY']}:1", "gen-other", px=60_000)
    try:
        env = {**env, "REDIS_URL": redis_url, "STREAM_PREFIX": keys.prefix}
        env["ASYNCGRPO_CONFIG"] = str(compose.ROOT / "configs" / "gpu.toml")
        service = start_service("gen-refused", "services.generator", env)
        assert service.process.wait(120) == 2
        output = service.output()
        assert "no free GPU in lease namespace 'gpu-box'" in output and "GPU 1: gen-other" in output
        assert "--scale generator=1" in output and "Traceback" not in output
    finally:
        other.delete(f"{keys.prefix}:gpu:{env['GENERATOR_GPU_HOST_KEY']}:1")
        other.close()
