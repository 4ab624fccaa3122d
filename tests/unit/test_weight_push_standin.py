"""The learner's sender and the generator's receiver code end to end on the CPU (gloo), with a torch model
standing in for vLLM's: weights bitwise equal after a push, loaded by the direct path in place (the
parameters are views of the receive buffers), and a second push with changed weights lands too.
The same driver runs over CUDA IPC in tests/gpu/test_weight_path.py."""

from __future__ import annotations

import torch

from services.learner.weight_push import WeightPusher
from tests.gpu import standin
from tests.gpu.weight_path import push, start_receiver, stop_receiver


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
