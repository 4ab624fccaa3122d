"""Non-finite numbers never reach the weights: the pure checks (:mod:`shared.finite`), the wire records that use
them (a rollout with a NaN, infinite or positive logprob, a scored group with an infinite reward, cannot be
built or decoded), and the learner's step, which is never applied when its loss or gradient norm is not finite."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from services.learner.model import load_policy
from services.learner.nonfinite import MAX_NONFINITE_STEPS_IN_A_ROW, NonfiniteSteps, NonFiniteTraining, SkippedStep
from services.learner.optimizer import NONFINITE_STEP
from services.learner.trainer import Trainer
from shared.codec import WireError, decode, encode
from shared.finite import finite_problem, logprob_problem, reward_problem, step_problem
from shared.records import Completion, ScoredGroup
from tests.support.factories import make_rollout, make_scored
from tests.support.tiny_model import build_tiny_llama
from tests.unit.test_learner_core import _batch, _groups, _settings

BAD_LOGPROBS = [
    ([-1.0, math.nan, -2.0], "behaviour_logprobs holds NaN at 1 (flat index)"),
    ([-1.0, -2.0, math.inf], "behaviour_logprobs holds +inf at 2 (flat index)"),
    ([-math.inf, -2.0, -math.inf], "behaviour_logprobs holds -inf at 0, 2 (flat index)"),
    ([-1.0, 0.5, -2.0], "behaviour_logprobs holds positive values (largest 0.5) at 1: a logprob is at most 0"),
]


@pytest.mark.parametrize(("values", "problem"), BAD_LOGPROBS)
def test_logprob_problem_names_the_value_and_its_positions(values, problem):
    assert logprob_problem(np.asarray(values, dtype=np.float32)) == problem


def test_good_logprobs_and_rewards_have_no_problem():
    assert logprob_problem(np.asarray([0.0, -1e-9, -80.0], dtype=np.float32)) is None
    assert logprob_problem(np.zeros(0, dtype=np.float32)) is None
    assert reward_problem(np.asarray([1.0, math.nan, -3.0])) is None  # NaN: a reward that was None
    assert finite_problem(np.asarray([0.0, -1.5]), "advantages") is None


def test_positions_beyond_three_are_counted_not_listed():
    values = np.full(7, math.nan, dtype=np.float32)
    assert logprob_problem(values, "old_logprobs") == "old_logprobs holds NaN at 0, 1, 2 and 4 more (flat index)"


def test_rewards_may_be_nan_never_infinite_and_advantages_neither():
    assert reward_problem(np.asarray([[1.0], [-math.inf]])) == "rewards holds -inf at 1 (flat index)"
    assert finite_problem(np.asarray([0.0, math.nan]), "advantages") == "advantages holds NaN at 1 (flat index)"


def test_step_problem_names_what_is_not_finite():
    assert step_problem(0.5, 3.0) is None
    assert step_problem(math.nan, 3.0) == "not finite: loss nan"
    assert step_problem(0.5, math.inf) == "not finite: grad_norm inf"
    assert step_problem(math.nan, math.nan) == "not finite: loss nan, grad_norm nan"


@pytest.mark.parametrize(("values", "problem"), BAD_LOGPROBS)
def test_a_completion_with_bad_logprobs_cannot_be_built(values, problem):
    with pytest.raises(ValueError, match="behaviour_logprobs holds"):
        Completion(text="", token_ids=np.arange(3, dtype=np.int32), behaviour_logprobs=values, finish_reason="stop")


@pytest.mark.parametrize(("values", "problem"), BAD_LOGPROBS)
def test_a_rollout_with_bad_logprobs_is_refused_at_decode(values, problem):
    """What a writer that skips the checks puts on the wire (built with ``model_construct``) does not decode."""
    rollout = make_rollout(tokens=3)
    bad = Completion.model_construct(
        **{**dict(rollout.completions[0]), "behaviour_logprobs": np.asarray(values, dtype=np.float32)}
    )
    poisoned = rollout.model_construct(**{**dict(rollout), "completions": (bad, *rollout.completions[1:])})
    with pytest.raises(WireError, match="behaviour_logprobs holds"):
        decode(encode(poisoned), type(rollout))


@pytest.mark.parametrize("where", ["rewards", "rewards_per_func"])
def test_a_scored_group_with_an_infinite_reward_is_refused_at_decode(where):
    group = make_scored()
    values = getattr(group, where).copy()
    values.flat[1] = np.inf
    poisoned = ScoredGroup.model_construct(**{**dict(group), where: values})
    with pytest.raises(WireError, match=f"{where} holds \\+inf at 1"):
        decode(encode(poisoned), ScoredGroup)


def test_a_nan_reward_where_a_function_gave_a_value_is_refused():
    group = make_scored()
    rewards = group.rewards.copy()
    rewards[0] = np.nan  # every function gave completion 0 a reward: its combination cannot be None
    with pytest.raises(ValueError, match="NaN exactly where every function's reward is NaN"):
        ScoredGroup(**{**dict(group), "rewards": rewards})


def test_a_run_of_skipped_steps_raises_naming_them_and_an_applied_step_ends_the_run():
    steps = NonfiniteSteps()
    for version in range(1, MAX_NONFINITE_STEPS_IN_A_ROW):
        steps.skipped(SkippedStep(version, "not finite: loss nan", (f"g{version}",)))
    steps.applied()
    assert steps.in_a_row == []
    for version in range(1, MAX_NONFINITE_STEPS_IN_A_ROW):
        steps.skipped(SkippedStep(version, "not finite: loss nan", (f"g{version}",)))
    with pytest.raises(NonFiniteTraining, match=r"3 optimizer steps in a row.*g1\).*g2\).*grad_norm inf \(groups g3"):
        steps.skipped(SkippedStep(3, "not finite: grad_norm inf", ("g3",)))


def test_applied_of_keeps_the_applied_steps_and_numbers_the_skipped_ones():
    steps = NonfiniteSteps()
    results = [{"loss": 1.0, "grad_norm": 2.0}, {"loss": math.nan, "grad_norm": 2.0, NONFINITE_STEP: 1.0}]
    assert steps.applied_of(results, version=5, group_ids=("a", "b")) == [results[0]]
    assert steps.in_a_row == [SkippedStep(6, "not finite: loss nan", ("a", "b"))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=5)


def _state(trainer: Trainer) -> tuple[dict[str, torch.Tensor], dict, dict, int]:
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    adamw = {
        name: {k: v.clone() for k, v in trainer.optimizer.adamw.state[p].items()}
        for name, p in trainer.model.named_parameters()
        if p in trainer.optimizer.adamw.state
    }
    schedule = {
        "last_epoch": trainer.optimizer.scheduler.last_epoch,
        "lr": trainer.optimizer.adamw.param_groups[0]["lr"],
    }
    return params, adamw, schedule, trainer.step


def _assert_same(before, after) -> None:
    (params, adamw, schedule, step), (params2, adamw2, schedule2, step2) = before, after
    assert step2 == step and schedule2 == schedule
    for name, value in params.items():
        assert torch.equal(params2[name], value), name
    assert adamw2.keys() == adamw.keys()
    for name, state in adamw.items():
        assert all(torch.equal(adamw2[name][k], v) for k, v in state.items()), name


def test_a_nan_behaviour_logprob_that_bypassed_the_records_never_reaches_the_weights(tiny):
    """The issue's case through the real step: ``old_logprobs = "behaviour"``, one NaN logprob in the batch
    (here put into the collated batch, past every record check). The step is not applied: weights, AdamW's
    state, the schedule and the step count stay; the next clean batch trains as usual."""
    settings = _settings(tiny, old_logprobs="behaviour", num_iterations=1, importance_correction=False)
    model, _ = load_policy(settings, str(tiny))
    trainer = Trainer(model, settings)
    trainer.train(_batch(_groups(model, seed=1)))  # one applied step: AdamW has state to keep
    before = _state(trainer)
    clean = _batch(_groups(model, seed=2))
    poisoned = clean.behaviour_logprobs.clone()
    poisoned[3, 0] = math.nan
    [figures] = trainer.train(dataclasses.replace(clean, behaviour_logprobs=poisoned))
    assert figures[NONFINITE_STEP] == 1.0
    assert math.isnan(figures["loss"]) and math.isnan(figures["grad_norm"])
    _assert_same(before, _state(trainer))
    assert all(p.grad is None for p in model.parameters())

    [applied] = trainer.train(clean)
    assert NONFINITE_STEP not in applied and math.isfinite(applied["loss"])
    assert trainer.step == before[3] + 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
