"""The weight path on one real GPU (skipped without CUDA).

* CUDA IPC: the learner's pusher on CUDA sends to a receiver process on the same GPU, through the
  generator's receiver code with a torch model standing in for vLLM's model runner: bitwise equal after a
  push, a second push with changed weights lands too, and the GB/s is printed next to a raw
  device-to-device copy of the same bytes (goal: at least half of it).
* What one GPU allows of NCCL: the transport choice from the real device UUID, bucket packing with the
  cast and unpacking on CUDA, and the refusal of two NCCL ranks on this one GPU.
"""

from __future__ import annotations

import pytest
import torch

from services.generator.weight_receiver import unpack_bucket
from services.learner.weight_push import WeightPusher, learner_device, pack_bucket, plan_buckets
from services.learner.weight_transport import PushRefused, plan_push
from shared.records import GeneratorRegistration
from tests.gpu import standin
from tests.gpu.weight_path import push, start_receiver, stop_receiver

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HIDDEN, LAYERS = 4096, 8  # 8 x 64 MiB float32 weights: about 0.5 GiB per push


def _raw_copy_seconds(nbytes: int, repeats: int = 5) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return best


def test_ipc_push_to_a_receiver_on_the_same_gpu_is_bitwise_and_fast():
    device = torch.device("cuda", 0)
    pusher = WeightPusher(bind_port=0, advertise_host="127.0.0.1", api_token="t", bucket_bytes=128 << 20, device=device)
    receiver = start_receiver("cuda:0", seed=2, hidden=HIDDEN, layers=LAYERS)
    try:
        assert receiver.uuid == pusher.learner.uuid
        model = standin.build_model(seed=1, hidden=HIDDEN, layers=LAYERS, device="cuda")
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        timings = []
        for version in (1, 2, 3):
            plan, answer, seconds = push(pusher, receiver, model, version, "float32")
            assert plan.transports == {"standin": "ipc"} and plan.ranks == {} and plan.world_size == 1
            assert "error" not in answer, answer
            assert answer["digests"] == standin.digests(model), f"push {version} is not bitwise equal"
            assert answer["result"]["direct"] == 1.0
            timings.append(max(seconds, answer["result"]["seconds"]))
            with torch.no_grad():
                for param in model.parameters():
                    param.mul_(-0.5)
    finally:
        stop_receiver(receiver)
    raw = _raw_copy_seconds(nbytes)
    ours = min(timings[1:])  # the first push also opens the IPC handles
    print(
        f"\n{torch.cuda.get_device_name(device)}: IPC push of {nbytes / 1e9:.2f} GB in {ours * 1e3:.1f} ms "
        f"({nbytes / ours / 1e9:.1f} GB/s) vs raw device-to-device copy {raw * 1e3:.2f} ms "
        f"({nbytes / raw / 1e9:.1f} GB/s): ratio {raw / ours:.2f} (goal >= 0.5)"
    )


def test_ipc_push_casts_float32_master_weights_to_a_bf16_engine():
    device = torch.device("cuda", 0)
    pusher = WeightPusher(bind_port=0, advertise_host="127.0.0.1", api_token="t", bucket_bytes=8 << 20, device=device)
    receiver = start_receiver("cuda:0", seed=2, hidden=256, layers=2)
    try:
        model = standin.build_model(seed=1, hidden=256, layers=2, device="cuda")
        reference = standin.build_model(seed=1, hidden=256, layers=2, device="cuda").to(torch.bfloat16)
        plan, answer, _ = push(pusher, receiver, model, 1, "bfloat16")
        assert plan.dtype == "bfloat16" and "error" not in answer, answer
        # The stand-in's parameters are float32: they hold the bf16 values the cast produced.
        expected = standin.digests(reference.to(torch.float32))
        assert answer["digests"] == expected
    finally:
        stop_receiver(receiver)


def test_transport_choice_from_this_gpu_uuid():
    learner = learner_device(torch.device("cuda", 0))
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    assert learner.uuid == uuid and learner.versions.nccl and learner.versions.torch == torch.__version__

    def gen(gid: str, *uuids: str) -> GeneratorRegistration:
        return GeneratorRegistration(
            generator_id=gid,
            url="http://x",
            policy_version=0,
            device="cuda:0",
            device_uuids=uuids,
            versions=learner.versions,
        )

    assert plan_push(learner, [gen("near", uuid), gen("far", "GPU-elsewhere")]).transports == {
        "near": "ipc",
        "far": "nccl",
    }
    with pytest.raises(PushRefused, match="two ranks on one physical GPU"):
        plan_push(learner, [gen("a", "GPU-elsewhere"), gen("b", "GPU-elsewhere")])


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_buckets_pack_and_unpack_on_cuda(dtype):
    torch.manual_seed(0)
    named = [(f"w{i}", torch.randn(257, 129, device="cuda")) for i in range(6)]
    named.append(("h", torch.randn(33, device="cuda", dtype=torch.bfloat16)))
    specs, buckets = plan_buckets(named, bucket_bytes=300_000, dtype=dtype)
    layout = [s.model_dump() for s in specs]
    got = {}
    for index, indices in enumerate(buckets):
        buffer = pack_bucket([named[i][1] for i in indices], dtype)
        assert buffer.is_cuda
        got.update(unpack_bucket(buffer, [s for s in layout if s["bucket"] == index]))
    for name, tensor in named:
        expected = tensor.to(getattr(torch, dtype)) if dtype else tensor
        assert torch.equal(got[name], expected), name
