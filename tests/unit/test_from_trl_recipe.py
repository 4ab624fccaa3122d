"""``config from-trl`` on a realistic ``trl grpo`` recipe, as a user runs it (issue 35, items 1-2): the dataset,
its splits, evaluation, trackers and gradient checkpointing are kept; logging, the Hub and dataloader options
are listed as having no effect instead of needing --allow-unmapped; without TRL installed the pinned TRL's
packaged defaults are used and named; an installed TRL wins; an option that could change what is learned and
has no counterpart is still refused; a file with no dataset says loudly that the run would use the built-in task.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

from shared.config.pipeline import PipelineConfig
from tests.support.processes import ROOT

RECIPE = ROOT / "tests" / "support" / "trl_grpo_dataset_recipe.yaml"
# Runs the launcher with `import trl` failing, whatever this environment has installed.
_WITHOUT_TRL = (
    "import runpy, sys; sys.modules['trl'] = None; sys.argv = ['asyncgrpo', *sys.argv[1:]]; "
    "runpy.run_module('services.launcher', run_name='__main__')"
)


def from_trl_cli(source: Path, *args: str, trl: str = "missing", pythonpath: Path | None = None):
    """``asyncgrpo config from-trl source args``; ``trl``: 'missing' blocks the import, 'as is' leaves it."""
    command = ["-c", _WITHOUT_TRL] if trl == "missing" else ["-m", "services.launcher"]
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), str(ROOT)])
    return subprocess.run(
        [sys.executable, *command, "config", "from-trl", str(source), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def header_section(text: str, title: str) -> list[str]:
    """The ``#   `` lines under the header line that starts with ``# title``."""
    lines = text.split("\n\n")[0].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"# {title}"))
    section = []
    for line in lines[start + 1 :]:
        if not line.startswith("#   "):
            break
        section.append(line[4:])
    return section


def test_recipe_translates_without_trl_and_without_allow_unmapped(tmp_path):
    out = tmp_path / "recipe.toml"
    done = from_trl_cli(RECIPE, "-o", str(out))
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    tables = tomllib.loads(text)
    assert tables["data"] == {
        "source": "openai/gsm8k",
        "dataset_config": "main",
        "train_split": "train",
        "eval_split": "test",
        "epochs": 0,
    }
    learner = tables["learner"]
    assert (learner["report_to"], learner["gradient_checkpointing"]) == (["wandb"], True)
    assert (learner["eval_every"], learner["eval_on_start"], learner["log_completions"]) == (50, False, 5)
    assert (learner["checkpoint_every"], learner["keep_checkpoints"]) == (50, 2)
    assert tables["generator"]["gpu_memory_utilization"] == 0.4
    ignored = [line.split(":")[0] for line in header_section(text, "Options with no effect here")]
    assert ignored == ["dataloader_num_workers", "hub_model_id", "logging_steps", "push_to_hub", "run_name"]
    assert "# Options with no counterpart" not in text and "WARNING" not in text + done.stdout
    pinned = "TRL 1.16.0's GRPOConfig defaults, packaged with asyncgrpo (TRL is not installed here"
    assert f"# Options the file leaves out: {pinned}" in text and pinned in done.stdout
    assert "# Note: deployment: vllm_mode 'colocate'" in text and "deploy/one-gpu.yml" in text
    assert "0 option(s) had no counterpart, 5 had no effect here" in done.stdout
    assert PipelineConfig.load(out).learner.data.eval_split == "test"  # what it wrote loads as it is


def test_an_option_that_could_change_what_is_learned_is_still_refused(tmp_path):
    recipe = yaml.safe_load(RECIPE.read_text())
    source = tmp_path / "recipe.yaml"
    source.write_text(yaml.safe_dump({**recipe, "sync_ref_model": True, "ref_model_sync_steps": 64}))
    out = tmp_path / "out.toml"
    refused = from_trl_cli(source, "-o", str(out))
    assert refused.returncode == 2 and not out.exists()
    assert "no counterpart here for: ref_model_sync_steps, sync_ref_model" in refused.stderr
    assert "may change the algorithm or the data" in refused.stderr and "Traceback" not in refused.stderr
    allowed = from_trl_cli(source, "--allow-unmapped", "-o", str(out))
    assert allowed.returncode == 0, allowed.stderr
    assert header_section(out.read_text(), "Options with no counterpart") == ["ref_model_sync_steps", "sync_ref_model"]


def test_a_file_without_a_dataset_names_the_builtin_task_loudly(tmp_path):
    source = tmp_path / "no_data.yaml"
    source.write_text("model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct\nreward_funcs: [my_rewards.accuracy]\n")
    out = tmp_path / "out.toml"
    done = from_trl_cli(source, "-o", str(out))
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert tomllib.loads(text)["data"]["source"] == "builtin:arithmetic"
    assert text.splitlines()[2].startswith("# WARNING: the TRL file names no dataset (dataset_name)")
    assert done.stdout.startswith("WARNING: the TRL file names no dataset (dataset_name), so this run would train")


def test_an_installed_trl_wins_over_the_packaged_defaults(tmp_path):
    """A stand-in TRL 9.9.9 on the path whose GRPOConfig defaults loss_type to 'grpo' (1.16's: 'dapo')."""
    package = tmp_path / "trl"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from dataclasses import dataclass\n"
        "__version__ = '9.9.9'\n"
        "@dataclass\nclass GRPOConfig:\n    loss_type: str = 'grpo'\n    num_generations: int = 4\n"
        "@dataclass\nclass ModelConfig:\n    use_peft: bool = False\n"
    )
    source = tmp_path / "recipe.yaml"
    source.write_text("model_name_or_path: m\ndataset_name: openai/gsm8k\n")
    out = tmp_path / "out.toml"
    done = from_trl_cli(source, "-o", str(out), trl="as is", pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert "# Options the file leaves out: the installed TRL 9.9.9's GRPOConfig defaults." in text
    learner = tomllib.loads(text)["learner"]
    assert (learner["loss_type"], learner["group_size"]) == ("grpo", 4)
