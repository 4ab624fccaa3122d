"""Evaluation on held-out prompts: which rows, how they are sampled, how a round's figures are computed, and
how the scorer scores a held-out group (rewards, no advantages)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from pydantic import ValidationError

from services.learner.data.feeder import load_rows
from services.learner.evaluation import EvalRound, eval_metrics, eval_sampling, load_eval_rows
from services.learner.startup import sampling_spec
from services.scorer.scoring import evaluated_group
from shared.config.learner import LearnerSettings
from shared.dataset.sources import DataError
from shared.records import ChatMessage, Completion, PromptTask, Rollout, RolloutTimings, SamplingSpec, ScoredGroup


def _settings(**fields) -> LearnerSettings:
    return LearnerSettings(model="m", api_token="t", **fields)


def test_held_out_rows_are_new_problems_of_the_training_task():
    data = {"source": "builtin:sums", "builtin_max_operand": 20, "builtin_size": 200, "system_prompt": "Answer."}
    settings = _settings(data=data, eval_data="held_out", eval_samples=100)
    held_out = load_eval_rows(settings)
    training = load_rows(settings.data)
    assert len(held_out) == 100
    questions = {row.prompt[-1].content for row in held_out}
    assert len(questions) == 100  # distinct
    assert not questions & {row.prompt[-1].content for row in training}
    # The [data] table's prompt rules apply: the system prompt comes first, the answer column is there.
    assert held_out[0].prompt[0] == ChatMessage(role="system", content="Answer.")
    first = held_out[0].prompt[-1].content.removeprefix("What is ").rstrip("?")
    if "+" in first:
        a, b = first.split(" + ")
        assert held_out[0].columns["answer"] == str(int(a) + int(b))
    assert load_eval_rows(settings) == held_out  # the same rows every round and every run


def test_eval_data_is_read_like_the_training_data_and_cut_to_eval_samples(tmp_path):
    rows = [{"prompt": f"q{i}", "solution": str(i)} for i in range(30)]
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    settings = _settings(data={"source": "builtin:sums", "answer_column": "solution"}, eval_data=str(path))
    with pytest.raises(DataError, match="no column solution"):
        load_eval_rows(settings.model_copy(update={"eval_data": str(_jsonl(tmp_path, [{"prompt": "q"}]))}))
    held_out = load_eval_rows(settings.model_copy(update={"eval_samples": 7}))
    assert [row.prompt for row in held_out] == [f"q{i}" for i in range(7)]  # in file order, not shuffled
    assert held_out[3].columns == {"answer": "3"}
    # The training file itself is no held-out data (tests/unit/test_data_splits.py has the cases).
    training = _settings(data={"source": str(path), "answer_column": "solution"}, eval_data=str(path))
    with pytest.raises(DataError, match=r"selects 30 rows that data\.train_split = 'train' also selects"):
        load_eval_rows(training)


def _jsonl(tmp_path, rows):
    path = tmp_path / "other.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_held_out_needs_a_built_in_training_task(tmp_path):
    with pytest.raises(ValidationError, match="eval_data = 'held_out' draws new problems of a built-in task"):
        _settings(data={"source": str(tmp_path / "train.jsonl")}, eval_data="held_out")


def test_evaluation_samples_greedily_by_default_with_the_training_length():
    settings = _settings(top_p=0.9, top_k=50, max_completion_length=64, repetition_penalty=1.1)
    training = sampling_spec(settings)
    assert eval_sampling(training, settings.eval_temperature) == SamplingSpec(
        temperature=0.0, max_tokens=64, repetition_penalty=1.1
    )
    sampled = eval_sampling(training, 0.7)
    assert (sampled.temperature, sampled.top_p, sampled.top_k) == (0.7, 0.9, 50)


def test_training_samples_to_min_completion_length_and_evaluation_ends_where_the_model_does():
    settings = _settings(max_completion_length=64, min_completion_length=64)
    training = sampling_spec(settings)
    assert (training.min_tokens, training.max_tokens) == (64, 64)
    assert eval_sampling(training, 0.0).min_tokens == eval_sampling(training, 0.7).min_tokens == 0
    with pytest.raises(ValidationError, match=r"min_completion_length \(65\) exceeds max_completion_length \(64\)"):
        _settings(max_completion_length=64, min_completion_length=65)
    with pytest.raises(ValidationError, match="masks every completion"):
        _settings(max_completion_length=64, min_completion_length=64, mask_truncated_completions=True)
    assert _settings(max_completion_length=64, min_completion_length=63, mask_truncated_completions=True)


def _group(step: int, rewards_per_func: list[list[float]], weights=(1.0, 0.5), lengths=None, version=3, finished=3):
    per_func = np.array(rewards_per_func, dtype=np.float32)
    size = per_func.shape[0]
    lengths = lengths or [4] * size
    task = PromptTask(prompt="q", group_size=size, policy_version=version, eval_step=step)
    completions = tuple(
        Completion(
            text="x",
            token_ids=np.arange(n, dtype=np.int32),
            behaviour_logprobs=np.zeros(n, dtype=np.float32),
            finish_reason="length" if n >= 8 else "stop",
        )
        for n in lengths
    )
    rollout = Rollout(
        group_id=task.task_id,
        task=task,
        prompt_token_ids=np.arange(3, dtype=np.int32),
        completions=completions,
        policy_version=version,
        finished_policy_version=finished,
        generator_id="g",
        timings=RolloutTimings(received_at=0, started_at=0, finished_at=0),
    )
    return evaluated_group(rollout, ("correct", "format"), weights, per_func)


def test_the_scorer_scores_a_held_out_group_without_advantages():
    group = _group(5, [[1.0, 1.0]])
    assert isinstance(group, ScoredGroup)
    assert group.rewards.tolist() == [1.5]
    assert group.advantages.tolist() == [0.0]  # a group of one has no group-relative advantage
    assert not group.dropped
    assert group.metrics["rewards/correct/mean"] == 1.0


def test_eval_metrics_of_a_round():
    groups = [
        _group(4, [[1.0, 1.0]], lengths=[4], version=4, finished=4),
        _group(4, [[0.0, 1.0]], lengths=[8], version=4, finished=5),
        _group(4, [[0.0, float("nan")]], lengths=[6], version=4, finished=4),
    ]
    metrics = eval_metrics(groups, wanted=4, seconds=2.5)
    # combined rewards: 1 + 0.5, 0 + 0.5, and 0 (a NaN reward is left out of the weighted sum, as in training)
    assert metrics["eval/reward"] == pytest.approx((1.5 + 0.5 + 0.0) / 3)
    assert metrics["eval/reward_std"] == pytest.approx(float(np.std([1.5, 0.5, 0.0], ddof=1)))
    assert metrics["eval/rewards/correct/mean"] == pytest.approx(1 / 3)
    assert metrics["eval/rewards/format/mean"] == 1.0  # NaN left out
    assert metrics["eval/completions/mean_length"] == 6.0
    assert metrics["eval/completions/clipped_ratio"] == pytest.approx(1 / 3)
    assert (metrics["eval/prompts"], metrics["eval/missing"], metrics["eval/seconds"]) == (3.0, 1.0, 2.5)
    assert (metrics["eval/policy_version/min"], metrics["eval/policy_version/max"]) == (4.0, 5.0)
    assert "eval/rewards/correct/std" not in metrics


def test_eval_metrics_of_a_round_that_got_nothing_back():
    assert eval_metrics([], wanted=3, seconds=9.0) == {"eval/prompts": 0.0, "eval/missing": 3.0, "eval/seconds": 9.0}


def test_a_round_keeps_its_own_groups_once():
    mine, other = _group(2, [[1.0, 0.0]]), _group(2, [[1.0, 0.0]])
    round_ = EvalRound(step=2, pending={mine.group_id}, wanted=1)
    assert not round_.receive(other)
    assert round_.receive(mine)
    assert not round_.receive(mine)  # a redelivery
    assert round_.groups == [mine] and not round_.pending
    assert not math.isnan(eval_metrics(round_.groups, 1, 0.0)["eval/reward"])


def test_eval_metrics_of_trajectories_record_the_held_out_tool_use():
    from tests.support.factories import make_scored, make_trajectory_rollout

    metrics = eval_metrics([make_scored(make_trajectory_rollout(group_size=2))], wanted=1, seconds=1.0)
    assert metrics["eval/tools/call_frequency"] == 1.0 and metrics["eval/tools/num_turns/mean"] == 2.0
    assert "eval/trajectories/cut_frequency" not in metrics
