"""The launcher pins each service's whole process to its cores: a generator replica's front end (HTTP, Redis,
the rollout loop) stays off the learner's core, not only its engine's compute threads."""

from __future__ import annotations

from pathlib import Path

from services.launcher.supervisor import Supervisor
from shared.config.launcher import LauncherSettings
from shared.config.learner import LearnerSettings


def _commands(tmp_path: Path, **launcher) -> dict[str, tuple[list[str], dict[str, str]]]:
    supervisor = Supervisor(
        tmp_path / "run.toml", {}, LauncherSettings(**launcher), LearnerSettings(model="m"), tmp_path / "logs"
    )
    started: dict[str, tuple[list[str], dict[str, str]]] = {}

    def start(name, command, extra_env, to_terminal=False):
        started[name] = (command, extra_env)

    supervisor._start = start  # type: ignore[method-assign]
    supervisor.start_all()
    return started


def test_generators_scorers_and_the_learner_run_on_their_cores(tmp_path):
    started = _commands(tmp_path, generators=2, generator_cpus=["0", "2-3"], learner_cpus="1", scorer_cpus="0")
    assert started["generator-0"][0][:3] == ["taskset", "-c", "0"]
    assert started["generator-0"][1]["GENERATOR_OMP_CPUS"] == "0"
    assert started["generator-1"][0][:3] == ["taskset", "-c", "2-3"]
    assert started["scorer-0"][0][:3] == ["taskset", "-c", "0"]
    assert started["learner"][0][:3] == ["taskset", "-c", "1"]


def test_without_cores_nothing_is_pinned(tmp_path):
    started = _commands(tmp_path, generators=2, generator_cpus=["0"])
    assert started["generator-1"][0][0] != "taskset" and "GENERATOR_OMP_CPUS" not in started["generator-1"][1]
    assert all(command[0] != "taskset" for name, (command, _) in started.items() if name != "generator-0")
