"""The docker compose configuration as the Compose client resolves it (``docker-compose config``), for tests
that check what containers would get without a Docker engine."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
# What `.env` must provide; tests resolve the files with these and nothing from the caller's environment. Each
# is as long as the services require of a secret (32 characters), so a service started from them starts.
REQUIRED_ENV = {
    name: f"test-{name.lower().replace('_', '-')}-0123456789abcdefghijklmnop"
    for name in (
        "API_TOKEN",
        "REDIS_PASSWORD",
        "REDIS_GENERATOR_PASSWORD",
        "REDIS_SCORER_PASSWORD",
        "REDIS_LEARNER_PASSWORD",
        "PLUGIN_TOKEN",
    )
}


# The client `make compose-env` installs from requirements/compose.txt (`make test` builds it first).
LOCKED_CLIENT = ROOT / ".venv-compose" / "bin" / "docker-compose"
SKIP_REASON = "no Docker Compose client: `make compose-env` installs one (make test does)"


def compose_command() -> list[str] | None:
    """The locked ``docker-compose`` of ``make compose-env``, else ``docker-compose`` (v1) or ``docker compose``
    (v2 plugin) from PATH; None when there is none."""
    if LOCKED_CLIENT.exists():
        return [str(LOCKED_CLIENT)]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=60)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def resolve(files: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``config`` on ``files`` in a clean environment (``REQUIRED_ENV`` plus ``env``). Compose would read
    ``.env`` from the project directory; ``--env-file`` points at an empty file so a developer's is ignored."""
    command = compose_command()
    assert command is not None, "no Docker Compose client"
    empty = ROOT / "tests" / "support" / "empty.env"
    args = [*command, "--env-file", str(empty)]
    for name in files:
        args += ["-f", name]
    clean = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **REQUIRED_ENV, **(env or {})}
    return subprocess.run([*args, "config"], cwd=ROOT, capture_output=True, text=True, timeout=120, env=clean)


def resolved(files: list[str], env: dict[str, str] | None = None) -> dict:
    """The resolved configuration as data; raises with compose's message if it does not resolve."""
    result = resolve(files, env)
    if result.returncode != 0:
        raise AssertionError(f"compose config failed: {result.stderr}")
    return yaml.safe_load(result.stdout)


def environment(service: dict) -> dict[str, str]:
    """A service's environment as a dict (compose v1 prints a dict, v2 may print a list of NAME=value)."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {name: "" if value is None else str(value) for name, value in env.items()}
