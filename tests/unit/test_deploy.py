"""What can be checked of the deployment here (no Docker engine, no cluster): the compose file parses and
reads the same settings as the launcher, Dockerfiles and manifests pass their linters and schemas."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.launcher.config_tools import load_pipeline
from tests.support.processes import ROOT

BIN = Path(sys.executable).parent


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        list(args), cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}
    )


def _compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and _run("docker", "compose", "version").returncode == 0:
        return ["docker", "compose"]
    return None


def test_compose_file_parses():
    command = _compose_command()
    if command is None:
        pytest.skip("no Docker Compose client (apt-get install docker-compose)")
    result = _run(*command, "-f", "docker-compose.yml", "config", env={"API_TOKEN": "x"})
    assert result.returncode == 0, result.stderr
    parsed = yaml.safe_load(result.stdout)
    assert set(parsed["services"]) == {"redis", "generator", "scorer", "learner", "reward-plugin"}
    assert parsed["services"]["learner"]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_compose_and_launcher_read_the_same_settings(monkeypatch):
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    env = compose["x-common-env"]
    assert env["ASYNCGRPO_CONFIG"] == "/config/gpu.toml"  # configs/ is mounted at /config
    monkeypatch.setenv("API_TOKEN", "x")
    pipeline = load_pipeline(ROOT / "configs" / "gpu.toml")  # the schema `asyncgrpo run` validates
    assert pipeline.learner.weight_sync_host == "learner" and pipeline.generator.port == 8001
    prefixes = {
        "GENERATOR_": type(pipeline.generator),
        "LEARNER_": type(pipeline.learner),
        "SCORER_": type(pipeline.scorer),
    }
    for service in compose["services"].values():
        for name in service.get("environment", {}):
            for prefix, cls in prefixes.items():
                if name.startswith(prefix):
                    assert name.removeprefix(prefix).lower() in cls.model_fields, name


def test_demo_config_is_valid(monkeypatch):
    monkeypatch.setenv("API_TOKEN", "x")
    pipeline = load_pipeline(ROOT / "configs" / "demo-cpu.toml")
    assert pipeline.learner.model == "@smollm2"


def test_dockerfiles_pass_hadolint():
    result = _run(str(BIN / "hadolint"), *sorted(str(p) for p in (ROOT / "deploy").glob("*.Dockerfile")))
    assert result.returncode == 0, result.stdout + result.stderr


def test_manifests_pass_yamllint_and_kubernetes_schemas():
    lint = _run(str(BIN / "yamllint"), "deploy/k8s", "deploy/prometheus", "docker-compose.yml")
    assert lint.returncode == 0, lint.stdout
    manifests = sorted(str(p) for p in (ROOT / "deploy" / "k8s").glob("*.yaml"))
    schema = _run(str(BIN / "kubernetes-validate"), "--strict", *manifests)
    assert schema.returncode == 0, schema.stdout + schema.stderr


def test_grafana_dashboard_has_the_required_panels():
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "asyncgrpo.json").read_text())
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for needed in ("reward", "staleness", "throughput", "weight sync"):
        assert needed in titles
