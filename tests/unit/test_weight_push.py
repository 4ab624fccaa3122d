"""Bucket layout, packing with the cast to the engine dtype, unpacking, the direct-load plan, and the CUDA
IPC record's round trip - everything of the weight path that needs no engine and no GPU."""

from __future__ import annotations

import pytest
import torch

from services.generator.weight_receiver import (
    DirectLoadUnavailable,
    TargetParam,
    bucket_byte_sizes,
    ipc_rebuild_args,
    plan_direct_load,
    source_names,
    stack_rows,
    unpack_bucket,
)
from services.learner.weight_push import pack_bucket, plan_buckets
from services.learner.weight_transport_ipc import ipc_record_from_args
from shared.codec import decode, encode
from shared.records import CudaIpcBucket, WeightVersionAnnouncement

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def _named():
    torch.manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(10, 4)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(4, 4)),
        ("model.layers.0.self_attn.k_proj.weight", torch.randn(2, 4)),
        ("model.layers.0.self_attn.v_proj.weight", torch.randn(2, 4)),
        ("model.norm.weight", torch.randn(4, dtype=torch.bfloat16)),
    ]


def _buffers(named, specs, buckets, dtype):
    layout = [s.model_dump() for s in specs]
    packed = [pack_bucket([named[i][1] for i in indices], dtype) for indices in buckets]
    return layout, packed


@pytest.mark.parametrize("dtype", [None, "bfloat16", "float32"])
def test_pack_and_unpack_round_trip_with_the_cast(dtype):
    named = _named()
    specs, buckets = plan_buckets(named, bucket_bytes=96, dtype=dtype)
    layout, packed = _buffers(named, specs, buckets, dtype)
    assert [b.numel() for b in packed] == bucket_byte_sizes(layout, len(buckets))
    got = {}
    for index, buffer in enumerate(packed):
        got.update(unpack_bucket(buffer, [s for s in layout if s["bucket"] == index]))
    for name, tensor in named:
        expected = tensor.to(getattr(torch, dtype)) if dtype else tensor
        assert got[name].dtype == expected.dtype and torch.equal(got[name], expected), name
    if dtype:
        assert {s.dtype for s in specs} == {dtype}
        assert sum(b.numel() for b in packed) == sum(t.numel() for _, t in named) * getattr(torch, dtype).itemsize


def test_buckets_hold_one_dtype_and_respect_the_size():
    named = _named()
    _, buckets = plan_buckets(named, bucket_bytes=96)
    for indices in buckets:
        assert len({named[i][1].dtype for i in indices}) == 1
        size = sum(named[i][1].numel() * named[i][1].element_size() for i in indices)
        assert size <= 96 or len(indices) == 1
    assert sorted(i for b in buckets for i in b) == list(range(len(named)))
    # float32 master weights for a bf16 engine travel as bf16: half the bytes, so fewer buckets.
    _, bf16_buckets = plan_buckets(named, bucket_bytes=96, dtype="bfloat16")
    assert len(bf16_buckets) < len(buckets)


def test_plan_buckets_refuses_integer_tensors():
    with pytest.raises(ValueError, match="pushes carry float32"):
        plan_buckets([("steps", torch.zeros(3, dtype=torch.int64))], 1024)


def test_source_names_of_stacked_parameters():
    assert source_names("model.layers.3.self_attn.qkv_proj.weight", PACKED) == (
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.k_proj.weight",
        "model.layers.3.self_attn.v_proj.weight",
    )
    assert source_names("model.layers.3.mlp.gate_up_proj.bias", PACKED)[1] == "model.layers.3.mlp.up_proj.bias"
    assert source_names("lm_head.weight", PACKED) == ("lm_head.weight",)


def _targets():
    return [
        TargetParam("model.embed_tokens.weight", ("model.embed_tokens.weight",), (10,), (4,), pad_rows=6),
        TargetParam(
            "model.layers.0.self_attn.qkv_proj.weight",
            source_names("model.layers.0.self_attn.qkv_proj.weight", PACKED),
            (4, 2, 2),
            (4,),
        ),
        TargetParam("model.norm.weight", ("model.norm.weight",), (4,), ()),
    ]


def test_direct_plan_maps_every_tensor_to_its_rows():
    pushed = {name: tuple(t.shape) for name, t in _named()}
    plan = plan_direct_load(pushed, _targets())
    assert plan == {
        "model.embed_tokens.weight": ("model.embed_tokens.weight", 0, 10),
        "model.layers.0.self_attn.q_proj.weight": ("model.layers.0.self_attn.qkv_proj.weight", 0, 4),
        "model.layers.0.self_attn.k_proj.weight": ("model.layers.0.self_attn.qkv_proj.weight", 4, 2),
        "model.layers.0.self_attn.v_proj.weight": ("model.layers.0.self_attn.qkv_proj.weight", 6, 2),
        "model.norm.weight": ("model.norm.weight", 0, 4),
    }
    assert _targets()[0].shape == (16, 4)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda p: p.pop("model.layers.0.self_attn.k_proj.weight"), "needs model.layers.0.self_attn.k_proj.weight"),
        (lambda p: p.update({"model.norm.weight": (5,)}), r"has shape \(5,\); model.norm.weight expects \(4,\)"),
        (lambda p: p.update({"extra.weight": (1,)}), "no engine parameter for extra.weight"),
    ],
)
def test_direct_plan_refuses_what_does_not_map_one_to_one(change, needle):
    pushed = {name: tuple(t.shape) for name, t in _named()}
    change(pushed)
    with pytest.raises(DirectLoadUnavailable, match=needle):
        plan_direct_load(pushed, _targets())


def test_stack_rows_is_a_view_when_the_pieces_lie_back_to_back():
    named = _named()[1:4]
    specs, buckets = plan_buckets(named, bucket_bytes=1 << 20)
    [buffer] = [pack_bucket([named[i][1] for i in indices]) for indices in buckets]
    pieces = [t for _, t in unpack_bucket(buffer, [s.model_dump() for s in specs])]
    stacked = stack_rows(pieces)
    assert torch.equal(stacked, torch.cat([t for _, t in named]))
    assert stacked.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # no copy
    apart = stack_rows([pieces[0], pieces[2]])  # not adjacent: copied
    assert torch.equal(apart, torch.cat([named[0][1], named[2][1]]))
    assert apart.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()


def test_ipc_record_travels_as_bytes_and_rebuilds_the_same_arguments():
    args = (
        torch.Tensor,
        torch.Size([4096]),
        (1,),
        128,
        torch.storage.TypedStorage,
        torch.uint8,
        3,
        b"\x01handle\x00" * 8,
        1 << 20,
        512,
        False,
        b"counter",
        7,
        b"\x02event",
        True,
    )
    record = ipc_record_from_args(5, "GPU-uuid", args)
    wire = encode(record)
    assert b"pickle" not in wire and decode(wire, CudaIpcBucket) == record
    rebuilt = ipc_rebuild_args(decode(wire, CudaIpcBucket), device_index=0)
    assert rebuilt[:6] == args[:6] and rebuilt[6] == 0 and rebuilt[7:] == args[7:]
    with pytest.raises(ValueError, match="flat uint8"):
        ipc_record_from_args(0, "GPU-uuid", (*args[:5], torch.float32, *args[6:]))


def test_announcement_keeps_ipc_generators_out_of_the_group():
    base = {"policy_version": 1, "rendezvous": "h:1", "namespace": "n", "world_size": 2}
    ok = WeightVersionAnnouncement(**base, ranks={"far": 1}, transports={"far": "nccl", "near": "ipc"})
    assert ok.participates("near") and ok.participates("far") and not ok.participates("other")
    assert ok.transport_of("near", "gloo") == "ipc"
    with pytest.raises(ValueError, match="joins no process group"):
        WeightVersionAnnouncement(**base, ranks={"near": 1}, transports={"near": "ipc"})
    with pytest.raises(ValueError, match="needs an entry in transports"):
        WeightVersionAnnouncement(**base, ranks={"far": 1}, transports={"near": "ipc"})
