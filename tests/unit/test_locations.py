"""The one rule for every file and module a configuration names (shared/config/locations.py): beside the file
the user passed, then the working directory, then (modules) ``sys.path``; and the run directory's copy, which
records where the user's file was so that the services and a later start from the copy look there too."""

from __future__ import annotations

import re
import sys
import uuid
from pathlib import Path

import pytest
import tomli_w

from services.launcher.preflight import preflight
from services.launcher.run_config import write_run_config
from shared.config.data import DataSettings
from shared.config.locations import import_named_module, locate, looked_in, search_dirs
from shared.reward_protocol import load_callable


@pytest.fixture
def folders(tmp_path, monkeypatch):
    """``experiment/`` (the user's config lives there), ``elsewhere/`` (the working directory); ``sys.path`` as
    it was, and the modules imported from them forgotten, afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("ASYNCGRPO_CONFIG", raising=False)
    experiment, elsewhere = tmp_path / "experiment", tmp_path / "elsewhere"
    experiment.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    yield experiment, elsewhere
    for name, module in list(sys.modules.items()):  # the users' modules of this test, never a library
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def _module(folder: Path, value: str) -> str:
    name = f"user_mod_{uuid.uuid4().hex[:8]}"
    (folder / f"{name}.py").write_text(f"def fn(*args, **kwargs):\n    return {value!r}\n")
    return name


def test_the_folders_are_the_configs_then_the_working_directory(folders):
    experiment, elsewhere = folders
    assert search_dirs(experiment / "x.toml") == [experiment, elsewhere]
    assert search_dirs() == [elsewhere]  # no configuration file: the working directory alone


def test_a_files_search_path_replaces_its_folder_relative_to_it(folders):
    experiment, elsewhere = folders
    config = experiment / "x.toml"
    config.write_text('search_path = ["../shared", "/abs/place"]\n[learner]\n')
    assert search_dirs(config) == [experiment.parent / "shared", Path("/abs/place"), elsewhere]
    config.write_text('search_path = "nope"\n')
    with pytest.raises(ValueError, match="search_path must be a list of folders"):
        search_dirs(config)


def test_a_relative_file_is_found_beside_the_config_before_the_working_directory(folders):
    experiment, elsewhere = folders
    for folder in (experiment, elsewhere):
        (folder / "data.jsonl").write_text(str(folder))
    dirs = search_dirs(experiment / "x.toml")
    assert locate("data.jsonl", dirs) == experiment / "data.jsonl"
    (experiment / "data.jsonl").unlink()
    assert locate("data.jsonl", dirs) == elsewhere / "data.jsonl"
    assert locate("missing.jsonl", dirs) is None
    assert looked_in("missing.jsonl", dirs) == f"{experiment / 'missing.jsonl'}, {elsewhere / 'missing.jsonl'}"
    assert locate(str(elsewhere / "data.jsonl"), []) == elsewhere / "data.jsonl"  # absolute: itself


def test_a_module_beside_the_config_wins_over_one_of_the_same_name_in_the_working_directory(folders, monkeypatch):
    experiment, elsewhere = folders
    name = _module(experiment, "beside")
    (elsewhere / f"{name}.py").write_text("def fn(*a, **k):\n    return 'cwd'\n")
    monkeypatch.setenv("ASYNCGRPO_CONFIG", str(experiment / "x.toml"))
    assert load_callable(f"{name}:fn", "reward function")() == "beside"


def test_a_module_in_neither_folder_comes_from_sys_path(folders):
    experiment, _ = folders
    assert import_named_module("json", [experiment]).__name__ == "json"


def test_a_module_nowhere_names_every_place_looked(folders, monkeypatch):
    experiment, elsewhere = folders
    monkeypatch.setenv("ASYNCGRPO_CONFIG", str(experiment / "x.toml"))
    message = f"(looked in {experiment}, {elsewhere}, then on sys.path); put it beside the configuration file"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_callable("no_such_user_module:fn", "environment class")


def test_a_module_found_whose_own_import_fails_says_what_it_lacks(folders, monkeypatch):
    experiment, _ = folders
    (experiment / "needs_more.py").write_text("import not_installed_anywhere_xyz\n")
    monkeypatch.setenv("ASYNCGRPO_CONFIG", str(experiment / "x.toml"))
    with pytest.raises(ValueError, match="No module named 'not_installed_anywhere_xyz'"):
        load_callable("needs_more:fn", "tool function")


def test_a_data_file_beside_the_config_is_read_from_another_directory(folders, monkeypatch):
    from shared.dataset.sources import DataError, read_source

    experiment, elsewhere = folders
    (experiment / "rows.jsonl").write_text('{"prompt": "2+2?", "answer": "4"}\n{"prompt": "3+3?", "answer": "6"}\n')
    monkeypatch.setenv("ASYNCGRPO_CONFIG", str(experiment / "x.toml"))
    assert [row["answer"] for row in read_source(DataSettings(source="rows.jsonl"))] == ["4", "6"]
    places = f"looked at {experiment / 'gone.jsonl'}, {elsewhere / 'gone.jsonl'}"
    with pytest.raises(DataError, match=re.escape(places)):
        read_source(DataSettings(source="gone.jsonl"))


def test_a_chat_template_beside_the_config_is_read_from_another_directory(folders, monkeypatch):
    from services.generator.startup import NotStarting, _chat_template

    experiment, elsewhere = folders
    (experiment / "templates").mkdir()
    (experiment / "templates" / "t.jinja").write_text("{{ messages }}")
    monkeypatch.setenv("ASYNCGRPO_CONFIG", str(experiment / "x.toml"))
    assert _chat_template("templates/t.jinja") == "{{ messages }}"
    with pytest.raises(NotStarting, match=re.escape(str(elsewhere / "templates" / "u.jinja"))):
        _chat_template("templates/u.jinja")


def _users_config(experiment: Path) -> Path:
    module = _module(experiment, "env")
    (experiment / "rows.jsonl").write_text('{"prompt": "2+2?", "answer": "4"}\n')
    rewards = experiment / "user_rewards.py"
    rewards.write_text("def exact(completions, answer, **kwargs):\n    return [1.0 for _ in completions]\n")
    document = {
        "scorer": {"rewards": [{"name": "exact", "function": "user_rewards:exact"}]},
        "generator": {"model": "/m", "environment": {"tools": [f"{module}:fn"], "max_tool_response_tokens": 16}},
        "learner": {"model": "/m", "max_steps": 40},
        "data": {"source": "rows.jsonl"},
    }
    config = experiment / "mine.toml"
    config.write_text(tomli_w.dumps(document))
    return config


def test_the_run_directorys_copy_finds_what_the_users_file_names_from_a_third_directory(folders, monkeypatch):
    """A start from ``runs/<name>/config.toml`` (a resume by hand, the services) looks where the user's file was."""
    experiment, elsewhere = folders
    config = _users_config(experiment)
    copy = write_run_config(config, elsewhere / "runs" / "r1", {"learner": {"max_steps": 2}})
    assert copy == elsewhere / "runs" / "r1" / "config.toml"
    assert preflight(config) == []
    third = elsewhere.parent / "third"
    third.mkdir()
    monkeypatch.chdir(third)
    for name in ("user_rewards",):
        sys.modules.pop(name, None)
    sys.path[:] = [p for p in sys.path if p != str(experiment)]
    assert search_dirs(copy) == [experiment, elsewhere, third]
    assert preflight(copy) == []  # the reward and the tool import, the reward's column is in rows.jsonl
    assert locate("rows.jsonl", search_dirs(copy)) == experiment / "rows.jsonl"
    text = copy.read_text()
    assert "max_steps = 2" in text and not list(copy.parent.glob(".config.toml.*"))


def test_the_copy_of_a_copy_keeps_the_users_folders_first(folders, monkeypatch):
    experiment, elsewhere = folders
    first = write_run_config(_users_config(experiment), elsewhere / "runs" / "r1")
    monkeypatch.chdir(experiment.parent)
    again = write_run_config(first, first.parent)  # a start from the copy writes it again, in place
    assert again == first and search_dirs(again) == [experiment, elsewhere, experiment.parent]
