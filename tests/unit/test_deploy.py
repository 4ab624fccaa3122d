"""What can be checked of the deployment here (no Docker engine, no cluster, no GPU): the compose files
resolve (``docker-compose config``) to a safe, complete configuration whose GPU placement is right, they
read the same settings as the launcher, and Dockerfiles and manifests pass their linters and schemas."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from shared.config.generator import GeneratorSettings
from shared.config.learner import LearnerSettings
from shared.config.pipeline import PipelineConfig, PipelineError, load_service
from shared.config.scorer import ScorerSettings
from shared.placement import leasable_gpus, memory_share_error, parse_gpu_list
from tests.support import compose
from tests.support.processes import ROOT

BIN = Path(sys.executable).parent
DEFAULT = ["docker-compose.yml"]
ONE_GPU = ["docker-compose.yml", "deploy/one-gpu.yml"]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
needs_compose = pytest.mark.skipif(compose.compose_command() is None, reason=compose.SKIP_REASON)


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        list(args), cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}
    )


@needs_compose
@pytest.mark.parametrize("files", [DEFAULT, ONE_GPU], ids=["default", "one-gpu"])
def test_compose_is_safe_and_complete(files):
    services = compose.resolved(files)["services"]
    assert set(services) == {"redis", "generator", "scorer", "learner", "reward-plugin"}
    assert services["learner"]["depends_on"]["redis"]["condition"] == "service_healthy"
    for name, service in services.items():
        assert "ports" not in service, f"{name} publishes a port nobody asked for"
        assert service.get("restart") in {"unless-stopped", "on-failure"}, name
    redis = services["redis"]
    assert "--requirepass" in " ".join(redis["command"]) and "REDISCLI_AUTH" in " ".join(redis["healthcheck"]["test"])
    for name in ("generator", "scorer", "learner"):
        assert compose.environment(services[name])["REDIS_URL"] == "redis://:test-password@redis:6379/0", name
    for name in ("generator", "learner"):
        service = services[name]
        assert service["ipc"] == "host", name  # vLLM's shared memory; CUDA IPC between the two containers
        assert service["build"]["dockerfile"] == "deploy/gpu.Dockerfile"
        assert service["image"] == f"asyncgrpo-gpu:{VERSION}"
        assert any(str(v).startswith("model-cache:/cache") for v in service["volumes"]), name
        env = compose.environment(service)
        assert env["HF_HOME"].startswith("/cache/") and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    for name in ("scorer", "reward-plugin"):
        assert services[name]["build"]["dockerfile"] == "deploy/scorer.Dockerfile"
        assert services[name]["image"] == f"asyncgrpo-scorer:{VERSION}"


@needs_compose
@pytest.mark.parametrize("missing", ["API_TOKEN", "REDIS_PASSWORD"])
def test_compose_refuses_to_run_without_its_secrets(missing):
    result = compose.resolve(DEFAULT, {missing: ""})
    assert result.returncode != 0 and f"set {missing} in .env" in result.stderr


@needs_compose
@pytest.mark.parametrize(
    ("gpus", "learner_gpus"), [("2", "0"), ("4", "0"), ("8", "0"), ("8", "0,1"), ("8", "6,7"), ("auto", "0")]
)
def test_compose_placement_keeps_generators_off_the_learners_gpus(gpus, learner_gpus):
    services = compose.resolved(DEFAULT, {"GPU_COUNT": gpus, "LEARNER_GPUS": learner_gpus})["services"]
    generator, learner = compose.environment(services["generator"]), compose.environment(services["learner"])
    # One namespace for every replica: set by compose, so not each container's own host name.
    assert generator["GENERATOR_GPU_HOST_KEY"] == "gpu-box"
    assert services["generator"]["deploy"]["resources"]["reservations"]["devices"][0]["count"] == "all"
    assert generator["GENERATOR_GPU_COUNT"] == gpus and generator.get("GENERATOR_COLOCATED", "false") == "false"
    learner_set = parse_gpu_list(learner["CUDA_VISIBLE_DEVICES"])
    assert learner_set == parse_gpu_list(generator["GENERATOR_LEARNER_GPUS"]) == parse_gpu_list(learner_gpus)
    if gpus != "auto":
        candidates = leasable_gpus(int(gpus), parse_gpu_list(generator["GENERATOR_LEARNER_GPUS"]), colocated=False)
        assert set(candidates).isdisjoint(learner_set)
        assert len(candidates) + len(learner_set) == int(gpus)  # every GPU has a job at --scale generator=len


@needs_compose
def test_one_gpu_override_colocates_on_gpu_0_with_shares_that_fit():
    services = compose.resolved(ONE_GPU)["services"]
    generator, learner = compose.environment(services["generator"]), compose.environment(services["learner"])
    assert generator["GENERATOR_COLOCATED"] == "true" and generator["GENERATOR_GPU_HOST_KEY"] == "gpu-box"
    assert generator["GENERATOR_GPU_COUNT"] == "1" and leasable_gpus(1, (0,), colocated=True) == (0,)
    assert parse_gpu_list(learner["CUDA_VISIBLE_DEVICES"]) == parse_gpu_list(generator["GENERATOR_LEARNER_GPUS"])
    assert services["learner"]["depends_on"]["generator"]["condition"] == "service_healthy"
    assert "/ready" in " ".join(services["generator"]["healthcheck"]["test"])  # vLLM has taken its share first
    assert generator["ASYNCGRPO_CONFIG"] == learner["ASYNCGRPO_CONFIG"] == "/config/gpu-1.toml"
    document = tomllib.loads((ROOT / "configs" / "gpu-1.toml").read_text())
    shares = document["generator"]["gpu_memory_utilization"], document["learner"]["gpu_memory_share"]
    assert memory_share_error(*shares) is None


@needs_compose
@pytest.mark.parametrize("service", ["generator", "scorer", "learner"])
def test_one_gpu_shares_over_the_whole_gpu_stop_every_container(service, monkeypatch):
    """configs/gpu-1.toml turns colocated mode on itself, so the learner's container, whose environment has no
    GENERATOR_* variables, refuses shares that do not fit as well as the generator's."""
    env = compose.environment(compose.resolved(ONE_GPU)["services"][service])
    for variable in [v for v in os.environ if v.split("_")[0] in {"GENERATOR", "SCORER", "LEARNER"}]:
        monkeypatch.delenv(variable)
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    path = env["ASYNCGRPO_CONFIG"].replace("/config", str(ROOT / "configs"))
    load_service(path, service)  # as shipped: 0.4 + 0.5
    monkeypatch.setenv("LEARNER_GPU_MEMORY_SHARE", "0.7")
    with pytest.raises(PipelineError, match=r"utilization \(0.4\) \+ learner.gpu_memory_share \(0.7\) = 1.10 exceeds"):
        load_service(path, service)


@needs_compose
@pytest.mark.parametrize("files", [DEFAULT, ONE_GPU], ids=["default", "one-gpu"])
def test_each_container_builds_its_settings_from_what_compose_gives_it(files, monkeypatch):
    services = compose.resolved(files)["services"]
    classes = {"generator": GeneratorSettings, "scorer": ScorerSettings, "learner": LearnerSettings}
    for name, cls in classes.items():
        env = compose.environment(services[name])
        with monkeypatch.context() as patch:
            for variable in [v for v in os.environ if v.split("_")[0] in {"GENERATOR", "SCORER", "LEARNER"}]:
                patch.delenv(variable)
            for variable, value in env.items():
                patch.setenv(variable, value)
            patch.setenv("ASYNCGRPO_CONFIG", env["ASYNCGRPO_CONFIG"].replace("/config", str(ROOT / "configs")))
            settings = cls.load()
        assert settings.redis_url == env["REDIS_URL"], name
        for variable in env:
            prefix = f"{name.upper()}_"
            if variable.startswith(prefix):
                assert variable.removeprefix(prefix).lower() in cls.model_fields, variable


def test_env_example_lists_every_variable_compose_reads():
    read: set[str] = set()
    for name in ONE_GPU:
        text = (ROOT / name).read_text()
        read |= set(re.findall(r"(?<!\$)\$\{([A-Z_][A-Z0-9_]*)", text))
    listed = set(re.findall(r"^([A-Z_][A-Z0-9_]*)=", (ROOT / ".env.example").read_text(), re.MULTILINE))
    assert read and read <= listed, f"missing from .env.example: {sorted(read - listed)}"
    assert {"API_TOKEN", "REDIS_PASSWORD", "LEARNER_GPUS", "GPU_COUNT", "GPU_HOST_KEY"} <= read


def test_compose_and_launcher_read_the_same_settings(monkeypatch):
    compose_file = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert compose_file["x-common-env"]["ASYNCGRPO_CONFIG"] == "/config/gpu.toml"  # configs/ is mounted at /config
    monkeypatch.setenv("API_TOKEN", "x")
    pipeline = PipelineConfig.load(ROOT / "configs" / "gpu.toml")  # the schema `asyncgrpo run` validates
    assert pipeline.learner.weight_sync_host == "learner" and pipeline.generator.port == 8001
    one_gpu = PipelineConfig.load(ROOT / "configs" / "gpu-1.toml")
    assert memory_share_error(one_gpu.generator.gpu_memory_utilization, one_gpu.learner.gpu_memory_share) is None


def test_k8s_images_carry_the_release_tag():
    images = re.findall(r"image:\s*(\S+)", "".join(p.read_text() for p in (ROOT / "deploy" / "k8s").glob("*.yaml")))
    assert images and not any(i.endswith(":latest") or ":" not in i for i in images), images
    ours = {i for i in images if i.startswith("asyncgrpo")}
    assert ours == {f"asyncgrpo-gpu:{VERSION}", f"asyncgrpo-scorer:{VERSION}"}


def test_demo_config_is_valid(monkeypatch):
    monkeypatch.setenv("API_TOKEN", "x")
    pipeline = PipelineConfig.load(ROOT / "configs" / "demo-cpu.toml")
    assert pipeline.learner.model == "@smollm2"


def test_dockerfiles_pass_hadolint():
    result = _run(str(BIN / "hadolint"), *sorted(str(p) for p in (ROOT / "deploy").glob("*.Dockerfile")))
    assert result.returncode == 0, result.stdout + result.stderr


def test_manifests_pass_yamllint_and_kubernetes_schemas():
    lint = _run(str(BIN / "yamllint"), "deploy/k8s", "deploy/prometheus", "docker-compose.yml", "deploy/one-gpu.yml")
    assert lint.returncode == 0, lint.stdout
    manifests = sorted(str(p) for p in (ROOT / "deploy" / "k8s").glob("*.yaml"))
    schema = _run(str(BIN / "kubernetes-validate"), "--strict", *manifests)
    assert schema.returncode == 0, schema.stdout + schema.stderr


def test_grafana_dashboard_has_the_required_panels():
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "asyncgrpo.json").read_text())
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for needed in ("reward", "staleness", "throughput", "weight sync"):
        assert needed in titles
