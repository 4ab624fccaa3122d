"""``shared.sampled_versions.trajectory_version`` and the ``Rollout.policy_version`` check it backs
(docs/concepts/multi-turn-design.md §2.2, build step 3).

The oldest version over sampled tokens only (masked -1 context ignored), None where nothing bounds it; a rollout
whose ``policy_version`` is newer than a sampled token is refused, naming the completion, and every record
today's code writes (the factories, the v1 goldens, a single-turn group without token versions) is accepted.
"""

from __future__ import annotations

from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from shared.codec import WireError, decode, encode
from shared.records import Rollout
from shared.sampled_versions import trajectory_version
from tests.support.factories import (
    make_rollout,
    make_scored,
    make_task,
    make_trajectory_completion,
    make_trajectory_rollout,
)
from tests.support.make_records_v1 import GOLDEN_DIR, golden_records


def _i32(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def _u8(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint8)


# trajectory_version ---------------------------------------------------------------------------------------


def test_the_oldest_sampled_version_of_mixed_versions():
    assert trajectory_version(_i32(5, 5, 6, 7, 7), None) == 5
    assert trajectory_version(_i32(7, 6, 5, 6), _u8(1, 1, 1, 1)) == 5
    assert isinstance(trajectory_version(_i32(4, 9), None), int)


def test_masked_minus_ones_are_ignored():
    assert trajectory_version(_i32(3, 3, 3, -1, -1, 4, 4), _u8(1, 1, 1, 0, 0, 1, 1)) == 3
    assert trajectory_version(_i32(-1, -1, 8, 9), _u8(0, 0, 1, 1)) == 8
    # Without a mask every token counts as sampled, but -1 still names no version.
    assert trajectory_version(_i32(-1, 6, 7), None) == 6


def test_only_sampled_tokens_count():
    # The pure function reads the mask, not the values: a version under loss_mask 0 is not a sampled token's.
    assert trajectory_version(_i32(2, 5, 6), _u8(0, 1, 1)) == 5


@pytest.mark.parametrize(
    ("versions", "mask"),
    [
        (None, None),
        (None, _u8(1, 1)),
        (_i32(), None),
        (_i32(), _u8()),
        (_i32(-1, -1), _u8(0, 0)),
        (_i32(-1, -1), None),
    ],
    ids=["no-versions", "no-versions-with-mask", "empty", "empty-with-mask", "all-masked", "all-minus-one"],
)
def test_none_where_nothing_bounds_the_version(versions, mask):
    assert trajectory_version(versions, mask) is None


def test_a_mask_of_another_length_is_refused():
    with pytest.raises(ValueError, match=r"loss_mask has shape \(2,\) but token_versions has shape \(3,\)"):
        trajectory_version(_i32(1, 2, 3), _u8(1, 1))


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 1000)), min_size=1, max_size=40))
def test_the_result_is_the_minimum_over_sampled_tokens(tokens):
    mask = _u8(*(int(sampled) for sampled, _ in tokens))
    versions = _i32(*(v if sampled else -1 for sampled, v in tokens))
    sampled = [v for s, v in tokens if s]
    assert trajectory_version(versions, mask) == (min(sampled) if sampled else None)


# Rollout.policy_version -----------------------------------------------------------------------------------


def test_a_policy_version_newer_than_a_sampled_token_is_refused():
    task = make_task(group_size=2, policy_version=4)
    completions = (make_trajectory_completion(), make_trajectory_completion())  # sampled by versions 3 and 4
    with pytest.raises(ValidationError, match=r"policy_version \(4\) exceeds completion 0's oldest sampled token"):
        make_rollout(task, completions=completions, finished_policy_version=4)


def test_a_single_turn_token_newer_than_its_stamp_is_refused_naming_the_completion():
    task = make_task(group_size=2, policy_version=5)
    fine = make_rollout(task).completions[0]
    old = fine.model_copy(update={"token_versions": np.full(len(fine.token_ids), 4, np.int32)})
    with pytest.raises(ValidationError, match=r"exceeds completion 1's oldest sampled token version \(4\)"):
        make_rollout(task, completions=(fine, old), finished_policy_version=5)


def test_the_refusal_holds_on_the_wire_too():
    envelope = msgpack.unpackb(encode(make_trajectory_rollout()), raw=False, strict_map_key=False)
    envelope["body"]["policy_version"] = 4
    with pytest.raises(WireError, match=r"policy_version \(4\) exceeds completion 0's"):
        decode(msgpack.packb(envelope, use_bin_type=True), Rollout)


def test_a_push_landing_mid_group_is_accepted():
    # Sampling started at 3; later tokens carry 4 (the factory's trajectory): policy_version is the lower bound.
    rollout = make_trajectory_rollout()
    assert rollout.policy_version == 3
    assert all(trajectory_version(c.token_versions, c.loss_mask) == 3 for c in rollout.completions)
    task = make_task(group_size=2, policy_version=2)
    completions = (make_trajectory_completion(), make_trajectory_completion())
    assert make_rollout(task, completions=completions, finished_policy_version=4).policy_version == 2


def test_completions_without_token_versions_bound_nothing():
    # Today's generator stamps no per-token versions: any policy_version is accepted.
    rollout = make_rollout(make_task(policy_version=17))
    assert all(c.token_versions is None for c in rollout.completions)


def test_every_factory_record_is_accepted():
    for record in (make_rollout(), make_scored(), make_trajectory_rollout(), make_scored(make_trajectory_rollout())):
        assert decode(encode(record)) is not None


@pytest.mark.parametrize("path", sorted(GOLDEN_DIR.glob("*.msgpack")), ids=lambda p: p.stem)
def test_the_v1_goldens_are_accepted(path: Path):
    # The validators run both when the golden's bytes are decoded and when today's code builds the record.
    assert decode(path.read_bytes()).kind == golden_records()[path.stem].kind


def test_the_v1_golden_rollout_carries_token_versions_that_bound_it():
    rollout = decode((GOLDEN_DIR / "rollout.msgpack").read_bytes(), Rollout)
    oldest = [trajectory_version(c.token_versions, c.loss_mask) for c in rollout.completions]
    assert oldest == [4, None] and rollout.policy_version == 4
