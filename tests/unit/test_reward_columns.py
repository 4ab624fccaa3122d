"""shared/reward_columns.py: the columns a reward function needs, the keywords it cannot take, and the
messages for both."""

from __future__ import annotations

from shared.reward_columns import (
    missing_columns,
    missing_columns_message,
    passed_keywords,
    required_columns,
    takes_every_keyword,
    unaccepted_keywords,
    unaccepted_keywords_message,
)


def accuracy(prompts, completions, completion_ids, solution, trainer_state, max_completion_length, **kwargs):
    return [0.0] * len(completions)


def with_defaults(completions, answer=None, *args, scale=1.0, level, **kwargs):
    return [0.0] * len(completions)


def test_required_columns_are_the_parameters_without_a_default_the_scorer_does_not_pass():
    assert required_columns(accuracy) == ["solution"]
    assert required_columns(with_defaults) == ["level"]
    assert required_columns(len) == []  # no Python signature: nothing to check
    assert missing_columns(accuracy, ["answer", "prompt"]) == ["solution"]
    assert missing_columns(accuracy, ["solution"]) == []


def test_the_message_names_the_reward_the_columns_and_both_fixes():
    message = missing_columns_message("accuracy", ["solution"], ["question", "answer"])
    assert "reward 'accuracy' needs the column 'solution'" in message
    assert "their columns: answer, question" in message
    assert "data.rename_columns = { <column> = 'solution' }" in message
    assert "solution=None" in message
    many = missing_columns_message("r", ["a", "b"], [])
    assert "columns 'a', 'b'" in many and "(none besides the prompt)" in many


def acc(prompts, completions, answer, /, *, level=1):
    return [0.0] * len(completions)


class Scorer:
    def __call__(self, prompts, completions, answer):
        return [0.0] * len(completions)


def test_passed_keywords_are_trls_arguments_the_columns_and_the_scorers_own():
    assert passed_keywords(["answer", "id"], multi_turn=False) == [
        "prompts", "completions", "completion_ids", "answer", "id", "max_completion_length"
    ]  # fmt: skip
    assert passed_keywords(["max_completion_length"], multi_turn=True) == [
        "prompts", "completions", "completion_ids", "max_completion_length", "env_reward"
    ]  # fmt: skip


def test_unaccepted_keywords_are_those_no_parameter_takes_by_keyword_and_none_with_kwargs():
    keywords = passed_keywords(["answer", "level", "id"], multi_turn=False)
    positional_only = ["prompts", "completions", "completion_ids", "answer", "id", "max_completion_length"]
    assert unaccepted_keywords(acc, keywords) == positional_only
    assert unaccepted_keywords(Scorer(), keywords) == ["completion_ids", "level", "id", "max_completion_length"]
    assert unaccepted_keywords(accuracy, [*keywords, "anything"]) == []  # **kwargs takes every keyword
    assert unaccepted_keywords(max, keywords) == []  # no Python signature: nothing to check
    assert takes_every_keyword(accuracy) and takes_every_keyword(max) and not takes_every_keyword(acc)


def test_the_unaccepted_message_names_the_function_the_keywords_and_the_fix_on_its_own_signature():
    assert unaccepted_keywords_message("r", Scorer(), ["id"]) == (
        "reward 'r': its function Scorer takes no keyword argument 'id', which the scorer passes it (as TRL does: "
        "prompts, completions, completion_ids, max_completion_length, every column of the dataset's rows, and "
        "env_reward with an environment), so every call would fail. Fix: add **kwargs to its parameters, as TRL's "
        "reward functions have: def Scorer(prompts, completions, answer, **kwargs)"
    )
    message = unaccepted_keywords_message("r", acc, ["id", "max_completion_length"])
    assert "no keyword arguments 'id', 'max_completion_length'," in message
    assert message.endswith("def acc(prompts, completions, answer, /, *, level=1, **kwargs)")
    assert unaccepted_keywords_message("r", max, ["id"]).endswith("def max(prompts, completions, **kwargs)")
