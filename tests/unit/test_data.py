"""The learner's data, with TRL's rules: prompt formats, columns, and every kind of source."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import pytest
from pydantic import ValidationError

from services.learner.data.feeder import PromptFeeder
from services.scorer.scoring import reward_batch
from shared.config.data import DataSettings
from shared.config.pipeline import PipelineConfig
from shared.dataset.rows import DataError, build_prompt, load_rows, plain_value
from shared.dataset.sources import read_eval_source, read_source
from shared.records import ChatMessage, Completion, SamplingSpec
from tests.support.factories import make_rollout
from tests.support.trl_doc_rewards import format_reward_func, reward_func, reward_len

ROOT = Path(__file__).resolve().parents[2]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _tasks(data: DataSettings, n: int = 1, group_size: int = 4):
    feeder = PromptFeeder(load_rows(data), data, SamplingSpec(max_tokens=32), group_size)
    return [feeder.next_task(0) for _ in range(n)]


def _rollout_with(task, texts: list[str]):
    completions = tuple(
        Completion(
            text=text,
            token_ids=np.arange(len(text), dtype=np.int32),
            behaviour_logprobs=np.zeros(len(text), dtype=np.float32),
            finish_reason="stop",
        )
        for text in texts
    )
    return make_rollout(task, completions=completions)


# Prompt formats ---------------------------------------------------------------------------------------


def test_a_string_prompt_is_plain_text_and_trls_reward_len_varies(tmp_path):
    source = _jsonl(tmp_path / "d.jsonl", [{"prompt": "The sky is", "solution": "blue"}])
    (task,) = _tasks(DataSettings(source=str(source)))
    assert task.prompt == "The sky is"  # no chat template, no str() of anything
    assert task.columns == {"solution": "blue"}
    batch = reward_batch(_rollout_with(task, [" blue.", " a shade of blue, mostly", "", " blue"]))
    assert batch.prompts == ["The sky is"] * 4 and batch.completions[1] == " a shade of blue, mostly"
    # TRL's documented reward_len, unchanged: it sees strings, so its rewards differ within the group.
    assert reward_len(**_kwargs(batch)) == [-14, -4, -20, -15]


def _kwargs(batch) -> dict:
    return dict(
        prompts=batch.prompts, completions=batch.completions, completion_ids=batch.completion_ids, **batch.columns
    )


def test_a_message_list_prompt_is_a_conversation_and_completions_are_messages(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Format?"}]
    source = _jsonl(tmp_path / "d.jsonl", [{"prompt": messages, "ground_truth": "4"}])
    (task,) = _tasks(DataSettings(source=str(source)))
    assert task.prompt == (ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Format?"))
    batch = reward_batch(_rollout_with(task, ["<think>a</think><answer>b</answer>", "nope", "x", "y"]))
    assert batch.prompts[0] == messages
    assert batch.completions[0] == [{"role": "assistant", "content": "<think>a</think><answer>b</answer>"}]
    assert format_reward_func(**_kwargs(batch)) == [1.0, 0.0, 0.0, 0.0]


def test_system_prompt_examples_and_prefill_make_a_string_prompt_a_conversation():
    shot = [ChatMessage(role="user", content="1+1?"), ChatMessage(role="assistant", content="2")]
    data = DataSettings(system_prompt="Answer.", examples=shot, assistant_prefill="<think>")
    assert build_prompt("2+3?", data) == (
        ChatMessage(role="system", content="Answer."),
        *shot,
        ChatMessage(role="user", content="2+3?"),
        ChatMessage(role="assistant", content="<think>"),
    )
    assert build_prompt("2+3?", DataSettings(assistant_prefill="<think>"))[0] == ChatMessage(
        role="user", content="2+3?"
    )
    # A conversation keeps its own system message; the examples follow it.
    own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "q"}]
    assert [m.content for m in build_prompt(own, data)] == ["Mine.", "1+1?", "2", "q", "<think>"]
    assert [m.content for m in build_prompt(own[1:], data)] == ["Answer.", "1+1?", "2", "q", "<think>"]


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "the prompt is empty"),
        (7, "the prompt is int"),
        ([], "the prompt is list"),
        ([{"role": "user"}], "must be a dict with 'role' and 'content'"),
        ([{"role": "robot", "content": "x"}], "a prompt message is invalid"),
        ([{"role": "user", "content": "x", "tool_calls": [1]}], "also has tool_calls"),
    ],
)
def test_a_prompt_that_is_neither_format_is_refused(prompt, message):
    with pytest.raises(DataError, match=message):
        build_prompt(prompt, DataSettings())


def test_a_bad_row_is_named_when_the_data_is_loaded(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "a"}]}, {"prompt": [{"role": "robot", "content": "b"}]}]
    with pytest.raises(DataError, match=r"d.jsonl, row 1: a prompt message is invalid"):
        load_rows(DataSettings(source=str(_jsonl(tmp_path / "d.jsonl", rows))))
    with pytest.raises(DataError, match=r"e.jsonl, row 1: the prompt is empty"):
        load_rows(DataSettings(source=str(_jsonl(tmp_path / "e.jsonl", [{"prompt": "q"}, {"prompt": ""}]))))


def test_message_keys_that_datasets_fills_with_none_are_ignored():
    assert build_prompt([{"role": "user", "content": "q", "name": None}], DataSettings()) == (
        ChatMessage(role="user", content="q"),
    )


def test_a_prefill_after_a_final_assistant_message_is_refused():
    with pytest.raises(DataError, match="ends with an assistant message"):
        build_prompt(
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            DataSettings(assistant_prefill="<"),
        )


# Columns ----------------------------------------------------------------------------------------------


def test_every_column_reaches_the_rewards_under_its_own_name_and_renames_only_when_asked(tmp_path):
    rows = [{"prompt": "p", "solution": "4", "level": 3, "tags": ["a", "b"], "completion": "ref"}]
    source = str(_jsonl(tmp_path / "d.jsonl", rows))
    (task,) = _tasks(DataSettings(source=source))
    # No answer column needed; TRL's completion column is not passed (as in TRL).
    assert task.columns == {"solution": "4", "level": 3, "tags": ["a", "b"]}
    (task,) = _tasks(DataSettings(source=source, answer_column="solution"))
    assert task.columns == {"answer": "4", "level": 3, "tags": ["a", "b"]}
    (task,) = _tasks(DataSettings(source=source, rename_columns={"solution": "ground_truth"}))
    assert task.columns == {"ground_truth": "4", "level": 3, "tags": ["a", "b"]}
    batch = reward_batch(_rollout_with(task, ["\\boxed{4}", "\\boxed{5}", "4", ""]))
    assert reward_func(**_kwargs(batch)) == [1.0, 0.0, 0.0, 0.0]  # TRL's documented reference reward


def test_missing_or_clashing_columns_are_named(tmp_path):
    source = str(_jsonl(tmp_path / "d.jsonl", [{"question": "q", "solution": "4", "answer": "x"}]))
    with pytest.raises(DataError, match="has no column result; its columns are question, solution, answer"):
        load_rows(DataSettings(source=source, answer_column="result"))
    with pytest.raises(DataError, match="has no column level"):
        load_rows(DataSettings(source=source, extra_columns=["level"]))
    with pytest.raises(DataError, match="'answer', which another column has"):
        load_rows(DataSettings(source=source, answer_column="solution"))
    with pytest.raises(DataError, match="has no column prompt or question"):
        load_rows(DataSettings(source=str(_jsonl(tmp_path / "e.jsonl", [{"text": "q"}]))))
    with pytest.raises(DataError, match="has no column text2"):
        load_rows(DataSettings(source=source, prompt_column="text2"))
    bad = str(_jsonl(tmp_path / "f.jsonl", [{"prompt": "q", "completions": "x"}]))
    with pytest.raises(DataError, match="completions has the name of a reward-function argument"):
        load_rows(DataSettings(source=bad))
    with pytest.raises(ValidationError, match="completion_ids is an argument of every reward function"):
        DataSettings(rename_columns={"x": "completion_ids"})


def test_column_values_become_what_json_and_msgpack_carry(tmp_path):
    frame = pd.DataFrame({"prompt": ["p", "q"], "when": pd.to_datetime(["2024-01-02", "2024-03-04"]), "x": [1.5, None]})
    frame.to_parquet(tmp_path / "d.parquet")
    rows = load_rows(DataSettings(source=str(tmp_path / "d.parquet")))
    assert rows[0].columns["when"].startswith("2024-01-02") and rows[1].columns["x"] is None
    json.dumps([r.columns for r in rows], allow_nan=False)


def test_builtin_arithmetic_and_the_demo_config_are_unchanged():
    demo = PipelineConfig.load(ROOT / "configs" / "demo-cpu.toml").learner.data
    (task,) = _tasks(demo)
    assert set(task.columns) == {"answer"}
    roles = [m.role for m in task.prompt]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert task.prompt[-1].content == "<think>" and task.prompt[-2].content.endswith("?")
    (bare,) = _tasks(DataSettings())  # the built-in task is conversational: its question is the user's turn
    assert [m.role for m in bare.prompt] == ["user"] and set(bare.columns) == {"answer"}


# Sources ----------------------------------------------------------------------------------------------

ROWS = [{"prompt": f"q{i}", "solution": str(i)} for i in range(3)]


def _prompts(source) -> list[str]:
    return sorted(row.prompt for row in load_rows(DataSettings(source=source)))


def test_json_parquet_and_csv_files_and_lists_of_them(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(ROWS))
    pd.DataFrame(ROWS).to_parquet(tmp_path / "b.parquet")
    pd.DataFrame(ROWS).to_csv(tmp_path / "c.csv", index=False)
    _jsonl(tmp_path / "d.jsonl", ROWS)
    for name in ("a.json", "b.parquet", "c.csv", "d.jsonl"):
        assert _prompts(str(tmp_path / name)) == ["q0", "q1", "q2"], name
    assert load_rows(DataSettings(source=str(tmp_path / "c.csv")))[0].columns == {"solution": 0}  # as datasets reads it
    parts = tmp_path / "parts"
    parts.mkdir()
    pd.DataFrame(ROWS[:1]).to_parquet(parts / "train-0.parquet")
    pd.DataFrame(ROWS[1:]).to_parquet(parts / "train-1.parquet")
    pd.DataFrame(ROWS).to_parquet(parts / "test-0.parquet")
    assert _prompts(str(parts)) == ["q0", "q1", "q2"]  # the train files only
    assert _prompts([str(parts / "train-0.parquet"), str(parts / "test-0.parquet")]) == ["q0", "q0", "q1", "q2"]
    with pytest.raises(DataError, match="mixes json and parquet files"):
        load_rows(DataSettings(source=[str(tmp_path / "a.json"), str(tmp_path / "b.parquet")]))
    with pytest.raises(DataError, match="does not exist"):
        load_rows(DataSettings(source=str(tmp_path / "missing.jsonl")))


def test_a_directory_written_by_save_to_disk(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    assert _prompts(str(tmp_path / "one")) == ["q0", "q1", "q2"]
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:2]), "test": datasets.Dataset.from_list(ROWS[2:])}
    )
    splits.save_to_disk(str(tmp_path / "dict"))
    assert _prompts(str(tmp_path / "dict")) == ["q0", "q1"]
    assert [r.prompt for r in load_rows(DataSettings(source=str(tmp_path / "dict"), train_split="test"))] == ["q2"]
    old_name = DataSettings(source=str(tmp_path / "dict"), split="test")  # split: train_split's former name
    assert [r.prompt for r in load_rows(old_name)] == ["q2"]
    with pytest.raises(DataError, match=r"holds the splits train, test, not 'dev'; set data\.train_split"):
        load_rows(DataSettings(source=str(tmp_path / "dict"), train_split="dev"))


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty Hugging Face datasets cache, with the Hub out of reach (HF_DATASETS_OFFLINE=1)."""
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return cache


def _cache_as(cache: Path, name: str, rows: list[dict], tmp_path: Path) -> None:
    """Put ``rows`` into ``cache`` where ``load_dataset(name)`` finds them offline (as a download leaves them)."""
    source = _jsonl(tmp_path / "to-cache.jsonl", rows)
    built = datasets.load_dataset("json", data_files={"train": str(source)}, cache_dir=str(tmp_path / "build"))
    target = cache / name.replace("/", "___") / "default" / "0.0.0" / "0123abcd"
    target.mkdir(parents=True)
    short = name.split("/")[-1]
    for file in Path(built["train"].cache_files[0]["filename"]).parent.iterdir():
        if file.suffix in (".arrow", ".json"):
            (target / file.name.replace("json-", f"{short}-")).write_bytes(file.read_bytes())
    info = json.loads((target / "dataset_info.json").read_text())
    (target / "dataset_info.json").write_text(json.dumps({**info, "config_name": "default", "dataset_name": short}))


def test_a_datasets_name_in_the_local_cache(offline_cache, tmp_path):
    _cache_as(offline_cache, "someone/tiny-math", ROWS, tmp_path)
    rows = load_rows(DataSettings(source="someone/tiny-math"))
    assert sorted(r.prompt for r in rows) == ["q0", "q1", "q2"] and rows[0].columns.keys() == {"solution"}


def test_a_datasets_name_is_split_and_sliced_like_any_source(offline_cache, tmp_path):
    _cache_as(offline_cache, "someone/tiny-math", ROWS, tmp_path)
    data = DataSettings(source="someone/tiny-math", train_split="train[:2]", eval_split="train[2:]")
    training, held = read_source(data), read_eval_source(data)
    assert (len(training), len(held)) == (2, 1)
    assert sorted(row["prompt"] for row in training + held) == ["q0", "q1", "q2"]
    with pytest.raises(DataError, match=r"split='test'\) failed"):  # the split's name reaches datasets
        read_eval_source(data.model_copy(update={"eval_split": "test"}))


def test_a_datasets_name_not_in_the_cache_says_how_to_fix_it(offline_cache):
    with pytest.raises(DataError) as error:
        load_rows(DataSettings(source="someone/not-cached"))
    message = str(error.value)
    assert "'someone/not-cached' is not a local file or directory" in message
    assert (
        "HF_DATASETS_OFFLINE=1" in message
        and str(offline_cache) in message
        and "set data.source to that path" in message
    )


def test_verls_parquet_layout(tmp_path):
    """verl's preprocessed GSM8K layout: the prompt as messages, the reference in reward_model.ground_truth."""
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} + 1? Put the answer after ####."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(2)
    ]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    (task,) = _tasks(DataSettings(source=str(tmp_path / "train.parquet"), shuffle_seed=3))
    assert isinstance(task.prompt, tuple) and task.prompt[0].role == "user"
    index = task.columns["extra_info"]["index"]
    assert task.columns["ground_truth"] == str(index + 1)  # reward_model.ground_truth, passed as ground_truth
    assert task.columns["reward_model"] == {"style": "rule", "ground_truth": str(index + 1)}
    assert task.columns["data_source"] == "openai/gsm8k" and task.columns["ability"] == "math"
    # Or by name: a dotted rename reaches into the nested column.
    (task,) = _tasks(DataSettings(source=str(tmp_path / "train.parquet"), answer_column="reward_model.ground_truth"))
    assert task.columns["answer"] == task.columns["ground_truth"]


def test_plain_values_nan_becomes_none_and_bytes_are_refused():
    assert plain_value({"a": (1, float("nan"))}, "c") == {"a": [1, None]}
    with pytest.raises(DataError, match="column 'c' holds a bytes"):
        plain_value(b"x", "c")
