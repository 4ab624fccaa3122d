"""A split the data source cannot have is refused by name (issue 64, item 4): a built-in task, a file or a list
of files is one split, ``train``, so ``eval_split = "test"`` on a one-file JSONL (what ``config from-trl`` makes
of ``dataset_test_split: test``) would read the training rows again. :func:`split_problems` says so without
reading a row (the start-up check runs it), and reading the source refuses with the same message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.config.data import DataSettings
from shared.dataset.sources import DataError, read_eval_source, read_source, split_problems

ROWS = [{"prompt": f"q{i}", "solution": str(i)} for i in range(10)]


def _jsonl(path: Path) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return path


def test_a_one_file_source_has_one_split_named_train(tmp_path):
    source = str(_jsonl(tmp_path / "conversational.jsonl"))
    data = DataSettings(source=source, eval_split="test")
    [problem] = split_problems(data)
    assert problem.startswith("data.eval_split 'test': ") and "one split, 'train'" in problem
    assert "data.eval_fraction" in problem  # the fix is named
    with pytest.raises(DataError) as refused:
        read_eval_source(data)
    assert str(refused.value) == problem
    assert split_problems(DataSettings(source=source, train_split="train[:90%]", eval_split="train[90%:]")) == []
    assert split_problems(DataSettings(source=[source, source], train_split="dev")) != []
    assert split_problems(data, fields=("train_split",)) == [] and split_problems(data, fields=("eval_split",))


def test_a_directory_has_the_splits_its_file_names_hold(tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    _jsonl(parts / "train-0.jsonl")
    _jsonl(parts / "test-0.jsonl")
    assert split_problems(DataSettings(source=str(parts), eval_split="test")) == []
    [problem] = split_problems(DataSettings(source=str(parts), eval_split="validation"))
    assert "no file of" in problem and "'validation'" in problem
    unnamed = tmp_path / "unnamed"
    unnamed.mkdir()
    _jsonl(unnamed / "rows.jsonl")
    assert split_problems(DataSettings(source=str(unnamed))) == []  # train: every file
    assert len(read_source(DataSettings(source=str(unnamed)))) == 10


def test_built_in_tasks_and_named_datasets(tmp_path):
    [problem] = split_problems(DataSettings(source="builtin:arithmetic", eval_split="test"))
    assert "a built-in task has one split, 'train'" in problem
    assert split_problems(DataSettings(source="someone/dataset", eval_split="test")) == []  # datasets knows its own
