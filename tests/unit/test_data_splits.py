"""Splits of the learner's data: datasets' split strings, the training split, the evaluation split or fraction,
and the rule that an evaluation row is never a training row."""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import pandas as pd
import pytest
from pydantic import ValidationError

from services.learner.data.feeder import PromptFeeder, load_rows
from services.learner.evaluation import eval_source, load_eval_rows, may_share_rows
from shared.config.data import DataSettings, SplitPart, parse_split, unsliced
from shared.config.learner import LearnerSettings
from shared.dataset.sources import DataError, held_out_count, overlap, read_eval_source, read_source
from shared.records import SamplingSpec

ROWS = [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _prompts(rows: list[dict]) -> list[str]:
    return [row["prompt"] for row in rows]


def _settings(**fields) -> LearnerSettings:
    return LearnerSettings(model="m", api_token="t", **fields)


# The split strings -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "parts"),
    [
        ("train", (SplitPart("train"),)),
        ("train[:90%]", (SplitPart("train", None, 90, percent=True),)),
        ("train[90%:]", (SplitPart("train", 90, None, percent=True),)),
        ("train[:1000]", (SplitPart("train", None, 1000),)),
        ("test[-5:-1]", (SplitPart("test", -5, -1),)),
        ("train[:10%](pct1_dropremainder)", (SplitPart("train", None, 10, True, "pct1_dropremainder"),)),
        ("train[:2] + test", (SplitPart("train", None, 2), SplitPart("test"))),
        ("validation.clean", (SplitPart("validation.clean"),)),
    ],
)
def test_split_strings_are_read_as_datasets_writes_them(spec, parts):
    assert parse_split(spec) == parts


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("train[0.5:]", r"cannot read 'train\[0.5:\]'; write a split name or a slice"),
        ("train[%:]", "cannot read"),
        ("tra in", "cannot read"),
        ("train+", "cannot read ''"),
        ("train[10:50%]", "mixes a row count and a percentage"),
        ("train[:101%]", "has a percentage beyond 100%"),
        ("train[:10%](nearest)", "rounding 'nearest' is unknown"),
        ("train[:10](closest)", "a rounding applies to percent slices only"),
    ],
)
def test_a_split_string_that_is_not_one_says_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_split(spec)


@pytest.mark.parametrize(
    ("spec", "size", "bounds"),
    [
        ("train", 10, (0, 10)),
        ("train[:90%]", 10, (0, 9)),
        ("train[90%:]", 10, (9, 10)),
        ("train[:90%]", 5, (0, 4)),  # 4.5 rounds to the even 4, as Python's round (and datasets) does
        ("train[90%:]", 5, (4, 5)),
        ("train[:1000]", 10, (0, 10)),
        ("train[-3:]", 10, (7, 10)),
        ("train[-30:]", 10, (0, 10)),
        ("train[-20%:]", 10, (8, 10)),
        ("train[5:2]", 10, (5, 2)),  # an empty slice
        ("train[:10%](pct1_dropremainder)", 250, (0, 20)),  # 10 x (250 // 100)
    ],
)
def test_a_slice_selects_these_rows(spec, size, bounds):
    (part,) = parse_split(spec)
    assert part.bounds(size) == bounds


SPECS = ["train", "train[:90%]", "train[90%:]", "train[33%:66%]", "train[:7]", "train[-4:]", "train[-15%:-5%]"]


@pytest.mark.parametrize("spec", SPECS)
def test_slices_select_the_rows_datasets_selects(spec):
    for size in (1, 2, 3, 7, 10, 99, 101, 1000):
        expected = [(a.from_, a.to) for a in datasets.ReadInstruction.from_spec(spec).to_absolute({"train": size})]
        assert [part.bounds(size) for part in parse_split(spec)] == expected, (spec, size)


def test_pct1_dropremainder_needs_a_hundred_rows():
    (part,) = parse_split("train[:10%](pct1_dropremainder)")
    with pytest.raises(ValueError, match=r"has 99 rows, and pct1_dropremainder rounding needs at least 100"):
        part.bounds(99)


def test_unsliced_keeps_the_names():
    assert unsliced("train[:90%] + test[5:]") == "train+test"


# Settings ---------------------------------------------------------------------------------------------


def test_split_is_still_read_as_train_split(tmp_path, monkeypatch):
    assert DataSettings(split="test[:5]").train_split == "test[:5]"
    assert DataSettings(train_split="test").train_split == "test"
    assert DataSettings().train_split == "train"
    with pytest.raises(ValidationError, match=r"data.split is the former name of data.train_split"):
        DataSettings(split="a", train_split="b")
    with pytest.raises(ValidationError, match=r"cannot read 'train:5'"):
        DataSettings(train_split="train:5")
    config = tmp_path / "c.toml"
    config.write_text('[learner]\nmodel = "m"\napi_token = "t"\n\n[data]\nsplit = "train[:80%]"\n')
    assert LearnerSettings.load(config).data.train_split == "train[:80%]"
    config.write_text('[learner]\nmodel = "m"\napi_token = "t"\n\n[data]\ntrain_split = "train[:70%]"\n')
    assert LearnerSettings.load(config).data.train_split == "train[:70%]"
    monkeypatch.setenv("LEARNER_DATA__SPLIT", "test")
    assert _settings().data.train_split == "test"
    monkeypatch.delenv("LEARNER_DATA__SPLIT")
    monkeypatch.setenv("LEARNER_DATA__TRAIN_SPLIT", "train[:10]")
    monkeypatch.setenv("LEARNER_DATA__EVAL_SPLIT", "train[10:]")
    settings = _settings()
    assert (settings.data.train_split, settings.data.eval_split) == ("train[:10]", "train[10:]")


def test_one_way_to_choose_the_evaluation_rows():
    with pytest.raises(ValidationError, match=r"data.eval_split .'test'. and data.eval_fraction .0.1. both"):
        DataSettings(eval_split="test", eval_fraction=0.1)
    for fraction in (0, 1, -0.5):
        with pytest.raises(ValidationError, match=r"eval_fraction"):
            DataSettings(eval_fraction=fraction)
    with pytest.raises(ValidationError, match=r"two sources of evaluation rows: learner.eval_data \('e.jsonl'\) and "):
        _settings(data={"eval_split": "test"}, eval_data="e.jsonl")
    with pytest.raises(ValidationError, match=r"two sources of evaluation rows: .* and data.eval_fraction"):
        _settings(data={"eval_fraction": 0.1}, eval_data="held_out")
    with pytest.raises(ValidationError, match=r"learner.eval_split .'test'. picks the split of learner.eval_data"):
        _settings(eval_split="test")
    with pytest.raises(ValidationError, match=r"learner.eval_split: split 'test:5'"):
        _settings(eval_data="e.jsonl", eval_split="test:5")
    assert _settings(data={"eval_fraction": 0.1}).data.eval_fraction == 0.1


# Held out by a fraction -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "fraction", "count"), [(10, 0.1, 1), (10, 0.25, 2), (10, 0.36, 4), (3, 0.01, 1), (1000, 0.05, 50)]
)
def test_held_out_count(size, fraction, count):
    assert held_out_count(size, fraction) == count


@pytest.mark.parametrize(("size", "fraction"), [(3, 0.9), (1, 0.5), (2, 0.75)])
def test_a_fraction_that_leaves_no_training_row_is_refused(size, fraction):
    with pytest.raises(DataError, match=f"data.eval_fraction = {fraction} of {size} rows leaves no training row"):
        held_out_count(size, fraction)


def test_overlap_counts_the_evaluation_rows_that_are_training_rows():
    assert overlap([("a", 0), ("a", 1)], [("a", 1), ("b", 1), ("a", 1)]) == 2
    assert overlap([("a", 0)], [("b", 0)]) == 0


def test_eval_fraction_holds_out_the_last_rows_and_the_feeder_never_sees_them(tmp_path):
    data = DataSettings(source=str(_jsonl(tmp_path / "d.jsonl", ROWS)), eval_fraction=0.2, epochs=2)
    assert _prompts(read_source(data)) == [f"q{i}" for i in range(8)]
    assert _prompts(read_eval_source(data)) == ["q8", "q9"]
    assert _prompts(read_eval_source(data)) == ["q8", "q9"]  # deterministic
    feeder = PromptFeeder(load_rows(data), data, SamplingSpec(max_tokens=8), group_size=2)
    fed = []
    while (task := feeder.next_task(0)) is not None:
        fed.append(task.prompt)
    assert len(fed) == 16 and set(fed) == {f"q{i}" for i in range(8)}


def test_eval_fraction_of_a_sliced_split_and_of_a_built_in_task(tmp_path):
    data = DataSettings(source=str(_jsonl(tmp_path / "d.jsonl", ROWS)), train_split="train[2:]", eval_fraction=0.25)
    assert _prompts(read_source(data)) == [f"q{i}" for i in range(2, 8)]
    assert _prompts(read_eval_source(data)) == ["q8", "q9"]
    builtin = DataSettings(source="builtin:sums", builtin_size=40, eval_fraction=0.1)
    training, held = read_source(builtin), read_eval_source(builtin)
    everything = read_source(DataSettings(source="builtin:sums", builtin_size=40))
    assert (len(training), len(held)) == (36, 4) and training + held == everything


# Held out by a split ----------------------------------------------------------------------------------


def test_slices_of_one_file_train_and_evaluate_on_disjoint_rows(tmp_path):
    source = str(_jsonl(tmp_path / "d.jsonl", ROWS))
    data = DataSettings(source=source, train_split="train[:70%]", eval_split="train[70%:]")
    assert _prompts(read_source(data)) == [f"q{i}" for i in range(7)]
    assert _prompts(read_eval_source(data)) == ["q7", "q8", "q9"]
    first_and_last = DataSettings(source=source, train_split="train[3:]", eval_split="train[:3]")
    assert _prompts(read_eval_source(first_and_last)) == ["q0", "q1", "q2"]
    joined = DataSettings(source=source, train_split="train[:2]+train[-2:]", eval_split="train[2:4]")
    assert _prompts(read_source(joined)) == ["q0", "q1", "q8", "q9"]
    assert _prompts(read_eval_source(joined)) == ["q2", "q3"]


@pytest.mark.parametrize(
    ("train_split", "eval_split", "shared"),
    [
        ("train", "train[90%:]", 1),
        ("train[:60%]", "train[50%:]", 1),
        ("train[:5]+train[5:]", "train[-1:]", 1),
    ],
)
def test_an_evaluation_split_that_holds_training_rows_is_refused(tmp_path, train_split, eval_split, shared):
    data = DataSettings(source=str(_jsonl(tmp_path / "d.jsonl", ROWS)), train_split=train_split, eval_split=eval_split)
    message = re.escape(
        f"data.eval_split = {eval_split!r} selects {shared} rows that data.train_split = {train_split!r}"
    )
    with pytest.raises(DataError, match=message):
        read_eval_source(data)


def test_an_eval_fraction_of_a_split_that_repeats_rows_is_refused(tmp_path):
    data = DataSettings(
        source=str(_jsonl(tmp_path / "d.jsonl", ROWS)), train_split="train+train[:1]", eval_fraction=0.05
    )
    with pytest.raises(DataError, match=r"data.eval_fraction = 0.05 selects 1 rows that data.train_split"):
        read_eval_source(data)


def test_a_directory_splits_by_file_name_and_an_evaluation_split_it_lacks_is_refused(tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    pd.DataFrame(ROWS[:6]).to_parquet(parts / "train-0.parquet")
    pd.DataFrame(ROWS[6:8]).to_parquet(parts / "train-1.parquet")
    pd.DataFrame(ROWS[8:]).to_parquet(parts / "test-0.parquet")
    data = DataSettings(source=str(parts), eval_split="test")
    assert _prompts(read_source(data)) == [f"q{i}" for i in range(8)]
    assert _prompts(read_eval_source(data)) == ["q8", "q9"]
    # A name no file holds is no split of the directory: refused by name, before a row is read.
    with pytest.raises(DataError, match=r"data.eval_split 'dev': no file of .* has 'dev' in its name"):
        read_eval_source(DataSettings(source=str(parts), eval_split="dev"))
    # Slices span the split's files in order.
    sliced = DataSettings(source=str(parts), train_split="train[:5]", eval_split="train[5:]")
    assert _prompts(read_eval_source(sliced)) == ["q5", "q6", "q7"]


def test_splits_of_a_saved_dataset_dict(tmp_path):
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:8]), "test": datasets.Dataset.from_list(ROWS[8:])}
    )
    splits.save_to_disk(str(tmp_path / "dict"))
    data = DataSettings(source=str(tmp_path / "dict"), train_split="train[:50%]", eval_split="test")
    assert _prompts(read_source(data)) == ["q0", "q1", "q2", "q3"]
    assert _prompts(read_eval_source(data)) == ["q8", "q9"]
    with pytest.raises(DataError, match=r"holds the splits train, test, not 'dev'; set data.eval_split"):
        read_eval_source(data.model_copy(update={"eval_split": "dev"}))


def test_a_built_in_task_has_one_split():
    data = DataSettings(source="builtin:sums", builtin_size=20, train_split="train[:15]", eval_split="train[15:]")
    assert read_source(data) + read_eval_source(data) == read_source(
        DataSettings(source="builtin:sums", builtin_size=20)
    )
    with pytest.raises(DataError, match=r"data.eval_split 'test': a built-in task has one split, 'train'"):
        read_eval_source(data.model_copy(update={"eval_split": "test"}))


def test_a_split_that_selects_nothing_is_refused(tmp_path):
    data = DataSettings(source=str(_jsonl(tmp_path / "d.jsonl", ROWS)), train_split="train[20:]")
    message = r"data.train_split 'train\[20:\]' selects no row of .*d.jsonl \(rows per split: train: 10\)"
    with pytest.raises(DataError, match=message):
        read_source(data)
    with pytest.raises(DataError, match=r"no evaluation split: set data.eval_split or data.eval_fraction"):
        read_eval_source(DataSettings(source="builtin:sums"))


# Evaluation reads them --------------------------------------------------------------------------------


def test_evaluation_rows_come_from_the_data_table_when_it_holds_some_out(tmp_path):
    source = str(_jsonl(tmp_path / "d.jsonl", ROWS))
    settings = _settings(data={"source": source, "eval_fraction": 0.3}, eval_samples=2)
    assert [row.prompt for row in load_eval_rows(settings)] == ["q7", "q8"]  # the first eval_samples held out
    assert [row.prompt for row in load_rows(settings.data)] == [f"q{i}" for i in range(7)]
    assert eval_source(settings) == f"the last 0.3 of split 'train' of {source!r}"
    split = _settings(data={"source": source, "train_split": "train[:8]", "eval_split": "train[8:]"})
    assert [row.prompt for row in load_eval_rows(split)] == ["q8", "q9"]
    assert eval_source(split) == f"split 'train[8:]' of {source!r}"
    assert eval_source(_settings(data={"source": source})) is None
    assert eval_source(_settings(data={"source": source}, eval_data="e.jsonl")) == "'e.jsonl'"


def test_eval_data_reads_the_training_split_names_without_their_slices(tmp_path):
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:8]), "test": datasets.Dataset.from_list(ROWS[8:])}
    )
    splits.save_to_disk(str(tmp_path / "dict"))
    training = str(_jsonl(tmp_path / "d.jsonl", ROWS))
    settings = _settings(data={"source": training, "train_split": "train[:2]"}, eval_data=str(tmp_path / "dict"))
    assert [row.prompt for row in load_eval_rows(settings)] == [f"q{i}" for i in range(8)]  # 'train', whole
    settings = settings.model_copy(update={"eval_split": "test[-1:]"})
    assert [row.prompt for row in load_eval_rows(settings)] == ["q9"]


# eval_data that reads the training source ----------------------------------------------------------------------


def test_eval_data_that_is_the_training_file_is_refused(tmp_path, monkeypatch):
    source = _jsonl(tmp_path / "train.jsonl", ROWS)
    monkeypatch.chdir(tmp_path)  # the same file written another way: relative here, absolute in data.source
    settings = _settings(data={"source": str(source)}, eval_data="train.jsonl")
    message = re.escape(
        "learner.eval_data = 'train.jsonl' reads data.source, and its split 'train' (no eval_split) selects 10 "
        "rows that data.train_split = 'train' also selects"
    )
    with pytest.raises(DataError, match=message) as caught:
        load_eval_rows(settings)
    for fix in ("learner.eval_split = 'train[90%:]'", "data.eval_fraction", "a different file"):
        assert fix in str(caught.value)


@pytest.mark.parametrize(
    ("train_split", "eval_split", "shared"),
    [
        ("train", "train[90%:]", 1),
        ("train[:60%]", "train[50%:]", 1),
    ],
)
def test_an_eval_split_of_the_training_file_that_holds_training_rows_is_refused(
    tmp_path, train_split, eval_split, shared
):
    source = str(_jsonl(tmp_path / "d.jsonl", ROWS))
    settings = _settings(data={"source": source, "train_split": train_split}, eval_data=source, eval_split=eval_split)
    message = re.escape(f"learner.eval_split = {eval_split!r} selects {shared} rows that data.train_split")
    with pytest.raises(DataError, match=message):
        load_eval_rows(settings)


def test_a_disjoint_slice_of_the_training_file_is_accepted(tmp_path):
    source = str(_jsonl(tmp_path / "d.jsonl", ROWS))
    data = {"source": source, "train_split": "train[:90%]"}
    settings = _settings(data=data, eval_data=source, eval_split="train[90%:]")
    assert [row.prompt for row in load_eval_rows(settings)] == ["q9"]
    assert _prompts(read_source(settings.data)) == [f"q{i}" for i in range(9)]


def test_eval_data_inside_the_training_source_is_compared_row_by_row(tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    train, test = _jsonl(parts / "train.jsonl", ROWS[:8]), _jsonl(parts / "test.jsonl", ROWS[8:])
    directory = _settings(data={"source": str(parts)}, eval_data=str(test))  # the directory trains on train.jsonl
    assert [row.prompt for row in load_eval_rows(directory)] == ["q8", "q9"]
    with pytest.raises(DataError, match=r"selects 8 rows that data.train_split = 'train' also selects"):
        load_eval_rows(directory.model_copy(update={"eval_data": str(train)}))
    listed = _settings(data={"source": [str(train), str(test)]}, eval_data=str(test))
    with pytest.raises(DataError, match=r"selects 2 rows that data.train_split"):
        load_eval_rows(listed)


def test_eval_data_that_is_the_training_task_or_saved_dataset_is_refused(tmp_path, monkeypatch):
    task = {"source": "builtin:sums", "builtin_size": 20}
    with pytest.raises(DataError, match=r"selects 20 rows that data.train_split"):
        load_eval_rows(_settings(data=task, eval_data="builtin:sums"))
    sliced = _settings(data={**task, "train_split": "train[:15]"}, eval_data="builtin:sums", eval_split="train[15:]")
    assert len(load_eval_rows(sliced)) == 5
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    monkeypatch.chdir(tmp_path)
    saved = _settings(data={"source": str(tmp_path / "saved")}, eval_data="./saved")  # one key, however written
    with pytest.raises(DataError, match=r"selects 10 rows that data.train_split"):
        load_eval_rows(saved)


def test_only_sources_that_may_share_rows_are_compared(tmp_path):
    assert may_share_rows("openai/gsm8k", "openai/gsm8k") and not may_share_rows("openai/gsm8k", "other/gsm8k")
    assert may_share_rows("builtin:sums", "builtin:sums") and not may_share_rows("builtin:sums", "builtin:products")
    assert may_share_rows(str(tmp_path / "parts" / "a.jsonl"), str(tmp_path / "parts"))
    assert may_share_rows([str(tmp_path / "a.jsonl")], [str(tmp_path / "b.jsonl"), str(tmp_path / "a.jsonl")])
    assert not may_share_rows(str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"))
