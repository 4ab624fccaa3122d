"""TRL 1.16's built-in rewards run without TRL (issue 64, item 3): ``shared.trl_rewards`` has TRL's names and
signatures and gives TRL's results on the cases of TRL's own tests (``tests/test_rewards.py``) and docstrings;
``config from-trl`` points a recipe's ``accuracy_reward`` & co. at it, and the scorer loads it."""

from __future__ import annotations

import importlib.util
import inspect
import threading

import pytest

from services.launcher.interop.trl import from_trl
from shared import trl_rewards
from shared.trl_rewards import (
    accuracy_reward,
    get_cosine_scaled_reward,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    reasoning_accuracy_reward,
    think_format_reward,
)
from tests.unit.test_translation import trl_defaults


def _c(*texts: str) -> list[list[dict[str, str]]]:
    return [[{"role": "assistant", "content": text}] for text in texts]


def test_trl_is_not_needed():
    assert importlib.util.find_spec("trl") is None  # the project's environment has no TRL: these run without it


def test_think_format_reward_on_trls_cases():
    valid = _c(
        "<think>This is my reasoning.</think>This is my answer.",
        "<think>\nThis is my reasoning.\n</think>\nThis is my answer.",
        "<think>\nThis is\nmy reasoning.\n</think>\nThis is my answer.",
        "<think>\nThis is <some tag> my reasoning.</think>\nThis is my answer.",
        "<think></think>\nThis is my answer.",
    )
    invalid = _c(
        "<think>\nThis is my reasoning.\nThis is my answer.",
        "<think>This is my reasoning.\nThis is my answer.",
        "This is my reasoning. This is my answer.",
        "This is my reasoning.\nThis is my answer.",
        "This is my reasoning.</think>\nThis is my answer.",
        "This is my reasoning.</think>This is my answer.",
        "This<think>is my reasoning.</think>\nThis is my answer.",
        "<think>This is<think>my reasoning.</think></think>This is my answer.",
        "<think>This is</think>\nmy\n<think>reasoning.</think>\nThis is my answer.",
    )
    assert think_format_reward(valid) == [1.0] * 5
    assert think_format_reward(invalid) == [0.0] * 9


def test_accuracy_reward_on_trls_cases():
    assert accuracy_reward(_c(r"\boxed{\frac{63}{400}}", r"\boxed{\frac{63}{400}}"), [r"\frac{63}{400}", "63/400"]) == [
        1.0,
        1.0,
    ]
    assert accuracy_reward(_c(r"\boxed{\frac{64}{400}}"), [r"\frac{63}{400}"]) == [0.0]
    assert accuracy_reward(_c(r"\boxed{3}"), ["6"]) == [0.0]
    unparsable = accuracy_reward(
        _c("Answer is forty two.", r"Some other content. \boxed{43}."),
        ["Answer is forty two.", "Answer is forty three."],
    )
    assert unparsable == [None, None]
    docstring = accuracy_reward(
        _c(r"My answer is \boxed{\frac{1}{3}}", r"My answer is \boxed{\frac{1}{2}}"), [r"\frac{1}{3}"] * 2
    )
    assert docstring == [1.0, 0.0]


def test_accuracy_reward_off_the_main_thread():
    """The scorer may call a reward from a worker thread, where math_verify's signal-based timeouts cannot run."""
    results: list = []
    thread = threading.Thread(
        target=lambda: results.extend(accuracy_reward(_c(r"\boxed{\frac{1}{3}}"), [r"\frac{1}{3}"]))
    )
    thread.start()
    thread.join()
    assert results == [1.0]


def test_reasoning_accuracy_reward_on_trls_cases():
    correct = _c(
        r"<think> Reasoning content </think> \boxed{\frac{63}{400}}",
        r"Reasoning content </think> \boxed{\frac{63}{400}}",
    )
    assert reasoning_accuracy_reward(correct, [r"\frac{63}{400}"] * 2) == [1.0, 1.0]
    custom = _c(r"<REASONING_START> Reasoning content </REASONING_END> \boxed{\frac{63}{400}}")
    assert reasoning_accuracy_reward(custom, [r"\frac{63}{400}"], reasoning_delimiters=["</REASONING_END>"]) == [1.0]
    assert reasoning_accuracy_reward(
        _c(r"<think> Reasoning content </think> \boxed{\frac{64}{400}}"), [r"\frac{63}{400}"]
    ) == [0.0]
    in_reasoning = _c(
        r"<think> My answer is \boxed{42} </think> Some other text.",
        r"<think> The answer is \boxed{42} </think> Here's a wrong answer: \boxed{43}.",
    )
    assert reasoning_accuracy_reward(in_reasoning, [r"\boxed{42}"] * 2) == [0.0, 0.0]
    incomplete = _c(
        r"<think> Incomplete reasoning without closing tag",
        r"Correct answer \frac{63}{400} but completely missing reasoning content",
    )
    assert reasoning_accuracy_reward(incomplete, [r"\frac{63}{400}"] * 2) == [0.0, 0.0]
    assert reasoning_accuracy_reward(_c(r"<think> Reasoning content </think> \boxed{42}"), ["forty two"]) == [None]


def test_soft_overlong_punishment_on_trls_cases():
    reward = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    assert reward(completion_ids=[[1] * 50]) == [0]
    assert reward([[1] * 110]) == [-1]
    assert reward([[1] * 90]) == [pytest.approx(-0.5)]


def test_cosine_scaled_reward_on_trls_cases():
    reward = get_cosine_scaled_reward(max_len=100)
    third, half = [r"\frac{1}{3}"] * 2, _c(r"\boxed{\frac{1}{2}}", r"\boxed{\frac{1}{2}}")
    right = _c(r"\boxed{\frac{1}{3}}", r"\boxed{\frac{1}{3}}")
    assert reward(right, third, [[1] * 25, [1] * 75]) == [
        pytest.approx(0.92678, abs=1e-4),
        pytest.approx(0.57322, abs=1e-4),
    ]
    assert reward(half, third, [[1] * 25, [1] * 75]) == [
        pytest.approx(-0.92678, abs=1e-4),
        pytest.approx(-0.57322, abs=1e-4),
    ]
    assert reward(_c(r"\boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}"), third, [[1] * 50] * 2) == [0.75, -0.75]
    assert reward(right, third, [[], [1] * 100]) == [pytest.approx(1.0), pytest.approx(0.5)]
    assert reward(half, third, [[], [1] * 100]) == [pytest.approx(-1.0), pytest.approx(-0.5)]
    assert reward(_c(r"\boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}"), third, [[1] * 200] * 2) == [0.5, -0.5]
    assert reward(_c(r"\boxed{42}"), ["forty two"], [[1] * 50]) == [None]
    bounds = get_cosine_scaled_reward(max_len=100, min_value_correct=0.0, max_value_correct=2.0)
    assert bounds(_c(r"\boxed{\frac{1}{3}}"), [r"\frac{1}{3}"], [[1] * 50]) == [pytest.approx(1.0)]


def test_repetition_penalty_on_trls_docstring_case():
    assert get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)([[1, 2, 3, 4], [5, 5, 5, 5, 5]]) == [
        0.0,
        -0.75,
    ]
    with pytest.raises(ValueError, match="should not be positive"):
        get_repetition_penalty_reward(max_penalty=0.5)


@pytest.mark.parametrize("name", ["accuracy_reward", "reasoning_accuracy_reward", "think_format_reward"])
def test_signatures_are_trls(name):
    """TRL 1.16's parameters, in TRL's order (its scorer-facing keywords; **kwargs takes the rest)."""
    expected = {
        "accuracy_reward": ["completions", "solution", "log_extra", "kwargs"],
        "reasoning_accuracy_reward": ["completions", "solution", "reasoning_delimiters", "log_extra", "kwargs"],
        "think_format_reward": ["completions", "kwargs"],
    }[name]
    assert list(inspect.signature(getattr(trl_rewards, name)).parameters) == expected


@pytest.mark.parametrize("name", ["accuracy_reward", "trl.rewards.think_format_reward"])
def test_from_trl_names_ours(name):
    fields = {"model_name_or_path": "m", "reward_funcs": [name]}
    [entry] = from_trl(fields, trl_defaults()).tables["scorer"]["rewards"]
    short = name.rpartition(".")[2]
    assert entry["function"] == f"shared.trl_rewards:{short}" and entry["name"] == short


async def test_the_scorer_loads_and_runs_them_as_a_translated_recipe_names_them():
    """What ``config from-trl`` writes, loaded by the scorer's loader and called its way (TRL's keywords, the
    row's columns, in a worker thread)."""
    from services.scorer.rewards.functions import RewardBatch, score_batch
    from services.scorer.rewards.trl_convention import trl_style
    from shared.reward_protocol import load_reward_function

    fields = {"model_name_or_path": "m", "reward_funcs": ["accuracy_reward", "think_format_reward"]}
    specs = from_trl(fields, trl_defaults()).tables["scorer"]["rewards"]
    functions = [trl_style(s["name"], load_reward_function(s["function"]), in_thread=True) for s in specs]
    batch = RewardBatch(
        prompts=[[{"role": "user", "content": "1/3?"}]] * 2,
        completions=_c(r"<think>so</think>\boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}"),
        completion_ids=[[1, 2], [3]],
        columns={"solution": [r"\frac{1}{3}"] * 2},
    )
    assert (await score_batch(functions, batch)).tolist() == [[1.0, 1.0], [0.0, 0.0]]
