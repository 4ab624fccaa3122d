"""What ``config from-trl`` says about a recipe reads as it behaves (issue 64, item 4): the staleness follows the
documented formula, a difference whose two values read alike says what it changes, a local file is never called
a Hub name, and a test split a one-file source cannot have is refused by the start-up check's split check."""

from __future__ import annotations

import pytest

from services.launcher.interop.translation import summary
from services.launcher.interop.trl import from_trl
from shared.config.data import DataSettings
from shared.dataset.sources import split_problems
from tests.unit.test_translation import trl_defaults

BASE = {"model_name_or_path": "some/model", "per_device_train_batch_size": 8, "num_generations": 8, "max_steps": 20}


def _differences(result) -> dict[str, str]:
    return {difference.name: difference.short() for difference in result.differences}


@pytest.mark.parametrize(
    "steps_per_generation, accumulation, staleness",
    [(4, 4, 0), (8, 4, 1), (12, 4, 2), (2, 1, 1)],
)
def test_staleness_is_the_documented_formula(steps_per_generation, accumulation, staleness):
    """max_staleness = steps_per_generation / gradient_accumulation_steps - 1, written and not a difference."""
    fields = dict(BASE, steps_per_generation=steps_per_generation, gradient_accumulation_steps=accumulation)
    result = from_trl(fields, trl_defaults())
    assert result.tables["learner"]["max_staleness"] == staleness
    assert "max_staleness" not in _differences(result)


def test_without_generation_blocks_trl_is_on_policy_and_ours_is_listed():
    result = from_trl(dict(BASE), trl_defaults())
    assert result.tables["learner"]["max_staleness"] == 1
    assert _differences(result)["max_staleness"] == "max_staleness (TRL 0, here 1)"


def test_a_difference_whose_values_read_alike_says_what_differs():
    result = from_trl(dict(BASE, max_prompt_length=512), trl_defaults())
    short = _differences(result)["max_prompt_length"]
    assert "cut from the left" in short and "skipped" in short, short
    assert "cut from the left" in summary(result, "TRL", None)
    [line] = [d.line() for d in result.differences if d.name == "max_prompt_length"]
    assert "never trained on here" in line


@pytest.mark.parametrize("name", ["conversational.jsonl", "data/train.parquet", "./rows"])
def test_a_local_file_is_not_called_a_hub_name(name):
    notes = " ".join(from_trl(dict(BASE, dataset_name=name), trl_defaults()).notes)
    assert f"data.source {name!r}: a local file or directory" in notes
    assert "Hugging Face cache" not in notes


def test_a_hub_name_is_still_one():
    notes = " ".join(from_trl(dict(BASE, dataset_name="openai/gsm8k"), trl_defaults()).notes)
    assert "local Hugging Face cache" in notes


def test_a_test_split_of_one_file_is_refused_at_start(tmp_path):
    source = tmp_path / "conversational.jsonl"
    source.write_text('{"prompt": "q", "solution": "1"}\n')
    fields = dict(BASE, dataset_name=str(source), dataset_test_split="test", eval_strategy="steps", eval_steps=5)
    data = DataSettings(**from_trl(fields, trl_defaults()).tables["data"])
    assert data.eval_split == "test"
    [problem] = split_problems(data)
    assert "one split, 'train'" in problem
