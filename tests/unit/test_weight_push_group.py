"""The gloo group kept from push to push, exactly: when the learner offers it, how a rank answers, the
handshake between the learner and a generator (reuse while both hold it, a new group when a generator lost
its own), the keeper that lets a failed push discard it, and two stand-in pushes that share one group."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import ClassVar

import pytest
import torch

from shared.records import GeneratorRegistration
from tests.gpu import standin
from tests.gpu.weight_path import push, start_receiver, stop_receiver
from weight_sync.collective import (
    HELD,
    MAX_IDLE_S,
    MISSING,
    GroupKeeper,
    KeptGroup,
    answer_offer,
    learner_group,
    may_offer,
    member_group,
    start_broadcast,
)
from weight_sync.plan import LearnerDevice, group_members, plan_push
from weight_sync.sender import WeightPusher


def _gen(gid: str, workers: int = 1) -> GeneratorRegistration:
    return GeneratorRegistration(generator_id=gid, url=f"http://{gid}:1", policy_version=0, engine_world_size=workers)


def test_group_members_change_when_a_generator_joins_leaves_or_grows():
    cpu = LearnerDevice()
    one = group_members(plan_push(cpu, [_gen("a"), _gen("b")]))
    assert one == ((("a", 1), ("b", 2)), 3)
    assert group_members(plan_push(cpu, [_gen("b"), _gen("a")])) != one  # ranks follow the plan's order
    assert group_members(plan_push(cpu, [_gen("a")])) == ((("a", 1),), 2)  # b left
    assert group_members(plan_push(cpu, [_gen("a"), _gen("b"), _gen("c")]))[1] == 4  # c joined
    assert group_members(plan_push(cpu, [_gen("a"), _gen("b", workers=2)]))[1] == 4  # b has two workers now
    # Generators over shared memory are no members: one moving there changes the group.
    assert group_members(plan_push(cpu, [_gen("a"), _gen("b")], shares_memory={"b"})) == ((("a", 1),), 2)


def test_the_learner_offers_a_kept_group_only_to_the_same_members_and_not_after_long_idleness():
    kept = KeptGroup(object(), "push/1/x", ("m", 2))
    # A clock reading whose sums with MAX_IDLE_S are exact: at time.monotonic()'s own value (8125.743822042 in one
    # CI run) now + MAX_IDLE_S - now came out a rounding above MAX_IDLE_S and the boundary case failed.
    kept.used_at = now = 1000.0
    assert may_offer(kept, ("m", 2), now)
    assert may_offer(kept, ("m", 2), now + MAX_IDLE_S)
    assert not may_offer(kept, ("m", 2), now + MAX_IDLE_S + 0.001)  # a firewall may have dropped its flows
    assert not may_offer(kept, ("m", 3), now)
    assert not may_offer(None, ("m", 2), now)


def test_a_rank_says_it_holds_the_offered_group_only_as_the_same_member():
    kept = KeptGroup(object(), "push/1/x", ("127.0.0.1:9", 1, 2))
    assert answer_offer(kept, "push/1/x", ("127.0.0.1:9", 1, 2)) == HELD
    assert answer_offer(kept, "push/2/y", ("127.0.0.1:9", 1, 2)) == MISSING  # another group (a new learner)
    assert answer_offer(kept, "push/1/x", ("127.0.0.1:9", 2, 3)) == MISSING  # another rank
    assert answer_offer(kept, "push/1/x", ("127.0.0.1:8", 1, 2)) == MISSING  # another learner's store
    assert answer_offer(None, "push/1/x", ("127.0.0.1:9", 1, 2)) == MISSING  # restarted, or cut short


class _Group:
    """Stands in for a process group: records that it was torn down (the last reference let go)."""

    released: ClassVar[list[str]] = []

    def __init__(self, name: str) -> None:
        self.name = name

    def __del__(self) -> None:
        _Group.released.append(self.name)


def _wait_released(name: str) -> bool:
    import time

    deadline = time.monotonic() + 5
    while name not in _Group.released and time.monotonic() < deadline:
        time.sleep(0.01)
    return name in _Group.released


def test_the_keeper_hands_its_group_to_the_next_push_and_a_failed_push_discards_it():
    keeper = GroupKeeper()
    assert keeper.take(("m", 2)) == (None, 0)
    keeper.keep(KeptGroup(_Group("g1"), "push/1/x", ("m", 2)), 0)
    kept, generation = keeper.take(("m", 2))
    assert kept is not None and kept.token == "push/1/x" and generation == 0
    assert keeper.take(("m", 2)) == (None, 0)  # taken: the push owns it now
    keeper.keep(kept, generation)
    del kept
    kept, _ = keeper.take(("m", 3))  # the members changed: torn down, not offered
    assert kept is None and _wait_released("g1")

    keeper.keep(KeptGroup(_Group("g2"), "push/2/x", ("m", 2)), 0)
    keeper.discard()  # the push's generator failed after sending: torn down
    assert _wait_released("g2") and keeper.take(("m", 2)) == (None, 1)
    keeper.keep(KeptGroup(_Group("g3"), "push/3/x", ("m", 2)), 0)  # a straggler of before the discard
    assert _wait_released("g3") and keeper.take(("m", 2)) == (None, 1)


def _handshake(pusher: WeightPusher, namespace: str, learner_kept, member_kept):
    """Both ends of one push's handshake (the generator on a thread); returns both groups."""
    learner_store = torch.distributed.PrefixStore(namespace, pusher.store)
    member_store = torch.distributed.PrefixStore(
        namespace,
        torch.distributed.TCPStore("127.0.0.1", pusher.port, is_master=False, timeout=timedelta(seconds=20)),
    )
    timeout = timedelta(seconds=20)
    out: dict[str, KeptGroup] = {}
    thread = threading.Thread(
        target=lambda: out.setdefault(
            "member", member_group(member_store, namespace, member_kept, ("me", 1, 2), 1, 2, timeout)
        )
    )
    thread.start()
    out["learner"] = learner_group(learner_store, namespace, learner_kept, ("them", 2), 2, timeout)
    thread.join(30)
    return out["learner"], out["member"]


def _broadcast_works(learner: KeptGroup, member: KeptGroup) -> bool:
    sent, received = torch.arange(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    work = start_broadcast(member.group, received)
    start_broadcast(learner.group, sent).wait()
    work.wait()
    return torch.equal(sent, received)


def test_the_handshake_reuses_a_group_both_hold_and_forms_one_when_a_generator_lost_its_own():
    pusher = WeightPusher(bind_port=0, advertise_host="127.0.0.1", api_token="t")
    learner, member = _handshake(pusher, "push/1/a", None, None)  # nothing to offer: a new group
    assert learner.token == member.token == "push/1/a" and _broadcast_works(learner, member)
    again, same = _handshake(pusher, "push/2/b", learner, member)
    assert again is learner and same is member and _broadcast_works(again, same)  # no new group
    # The generator restarted (it holds nothing): it says so, and both form a new group in the same push.
    fresh, formed = _handshake(pusher, "push/3/c", learner, None)
    assert fresh is not learner and fresh.token == formed.token == "push/3/c" and _broadcast_works(fresh, formed)


def test_stand_in_pushes_share_one_gloo_group_until_the_receiver_restarts():
    """Two pushes to one stand-in receiver use the group the first formed; after the receiver restarts
    (same id, same rank, nothing held) the next push forms a new one and still lands bitwise."""
    pusher = WeightPusher(bind_port=0, advertise_host="127.0.0.1", api_token="t", bucket_bytes=1 << 16)
    model = standin.build_model(seed=1, hidden=64, layers=3, device="cpu")
    receiver = start_receiver("cpu", seed=2, hidden=64, layers=3)
    try:
        for version in (1, 2, 3):
            _, answer, _ = push(pusher, receiver, model, version, "float32")
            assert "error" not in answer, answer
            assert answer["digests"] == standin.digests(model)
            assert pusher._groups._kept is not None and pusher._groups._kept.token == "push/1/test"
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(1.0)
        stop_receiver(receiver)
        receiver = start_receiver("cpu", seed=3, hidden=64, layers=3)
        _, answer, _ = push(pusher, receiver, model, 4, "float32")
        assert "error" not in answer, answer
        assert answer["digests"] == standin.digests(model)
        assert pusher._groups._kept is not None and pusher._groups._kept.token == "push/4/test"
    finally:
        stop_receiver(receiver)
        pusher.close()


def _open(worker, pusher: WeightPusher, namespace: str, learner_kept):
    """The generator's worker joins the push in ``namespace`` (on a thread) while the learner offers
    ``learner_kept``; returns the learner's group."""
    thread = threading.Thread(
        target=worker.weight_channel_open, args=("127.0.0.1", pusher.port, namespace, 1, 2, 20.0, 20.0, "gloo", "g")
    )
    thread.start()
    store = torch.distributed.PrefixStore(namespace, pusher.store)
    learner = learner_group(store, namespace, learner_kept, ("them", 2), 2, timedelta(seconds=20))
    thread.join(30)
    return learner


def test_a_generator_keeps_its_group_after_a_whole_push_and_drops_it_after_one_cut_short():
    from tests.gpu.standin import StandInWorker, build_model

    pusher = WeightPusher(bind_port=0, advertise_host="127.0.0.1", api_token="t")
    worker = StandInWorker(build_model(seed=0, hidden=8, layers=1, device="cpu"), torch.device("cpu"))
    learner = _open(worker, pusher, "push/1/a", None)
    worker._received = True  # as weight_channel_receive leaves it once every bucket arrived
    worker.weight_channel_close()
    kept = worker._gloo
    assert kept is not None and kept.token == "push/1/a"
    worker.weight_channel_close()  # closing again (the next open starts by closing) keeps it too
    assert worker._gloo is kept
    assert _open(worker, pusher, "push/2/b", learner) is learner and worker._gloo is kept  # reused
    worker.weight_channel_close()  # cut short: nothing received
    assert worker._gloo is None
    fresh = _open(worker, pusher, "push/3/c", learner)  # the learner offers; the generator holds nothing
    assert fresh is not learner and worker._gloo is not None and worker._gloo.token == "push/3/c"
    worker.weight_channel_open("127.0.0.1", pusher.port, "push/4/d", 0, 1, 20.0, 20.0, "shm", "g")
    assert worker._gloo is None  # moved to shared memory: the gloo group is let go
    worker.weight_channel_close()


def test_a_receiver_with_kept_buffers_starts_every_bucket_at_once_else_one_ahead():
    from weight_sync.collective import posting_schedule

    assert posting_schedule(4, 4) == ([0, 1, 2, 3], [[], [], [], []])  # the sender never waits for a recv
    assert posting_schedule(4, 9) == ([0, 1, 2, 3], [[], [], [], []])
    assert posting_schedule(4, 1) == ([0], [[1], [2], [3], []])  # bucket k+1 comes while k loads
    assert posting_schedule(4, 2) == ([0, 1], [[2], [3], [], []])
    assert posting_schedule(1, 1) == ([0], [[]])
    assert posting_schedule(0, 1) == ([], [])
    with pytest.raises(ValueError, match="at least the next bucket"):
        posting_schedule(3, 0)


class _RecordingGroup:
    """A gloo group stand-in that records when each broadcast starts and when its end is waited for."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def broadcast(self, tensors, options):
        index = sum(event.startswith("start") for event in self.events)
        self.events.append(f"start {index}")
        group = self

        class _Work:
            def wait(self) -> None:
                group.events.append(f"end {index}")

        return _Work()


def test_the_learner_sends_one_bucket_at_a_time_in_order():
    from weight_sync.plan import PushPlan
    from weight_sync.protocol import plan_buckets
    from weight_sync.push_thread import BucketPush, _pack_and_send

    named = [(f"w{i}", torch.full((256,), float(i))) for i in range(3)]
    _, buckets = plan_buckets(named, 1024, "float32")
    assert len(buckets) == 3
    plan = PushPlan(transports={"g": "gloo"}, ranks={"g": 1}, world_size=2, dtype="float32")
    push = BucketPush(None, "push/1/x", plan, named, buckets, None, None, frozenset())
    group = _RecordingGroup()
    assert _pack_and_send(push, torch.device("cpu"), timedelta(seconds=1), group) == 3 * 1024
    # Bucket k+1 is packed while k is sent, but starts only once k is sent: never two on the link at once.
    assert group.events == ["start 0", "end 0", "start 1", "end 1", "start 2", "end 2"]
