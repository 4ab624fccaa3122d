"""Runs the services of one pipeline on one machine: generators, scorers, the learner (Redis is the caller's).

Every service is its own process reading the same TOML file (``ASYNCGRPO_CONFIG``), in the directory the
launcher was started from (relative paths and reward modules resolve there); the launcher adds only
per-replica values (generator id, ports, CPU cores), a per-run API token and example-plugin token
(``PLUGIN_TOKEN``), and 127.0.0.1 as every service's address (HTTP, the weight store, the plugin): nothing of
a run is reachable from another machine. Ports are free ones by default
(:func:`plan_ports`), so two runs on one machine do not collide, and are printed. The learner's output goes to
the terminal (its progress bar); the others' to ``<log_dir>/<name>.log``, and when one of them exits early the
end of its log is printed with the path; every breaker of theirs that opens or closes (a reward plugin, an
environment) is shown on the console as it happens, with the service, the breaker and the reason
(:func:`breaker_console_line`). When the learner finishes, the others are stopped with SIGTERM;
Ctrl-C stops everyone the same way. Only the pids started here are signalled.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from services.launcher.local_redis import free_ports
from shared.config.base import CONFIG_ENV
from shared.config.launcher import LauncherSettings
from shared.config.learner import LearnerSettings
from shared.redaction import redact
from shared.resilience import BreakerTransition, breaker_transition

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
TAIL_LINES = 20  # of a failed service's log, printed on the console
SCORER_PORT_OFFSET = 90  # fixed ports: scorer i listens on first_generator_port + 90 + i
LOOPBACK = "127.0.0.1"  # every service of a run binds here: the run is one machine's


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log_path: Path | None
    handles: list = field(default_factory=list)
    read_to: int = 0  # how far the launcher has read its log (bytes), looking for breaker transitions


@dataclass(frozen=True)
class Ports:
    """The ports of one run's services (``weight_store`` 0: the learner picks a free one itself)."""

    generators: list[int]
    scorers: list[int]
    learner: int
    weight_store: int

    def describe(self) -> str:
        named = [f"generator-{i} {port}" for i, port in enumerate(self.generators)]
        named += [f"scorer-{i} {port}" for i, port in enumerate(self.scorers)]
        named += [f"learner {self.learner}", f"weight store {self.weight_store or 'free (the learner picks)'}"]
        return ", ".join(named)


def plan_ports(launcher: LauncherSettings, learner: LearnerSettings) -> Ports:
    """Free ports for every service (``first_generator_port = 0``), except learner ports its table or
    environment sets; or the fixed layout from ``first_generator_port``."""
    first = launcher.first_generator_port
    if first:
        return Ports(
            generators=[first + i for i in range(launcher.generators)],
            scorers=[first + SCORER_PORT_OFFSET + i for i in range(launcher.scorers)],
            learner=learner.port,
            weight_store=learner.weight_sync_port,
        )
    free = iter(free_ports(launcher.generators + launcher.scorers + 2))
    return Ports(
        generators=[next(free) for _ in range(launcher.generators)],
        scorers=[next(free) for _ in range(launcher.scorers)],
        learner=_set_or(learner, "port", next(free)),
        weight_store=_set_or(learner, "weight_sync_port", next(free)),
    )


def _set_or(learner: LearnerSettings, name: str, free: int) -> int:
    """The learner's port ``name`` when its table or environment sets one (not 0), else the free one."""
    value = getattr(learner, name)
    return value if name in learner.model_fields_set and value else free


def _pinned(command: list[str], cpus: str) -> list[str]:
    return ["taskset", "-c", cpus, *command] if cpus else command


def new_log_lines(path: Path, offset: int) -> tuple[list[str], int]:
    """The whole lines written to ``path`` from byte ``offset`` on, and the offset after the last of them (a
    line still being written is read next time)."""
    if not path.exists():
        return [], offset
    with path.open("rb") as handle:
        handle.seek(offset)
        written = handle.read()
    complete = written[: written.rfind(b"\n") + 1]
    return complete.decode("utf-8", errors="replace").splitlines(), offset + len(complete)


def breaker_console_line(service: str, transition: BreakerTransition) -> str | None:
    """What the console says of ``service``'s breaker transition: one line when it opens, one when it closes
    (half-open, the trial call, is left to the service's log)."""
    if transition.state == "open":
        return (
            f"{service}: {transition.subject} {transition.name}: breaker open ({transition.why}); "
            f"last error: {redact(transition.error)}"
        )
    if transition.state == "closed":
        return f"{service}: {transition.subject} {transition.name}: breaker closed ({transition.why})"
    return None


def log_tail(path: Path, lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` lines of a log file (none when it is missing)."""
    if not path.exists():
        return []
    with path.open(encoding="utf-8", errors="replace") as handle:
        return [line.rstrip("\n") for line in deque(handle, maxlen=lines)]


class Supervisor:
    """The children of one ``asyncgrpo run``: started from ``[launcher]``, watched, stopped by their pids."""

    def __init__(
        self,
        config_path: Path,
        env: dict[str, str],
        settings: LauncherSettings,
        learner: LearnerSettings,
        log_dir: Path,
    ) -> None:
        """``settings``: the file's ``[launcher]`` table and ``learner`` its ``[learner]`` table as this run
        resolves it, validated with the rest of the file by the caller; ``log_dir``: the services' logs."""
        self.config_path = config_path.resolve()
        self.settings = settings
        python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self.env = {
            **os.environ,
            **env,
            CONFIG_ENV: str(self.config_path),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": python_path,  # the services run this launcher's code, from any directory
        }
        self.env.setdefault("API_TOKEN", secrets.token_urlsafe(32))
        self.env.setdefault("PLUGIN_TOKEN", secrets.token_urlsafe(32))  # a reward's bearer_token_env names it
        self.children: list[Child] = []
        self.log_dir = log_dir
        self.cwd = Path.cwd()
        self.ports = plan_ports(settings, learner)

    def _start(self, name: str, command: list[str], extra_env: dict[str, str], to_terminal: bool = False) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**self.env, **extra_env}
        if to_terminal:
            process = subprocess.Popen(command, cwd=self.cwd, env=env, start_new_session=True)
            child = Child(name, process, None)
        else:
            log_path = self.log_dir / f"{name}.log"
            handle = log_path.open("ab")
            written_before = handle.seek(0, os.SEEK_END)  # before the service writes to it
            process = subprocess.Popen(
                command, cwd=self.cwd, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
            )
            # A log is appended to from run to run: only what this run writes is looked at for breakers.
            child = Child(name, process, log_path, [handle], read_to=written_before)
        self.children.append(child)
        log.info("started %s (pid %d)%s", name, process.pid, f", log {child.log_path}" if child.log_path else "")
        return child

    def start_all(self) -> Child:
        """Every service of ``[launcher]``, the learner last; returns the learner."""
        s, python = self.settings, sys.executable
        log.info("ports: %s", self.ports.describe())
        if s.example_plugin:
            plugin = [python, "-m", "services.reward_plugin", "--host", LOOPBACK, "--port", "9000"]
            self._start("reward-plugin", plugin, {})
        for i, port in enumerate(self.ports.scorers):
            scorer_env = {"SCORER_SCORER_ID": f"scorer-{i}", "SCORER_HOST": LOOPBACK, "SCORER_PORT": str(port)}
            self._start(f"scorer-{i}", _pinned([python, "-m", "services.scorer"], s.scorer_cpus), scorer_env)
        for i, port in enumerate(self.ports.generators):
            command = _pinned([python, "-m", "services.generator"], self._generator_cpus(i))
            self._start(f"generator-{i}", command, self._generator_env(i, port))
        learner_env = {
            "LEARNER_WEIGHT_SYNC_HOST": LOOPBACK,
            "LEARNER_WEIGHT_SYNC_BIND": LOOPBACK,
            "LEARNER_HOST": LOOPBACK,
            "LEARNER_PORT": str(self.ports.learner),
            "LEARNER_WEIGHT_SYNC_PORT": str(self.ports.weight_store),
        }
        command = _pinned([python, "-m", "services.learner"], s.learner_cpus)
        return self._start("learner", command, learner_env, to_terminal=True)

    def _generator_env(self, i: int, port: int) -> dict[str, str]:
        """Replica ``i``'s id, port and the URL it registers (the same port), and its CPU cores if set."""
        extra = {
            "GENERATOR_GENERATOR_ID": f"gen-{i}",
            "GENERATOR_HOST": LOOPBACK,
            "GENERATOR_PORT": str(port),
            "GENERATOR_PUBLIC_URL": f"http://{LOOPBACK}:{port}",
        }
        if cpus := self._generator_cpus(i):
            extra["GENERATOR_OMP_CPUS"] = cpus
        return extra

    def _generator_cpus(self, i: int) -> str:
        """Replica ``i``'s cores from ``generator_cpus`` ("": not pinned)."""
        cpus = self.settings.generator_cpus
        return cpus[i] if i < len(cpus) else ""

    def watch(self, learner: Child) -> int:
        """Wait for the learner; a service that dies early stops the run (the end of its log is printed).
        Returns the learner's exit code, or 1."""
        while True:
            code = learner.process.poll()
            if code is not None:
                return code
            self.show_breakers()
            for child in self.children:
                if child is not learner and child.process.poll() is not None:
                    report_exit(child)
                    return 1
            time.sleep(0.5)

    def show_breakers(self) -> None:
        """Log, on the console, every breaker transition the services have written to their logs since the
        last look (the learner writes to the console itself)."""
        for child in self.children:
            if child.log_path is None:
                continue
            for handle in child.handles:
                handle.flush()
            lines, child.read_to = new_log_lines(child.log_path, child.read_to)
            for line in lines:
                transition = breaker_transition(line)
                if transition is None:
                    continue
                if shown := breaker_console_line(child.name, transition):
                    log.log(logging.WARNING if transition.state == "open" else logging.INFO, "%s", shown)

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


def report_exit(child: Child) -> None:
    """On stderr: which service exited and with what, the end of its log and the log's path."""
    for handle in child.handles:
        handle.flush()
    lines = [f"launcher: {child.name} exited with {child.process.returncode}; stopping the run."]
    if child.log_path is not None:
        tail = log_tail(child.log_path)
        lines.append(f"The last {len(tail)} lines of its log, {child.log_path}:")
        lines += [f"  | {line}" for line in tail]
    print("\n".join(lines), file=sys.stderr, flush=True)
