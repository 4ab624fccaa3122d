"""The start-up check through the real commands (issue #35, items 3-4): ``asyncgrpo run`` refuses a misspelled
reward and a reward's missing column before it asks for Redis or starts any process, prints each problem once
with no traceback, exits 2 and leaves no run directory; ``config explain`` shows the data first and the check's
result; the scorer started on its own refuses the misspelled reward at its start (exit 2, one line). The user's
modules are imported by a child of the launcher, never by the launcher itself."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.support.processes import ROOT, start_service

pytestmark = pytest.mark.integration

REWARDS = """
import os
from pathlib import Path

# Which process imported this module: its parent is the launcher when a child of the launcher did. Beside the
# module, never in the importer's working directory (a scorer started in the repository left it there once).
Path(__file__).with_name("imported-by").open("a").write(f"{os.getpid()} {os.getppid()}\\n")


def accuracy_reward(completions, solution, **kwargs):
    return [0.0 for _ in completions]


def strict(prompts, completions, answer):
    return [0.0 for _ in completions]
"""


def launcher(
    tmp_path: Path, *args: str, redis_url: str = "redis://127.0.0.1:1/0"
) -> tuple[subprocess.CompletedProcess[str], float]:
    """``python -m services.launcher ARGS`` run in ``tmp_path`` (so ``runs/`` would appear there), and its seconds."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("LEARNER_", "SCORER_", "GENERATOR_"))}
    env.update(PYTHONPATH=str(ROOT), REDIS_URL=redis_url)
    env.pop("ASYNCGRPO_CONFIG", None)
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "services.launcher", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return result, time.monotonic() - started


def experiment(tmp_path: Path, function: str) -> Path:
    """A configuration beside its reward module (a fresh name) and a two-row JSONL dataset without 'solution'."""
    module = f"rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(REWARDS)
    rows = [{"prompt": "1 + 1?", "answer": "2"}, {"prompt": "2 + 2?", "answer": "4"}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = tmp_path / "run.toml"
    config.write_text(
        f'[generator]\nmodel = "/m"\n\n[scorer]\nrewards = [{{ name = "acc", function = "{module}:{function}" }}]\n\n'
        '[learner]\nmodel = "/m"\nrun_name = "refused"\n\n[data]\nsource = "train.jsonl"\n'
    )
    return config


@pytest.fixture
def would_be_redis():
    """A listening socket standing in for Redis: nobody may connect to it before the check passes."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.setblocking(False)
        yield server


def assert_refused_before_anything(
    result: subprocess.CompletedProcess[str], tmp_path: Path, server: socket.socket
) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "started" not in result.stdout + result.stderr
    assert not (tmp_path / "runs").exists()
    with pytest.raises(BlockingIOError):
        server.accept()  # nobody asked whether Redis answers


def test_run_refuses_a_misspelled_reward_naming_the_closest(tmp_path, would_be_redis):
    config = experiment(tmp_path, "acuracy_reward")
    redis_url = f"redis://127.0.0.1:{would_be_redis.getsockname()[1]}/0"
    result, seconds = launcher(tmp_path, "run", "--config", str(config), redis_url=redis_url)
    assert_refused_before_anything(result, tmp_path, would_be_redis)
    [line] = [line for line in result.stderr.splitlines() if "acuracy_reward" in line]
    assert line.startswith("launcher: scorer.rewards[0]: ") and line.endswith("did you mean 'accuracy_reward'?")
    print(f"\nrefused in {seconds:.2f} s")


def test_run_refuses_a_rewards_missing_column_naming_the_fix(tmp_path, would_be_redis):
    config = experiment(tmp_path, "accuracy_reward")
    redis_url = f"redis://127.0.0.1:{would_be_redis.getsockname()[1]}/0"
    result, seconds = launcher(tmp_path, "run", "--config", str(config), redis_url=redis_url)
    assert_refused_before_anything(result, tmp_path, would_be_redis)
    assert result.stderr.count("needs the column") == 1
    assert "launcher: scorer.rewards[0]: reward 'acc' needs the column 'solution'" in result.stderr
    assert "their columns: answer. Fix: rename a column to 'solution' with data.rename_columns" in result.stderr
    print(f"\nrefused in {seconds:.2f} s")


def test_run_refuses_a_reward_without_kwargs_in_a_child_of_the_launcher(tmp_path, would_be_redis):
    config = experiment(tmp_path, "strict")
    redis_url = f"redis://127.0.0.1:{would_be_redis.getsockname()[1]}/0"
    result, seconds = launcher(tmp_path, "run", "--config", str(config), redis_url=redis_url)
    assert_refused_before_anything(result, tmp_path, would_be_redis)
    assert result.stderr.count("takes no keyword argument") == 1
    assert (
        "launcher: scorer.rewards[0]: reward 'acc': its function strict takes no keyword arguments 'completion_ids', "
        "'max_completion_length', which the scorer passes it" in result.stderr
    )
    assert result.stderr.rstrip().endswith("def strict(prompts, completions, answer, **kwargs)")
    [(_, parent)] = [line.split() for line in (tmp_path / "imported-by").read_text().splitlines()]
    assert int(parent) != os.getpid()  # not the launcher (pytest's child): a child of the launcher imported it
    print(f"\nrefused in {seconds:.2f} s")


def test_config_explain_shows_the_data_first_and_the_checks_problems(tmp_path):
    config = experiment(tmp_path, "accuracy_reward")
    result, _ = launcher(tmp_path, "config", "explain", str(config))
    assert result.returncode == 2, result.stderr
    assert result.stdout.startswith("Data\n  source                                  'train.jsonl'")
    assert "Start-up check: 1 problem(s)" in result.stdout and "needs the column 'solution'" in result.stdout


def test_config_explain_says_the_check_passed(tmp_path):
    config = experiment(tmp_path, "accuracy_reward")
    renamed = 'source = "train.jsonl"\nrename_columns = { answer = "solution" }'
    config.write_text(config.read_text().replace('source = "train.jsonl"', renamed))
    result, _ = launcher(tmp_path, "config", "explain", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("Data\n") and "Start-up check: passed" in result.stdout


def test_the_launchers_check_imports_neither_torch_nor_vllm():
    code = "import sys, services.launcher.cli; print(sorted({'torch', 'vllm'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "[]", result.stderr


def test_the_scorer_refuses_a_misspelled_reward_at_its_start(tmp_path, redis_url, keys):
    config = experiment(tmp_path, "acuracy_reward")
    env = {"ASYNCGRPO_CONFIG": str(config), "REDIS_URL": redis_url, "STREAM_PREFIX": keys.prefix}
    env.update(API_TOKEN=secrets.token_urlsafe(32), SCORER_HOST="127.0.0.1", SCORER_PORT="0")
    scorer = start_service("scorer", "services.scorer", env)
    try:
        assert scorer.process.wait(60) == 2, scorer.output()
    finally:
        scorer.stop()
    assert "not starting: reward 'acc': " in scorer.output() and "did you mean 'accuracy_reward'?" in scorer.output()
    assert "Traceback" not in scorer.output()
