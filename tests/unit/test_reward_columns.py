"""services/scorer/rewards/columns.py: the columns a reward function needs, and the message when one is missing."""

from __future__ import annotations

from services.scorer.rewards.columns import missing_columns, missing_columns_message, required_columns


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
