"""The learner's counters: each drop reason moves its own field, and a checkpoint's counters come back."""

from __future__ import annotations

import typing

from services.learner.metrics.counters import Counters, DropReason


def test_each_drop_reason_counts_in_its_own_field():
    counters = Counters()
    for reason in typing.get_args(DropReason):
        counters.dropped(reason)
        assert counters.as_dict()[f"groups_{reason}"] == 1, reason
    assert sum(counters.as_dict().values()) == len(typing.get_args(DropReason))


def test_counters_round_trip_through_a_checkpoint_and_ignore_unknown_names():
    counters = Counters()
    counters.admitted(5)
    counters.trained(4)
    counters.rejected()
    counters.pushed(ok=True)
    counters.pushed(ok=False)
    saved = {name: float(value) for name, value in counters.as_dict().items()} | {"groups_from_the_future": 3.0}
    assert Counters.restore(saved) == counters
