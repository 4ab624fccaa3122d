"""Runs the services of one pipeline on one machine: generators, scorers, the learner (Redis is the caller's).

Every service is its own process reading the same TOML file (``ASYNCGRPO_CONFIG``); the launcher adds only
per-replica values (generator id, port, CPU cores) and a per-run API token. The learner's output goes to the
terminal (its progress bar); the others' to ``<log_dir>/<name>.log``. When the learner finishes, the others
are stopped with SIGTERM; Ctrl-C stops everyone the same way. Only the pids started here are signalled.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.config.base import CONFIG_ENV
from shared.config.launcher import LauncherSettings

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log_path: Path | None
    handles: list = field(default_factory=list)


def _pinned(command: list[str], cpus: str) -> list[str]:
    return ["taskset", "-c", cpus, *command] if cpus else command


class Supervisor:
    """The children of one ``asyncgrpo run``: started from ``[launcher]``, watched, stopped by their pids."""

    def __init__(self, config_path: Path, env: dict[str, str], settings: LauncherSettings) -> None:
        """``settings``: the file's ``[launcher]`` table, validated with the rest of the file by the caller."""
        self.config_path = config_path.resolve()
        self.settings = settings
        self.env = {**os.environ, **env, CONFIG_ENV: str(self.config_path), "PYTHONUNBUFFERED": "1"}
        self.env.setdefault("API_TOKEN", secrets.token_urlsafe(24))
        self.children: list[Child] = []
        self.log_dir = Path(self.settings.log_dir)

    def _start(self, name: str, command: list[str], extra_env: dict[str, str], to_terminal: bool = False) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**self.env, **extra_env}
        if to_terminal:
            process = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)
            child = Child(name, process, None)
        else:
            log_path = self.log_dir / f"{name}.log"
            handle = log_path.open("ab")
            process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
            )
            child = Child(name, process, log_path, [handle])
        self.children.append(child)
        log.info("started %s (pid %d)%s", name, process.pid, f", log {child.log_path}" if child.log_path else "")
        return child

    def start_all(self) -> Child:
        s = self.settings
        python = sys.executable
        if s.example_plugin:
            self._start("reward-plugin", [python, "-m", "services.reward_plugin", "--port", "9000"], {})
        for i in range(s.scorers):
            self._start(
                f"scorer-{i}",
                [python, "-m", "services.scorer"],
                {"SCORER_SCORER_ID": f"scorer-{i}", "SCORER_PORT": str(s.first_generator_port + 90 + i)},
            )
        for i in range(s.generators):
            cpus = s.generator_cpus[i] if i < len(s.generator_cpus) else ""
            extra = {
                "GENERATOR_GENERATOR_ID": f"gen-{i}",
                "GENERATOR_PORT": str(s.first_generator_port + i),
                "GENERATOR_PUBLIC_URL": f"http://127.0.0.1:{s.first_generator_port + i}",
            }
            if cpus:
                extra["GENERATOR_OMP_CPUS"] = cpus
            self._start(f"generator-{i}", [python, "-m", "services.generator"], extra)
        return self._start(
            "learner",
            _pinned([python, "-m", "services.learner"], s.learner_cpus),
            {"LEARNER_WEIGHT_SYNC_HOST": "127.0.0.1"},
            to_terminal=True,
        )

    def watch(self, learner: Child) -> int:
        """Wait for the learner; a service that dies early stops the run. Returns the learner's exit code."""
        while True:
            code = learner.process.poll()
            if code is not None:
                return code
            for child in self.children:
                if child is not learner and child.process.poll() is not None:
                    log.error(
                        "%s exited with %s; stopping the run (see %s)",
                        child.name,
                        child.process.returncode,
                        child.log_path,
                    )
                    return 1
            time.sleep(0.5)

    def stop_all(self) -> dict[str, int]:
        """SIGTERM every child still running, wait, SIGKILL stragglers; returns each exit code."""
        for child in self.children:
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.settings.stop_timeout_s
        codes = {}
        for child in self.children:
            try:
                codes[child.name] = child.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("%s did not stop in time; killing its process group", child.name)
                os.killpg(child.process.pid, signal.SIGKILL)
                codes[child.name] = child.process.wait()
            for handle in child.handles:
                handle.close()
        return codes
