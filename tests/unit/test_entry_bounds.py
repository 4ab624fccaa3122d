"""The bounds a reader checks after decoding (:func:`shared.intake.bound_problem`), exactly."""

from __future__ import annotations

import numpy as np

from shared.config.bounds import EntryBoundsSettings
from shared.intake import bound_problem
from tests.support.factories import make_rollout, make_scored, make_task, make_trajectory_completion

BOUNDS = EntryBoundsSettings(max_group_size=4, max_sequence_tokens=8)


def test_each_bound_is_named_with_its_setting():
    assert bound_problem(make_task(group_size=4), BOUNDS) is None
    assert bound_problem(make_task(group_size=5), BOUNDS) == "group_size of 5 completions is over max_group_size (4)"
    assert bound_problem(make_rollout(tokens=8), BOUNDS) is None
    assert bound_problem(make_rollout(tokens=9), BOUNDS) == "completion 0 has 9 tokens, over max_sequence_tokens (8)"
    group = make_scored(make_rollout(make_task(group_size=6), tokens=2))
    assert bound_problem(group, BOUNDS) == "group of 6 completions is over max_group_size (4)"
    long_prompt = make_rollout(tokens=2, prompt_token_ids=list(range(9)))
    assert bound_problem(long_prompt, BOUNDS) == "the prompt has 9 tokens, over max_sequence_tokens (8)"


def test_a_trajectorys_own_prompt_is_bounded_too():
    own = make_trajectory_completion(prompt_token_ids=np.arange(20, dtype=np.int32))
    rollout = make_rollout(make_task(group_size=2), completions=(make_trajectory_completion(), own))
    bounds = EntryBoundsSettings(max_sequence_tokens=19)
    assert max(len(c.token_ids) for c in rollout.completions) <= 19 and len(rollout.prompt_token_ids) <= 19
    assert bound_problem(rollout, bounds) == "completion 1's prompt has 20 tokens, over max_sequence_tokens (19)"
