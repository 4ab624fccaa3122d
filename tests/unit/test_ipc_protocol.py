"""The CPU-checkable parts of the CUDA IPC push (the device parts run in tests/gpu): the wait for the receivers'
answers in the learner's store, the receiver's copy plan, the kept record's key, and the layout a receiver keeps
from push to push."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

from shared.records import IPC_DONE_OK, ipc_done_key
from weight_sync.collective import join_store
from weight_sync.protocol import KeptLayout, plan_buckets
from weight_sync.transport_ipc import SEPARATE_COPY_BYTES, CopyPlan, _answers, _memory_key, wait_ipc


def test_every_receiver_that_answered_with_an_error_is_named(weight_store):
    learner, port = weight_store
    receiver = join_store("127.0.0.1", port, "push/1", timedelta(seconds=5))
    receiver.set(ipc_done_key("a"), IPC_DONE_OK)
    receiver.set(ipc_done_key("b"), b"RuntimeError: the IPC record and the announced layout disagree")
    receiver.set(ipc_done_key("c"), b"CUDA error: out of memory")
    with pytest.raises(RuntimeError, match="could not load the weights: b: RuntimeError: the IPC rec") as caught:
        wait_ipc(learner, ["a", "b", "c"], timedelta(seconds=5))
    assert "c: CUDA error: out of memory" in str(caught.value) and "a:" not in str(caught.value)


def test_the_answers_are_read_once_all_are_set_across_slices_of_the_store_timeout(weight_store):
    learner, port = weight_store
    receiver = join_store("127.0.0.1", port, "push/1", timedelta(seconds=5))
    keys = [ipc_done_key(gid) for gid in ("a", "b")]

    def answer_late() -> None:
        time.sleep(0.7)  # longer than the learner's store timeout: the read goes on in a second slice
        receiver.set(keys[0], b"first")
        receiver.set(keys[1], b"second")

    thread = threading.Thread(target=answer_late)
    thread.start()
    assert _answers(learner, keys, timedelta(seconds=10)) == [b"first", b"second"]
    thread.join()
    for timeout in (0.2, 0.6):  # inside the store's timeout of 0.4 s, and past it
        started = time.monotonic()
        with pytest.raises(torch.distributed.DistStoreError):  # nobody answers: it ends at the push's timeout
            _answers(learner, [ipc_done_key("c")], timedelta(seconds=timeout))
        assert timeout <= time.monotonic() - started < timeout + 0.3


@pytest.fixture
def weight_store():
    master = torch.distributed.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=0.4), wait_for_workers=False)
    yield torch.distributed.PrefixStore("push/1", master), master.port


def test_the_copy_plan_copies_large_tensors_one_by_one_and_small_ones_together():
    assert SEPARATE_COPY_BYTES == 128 << 20  # the default; here a threshold of 4 KiB stands in for it
    big = 1024  # float32 elements of exactly the threshold
    sources = [torch.randn(big), torch.randn(16), torch.randn(big + 1), torch.randn(3, 5)]
    destinations = [torch.zeros(big), torch.zeros(16, dtype=torch.bfloat16), torch.zeros(big + 1), torch.zeros(3, 5)]
    padding = [torch.ones(4)]
    plan = CopyPlan.of(destinations, sources, padding, separate_bytes=4096)
    assert [d is destinations[0] or d is destinations[2] for d, _ in plan.separate] == [True, True]
    assert plan.batched[0] == [destinations[1], destinations[3]] and plan.batched[1] == [sources[1], sources[3]]
    plan.run()
    for destination, source in zip(destinations, sources, strict=True):
        assert torch.equal(destination, source.to(destination.dtype))  # the small bf16 one cast as it is copied
    assert torch.equal(padding[0], torch.zeros(4))
    with pytest.raises(ValueError):
        CopyPlan.of(destinations, sources[:3], [])


def test_the_kept_record_key_follows_the_memory_not_the_values():
    weight, bias = torch.randn(8, 4), torch.randn(4)
    named = [("w", weight), ("b", bias)]
    key = _memory_key(named)
    weight.mul_(2.0)  # an optimizer step: same memory, same record
    assert _memory_key([("w", weight.detach()), ("b", bias.detach())]) == key
    assert _memory_key([("w", weight.clone()), ("b", bias)]) != key  # new memory
    assert _memory_key([("w", weight.view(4, 8)), ("b", bias)]) != key  # same memory, another shape
    assert _memory_key([("w", weight.t()), ("b", bias)]) != key  # strides
    assert _memory_key([("w", weight.view(torch.int32)), ("b", bias)]) != key  # dtype
    assert _memory_key([("w2", weight), ("b", bias)]) != key  # name


def test_a_receiver_reads_a_repeated_layout_once():
    named = [(f"w{i}", torch.zeros(4, 4)) for i in range(3)]
    specs, _ = plan_buckets(named, 1 << 20, None)
    kept = KeptLayout()
    first = kept.read([s.model_dump() for s in specs])
    assert first == specs
    assert kept.read([s.model_dump() for s in specs]) is first  # an equal layout, sent anew
    changed = [s.model_dump() for s in specs]
    changed[1]["shape"] = (2, 8)
    again = kept.read(changed)
    assert again is not first and tuple(again[1].shape) == (2, 8)
    with pytest.raises(ValueError):
        kept.read([{**changed[0], "dtype": "float99"}])
