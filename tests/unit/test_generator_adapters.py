"""The generator's LoRA adapter bookkeeping (services/generator/adapters.py): which versions stay loaded, what
is evicted, and ids never reused."""

from __future__ import annotations

import pytest

from services.generator.adapters import AdapterSlots, LoadedAdapter, adapter_name, kept_adapters


def _push(slots: AdapterSlots, version: int) -> list[LoadedAdapter]:
    adapter, evicted = slots.plan(version)
    slots.loaded_ok(adapter)
    return evicted


def test_keeps_max_staleness_plus_one():
    assert kept_adapters(0) == 1
    assert kept_adapters(2) == 3
    with pytest.raises(ValueError, match="0 or more"):
        kept_adapters(-1)


def test_evicts_the_oldest_beyond_keep():
    slots = AdapterSlots(keep=2)
    assert slots.served is None
    assert _push(slots, 1) == []
    assert _push(slots, 2) == []
    assert _push(slots, 3) == [LoadedAdapter(1, 1)]
    assert slots.loaded == [LoadedAdapter(2, 2), LoadedAdapter(3, 3)]
    assert slots.served == LoadedAdapter(3, 3)


def test_synchronous_keeps_only_the_served():
    slots = AdapterSlots(keep=1)
    _push(slots, 1)
    assert _push(slots, 2) == [LoadedAdapter(1, 1)]
    assert slots.loaded == [LoadedAdapter(2, 2)]


def test_plan_changes_nothing_until_loaded():
    slots = AdapterSlots(keep=1)
    _push(slots, 1)
    adapter, evicted = slots.plan(2)
    assert (adapter, evicted) == (LoadedAdapter(2, 2), [LoadedAdapter(1, 1)])
    assert slots.served == LoadedAdapter(1, 1)  # a failed load: the last adapter is still served
    assert slots.plan(2)[0] == LoadedAdapter(2, 3)  # the failed id is not reused


def test_a_version_pushed_again_gets_a_new_id_and_name():
    slots = AdapterSlots(keep=3)
    _push(slots, 4)
    _push(slots, 5)
    _push(slots, 4)  # a restarted learner's reset push of an older version, with other weights
    assert [a.lora_id for a in slots.loaded] == [1, 2, 3]
    assert slots.served == LoadedAdapter(4, 3)
    assert slots.served.name == "policy-v4-3" == adapter_name(4, 3)
    assert len({a.name for a in slots.loaded}) == 3


def test_keep_below_one_is_refused():
    with pytest.raises(ValueError, match="served adapter"):
        AdapterSlots(keep=0)
