"""The documented commands that train: ``make demo`` and ``make demo-tools`` in their ``--quick`` form, and
``asyncgrpo run`` on a user's own folder, each as its user types it and never from the repository's directory.

Each takes the launcher's whole path (the start-up check, the run directory's copy of the configuration, Redis,
every service, the held-out evaluation, the PNG) on two steps; the goals are reported, not checked (the full
demos are ``make demo`` / ``make demo-tools`` themselves). The user's run is what broke ``make demo-tools`` on a
fresh clone: an environment module, a reward module, a chat template and a data file beside the configuration,
found from ``/``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.support.processes import ROOT, require_current_setup

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]

ASYNCGRPO = Path(sys.executable).parent / "asyncgrpo"
RUN_TIMEOUT_S = 900
PNG = b"\x89PNG\r\n\x1a\n"


def _run(command: list[str], cwd: Path, runs: Path) -> subprocess.CompletedProcess:
    """``command`` in ``cwd`` with the runs directory ``runs`` (``LEARNER_RUNS_DIR``, as a user may set it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LEARNER_", "GENERATOR_", "SCORER_"))}
    env.pop("ASYNCGRPO_CONFIG", None)
    env["LEARNER_RUNS_DIR"] = str(runs)
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, f"{' '.join(command)} exited {result.returncode}:\n{_tail(result)}"
    return result


def _tail(result: subprocess.CompletedProcess, lines: int = 60) -> str:
    return "\n".join((result.stdout + result.stderr).splitlines()[-lines:])


@pytest.fixture(autouse=True)
def _setup_is_current():
    require_current_setup()


def _only_run(runs: Path) -> Path:
    [run_dir] = [p for p in runs.iterdir() if p.is_dir()]
    return run_dir


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _check_demo_run(run_dir: Path, png: str) -> list[dict]:
    """What every quick demo leaves: its two steps, evaluations at steps 0 and 2, the PNG, a checkpoint, and
    the configuration's copy that resolves against the repository's configs/."""
    records = _records(run_dir)
    assert [r["step"] for r in records if "reward" in r] == [1, 2]
    assert sorted(r["step"] for r in records if "eval/rewards/correctness/mean" in r) == [0, 2]
    assert (run_dir / png).read_bytes()[:8] == PNG
    assert (run_dir / "checkpoints" / "step-2").is_dir()
    copy = tomllib.loads((run_dir / "config.toml").read_text())
    assert copy["search_path"][0] == str(ROOT / "configs") and copy["learner"]["max_steps"] == 2
    return records


@pytest.mark.smokes("make demo", "asyncgrpo demo")
def test_make_demo_quick_from_another_directory(tmp_path):
    result = _run(["make", "-C", str(ROOT), "demo", "DEMO_ARGS=--quick"], tmp_path, tmp_path / "runs")
    _check_demo_run(_only_run(tmp_path / "runs"), "reward_curve.png")
    assert "held-out accuracy" in result.stdout and "GOAL MISSED" not in result.stdout


@pytest.mark.smokes("make demo-tools")
def test_make_demo_tools_quick_from_another_directory(tmp_path):
    """Failed on ed12821 from any directory: the start-up check looked for configs/calculator_env.py beside the
    run directory's copy of the configuration."""
    result = _run(["make", "-C", str(ROOT), "demo-tools", "DEMO_ARGS=--quick"], tmp_path, tmp_path / "runs")
    records = _check_demo_run(_only_run(tmp_path / "runs"), "tool_curve.png")
    assert any("tools/call_frequency" in r for r in records if "reward" in r)
    assert "tool calls/trajectory" in result.stdout


def _user_folder(folder: Path) -> Path:
    """A user's experiment: the tool-use demo's configuration as their own ``experiment.toml``, their
    environment module, reward module, chat template and data file beside it, every name relative."""
    folder.mkdir()
    shutil.copy(ROOT / "configs" / "calculator_env.py", folder / "my_calculator.py")
    shutil.copytree(ROOT / "configs" / "templates", folder / "chat")
    (folder / "my_rewards.py").write_text(
        "def answered(completions, answer, **kwargs):\n"
        '    """1 when the last message holds the answer at all (a TRL-style reward of the user\'s)."""\n'
        "    return [float(answer in c[-1]['content']) for c, answer in zip(completions, answer)]\n"
    )
    problems = [{"prompt": [{"role": "user", "content": f"What is {a} times {b}?"}], "answer": str(a * b)}
                for a, b in ((417, 36), (528, 73), (906, 14), (233, 58), (761, 92), (345, 67))]  # fmt: skip
    (folder / "problems.jsonl").write_text("".join(json.dumps(p) + "\n" for p in problems))
    document = tomllib.loads((ROOT / "configs" / "demo-tools-cpu.toml").read_text())
    document["environment"] |= {"python": "my_calculator:CalculatorEnv", "chat_template": "chat/smollm2_tools.jinja"}
    document["scorer"]["rewards"].append({"name": "answered", "function": "my_rewards:answered", "weight": 0.5})
    document["data"] |= {"source": "problems.jsonl"}
    document["learner"] |= {"max_steps": 1, "checkpoint_every": 1}
    for key in ("eval_data", "eval_samples", "eval_every"):
        document["learner"].pop(key)
    import tomli_w

    config = folder / "experiment.toml"
    config.write_text(tomli_w.dumps(document))
    return config


@pytest.mark.smokes("asyncgrpo run")
def test_a_users_modules_template_and_data_beside_the_config_are_found_from_the_root_directory(tmp_path):
    """Failed on ed12821: run from ``/``, ``problems.jsonl`` was looked for in ``/``."""
    config = _user_folder(tmp_path / "experiment")
    runs = tmp_path / "runs"
    _run([str(ASYNCGRPO), "run", "--config", str(config), "--run-name", "first"], Path("/"), runs)
    run_dir = runs / "first"
    [step] = [r for r in _records(run_dir) if "reward" in r]
    assert step["step"] == 1 and "rewards/answered/mean" in step and "rewards/correctness/mean" in step
    assert tomllib.loads((run_dir / "config.toml").read_text())["search_path"] == [str(config.parent), "/"]
    assert (run_dir / "checkpoints" / "step-1").is_dir()
