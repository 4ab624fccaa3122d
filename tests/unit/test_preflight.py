"""services/launcher/preflight.py and services/scorer/startup.py: what would stop a service at its start, found
before anything starts (issue #35, items 3-4): a reward, environment class or tool that does not import (with
the closest names), and a reward's column the dataset's rows lack (with the scorer's own message)."""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

import pytest

import services.launcher.preflight as preflight_module
from services.launcher.explain import explain
from services.launcher.preflight import FIRST_ROWS, Problem, first_row_columns, isolated_preflight, preflight
from services.scorer.startup import build_rewards
from shared.config.data import DataSettings
from shared.config.pipeline import PipelineConfig
from shared.config.scorer import RewardSpec
from shared.dataset.sources import read_source
from shared.lifecycle import NotStarting
from shared.reward_columns import missing_columns_message, unaccepted_keywords_message
from shared.reward_imports import closest_names_hint, public_callables, reward_problems

REWARDS = """
import math

def accuracy_reward(completions, solution, **kwargs):
    return [0.0 for _ in completions]

def brevity(completions, **kwargs):
    return [1.0 for _ in completions]

def strict(prompts, completions, completion_ids, answer, max_completion_length):
    return [1.0 for _ in completions]

class CounterEnv:
    def reset(self, **row):
        return ""

_private = 1
"""
ROWS = [{"prompt": "1 + 1?", "answer": "2"}, {"prompt": "2 + 2?", "answer": "4"}]


@pytest.fixture
def module(tmp_path, monkeypatch) -> str:
    """A reward module beside the configuration file, under a name no other test imports."""
    for var in ("ASYNCGRPO_CONFIG", "LEARNER_DATA__SOURCE", "LEARNER_RUN_NAME", "REDIS_URL", "STREAM_PREFIX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    name = f"rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(REWARDS)
    yield name
    sys.modules.pop(name, None)


def write_config(tmp_path: Path, rewards: str, data: str = "", environment: str = "") -> Path:
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    path = tmp_path / "run.toml"
    path.write_text(
        f'[generator]\nmodel = "/m"\n{environment}\n[scorer]\nrewards = [{rewards}]\n\n[learner]\nmodel = "/m"\n'
        f'runs_dir = "{tmp_path / "runs"}"\n\n[data]\nsource = "{tmp_path / "train.jsonl"}"\n{data}\n'
    )
    return path


def test_a_misspelled_reward_function_is_named_with_the_closest_one(module, tmp_path):
    config = write_config(tmp_path, f'{{ name = "acc", function = "{module}:acuracy_reward" }}')
    [problem] = preflight(config)
    assert problem.setting == "scorer.rewards[0]"
    assert problem.message == f"{module!r} has no callable 'acuracy_reward'; did you mean 'accuracy_reward'?"
    assert str(problem) == f"scorer.rewards[0]: {problem.message}"


def test_a_name_close_to_nothing_lists_what_the_module_defines(module, tmp_path):
    config = write_config(tmp_path, f'{{ name = "r", function = "{module}:xyz" }}')
    [problem] = preflight(config)
    assert (
        problem.message
        == f"{module!r} has no callable 'xyz'; {module!r} defines CounterEnv, accuracy_reward, brevity, strict"
    )


def test_a_module_that_does_not_import_says_where_it_was_looked_for(module, tmp_path):
    config = write_config(tmp_path, '{ name = "r", function = "no_such_module_here:fn" }')
    [problem] = preflight(config)
    assert problem.message.startswith("cannot import reward function module 'no_such_module_here'")
    assert str(tmp_path) in problem.message and "put it beside the configuration file" in problem.message


def test_a_module_that_raises_on_import_is_one_line_naming_the_file_and_line(module, tmp_path):
    (tmp_path / f"{module}.py").write_text("x = 1\nraise RuntimeError('no API key')\n")
    config = write_config(tmp_path, f'{{ name = "r", function = "{module}:fn" }}')
    [problem] = preflight(config)
    assert problem.message == (
        f"importing {module!r} for reward function '{module}:fn' raised RuntimeError: no API key "
        f"(at {tmp_path / f'{module}.py'}:2)"
    )


def test_an_unknown_built_in_is_named_with_the_closest_built_in(module, tmp_path):
    [problem] = preflight(write_config(tmp_path, '{ name = "corectness" }'))
    assert problem.setting == str(tmp_path / "run.toml")
    assert "scorer.rewards.0: unknown reward 'corectness'" in problem.message
    assert "did you mean 'correctness'?" in problem.message


def test_a_column_the_dataset_lacks_is_named_with_the_scorers_message(module, tmp_path):
    config = write_config(tmp_path, f'{{ name = "acc", function = "{module}:accuracy_reward" }}')
    [problem] = preflight(config)
    assert problem == Problem("scorer.rewards[0]", missing_columns_message("acc", ["solution"], ["answer"]))
    assert "reward 'acc' needs the column 'solution'" in problem.message
    assert "their columns: answer." in problem.message and "data.rename_columns" in problem.message


def test_a_renamed_column_counts_as_the_learner_renames_it(module, tmp_path):
    config = write_config(
        tmp_path,
        f'{{ name = "acc", function = "{module}:accuracy_reward" }}',
        'rename_columns = { answer = "solution" }',
    )
    assert preflight(config) == []


def test_a_renamed_column_the_dataset_lacks_is_the_learners_own_data_error(module, tmp_path):
    config = write_config(
        tmp_path, f'{{ name = "acc", function = "{module}:accuracy_reward" }}', 'answer_column = "sol"'
    )
    [problem] = preflight(config)
    assert problem.setting == "data" and problem.message.startswith(f"{tmp_path / 'train.jsonl'} has no column sol;")


def test_the_data_is_read_only_when_a_reward_needs_a_column(module, tmp_path):
    config = write_config(tmp_path, f'{{ name = "fmt", function = "{module}:brevity" }}')
    config.write_text(config.read_text().replace("train.jsonl", "missing.jsonl"))
    assert preflight(config) == []  # format_reward needs no column: the data is not read
    config.write_text(config.read_text().replace(":brevity", ":accuracy_reward"))
    [problem] = preflight(config)
    assert problem.setting == "data" and f"data source {tmp_path / 'missing.jsonl'} does not exist" in problem.message


def test_an_environment_class_and_tools_are_imported_too(module, tmp_path):
    environment = (
        f'[environment]\npython = "{module}:CountrEnv"\ntools = ["{module}:brevity", "{module}:tol"]\n'
        "max_tool_response_tokens = 16\n"
    )
    config = write_config(tmp_path, '{ name = "correctness" }', environment=environment)
    problems = preflight(config)
    assert [p.setting for p in problems] == ["environment.python", "environment.tools[1]"]
    assert problems[0].message.endswith("did you mean 'CounterEnv'?")


def test_the_configuration_variable_is_restored(module, tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCGRPO_CONFIG", "/elsewhere.toml")
    config = write_config(tmp_path, f'{{ name = "fmt", function = "{module}:brevity" }}')
    assert preflight(PipelineConfig.load(config), config_file=config) == []
    assert os.environ["ASYNCGRPO_CONFIG"] == "/elsewhere.toml"


def test_the_columns_are_those_the_learner_prepares(tmp_path):
    rows = [{"question": "q", "reward_model": {"ground_truth": "1"}, "completion": "x", "level": 3}]
    (tmp_path / "d.jsonl").write_text(json.dumps(rows[0]) + "\n")
    data = DataSettings(source=str(tmp_path / "d.jsonl"), rename_columns={"level": "difficulty"})
    assert first_row_columns(data) == ["difficulty", "ground_truth", "reward_model"]


def test_closest_names_hint():
    callables = {"accuracy_reward": True, "brevity": True, "Sequence": False}
    assert closest_names_hint("acuracy_reward", callables, "m") == "; did you mean 'accuracy_reward'?"
    assert closest_names_hint("zzz", callables, "m") == "; 'm' defines accuracy_reward, brevity"
    assert closest_names_hint("zzz", {"Sequence": False}, "m") == ""
    many = {f"reward_{i:02}": True for i in range(14)}
    assert closest_names_hint("zzz", many, "m").endswith("reward_11, ... (2 more)")
    namespace = {"__name__": "m", "f": print, "_g": len, "n": 1}
    assert public_callables(namespace) == {"f": False}


def test_the_scorer_refuses_a_reward_that_does_not_import_before_it_builds_any(module, tmp_path):
    misspelled = RewardSpec(name="acc", function=f"{module}:acuracy_reward")
    assert reward_problems([RewardSpec(name="correctness"), misspelled]) == [
        f"reward 'acc': {module!r} has no callable 'acuracy_reward'; did you mean 'accuracy_reward'?"
    ]
    with pytest.raises(NotStarting, match="did you mean 'accuracy_reward'"):
        build_rewards([misspelled], http=None)  # refused before the HTTP client is needed


def test_explain_shows_the_data_first_and_the_start_check(module, tmp_path):
    config = write_config(tmp_path, f'{{ name = "acc", function = "{module}:accuracy_reward" }}')
    pipeline = PipelineConfig.load(config)
    text = explain(pipeline, preflight(pipeline, config_file=config))
    assert text.startswith(f"Data\n  source                                  '{tmp_path / 'train.jsonl'}'")
    assert "Start-up check: 1 problem(s); asyncgrpo run would refuse to start" in text
    assert "  - scorer.rewards[0]: reward 'acc' needs the column 'solution'" in text
    assert "Start-up check: passed" in explain(pipeline, [])
    assert "Start-up check" not in explain(pipeline)


def test_a_reward_without_kwargs_that_cannot_take_a_column_is_named_with_the_scorers_message(module, tmp_path):
    rows = [{"prompt": "1 + 1?", "answer": "2"}, {"prompt": "2 + 2?", "answer": "4", "id": 7}]
    config = write_config(tmp_path, f'{{ name = "acc", function = "{module}:strict" }}')
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    [problem] = preflight(config)
    function = sys.modules[module].strict
    assert problem == Problem("scorer.rewards[0]", unaccepted_keywords_message("acc", function, ["id"]))
    assert problem.message.endswith(
        "def strict(prompts, completions, completion_ids, answer, max_completion_length, **kwargs)"
    )


def test_a_reward_without_kwargs_is_told_env_reward_when_an_environment_runs(module, tmp_path):
    environment = f'[environment]\npython = "{module}:CounterEnv"\nmax_tool_response_tokens = 16\n'
    config = write_config(tmp_path, f'{{ name = "acc", function = "{module}:strict" }}', environment=environment)
    [problem] = preflight(config)
    assert problem.message == unaccepted_keywords_message("acc", sys.modules[module].strict, ["env_reward"])


def test_a_reward_without_kwargs_that_takes_every_keyword_passes(module, tmp_path):
    assert preflight(write_config(tmp_path, f'{{ name = "acc", function = "{module}:strict" }}')) == []


def test_only_the_first_rows_are_converted(tmp_path, monkeypatch):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(1000)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    import datasets

    converted = []
    to_list = datasets.Dataset.to_list
    monkeypatch.setattr(datasets.Dataset, "to_list", lambda self: converted.append(len(self)) or to_list(self))
    data = DataSettings(source=str(tmp_path / "d.jsonl"), train_split="train[10:]", eval_fraction=0.5)
    assert first_row_columns(data) == ["answer"]
    assert converted == [FIRST_ROWS]
    assert [row["prompt"] for row in read_source(data, limit=3)] == ["q10", "q11", "q12"]


def test_the_first_rows_are_the_first_training_rows_whatever_the_split(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(12)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    source = str(tmp_path / "d.jsonl")
    for split, fraction in [("train", None), ("train[2:4]+train[-3:]", None), ("train[50%:]", 0.5), ("train", 0.9)]:
        data = DataSettings(source=source, train_split=split, eval_fraction=fraction)
        assert read_source(data, limit=4) == read_source(data)[:4], split


def test_an_unexpected_error_while_reading_names_its_type_and_message(module, tmp_path, monkeypatch):
    def broken(data, limit=None):
        raise KeyError("file0")

    monkeypatch.setattr(preflight_module, "read_source", broken)
    [problem] = preflight(write_config(tmp_path, f'{{ name = "acc", function = "{module}:accuracy_reward" }}'))
    assert problem == Problem("data.source", f"reading {str(tmp_path / 'train.jsonl')!r} failed: KeyError: 'file0'")


def test_the_isolated_check_imports_the_users_modules_in_a_child_only(module, tmp_path):
    (tmp_path / f"{module}.py").write_text("import sys\nsys.path.append('/from/the/rewards')\n" + REWARDS)
    config = write_config(tmp_path, f'{{ name = "acc", function = "{module}:acuracy_reward" }}')
    path_before = list(sys.path)
    [problem] = isolated_preflight(config)
    assert problem.setting == "scorer.rewards[0]" and problem.message.endswith("did you mean 'accuracy_reward'?")
    assert module not in sys.modules and sys.path == path_before


def test_a_module_that_ends_the_child_is_one_problem(module, tmp_path):
    (tmp_path / f"{module}.py").write_text("import os\nos._exit(3)\n")
    config = write_config(tmp_path, f'{{ name = "acc", function = "{module}:fn" }}')
    [problem] = isolated_preflight(config)
    assert problem.setting == "--config"
    assert problem.message.startswith(f"the start-up check of {config} ended without an answer (")
    assert problem.message.endswith("import each one with python -c to see which")


def test_the_isolated_check_of_built_in_rewards_starts_no_child(tmp_path, monkeypatch):
    monkeypatch.setattr(preflight_module, "ProcessPoolExecutor", None)  # calling it would raise
    config = write_config(tmp_path, '{ name = "correctness" }')
    assert isolated_preflight(config) == []
    [problem] = isolated_preflight(write_config(tmp_path, '{ name = "corectness" }'))
    assert "did you mean 'correctness'?" in problem.message
