"""Non-finite numbers on the streams, against real Redis: a rollout whose behaviour logprobs hold NaN, +-inf or
a positive value is dead-lettered by the scorer with the reason (it never reaches the scored stream), and so
is a group whose rewards overflow float32 once combined; the learner dead-letters a scored group with such
numbers at admission. Valid groups around them are scored and trained as usual."""

from __future__ import annotations

import math

import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from services.learner.startup import build_learner
from shared.codec import encode
from shared.config.scorer import RewardSpec
from shared.keys import Keys
from shared.records import Completion, Rollout, ScoredGroup
from shared.streams import StreamProducer
from tests.integration.test_learner import _settings
from tests.integration.test_reward_outages import _feed, _score_in_process
from tests.support.factories import make_rollout, make_scored, make_task
from tests.support.fake_pipeline import run_loop_to_end
from tests.support.tiny_model import build_tiny_llama

pytestmark = pytest.mark.integration

POISONS = {
    "nan": (math.nan, "behaviour_logprobs holds NaN at 1"),
    "+inf": (math.inf, "behaviour_logprobs holds +inf at 1"),
    "-inf": (-math.inf, "behaviour_logprobs holds -inf at 1"),
    "positive": (0.25, "behaviour_logprobs holds positive values (largest 0.25) at 1"),
}


def near_float32_max(completions, **_) -> list[float]:
    """A reward within float32 whose weighted sum (weight 2) is not: +inf once on the wire."""
    return [3.0e38] * len(completions)


def _poisoned_rollout(value: float, seed: int) -> Rollout:
    """A rollout whose first completion's logprob 1 is ``value``, built past the record's checks as a writer
    that skipped them would."""
    rollout = make_rollout(make_task(group_size=4), tokens=3, seed=seed)
    first = rollout.completions[0]
    logprobs = first.behaviour_logprobs.copy()
    logprobs[1] = value
    bad = Completion.model_construct(**{**dict(first), "behaviour_logprobs": logprobs})
    return Rollout.model_construct(**{**dict(rollout), "completions": (bad, *rollout.completions[1:])})


async def test_the_scorer_dead_letters_rollouts_with_bad_logprobs_and_groups_whose_rewards_overflow(redis_client, keys):
    keys = Keys(keys.prefix)
    fed = await _feed(redis_client, keys, 2)
    poisoned = [_poisoned_rollout(value, seed=50 + i) for i, (value, _) in enumerate(POISONS.values())]
    await StreamProducer(redis_client, keys.rollouts).add_many([(r.group_id, encode(r)) for r in poisoned])
    fed += [r.group_id for r in poisoned] + await _feed(redis_client, keys, 2, first=2)
    spec = RewardSpec(name="digit")
    accounting, groups, loop = await _score_in_process(redis_client, keys, [spec], fed)
    accounting.check(fed)
    assert set(accounting.dead) == {r.group_id for r in poisoned} and len(groups) == 4
    for rollout, (_, named) in zip(poisoned, POISONS.values(), strict=True):
        reason = accounting.dead[rollout.group_id]
        assert reason.startswith("WireError: completions.0: ") and named in reason, reason
    assert loop.stats.rejected == len(POISONS)

    keys2 = Keys(f"{keys.prefix}:overflow")
    fed = await _feed(redis_client, keys2, 2)
    big = RewardSpec(name="big", function=f"{__name__}:near_float32_max", weight=2.0)
    accounting, groups, loop = await _score_in_process(redis_client, keys2, [big], fed)
    accounting.check(fed)
    assert not groups and loop.stats.groups_nonfinite == 2
    for reason in accounting.dead.values():
        assert reason.startswith("ValueError: ") and "rewards holds +inf at 0, 1, 2 and 1 more" in reason, reason


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=7, logit_scale=1.0)


def _poisoned_group(seed: int) -> tuple[ScoredGroup, str]:
    """A scored group with an infinite reward (seed even) or a NaN logprob (odd), and what its reason names."""
    group = make_scored(make_rollout(make_task(group_size=4), tokens=3, seed=seed))
    if seed % 2:
        rollout = _poisoned_rollout(math.nan, seed)
        return ScoredGroup.model_construct(**{**dict(group), "rollout": rollout}), "behaviour_logprobs holds NaN"
    rewards = group.rewards.copy()
    rewards[2] = np.inf
    return ScoredGroup.model_construct(**{**dict(group), "rewards": rewards}), "rewards holds +inf at 2"


async def test_the_learner_dead_letters_scored_groups_with_non_finite_numbers_at_admission(
    tiny, tmp_path, redis_client, redis_url, keys
):
    settings = _settings(tiny, tmp_path, keys.prefix, redis_url, max_steps=2, checkpoint_every=10)
    keys = Keys(keys.prefix)
    async with httpx.AsyncClient() as http:
        loop, _ = await build_learner(settings, redis_client, http, CollectorRegistry())
        await loop.consumer.start()
        poisoned = [_poisoned_group(seed) for seed in (1, 2)]
        await StreamProducer(redis_client, keys.scored).add_many([(g.group_id, encode(g)) for g, _ in poisoned])
        await run_loop_to_end(loop, redis_client, keys)
    dead = {f[b"id"].decode(): f[b"reason"].decode() for _, f in await redis_client.xrange(keys.dead_letter)}
    assert set(dead) == {g.group_id for g, _ in poisoned}
    for group, named in poisoned:
        assert dead[group.group_id].startswith("WireError: ") and named in dead[group.group_id], dead
    assert loop.counters.groups_rejected == 2 and loop.trainer.step == 2
    assert all(bool(p.isfinite().all()) for p in loop.trainer.model.parameters())
