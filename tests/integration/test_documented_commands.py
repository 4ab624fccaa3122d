"""The documented commands that start in seconds, each run as the documentation writes it, from a working
directory that is not the repository's (tests/unit/test_documented_commands.py lists what must be smoked;
the demos and ``asyncgrpo run`` are in tests/e2e/test_documented_runs.py).

Where a page gives the command line, the line is read from the page and run with only its port (and its
``<token>`` placeholder) replaced, so a page and the code cannot drift apart unnoticed."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support.processes import ROOT, require_current_setup, start_service, wait_http_ok
from tests.support.redis_server import free_port

pytestmark = pytest.mark.integration

ASYNCGRPO = Path(sys.executable).parent / "asyncgrpo"  # the console script `make setup` installs
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))
TOKEN = "documented-commands-token-0123456789abcdef"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def asyncgrpo(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The console script, offline: a recipe's Hub dataset is looked for in the local cache only."""
    env = {k: v for k, v in os.environ.items() if k != "ASYNCGRPO_CONFIG"}
    env |= {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([str(ASYNCGRPO), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def fenced(page: str, language: str) -> list[str]:
    """The fenced blocks of ``page`` (a path under docs/) written in ``language``."""
    return [body for lang, body in FENCE.findall((ROOT / "docs" / page).read_text()) if lang == language]


def documented_line(page: str, start: str) -> list[str]:
    """The first command line of ``page`` (fenced or inline) that begins with ``start``, as argv."""
    text = (ROOT / "docs" / page).read_text()
    match = re.search(rf"(?:^|`){re.escape(start)}[^`\n]*", text, re.M)
    assert match, f"docs/{page} no longer gives a command starting {start!r}"
    return shlex.split(match.group(0).lstrip("`").split(" #")[0])


def with_port(argv: list[str], port: int) -> list[str]:
    return [str(port) if previous == "--port" else arg for previous, arg in zip(["", *argv[:-1]], argv, strict=True)]


@pytest.mark.smokes("asyncgrpo config explain")
@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_config_explain_passes_on_every_shipped_configuration(config, tmp_path):
    result = asyncgrpo("config", "explain", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Start-up check: passed" in result.stdout


@pytest.mark.smokes("asyncgrpo config tables")
def test_config_tables_prints_every_settings_table(tmp_path):
    result = asyncgrpo("config", "tables", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for table in ("generator", "scorer", "learner", "data", "environment", "launcher"):
        assert re.search(rf"^#+ .*\[?{table}\]?", result.stdout, re.M | re.I), table
    assert result.stdout.count("\n|") > 100


TRANSLATIONS = [
    ("from-trl", ROOT / "tests" / "support" / "trl_grpo_recipe.yaml"),
    ("from-trl", ROOT / "tests" / "support" / "trl_grpo_dataset_recipe.yaml"),
    ("from-verl", ROOT / "tests" / "support" / "verl_grpo_gsm8k.yaml"),
]


@pytest.mark.smokes("asyncgrpo config from-trl", "asyncgrpo config from-verl")
@pytest.mark.parametrize(("command", "recipe"), TRANSLATIONS, ids=[r.name for _, r in TRANSLATIONS])
def test_a_translated_recipe_is_a_configuration_explain_accepts(command, recipe, tmp_path):
    out = tmp_path / "translated.toml"
    result = asyncgrpo("config", command, str(recipe), "--output", str(out), "--allow-unmapped", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[learner]" in out.read_text()
    explained = asyncgrpo("config", "explain", str(out), cwd=tmp_path)
    assert "Start-up check" in explained.stdout, explained.stdout + explained.stderr


GUIDES = [("from-trl", "guides/from-trl.md"), ("from-verl", "guides/from-verl.md")]


@pytest.mark.parametrize(("command", "page"), GUIDES)
def test_the_guides_yaml_examples_translate(command, page, tmp_path):
    """Each YAML block of the guide is a recipe the translation takes (the guides' own examples)."""
    blocks = fenced(page, "yaml")
    assert blocks, f"docs/{page} shows no recipe (a fenced yaml block) to translate"
    for i, block in enumerate(blocks):
        recipe = tmp_path / f"example-{i}.yaml"
        recipe.write_text(block)
        out = tmp_path / f"{i}.toml"
        result = asyncgrpo("config", command, str(recipe), "--output", str(out), cwd=tmp_path)
        assert result.returncode == 0, f"docs/{page} example {i}:\n{block}\n{result.stdout}{result.stderr}"
        explained = asyncgrpo("config", "explain", str(out), cwd=tmp_path)  # loads; a Hub dataset is not here
        assert "Start-up check" in explained.stdout, f"docs/{page} example {i}:\n{explained.stdout}{explained.stderr}"


@pytest.mark.smokes("make test-fast")
def test_make_test_fast_runs_its_tier(tmp_path):
    """The target, its marker expression and pytest, on one fast file (the whole tier is what make test runs)."""
    require_current_setup()
    args = "PYTEST_ARGS=-q -p no:cacheprovider tests/unit/test_documented_commands.py"
    result = subprocess.run(["make", "-C", str(ROOT), "test-fast", args], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"\d+ passed", result.stdout), result.stdout[-2000:]


@pytest.mark.smokes("asyncgrpo prepare-model")
def test_prepare_model_prints_a_model_directory(tmp_path):
    result = asyncgrpo("prepare-model", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    model = Path(result.stdout.strip().splitlines()[-1])
    assert (model / "config.json").is_file() and any(model.glob("*.safetensors"))


@pytest.mark.smokes("python -m services.reward_plugin")
def test_the_reward_plugin_command_of_the_guide_serves_the_guides_request(tmp_path):
    """docs/guides/reward-plugins.md: ``python -m services.reward_plugin --function my_module:my_reward``,
    the module in the working directory, scored with the guide's first request."""
    argv = documented_line("guides/reward-plugins.md", "python -m services.reward_plugin")
    (tmp_path / "my_module.py").write_text(
        "def my_reward(completions, answer, **kwargs):\n"
        "    return [1.0 if f'<answer>{a}</answer>' in c else 0.0 for c, a in zip(completions, answer)]\n"
    )
    port = free_port()
    service = _start(argv, port, tmp_path, {"PLUGIN_TOKEN": TOKEN})
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 60)
        request = json.loads(next(b for b in fenced("guides/reward-plugins.md", "json") if '"completion": "' in b))
        reply = httpx.post(f"http://127.0.0.1:{port}/score", json=request, headers=_auth(), timeout=30)
        assert reply.status_code == 200, reply.text
        assert reply.json()["rewards"] == [1.0, 0.0]
    finally:
        service.stop()


@pytest.mark.smokes("python -m services.env_server")
def test_the_env_server_command_of_the_guide_serves_the_guides_environment(tmp_path):
    """docs/guides/multi-turn.md: its ``my_env.py`` (``Counter``) served by the command it gives; a session
    steps the counter as the class says."""
    argv = documented_line("guides/multi-turn.md", "python -m services.env_server")
    [module] = [b for b in fenced("guides/multi-turn.md", "python") if "class Counter" in b]
    (tmp_path / "my_env.py").write_text(module)
    port = free_port()
    service = _start(argv, port, tmp_path, {"ENV_SERVER_API_TOKEN": TOKEN})
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 60)
        base, protocol = f"http://127.0.0.1:{port}", "asyncgrpo.env/v1"
        body = {"protocol": protocol, "session_key": "doc-0", "row": {"prompt": "p", "start": 7}}
        created = httpx.post(f"{base}/sessions", json=body, headers=_auth(), timeout=30)
        assert created.status_code == 201, created.text
        call = {"id": "c0", "name": "increment", "arguments": {"step": 3}}
        step = {"protocol": protocol, "step": 0, "tool_calls": [call]}
        reply = httpx.post(f"{base}/sessions/{created.json()['session_id']}/step", json=step, headers=_auth())
        assert reply.status_code == 200, reply.text
        assert "10" in json.dumps(reply.json())
    finally:
        service.stop()


def _start(argv: list[str], port: int, cwd: Path, env: dict[str, str]):
    """The documented ``python -m services.<x> ...`` line, with this interpreter and ``port``, in ``cwd``."""
    assert argv[:2] == ["python", "-m"], argv
    service = start_service(argv[2], argv[2], env, with_port(argv[3:], port), cwd=cwd)
    service.port = port
    return service


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}
