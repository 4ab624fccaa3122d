"""Reward calls as under TRL: where a failure is located, missing columns as bad records, ``trainer_state``,
batched rewards over several groups, and NaN figures for a function that never judges."""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import traceback
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

import services.scorer.rewards.functions as functions_module
from services.scorer.rewards.batching import RewardBatcher, merge_batches, split_result
from services.scorer.rewards.functions import (
    RewardBatch,
    RewardBugError,
    RewardFailure,
    RewardInputError,
    TrainerState,
    failure_detail,
    run_function,
    user_frame,
)
from services.scorer.rewards.trl_convention import call_problem, takes_trainer_state, trl_style
from services.scorer.scoring import build_functions, reward_batch, scored_group
from services.scorer.scoring_loop import ScoringLoop
from shared.advantages import reward_function_metrics
from shared.config.learner import LearnerSettings
from shared.config.scorer import RewardSpec, ScorerSettings
from shared.records import AdvantageSpec
from shared.reward_columns import missing_columns_message, unaccepted_keywords_message
from shared.reward_protocol import load_reward_function
from tests.support.factories import make_rollout, make_task

ROOT = Path(functions_module.__file__).resolve().parents[3]

# A user's reward module: the failure is raised two helpers down, the second time inside the standard library.
USER_MODULE = """\
import json


def _parse(text):
    return json.loads(text)


def _score(completion):
    if completion == "boom":
        raise ValueError("cannot score " + completion)
    return float(_parse(completion))


def accuracy(prompts, completions, **kwargs):
    return [_score(c) for c in completions]
"""


def _user_reward(tmp_path, monkeypatch, module: str):
    (tmp_path / f"{module}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return load_reward_function(f"{module}:accuracy")


def _batch(completions: list, group_id: str = "g", **columns) -> RewardBatch:
    size = len(completions)
    return RewardBatch(["p"] * size, completions, [[1]] * size, {k: [v] * size for k, v in columns.items()}, group_id)


# 1. A failure names the user's file and line.


@pytest.mark.parametrize("in_thread", [True, False])
async def test_a_failure_names_the_deepest_line_of_the_users_file_through_the_thread_pool(
    tmp_path, monkeypatch, in_thread
):
    function = trl_style("acc", _user_reward(tmp_path, monkeypatch, f"frames_{in_thread}"), in_thread=in_thread)
    raised = await run_function(function, _batch(["1", "boom"]))
    assert isinstance(raised, RewardFailure) and raised.bug
    assert raised.detail == f"ValueError: cannot score boom (at frames_{in_thread}.py:10 in _score)"
    decoded = await run_function(function, _batch(["1", "x"]))  # raised in json/decoder.py, called at line 5
    assert decoded.detail == (
        "json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0) "
        f"(at frames_{in_thread}.py:5 in _parse)"
    )


def test_user_frame_prefers_the_functions_file_then_the_first_frame_outside_the_project_and_stdlib():
    stdlib = json.decoder.__file__
    frames = [
        traceback.FrameSummary(str(ROOT / "services/scorer/rewards/functions.py"), 10, "call", lookup_line=False),
        traceback.FrameSummary(str(ROOT / "shared/threads.py"), 20, "work", lookup_line=False),
        traceback.FrameSummary("/opt/user/outer.py", 3, "reward", lookup_line=False),
        traceback.FrameSummary("/opt/user/inner.py", 7, "helper", lookup_line=False),
        traceback.FrameSummary(stdlib, 355, "raw_decode", lookup_line=False),
    ]
    assert user_frame(frames, "/opt/user/inner.py") is frames[3]
    assert user_frame(frames, "/opt/user/elsewhere.py") is frames[2]
    assert user_frame(frames, None) is frames[2]
    assert user_frame([frames[0], frames[1], frames[4]], None) is frames[4]  # no user code: the innermost
    assert user_frame([], None) is None


def test_failure_detail_of_an_exception_without_a_traceback_is_its_message():
    assert failure_detail(ValueError("bad row")) == "ValueError: bad row"


# 2. A missing column is a data error.


def needs_solution(prompts, completions, solution, **kwargs):
    needs_solution.calls += 1
    return [1.0] * len(completions)


needs_solution.calls = 0


async def test_a_missing_column_is_a_bad_input_checked_before_the_call():
    function = trl_style("acc", needs_solution, in_thread=True)
    failure = await run_function(function, _batch(["a", "b"], answer="5"))
    assert isinstance(failure, RewardFailure) and failure.bad_input and not failure.bug
    assert failure.detail == missing_columns_message("acc", ["solution"], ["answer"])
    assert "required = false" not in failure.detail
    assert needs_solution.calls == 0
    assert function.stats.bad_inputs == 1 and function.stats.bugs == 0 and function.stats.errors == 0
    assert function.breaker.failures == 0
    assert await run_function(function, _batch(["a"], solution="5")) == [1.0]


async def test_the_scoring_loop_refuses_a_group_missing_a_column_as_a_bad_record():
    loop = ScoringLoop(
        None, None, [trl_style("acc", needs_solution, in_thread=False)], [1.0], AdvantageSpec(),
        drop_zero_std=False, max_in_flight=1,
    )  # fmt: skip
    with pytest.raises(RewardInputError, match=r"reward acc on group .*needs the column 'solution'"):
        await loop.score_rewards(make_rollout(make_task(group_size=2)))


def strict(prompts, completions, completion_ids):
    return [1.0] * len(completions)


def strict_with_answer(prompts, completions, completion_ids, answer):
    strict_with_answer.calls += 1
    return [1.0] * len(completions)


strict_with_answer.calls = 0


@pytest.mark.parametrize("in_thread", [True, False])
async def test_a_column_the_function_takes_no_keyword_for_is_a_bug_in_its_signature(in_thread):
    function = trl_style("strict", strict, in_thread=in_thread)
    failure = await run_function(function, _batch(["a"], answer="5", id=3))
    assert failure.bug and not failure.bad_input
    assert failure.detail == unaccepted_keywords_message("strict", strict, ["answer", "id"])
    assert failure.detail.endswith("def strict(prompts, completions, completion_ids, **kwargs)")
    assert function.stats.bugs == 1 and function.stats.bad_inputs == 0


async def test_a_keyword_the_scorer_always_passes_is_found_before_the_call():
    strict_with_answer.calls = 0
    function = trl_style("acc", strict_with_answer, in_thread=True)
    failure = await run_function(function, _batch(["a"], answer="5", max_completion_length=8))
    assert failure.bug and not failure.bad_input and strict_with_answer.calls == 0
    assert failure.detail == (
        "reward 'acc': its function strict_with_answer takes no keyword argument 'max_completion_length', which the "
        "scorer passes it (as TRL does: prompts, completions, completion_ids, max_completion_length, every column "
        "of the dataset's rows, and env_reward with an environment), so every call would fail. Fix: add **kwargs "
        "to its parameters, as TRL's reward functions have: def strict_with_answer(prompts, completions, "
        "completion_ids, answer, **kwargs)"
    )


async def test_the_scoring_loop_stops_on_a_required_rewards_signature_bug_not_a_bad_record():
    loop = ScoringLoop(
        None, None, [trl_style("acc", strict, in_thread=False)], [1.0], AdvantageSpec(),
        drop_zero_std=False, max_in_flight=1,
    )  # fmt: skip
    with pytest.raises(RewardBugError, match=r"takes no keyword argument.*max_completion_length.*add \*\*kwargs"):
        await loop.score_rewards(make_rollout(make_task(group_size=2)))


def hides_its_signature(prompts, completions):
    return [1.0] * len(completions)


hides_its_signature.__signature__ = inspect.Signature([inspect.Parameter("kw", inspect.Parameter.VAR_KEYWORD)])


async def test_an_unexpected_keyword_the_call_itself_reports_is_the_same_bug():
    failure = await run_function(trl_style("hidden", hides_its_signature, in_thread=True), _batch(["a"]))
    assert failure.bug and not failure.bad_input
    assert failure.detail == unaccepted_keywords_message("hidden", hides_its_signature, ["completion_ids"])
    assert failure.detail.endswith("def hides_its_signature(prompts, completions, **kwargs)")


def hidden_solution(prompts, completions, solution, **kwargs):
    return [1.0] * len(completions)


# inspect sees only **kwargs (as for a wrapped or compiled function), so the check before the call passes.
hidden_solution.__signature__ = inspect.Signature([inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])


async def test_a_missing_keyword_the_call_itself_reports_is_the_same_bad_input():
    failure = await run_function(trl_style("hidden", hidden_solution, in_thread=True), _batch(["a"], answer="5"))
    assert failure.bad_input
    assert failure.detail == missing_columns_message("hidden", ["solution"], ["answer"])


def _takes_one(a):
    return a


def calls_badly(prompts, completions, **kwargs):
    return [_takes_one(answer=1) for _ in completions]


async def test_a_typeerror_inside_the_function_stays_a_bug():
    failure = await run_function(trl_style("bad", calls_badly, in_thread=True), _batch(["a"], answer="5"))
    assert failure.bug and not failure.bad_input
    assert failure.detail.startswith("TypeError: _takes_one() got an unexpected keyword argument 'answer' (at ")
    with pytest.raises(TypeError) as raised:
        _takes_one(answer=1)
    assert (
        call_problem("bad", raised.value, {"answer": [1]}, calls_badly) is None
    )  # raised in this file: the user's code


# 3. trainer_state.


def test_reward_batch_carries_the_groups_step_and_max_steps():
    rollout = make_rollout(make_task(group_size=2, policy_version=7))
    assert reward_batch(rollout, 50).trainer_state == TrainerState(global_step=7, max_steps=50, epoch=None)
    assert reward_batch(rollout).trainer_state == TrainerState(global_step=7, max_steps=None, epoch=None)
    with pytest.raises(AttributeError):
        reward_batch(rollout).trainer_state.log_history  # noqa: B018 (not a TrainerState field we have)


def with_state(prompts, completions, completion_ids, answer, max_completion_length, trainer_state):
    return [float(trainer_state.global_step)] * len(completions)


def with_kwargs(prompts, completions, **kwargs):
    return [float(kwargs["trainer_state"].max_steps)] * len(completions)


def without_state(prompts, completions, completion_ids, answer, max_completion_length):
    return [2.0] * len(completions)


def test_takes_trainer_state_is_the_parameter_or_kwargs():
    assert [takes_trainer_state(f) for f in (with_state, with_kwargs, without_state, len)] == [
        True,
        True,
        False,
        False,
    ]


async def test_functions_get_trainer_state_as_trl_passes_it():
    rollout = make_rollout(make_task(group_size=2, policy_version=3))
    rewards = [trl_style(f.__name__, f, in_thread=True) for f in (with_state, with_kwargs, without_state)]
    loop = ScoringLoop(
        None, None, rewards, [1.0, 1.0, 1.0], AdvantageSpec(), drop_zero_std=False, max_in_flight=1, max_steps=40
    )
    assert (await loop.score_rewards(rollout)).tolist() == [[3.0, 40.0, 2.0], [3.0, 40.0, 2.0]]


def test_max_steps_set_once_in_common_reaches_learner_and_scorer(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[common]\nmax_steps = 300\ngroups_per_step = 4\n[learner]\nmodel = "m"\n')
    assert LearnerSettings.load(config).max_steps == 300 and ScorerSettings.load(config).max_steps == 300
    assert ScorerSettings.load(config).groups_per_step == 4 == LearnerSettings.load(config).groups_per_step
    assert ScorerSettings().max_steps is None


# 4. Batched rewards.


def test_merge_and_split_keep_each_groups_completions_in_order():
    one = RewardBatch(["p1"] * 2, ["a", "b"], [[1], [2]], {"answer": ["1", "1"]}, "g1", trainer_state=TrainerState(4))
    two = RewardBatch(["p2"], ["c"], [[3]], {"answer": ["2"]}, "g2", trainer_state=TrainerState(6, 10))
    merged = merge_batches([one, two])
    assert merged == RewardBatch(
        ["p1", "p1", "p2"], ["a", "b", "c"], [[1], [2], [3]], {"answer": ["1", "1", "2"]}, "g1,g2",
        trainer_state=TrainerState(6, 10),
    )  # fmt: skip
    assert split_result([0.0, 1.0, 2.0], [one, two]) == [[0.0, 1.0], [2.0]]
    failure = RewardFailure("r", "g1,g2", "boom", bug=True)
    assert split_result(failure, [one, two]) == [
        RewardFailure("r", "g1", "boom", bug=True),
        RewardFailure("r", "g2", "boom", bug=True),
    ]
    with pytest.raises(ValueError, match="different column names"):
        merge_batches([one, RewardBatch(["p"], ["d"], [[4]], {}, "g3")])
    with pytest.raises(ValueError, match="2 values for 3 completions"):
        split_result([0.0, 1.0], [one, two])


class Recorder:
    """A batch-level reward: each completion's position in the call, and the sizes of the calls."""

    def __init__(self, fail: bool = False) -> None:
        self.sizes: list[int] = []
        self.fail = fail

    def __call__(self, prompts, completions, **kwargs):
        self.sizes.append(len(completions))
        if self.fail:
            raise ValueError("batch failed")
        return [float(i) for i in range(len(completions))]


async def test_a_batched_reward_is_called_once_over_the_groups_waiting_and_split_back():
    recorder = Recorder()
    function = trl_style("rank", recorder, in_thread=True, batched=True)
    batcher = RewardBatcher(function, max_groups=3, wait_s=30.0)  # full at 3: no wait
    results = await asyncio.gather(*(batcher.run(_batch(["x", "y"], f"g{i}", answer="1")) for i in range(3)))
    assert results == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert recorder.sizes == [6] and function.stats.calls == 1


async def test_a_batch_not_full_is_called_after_wait_s_and_lanes_and_columns_never_mix():
    recorder = Recorder()
    batcher = RewardBatcher(trl_style("rank", recorder, in_thread=False, batched=True), max_groups=8, wait_s=0.05)
    results = await asyncio.gather(
        batcher.run(_batch(["a"], "t1", answer="1")),
        batcher.run(_batch(["b"], "t2", answer="1")),
        batcher.run(_batch(["c"], "e1", answer="1"), lane=5),  # an evaluation round
        batcher.run(_batch(["d"], "t3")),  # other columns
    )
    assert results == [[0.0], [1.0], [0.0], [0.0]]
    assert sorted(recorder.sizes) == [1, 1, 2]


async def test_a_batched_failure_is_each_groups_failure_and_one_breaker_count():
    function = trl_style("rank", Recorder(fail=True), in_thread=False, batched=True, required=False)
    batcher = RewardBatcher(function, max_groups=2, wait_s=30.0)
    results = await asyncio.gather(batcher.run(_batch(["a"], "g1")), batcher.run(_batch(["b"], "g2")))
    assert [(r.group_id, r.bug) for r in results] == [("g1", True), ("g2", True)]
    assert results[0].detail.startswith("ValueError: batch failed (at test_reward_calls_trl.py:")
    assert function.stats.errors == 1 and function.breaker.failures == 1


async def test_the_scoring_loop_calls_a_batched_reward_over_its_groups_in_flight():
    recorder = Recorder()
    rewards = [trl_style("rank", recorder, in_thread=True, batched=True)]
    loop = ScoringLoop(
        None, None, rewards, [1.0], AdvantageSpec(), drop_zero_std=False, max_in_flight=4, batch_groups=2,
        batch_wait_s=30.0,
    )  # fmt: skip
    rollouts = [make_rollout(make_task(group_size=2)) for _ in range(2)]
    scored = await asyncio.gather(*(loop.score_rewards(r) for r in rollouts))
    assert [s.ravel().tolist() for s in scored] == [[0.0, 1.0], [2.0, 3.0]]
    assert recorder.sizes == [4]


def test_batched_settings_are_checked_and_reach_the_functions():
    with pytest.raises(ValidationError, match="batched = true applies to Python functions"):
        RewardSpec(name="judge", url="http://judge:9000/score", batched=True)
    spec = RewardSpec(name="correctness", batched=True)
    with pytest.raises(ValidationError, match=r"groups_per_step \(16\) exceeds max_groups_in_flight \(8\)"):
        ScorerSettings(rewards=[spec], groups_per_step=16)
    assert ScorerSettings(rewards=[spec], groups_per_step=4).batch_groups == 4
    assert ScorerSettings(rewards=[spec], max_groups_in_flight=6).batch_groups == 6
    assert ScorerSettings(rewards=[RewardSpec(name="correctness")], groups_per_step=16).groups_per_step == 16
    functions, _ = build_functions([spec, RewardSpec(name="digit")], None)
    assert [f.batched for f in functions] == [True, False]


# 5. A function that never judges.


def test_a_function_with_no_values_has_nan_mean_and_std_alike():
    per_func = np.array([[math.nan, 1.0, 3.0], [math.nan, 2.0, math.nan]])
    metrics = reward_function_metrics(["never", "both", "one"], per_func)
    assert math.isnan(metrics["rewards/never/mean"]) and math.isnan(metrics["rewards/never/std"])
    assert metrics["rewards/both/mean"] == 1.5 and metrics["rewards/both/std"] == pytest.approx(math.sqrt(0.5))
    assert metrics["rewards/one/mean"] == 3.0 and metrics["rewards/one/std"] == 0.0


def test_a_scored_group_logs_nan_mean_and_std_for_an_all_none_reward():
    rollout = make_rollout(make_task(group_size=2))
    per_func = np.array([[math.nan, 1.0], [math.nan, 0.0]], dtype=np.float32)
    group = scored_group(rollout, ["judge", "acc"], [1.0, 1.0], per_func, AdvantageSpec(), drop_zero_std=False)
    assert math.isnan(group.metrics["rewards/judge/mean"]) and math.isnan(group.metrics["rewards/judge/std"])
