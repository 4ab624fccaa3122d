"""The learner's sender and the generator's receiver code end to end on the CPU (gloo), with a torch model
standing in for vLLM's: weights bitwise equal after a push, loaded by the direct path in place (the
parameters are views of the receive buffers), and a second push with changed weights lands too.
The same driver runs over CUDA IPC in tests/gpu/test_weight_path.py."""

from __future__ import annotations

import pytest
import torch

from services.learner.model import linear_weight_names
from tests.gpu import standin
from tests.gpu.weight_path import digests, push, start_receiver, stop_receiver
from weight_sync.send_buffers import own_parameters, place_parameters
from weight_sync.sender import WeightPusher


def test_gloo_push_to_a_stand_in_receiver_is_bitwise_and_direct():
    pusher = WeightPusher(bind_port=0, advertise_host="127.0.0.1", api_token="t", bucket_bytes=1 << 16)
    receiver = start_receiver("cpu", seed=2, hidden=64, layers=3)
    try:
        model = standin.build_model(seed=1, hidden=64, layers=3, device="cpu")
        for version in (1, 2):
            plan, answer, _ = push(pusher, receiver, model, version, "float32")
            assert plan.transports == {"standin": "gloo"} and plan.ranks == {"standin": 1}
            assert "error" not in answer, answer
            assert answer["digests"] == standin.digests(model)
            assert answer["result"]["direct"] == 1.0
            # Every parameter is its own tensor in a bucket: all of them become views of the receive buffers,
            # which the second push is received into.
            assert answer["result"]["aliased_bytes"] == answer["result"]["bytes"]
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(1.0)
    finally:
        stop_receiver(receiver)


@pytest.mark.parametrize("transposed", [False, True])
def test_shm_push_to_a_stand_in_receiver_is_bitwise_and_keeps_nothing_of_the_segments(tmp_path, transposed):
    """A CPU learner that sees the receiver's probe pushes through shared memory: no group, no rank; the
    weights are bitwise equal after each push, the second push packs into the same segments (the parameters
    live in them by then: nothing is copied), and packing
    anything into them afterwards (as the next push does, while the receiver still samples) changes nothing
    on the receiver. ``transposed``: the linear weights travel transposed (as to engines that repack them),
    and the parameters placed in the segments are transposed views of them: still bitwise."""
    pusher = WeightPusher(
        bind_port=0, advertise_host="127.0.0.1", api_token="t", bucket_bytes=1 << 16, shm_dir=str(tmp_path)
    )
    receiver = start_receiver("cpu", seed=2, hidden=64, layers=3, shm_dir=str(tmp_path))
    try:
        model = standin.build_model(seed=1, hidden=64, layers=3, device="cpu")
        linear = linear_weight_names(model) if transposed else frozenset()
        assert len(linear) == (3 if transposed else 0)
        segment_paths = []
        for version in (1, 2):
            plan, answer, _ = push(pusher, receiver, model, version, "float32", linear)
            assert plan.transports == {"standin": "shm"} and plan.ranks == {} and plan.world_size == 1
            assert "error" not in answer, answer
            assert answer["digests"] == standin.digests(model)
            assert answer["result"]["direct"] == 1.0 and answer["result"]["aliased_bytes"] == 0
            assert answer["result"]["copied_borrowed_bytes"] == 0
            segment_paths.append(sorted(p.name for p in tmp_path.glob("asyncgrpo-weights-*")))
            # As the learner's loop does: the parameters move into the segments, so push 2 packs by no copy.
            assert len(place_parameters(model, pusher.weight_homes())) == len(list(model.parameters()))
            assert (model[1].weight.stride() == (1, 64)) == transposed
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(1.0)
        assert segment_paths[0] == segment_paths[1] and len(segment_paths[0]) > 1  # kept from push to push
        own_parameters(list(model.parameters()))  # the segments are written below
        loaded = digests(receiver)
        assert pusher._send_buffers is not None
        for tensor in pusher._send_buffers[1]:
            tensor.fill_(7)
        assert digests(receiver) == loaded
    finally:
        stop_receiver(receiver)
        pusher.close()
    assert list(tmp_path.glob("asyncgrpo-*")) == []  # the segments and the receiver's probe are gone
