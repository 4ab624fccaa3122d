"""Bucket layout, packing with the cast to the engine dtype, unpacking, the direct-load plan and its in-place
copy list (what an IPC receiver copies), and the CUDA IPC record's round trip - everything of the weight path
that needs no engine and no GPU."""

from __future__ import annotations

import gc

import httpx
import pytest
import torch

from shared.codec import decode, encode
from shared.records import CudaIpcWeights, TensorSpec, WeightVersionAnnouncement
from weight_sync.direct_load import (
    DirectLoader,
    DirectLoadUnavailable,
    PendingHandle,
    TargetParam,
    describe_targets,
    is_transposed,
    joined_view,
    plan_direct_load,
    source_names,
    stack_rows,
)
from weight_sync.protocol import (
    bucket_byte_sizes,
    bucket_views,
    joined_names,
    lies_in,
    pack_bucket,
    plan_buckets,
    read_layout,
    stacked_order,
    unpack_bucket,
)
from weight_sync.send_buffers import slot_views
from weight_sync.sender import _PHASES, _describe, _phases_of, _slowest_phases
from weight_sync.transport_ipc import ipc_rebuild_args, ipc_record_from_args

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


def _sizes(layout, num_buckets):
    return bucket_byte_sizes(read_layout(layout), num_buckets)


def _buffers(named, specs, buckets, dtype):
    layout = [s.model_dump() for s in specs]
    packed = [pack_bucket([named[i][1] for i in indices], dtype) for indices in buckets]
    return layout, packed


@pytest.mark.parametrize("dtype", [None, "bfloat16", "float32"])
def test_pack_and_unpack_round_trip_with_the_cast(dtype):
    named = _named()
    specs, buckets = plan_buckets(named, bucket_bytes=96, dtype=dtype)
    layout, packed = _buffers(named, specs, buckets, dtype)
    assert [b.numel() for b in packed] == _sizes(layout, len(buckets))
    got = {}
    for index, buffer in enumerate(packed):
        got.update(unpack_bucket(buffer, [s for s in read_layout(layout) if s.bucket == index]))
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
    pieces = [t for _, t in unpack_bucket(buffer, specs)]
    stacked = stack_rows(pieces)
    assert torch.equal(stacked, torch.cat([t for _, t in named]))
    assert stacked.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # no copy
    apart = stack_rows([pieces[0], pieces[2]])  # not adjacent: copied
    assert torch.equal(apart, torch.cat([named[0][1], named[2][1]]))
    assert apart.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()


def test_ipc_record_travels_as_bytes_and_rebuilds_the_same_arguments():
    tensor = torch.zeros(32, 32)  # 4096 bytes
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
    record = CudaIpcWeights(device_uuid="GPU-uuid", tensors=(ipc_record_from_args("w", tensor, args),))
    wire = encode(record)
    assert b"pickle" not in wire and decode(wire, CudaIpcWeights) == record
    sent = decode(wire, CudaIpcWeights).tensors[0]
    assert (sent.name, sent.dtype, sent.shape, sent.nbytes) == ("w", "float32", (32, 32), 4096)
    rebuilt = ipc_rebuild_args(sent, device_index=0)
    assert rebuilt[:6] == args[:6] and rebuilt[6] == 0 and rebuilt[7:] == args[7:]
    with pytest.raises(ValueError, match="flat uint8"):
        ipc_record_from_args("w", tensor, (*args[:5], torch.float32, *args[6:]))
    with pytest.raises(ValueError, match="4096 bytes for float32 of shape"):  # the bytes must fit the shape
        ipc_record_from_args("w", torch.zeros(16, 16), args)
    with pytest.raises(ValueError, match="float64"):
        ipc_record_from_args("w", torch.zeros(16, 32, dtype=torch.float64), args)


def test_announcement_keeps_ipc_generators_out_of_the_group():
    base = {"policy_version": 1, "rendezvous": "h:1", "namespace": "n", "world_size": 2}
    ok = WeightVersionAnnouncement(**base, ranks={"far": 1}, transports={"far": "nccl", "near": "ipc"})
    assert ok.participates("near") and ok.participates("far") and not ok.participates("other")
    assert ok.transport_of("near", "gloo") == "ipc"
    with pytest.raises(ValueError, match="joins no process group"):
        WeightVersionAnnouncement(**base, ranks={"near": 1}, transports={"near": "ipc"})
    shm = WeightVersionAnnouncement(**base, ranks={"far": 1}, transports={"far": "gloo", "near": "shm"})
    assert shm.participates("near") and shm.transport_of("near", "gloo") == "shm"
    with pytest.raises(ValueError, match="joins no process group"):
        WeightVersionAnnouncement(**base, ranks={"near": 1}, transports={"near": "shm"})
    with pytest.raises(ValueError, match="needs an entry in transports"):
        WeightVersionAnnouncement(**base, ranks={"far": 1}, transports={"near": "ipc"})


# The direct loader on a model built like vLLM-CPU's ---------------------------------------------------------


def _cpu_method(class_name: str, remove_weight: bool):
    """vLLM-CPU's unquantized method, as far as loading goes: after loading it packs the weight into a kernel
    handle of its own (here a clone) and, for linear layers, drops the parameter's data."""

    def process_weights_after_loading(self, layer):
        self.calls += 1
        packed = layer.weight.detach().clone()
        layer.cpu_linear = lambda x, weight, bias, _packed=packed: torch.nn.functional.linear(x, _packed, bias)
        if remove_weight:
            layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)

    method = type(class_name, (), {"process_weights_after_loading": process_weights_after_loading})()
    method.calls = 0
    return method


class _Layer(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, method, **attrs) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.quant_method = method
        for key, value in attrs.items():
            setattr(self, key, value)
        method.process_weights_after_loading(self)


class _CpuEngineModel(torch.nn.Module):
    """An embedding tied to the LM head, a fused qkv projection whose weight lives only in its handle, and a
    norm - the cases the CPU direct loader must get right."""

    packed_modules_mapping = PACKED

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = _Layer(torch.zeros(10, 4), _cpu_method("UnquantizedEmbeddingMethod", False))
        attn = torch.nn.Module()
        attn.qkv_proj = _Layer(
            torch.zeros(8, 4),
            _cpu_method("UnquantizedLinearMethod", True),
            output_partition_sizes=[4, 2, 2],
            input_size_per_partition=4,
        )
        layer = torch.nn.Module()
        layer.self_attn = attn
        self.model.layers = torch.nn.ModuleList([layer])
        self.model.norm = torch.nn.Module()
        self.model.norm.weight = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.lm_head = torch.nn.Module()
        self.lm_head.quant_method = _cpu_method("UnquantizedEmbeddingMethod", False)
        self.lm_head.weight = self.model.embed_tokens.weight  # tied, as vLLM's tie_weights does
        self.lm_head.quant_method.process_weights_after_loading(self.lm_head)

    def outputs(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the engine computes with: the handles (or views) and the embedding table."""
        qkv = self.model.layers[0].self_attn.qkv_proj
        return {
            "qkv": qkv.cpu_linear(x, qkv.weight, None),
            "lm_head": self.lm_head.cpu_linear(x, self.lm_head.weight, None),
            "embed": self.model.embed_tokens.weight[torch.tensor([1, 7])],
            "norm": self.model.norm.weight.clone(),
        }


def _expected(named, x: torch.Tensor) -> dict[str, torch.Tensor]:
    w = {name: t.float() for name, t in named}
    qkv = torch.cat([w[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    embed = w["model.embed_tokens.weight"]
    return {
        "qkv": x @ qkv.T,
        "lm_head": x @ embed.T,
        "embed": embed[torch.tensor([1, 7])],
        "norm": w["model.norm.weight"],
    }


def _load(model, named, bucket_bytes: int, alias: bool, buffers=None, borrowed: bool = False):
    """One push of ``named`` into ``model`` through the direct loader; returns the loader and the buffers the
    buckets were received into (``buffers`` again when given, as a worker keeping them does). ``borrowed``:
    loaded from the sender's buffers themselves, as over shared memory."""
    specs, buckets = plan_buckets(named, bucket_bytes=bucket_bytes, dtype="float32")
    layout, packed = _buffers(named, specs, buckets, "float32")
    if borrowed:
        buffers = packed
    elif buffers is None:
        buffers = [torch.empty_like(b) for b in packed]
    if not borrowed:
        for buffer, sent in zip(buffers, packed, strict=True):
            buffer.copy_(sent)  # what the receive does
    return _load_buckets(model, layout, buffers, alias=alias, borrowed=borrowed), buffers


def _load_buckets(model, layout, buffers, **options) -> DirectLoader:
    """A direct loader (``options`` as DirectLoader takes them) fed every bucket of ``layout`` from ``buffers``."""
    targets = describe_targets(model, tensor_parallel_size=1)
    plan = plan_direct_load({s["name"]: tuple(s["shape"]) for s in layout}, targets)
    loader = DirectLoader(model, plan, targets, **options)
    for index, buffer in enumerate(buffers):
        loader.add_all(unpack_bucket(buffer, [s for s in read_layout(layout) if s.bucket == index]))
    loader.finish()
    return loader


def _changed(named, by: float):
    return [(name, t + by) for name, t in named]


def test_a_tied_lm_head_is_one_target_and_its_handle_is_rebuilt():
    model = _CpuEngineModel()
    names = [t.name for t in describe_targets(model, tensor_parallel_size=1)]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    x = torch.randn(3, 4)
    named = _named()
    loader, _ = _load(model, named, bucket_bytes=1 << 20, alias=False)
    for key, value in model.outputs(x).items():
        torch.testing.assert_close(value, _expected(named, x)[key], msg=key)
    assert loader.aliased_bytes == 0
    assert model.lm_head.quant_method.calls == 2 and model.model.embed_tokens.quant_method.calls == 2


def test_aliased_parameters_take_the_next_push_with_no_loading():
    model = _CpuEngineModel()
    x = torch.randn(3, 4)
    named = _named()
    loader, buffers = _load(model, named, bucket_bytes=1 << 20, alias=True)
    for key, value in model.outputs(x).items():
        torch.testing.assert_close(value, _expected(named, x)[key], msg=key)
    assert loader.aliased_bytes == sum(b.numel() for b in buffers)  # every byte: no copy at all
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.cpu_linear is torch.nn.functional.linear and qkv.quant_method.calls == 1  # no handle made
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie holds
    storages = {b.untyped_storage().data_ptr() for b in buffers}
    assert {p.untyped_storage().data_ptr() for p in model.parameters()} <= storages

    # The next push is received into the same buffers: the engine computes with it before any loading ...
    newer = _changed(named, 1.0)
    specs, buckets = plan_buckets(newer, bucket_bytes=1 << 20, dtype="float32")
    for buffer, sent in zip(buffers, _buffers(newer, specs, buckets, "float32")[1], strict=True):
        buffer.copy_(sent)
    for key, value in model.outputs(x).items():
        torch.testing.assert_close(value, _expected(newer, x)[key], msg=key)
    # ... and the loader, run as every push runs it, finds nothing to do.
    ptrs = {name: p.data_ptr() for name, p in model.named_parameters()}
    _load(model, newer, bucket_bytes=1 << 20, alias=True, buffers=buffers)
    assert ptrs == {name: p.data_ptr() for name, p in model.named_parameters()}
    for key, value in model.outputs(x).items():
        torch.testing.assert_close(value, _expected(newer, x)[key], msg=key)


def test_pieces_split_across_buckets_are_copied_and_the_handle_rebuilt():
    model = _CpuEngineModel()
    x = torch.randn(3, 4)
    named = _named()
    # 64-byte buckets put q (64 bytes) alone, so q, k, v of the fused projection are not back to back.
    loader, buffers = _load(model, named, bucket_bytes=64, alias=True)
    assert len(buffers) > 2
    for key, value in model.outputs(x).items():
        torch.testing.assert_close(value, _expected(named, x)[key], msg=key)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.cpu_linear is not torch.nn.functional.linear and qkv.quant_method.calls == 2
    qkv_bytes = 8 * 4 * 4
    assert loader.aliased_bytes == sum(b.numel() for b in buffers) - qkv_bytes
    # Aliased once, the layout changes: the parameters are copied or rebound, never left stale.
    newer = _changed(named, -2.0)
    _load(model, newer, bucket_bytes=1 << 20, alias=False)
    for key, value in model.outputs(x).items():
        torch.testing.assert_close(value, _expected(newer, x)[key], msg=key)


class _GpuEngineModel(torch.nn.Module):
    """vLLM's layout on a GPU: plain bf16 parameters (no kernel handles), a fused qkv projection and an
    embedding padded to 12 rows beyond its 10-token vocabulary."""

    packed_modules_mapping = PACKED

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Module()
        self.model.embed_tokens.weight = torch.nn.Parameter(torch.full((12, 4), 9.0, dtype=torch.bfloat16))
        self.model.embed_tokens.org_vocab_size = 10
        attn = torch.nn.Module()
        attn.qkv_proj = torch.nn.Module()
        attn.qkv_proj.weight = torch.nn.Parameter(torch.zeros(8, 4, dtype=torch.bfloat16))
        attn.qkv_proj.output_partition_sizes = [4, 2, 2]
        layer = torch.nn.Module()
        layer.self_attn = attn
        self.model.layers = torch.nn.ModuleList([layer])
        self.model.norm = torch.nn.Module()
        self.model.norm.weight = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))


def test_in_place_copies_cast_into_the_rows_of_each_parameter_and_zero_the_padding():
    model = _GpuEngineModel()
    named = _named()  # float32 (and one bf16) tensors, as an IPC push hands them over: the receiver casts
    targets = describe_targets(model, tensor_parallel_size=1)
    plan = plan_direct_load({name: tuple(t.shape) for name, t in named}, targets)
    loader = DirectLoader(model, plan, targets)
    destinations, sources, padding = loader.in_place_copies(named)
    assert [s.data_ptr() for s in sources] == [t.data_ptr() for _, t in named]
    ptrs = {name: p.data_ptr() for name, p in model.named_parameters()}
    torch._foreach_copy_(destinations, sources)
    torch._foreach_zero_(padding)
    assert ptrs == {name: p.data_ptr() for name, p in model.named_parameters()}  # in place: graphs stay valid
    w = {name: t.to(torch.bfloat16) for name, t in named}
    embed = model.model.embed_tokens.weight
    assert torch.equal(embed[:10], w["model.embed_tokens.weight"]) and not embed[10:].any()
    qkv = torch.cat([w[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.weight, qkv)
    assert torch.equal(model.model.norm.weight, w["model.norm.weight"])
    with pytest.raises(RuntimeError, match="the push carries 4 tensors"):
        loader.in_place_copies(named[:4])


def test_in_place_copies_leave_cpu_layers_with_kernel_handles_to_the_loader():
    model = _CpuEngineModel()
    named = _named()
    targets = describe_targets(model, tensor_parallel_size=1)
    plan = plan_direct_load({name: tuple(t.shape) for name, t in named}, targets)
    assert DirectLoader(model, plan, targets).in_place_copies(named) is None


def test_pack_bucket_into_a_buffer_casts_while_copying_and_checks_the_size():
    named = _named()
    tensors = [t for _, t in named]
    expected = pack_bucket(tensors, "bfloat16")
    out = torch.full((expected.numel(),), 7, dtype=torch.uint8)
    assert pack_bucket(tensors, "bfloat16", out) is out and torch.equal(out, expected)
    with pytest.raises(ValueError, match=r"bucket buffer holds 3 torch\.uint8"):
        pack_bucket(tensors, "bfloat16", torch.empty(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="a bucket carries one dtype"):
        pack_bucket(tensors)  # float32 and a bfloat16 norm, no cast


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_slot_views_are_where_pack_bucket_puts_each_tensor_that_travels_uncast(dtype):
    named = [(n, t.float()) for n, t in _named()] if dtype else _named()
    named.append(("model.layers.0.mlp.gate_proj.weight", torch.randn(3, 4, dtype=torch.bfloat16)))
    _, buckets = plan_buckets(named, bucket_bytes=96, dtype=dtype)
    buffers = [pack_bucket([named[i][1] for i in indices], dtype) for indices in buckets]
    views = slot_views(named, buckets, dtype, buffers)
    uncast = {name for name, t in named if dtype is None or t.dtype == torch.float32}
    assert set(views) == uncast
    for name, tensor in named:
        if name in views:
            assert views[name].dtype == tensor.dtype and torch.equal(views[name], tensor)
            assert views[name].untyped_storage().data_ptr() in {b.data_ptr() for b in buffers}


def test_placed_parameters_are_packed_by_no_copy_and_stay_exact_and_can_be_owned_again(monkeypatch):
    from weight_sync.send_buffers import own_parameters, place_parameters

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    _, buckets = plan_buckets(named, bucket_bytes=64, dtype="float32")
    assert len(buckets) > 1
    buffers = [pack_bucket([named[i][1] for i in indices], "float32") for indices in buckets]
    before = {n: t.clone() for n, t in named}
    placed = place_parameters(model, slot_views(named, buckets, "float32", buffers))
    assert len(placed) == 4
    starts = {b.data_ptr() for b in buffers}
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name])
        assert param.untyped_storage().data_ptr() in starts  # the parameter lives in its slot
    # An optimizer step changes the parameters where they lie; packing them again copies nothing and the
    # buckets hold exactly what packing a private copy of them gives.
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    copies = []
    copy = torch.Tensor.copy_
    for indices, buffer in zip(buckets, buffers, strict=True):
        tensors = [named[i][1] for i in indices]
        expected = pack_bucket([t.clone() for t in tensors], "float32")
        monkeypatch.setattr(
            torch.Tensor, "copy_", lambda self, src, *a, **k: copies.append(1) or copy(self, src, *a, **k)
        )
        assert pack_bucket(tensors, "float32", buffer) is buffer and torch.equal(buffer, expected)
        monkeypatch.undo()
    assert copies == []  # nothing was copied: the parameters are their slots
    assert place_parameters(model, slot_views(named, buckets, "float32", buffers)) == placed  # nothing moves
    # A cast push's slots are not the parameters: nothing is placed there.
    assert place_parameters(model, slot_views(named, buckets, "bfloat16", buffers)) == []
    own_parameters(placed)
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    for buffer in buffers:
        buffer.fill_(7)
    for name, param in model.named_parameters():
        assert param.untyped_storage().data_ptr() not in starts and torch.equal(param, values[name])


def test_the_pusher_packs_into_the_same_cpu_buffers_while_the_layout_holds():
    import threading

    from weight_sync.push_thread import SendThread
    from weight_sync.sender import WeightPusher

    pusher = WeightPusher(bind_port=0, advertise_host="127.0.0.1", api_token="t", bucket_bytes=96)
    named = _named()
    specs, buckets = plan_buckets(named, bucket_bytes=96, dtype="float32")
    first, segments = pusher._buffers_for(specs, len(buckets), shared=False)
    assert segments is None
    assert first is not None and [b.numel() for b in first] == _sizes([s.model_dump() for s in specs], len(buckets))
    assert pusher._buffers_for(specs, len(buckets), shared=False)[0] is first
    other_specs, other_buckets = plan_buckets(named, bucket_bytes=1 << 20, dtype="float32")
    assert pusher._buffers_for(other_specs, len(other_buckets), shared=False)[0] is not first
    # A push whose sending thread still runs (it timed out, say) may still read its buffers: new ones.
    again = pusher._buffers_for(other_specs, len(other_buckets), shared=False)[0]
    release = threading.Event()
    pusher._sender = SendThread(lambda: int(release.wait(30)))
    try:
        assert pusher._buffers_for(other_specs, len(other_buckets), shared=False)[0] is not again
    finally:
        release.set()


# Loading from memory the learner writes the next push into (shared memory) ---------------------------------


def _fallback_method():
    """vLLM-CPU's plain ``linear`` fallback: the layer computes with its weight parameter itself."""

    def process_weights_after_loading(self, layer):
        self.calls += 1
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    method = type("UnquantizedLinearMethod", (), {"process_weights_after_loading": process_weights_after_loading})()
    method.calls = 0
    return method


@pytest.mark.parametrize("fallback", [False, True])
def test_nothing_keeps_pointing_into_borrowed_buffers(fallback):
    """Packed kernels make their own copy (nothing to do); a layer that computes with its weight itself gets a
    copy. Either way, overwriting the buffers afterwards (the learner packing the next push while the engine
    still samples) changes nothing the engine computes with."""
    model = _CpuEngineModel()
    qkv = model.model.layers[0].self_attn.qkv_proj
    if fallback:
        qkv.quant_method = _fallback_method()
    x = torch.randn(3, 4)
    named = _named()
    loader, buffers = _load(model, named, bucket_bytes=1 << 20, alias=False, borrowed=True)
    before = model.outputs(x)
    for key, value in before.items():
        torch.testing.assert_close(value, _expected(named, x)[key], msg=key)
    assert loader.copied_borrowed_bytes == (8 * 4 * 4 if fallback else 0)
    storages = {b.untyped_storage().data_ptr() for b in buffers}
    assert not {p.untyped_storage().data_ptr() for p in model.parameters()} & storages
    for buffer in buffers:
        buffer.fill_(3)
    for key, value in model.outputs(x).items():
        torch.testing.assert_close(value, before[key], msg=key)


def test_borrowed_buffers_are_never_aliased():
    model = _CpuEngineModel()
    targets = describe_targets(model, tensor_parallel_size=1)
    with pytest.raises(ValueError, match="cannot alias"):
        DirectLoader(model, {}, targets, alias=True, borrowed=True)


def test_the_pusher_packs_into_kept_shared_memory_segments_and_removes_them(tmp_path):
    from weight_sync.push_thread import SendThread
    from weight_sync.sender import WeightPusher

    pusher = WeightPusher(
        bind_port=0, advertise_host="127.0.0.1", api_token="t", bucket_bytes=96, shm_dir=str(tmp_path)
    )
    named = _named()
    specs, buckets = plan_buckets(named, bucket_bytes=96, dtype="float32")
    buffers, segments = pusher._buffers_for(specs, len(buckets), shared=True)
    assert segments is not None and buffers == segments.tensors
    sizes = _sizes([s.model_dump() for s in specs], len(buckets))
    assert [s.path.stat().st_size for s in segments.segments] == sizes == [b.numel() for b in buffers]
    again, same = pusher._buffers_for(specs, len(buckets), shared=True)
    assert same is segments and again == buffers
    # After a failed push a receiver may still read the segments: new ones, and the old files go.
    failed = SendThread(lambda: 1 // 0)
    failed._thread.join()
    pusher._sender = failed
    _, fresh = pusher._buffers_for(specs, len(buckets), shared=True)
    assert fresh is not None and fresh is not segments
    assert not any(s.path.exists() for s in segments.segments) and all(s.path.exists() for s in fresh.segments)
    # Plain memory when no receiver shares it; the segments go then too.
    _, none = pusher._buffers_for(specs, len(buckets), shared=False)
    assert none is None and list(tmp_path.iterdir()) == []
    pusher._buffers_for(specs, len(buckets), shared=True)
    pusher.close()
    assert list(tmp_path.iterdir()) == []


def test_the_pusher_picks_shared_memory_only_for_probes_it_can_read(tmp_path):
    from shared.records import GeneratorRegistration
    from shared.shm import make_probe
    from weight_sync.sender import WeightPusher

    here, elsewhere = tmp_path / "shm", tmp_path / "other"
    here.mkdir()
    elsewhere.mkdir()
    probe, token = make_probe(here)
    other_probe, other_token = make_probe(elsewhere)

    def registration(gid, path, token):
        return GeneratorRegistration(
            generator_id=gid, url="http://x", policy_version=0, shm_probe={"path": path, "token": token}
        )

    generators = [
        registration("near", str(probe.path), token),
        registration("wrong-token", str(probe.path), "f" * 32),
        registration("other-dir", str(other_probe.path), other_token),
        registration("gone", str(here / "asyncgrpo-probe-0123"), token),
        GeneratorRegistration(generator_id="no-probe", url="http://x", policy_version=0),
    ]
    pusher = WeightPusher(bind_port=0, advertise_host="127.0.0.1", api_token="t", shm_dir=str(here))
    assert pusher._shares_memory(generators) == {"near"}
    off = WeightPusher(bind_port=0, advertise_host="127.0.0.1", api_token="t", shm_dir="")
    assert off.shm_dir is None and off._shares_memory(generators) == set()
    probe.close()
    assert pusher._shares_memory(generators) == set()  # the generator is gone
    other_probe.close()


def test_no_room_for_segments_is_logged_and_the_push_goes_over_gloo(tmp_path, monkeypatch, caplog):
    import errno

    import shared.shm
    from shared.records import GeneratorRegistration
    from shared.shm import make_probe
    from weight_sync.plan import plan_push
    from weight_sync.sender import WeightPusher

    probe, token = make_probe(tmp_path)
    pusher = WeightPusher(
        bind_port=0, advertise_host="127.0.0.1", api_token="t", bucket_bytes=96, shm_dir=str(tmp_path)
    )
    generator = GeneratorRegistration(
        generator_id="near",
        url="http://x",
        policy_version=0,
        versions=pusher.learner.versions,
        shm_probe={"path": str(probe.path), "token": token},
    )
    plan = plan_push(pusher.learner, [generator], pusher._shares_memory([generator]))
    assert plan.transports == {"near": "shm"}

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shared.shm.os, "posix_fallocate", full)
    specs, buckets = plan_buckets(_named(), bucket_bytes=96, dtype="float32")
    plan, buffers, segments = pusher._send_buffers_or_gloo(plan, [generator], specs, len(buckets))
    assert plan.transports == {"near": "gloo"} and plan.ranks == {"near": 1}
    assert segments is None and buffers is not None and pusher.shm_dir is None
    assert "shared-memory weight pushes are off for this learner" in caplog.text and "shm_size" in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == [probe.path.name]  # no half-made segment left
    probe.close()


def test_a_push_the_learner_gives_up_on_stops_shared_memory_receivers_at_once(tmp_path):
    """The learner fails while sending (here: no segments to pack into); it says so in the push's namespace,
    and a receiver waiting for the first bucket's record stops within a second or two with the reason, not
    after its 60 s timeout."""
    import threading
    import time
    from datetime import timedelta

    from tests.gpu.standin import StandInWorker, build_model
    from weight_sync.plan import PushPlan
    from weight_sync.sender import WeightPusher

    pusher = WeightPusher(bind_port=0, advertise_host="127.0.0.1", api_token="t", bucket_bytes=1 << 16)
    worker = StandInWorker(build_model(seed=0, hidden=8, layers=1, device="cpu"), torch.device("cpu"))
    named = [(n, p.detach()) for n, p in build_model(seed=1, hidden=8, layers=1, device="cpu").named_parameters()]
    specs, buckets = plan_buckets(named, 1 << 16, "float32")
    worker.weight_channel_open("127.0.0.1", pusher.port, "push/1/t", 0, 1, 10.0, 60.0, "shm", "g")
    outcome: dict[str, object] = {}

    def receive():
        started = time.monotonic()
        try:
            worker.weight_channel_receive([s.model_dump() for s in specs], len(buckets))
        except RuntimeError as exc:
            outcome["error"] = str(exc)
        outcome["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=receive)
    thread.start()
    plan = PushPlan(transports={"g": "shm"}, ranks={}, world_size=1, dtype="float32")
    with pytest.raises(ValueError, match="packs into shared-memory segments"):
        pusher.send_buckets("push/1/t", plan, named, buckets, None, None)
    thread.join(30)
    assert "the learner gave up on this push: ValueError: a push with shared-memory" in str(outcome.get("error"))
    assert outcome["seconds"] < 10
    store = torch.distributed.PrefixStore("push/1/t", pusher.store)
    store.set_timeout(timedelta(seconds=1))
    assert store.get("abort").startswith(b"ValueError")
    assert pusher.weight_homes() == {}  # no parameter moves into buffers a failed push may still have readers of
    worker.weight_channel_close()


# Linear weights stored transposed, for CPU engines that repack them (vLLM-CPU's oneDNN handles) -----------------


def _linear_named():
    named = _named()
    return [(n, t.float()) for n, t in named]


LINEAR = frozenset(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")


def test_transposed_tensors_are_packed_as_their_transpose_and_unpack_to_the_same_values():
    named = _linear_named()
    specs, buckets = plan_buckets(named, bucket_bytes=1 << 20, dtype="float32", transposed=LINEAR | {"not.pushed"})
    assert {s.name for s in specs if s.transposed} == LINEAR
    [indices] = buckets
    flags = [named[i][0] in LINEAR for i in indices]
    packed = pack_bucket([named[i][1] for i in indices], "float32", transposed=flags)
    # The bytes are those of each transpose, contiguous: what the engine's prepacking reads.
    expected = torch.cat([(t.t().contiguous() if f else t).reshape(-1) for (_, t), f in zip(named, flags, strict=True)])
    assert torch.equal(packed.view(torch.float32), expected)
    unpacked = dict(unpack_bucket(packed, specs))
    for name, tensor in named:
        assert torch.equal(unpacked[name], tensor), name
        assert is_transposed(unpacked[name]) == (name in LINEAR), name
    with pytest.raises(ValueError, match="only a 2-D tensor travels transposed"):
        pack_bucket([torch.zeros(4)], "float32", transposed=[True])
    with pytest.raises(ValueError, match="2 transposed and 1 joined flags for 1 tensors"):
        pack_bucket([torch.zeros(4)], "float32", transposed=[True, False])


def test_a_spec_refuses_to_transpose_what_is_not_2d():
    from shared.records import TensorSpec

    assert TensorSpec(name="w", dtype="float32", shape=(2, 3), bucket=0, transposed=True).transposed
    with pytest.raises(ValueError, match="only a 2-D tensor travels transposed"):
        TensorSpec(name="norm", dtype="float32", shape=(3,), bucket=0, transposed=True)


def test_stack_rows_joins_transposed_pieces_into_the_layout_the_prepacking_reads():
    pieces = [torch.randn(4, 3).t().contiguous().t() for _ in range(2)]  # [4, 3] each, strides (1, 4)
    pieces.append(torch.randn(2, 3).t().contiguous().t())
    stacked = stack_rows(pieces)
    assert torch.equal(stacked, torch.cat([p.contiguous() for p in pieces]))
    assert stacked.shape == (10, 3) and stacked.t().is_contiguous()  # [in, out] contiguous under the .t()
    assert stack_rows(pieces[:1]) is pieces[0]
    assert not is_transposed(torch.randn(3, 3)) and not is_transposed(torch.randn(1, 3).t())


def _recording_method():
    """vLLM-CPU's unquantized linear method, recording the layout of the weight it packs from."""
    method = _cpu_method("UnquantizedLinearMethod", True)
    process = type(method).process_weights_after_loading
    method.layouts = []

    def record(self, layer):
        self.layouts.append(layer.weight.t().is_contiguous())
        process(self, layer)

    type(method).process_weights_after_loading = record
    return method


@pytest.mark.parametrize("borrowed", [False, True])
def test_transposed_pieces_reach_the_handle_transposed_and_the_engine_computes_the_same(borrowed):
    model = _CpuEngineModel()
    qkv = model.model.layers[0].self_attn.qkv_proj
    qkv.quant_method = _recording_method()
    x = torch.randn(3, 4)
    named = _linear_named()
    specs, buckets = plan_buckets(named, bucket_bytes=1 << 20, dtype="float32", transposed=LINEAR)
    layout = [s.model_dump() for s in specs]
    buffers = [
        pack_bucket([named[i][1] for i in indices], "float32", transposed=[named[i][0] in LINEAR for i in indices])
        for indices in buckets
    ]
    targets = describe_targets(model, tensor_parallel_size=1)
    plan = plan_direct_load({s["name"]: tuple(s["shape"]) for s in layout}, targets)
    loader = DirectLoader(model, plan, targets, borrowed=borrowed)
    for index, buffer in enumerate(buffers):
        loader.add_all(unpack_bucket(buffer, [s for s in read_layout(layout) if s.bucket == index]))
    loader.finish()
    assert qkv.quant_method.layouts == [True]  # packed from [in, out] contiguous
    for key, value in model.outputs(x).items():
        torch.testing.assert_close(value, _expected(named, x)[key], msg=key)
    for buffer in buffers:  # the next push's packing changes nothing the engine computes with
        buffer.fill_(3)
    for key, value in model.outputs(x).items():
        torch.testing.assert_close(value, _expected(named, x)[key], msg=key)


def _trains_like(model: torch.nn.Module, twin: torch.nn.Module) -> None:
    """Three AdamW steps on each, the same input: ``model``'s parameters end equal to ``twin``'s."""
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (model, twin)]
    x = torch.randn(5, 4)
    for _ in range(3):
        for m, optimizer in zip((model, twin), optimizers, strict=True):
            optimizer.zero_grad()
            m(x).square().sum().backward()
            optimizer.step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_placed_transposed_parameters_train_and_pack_by_no_copy(monkeypatch):
    from services.learner.model import linear_weight_names
    from weight_sync.send_buffers import place_parameters

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    twin = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    twin.load_state_dict(model.state_dict())
    linear = linear_weight_names(model)
    assert linear == {"0.weight", "1.weight"}
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    _, buckets = plan_buckets(named, bucket_bytes=64, dtype="float32", transposed=linear)
    buffers = [
        pack_bucket([named[i][1] for i in idx], "float32", transposed=[named[i][0] in linear for i in idx])
        for idx in buckets
    ]
    placed = place_parameters(model, slot_views(named, buckets, "float32", buffers, linear))
    assert len(placed) == 4
    assert model[0].weight.stride() == (1, 6) and model[0].bias.is_contiguous()
    _trains_like(model, twin)  # training on transposed parameters gives what training on ordinary ones gives
    assert model[0].weight.stride() == (1, 6)  # still in its slot
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    copies = []
    copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, *a, **k: copies.append(1) or copy(self, src, *a, **k))
    for idx, buffer in zip(buckets, buffers, strict=True):
        pack_bucket([named[i][1] for i in idx], "float32", buffer, [named[i][0] in linear for i in idx])
    monkeypatch.undo()
    assert copies == []
    unpacked = {}
    specs, _ = plan_buckets(named, bucket_bytes=64, dtype="float32", transposed=linear)
    for index, buffer in enumerate(buffers):
        unpacked.update(unpack_bucket(buffer, [s for s in specs if s.bucket == index]))
    for name, param in model.named_parameters():
        assert torch.equal(unpacked[name], param), name


def test_linear_weight_names_leave_out_weights_tied_to_an_embedding():
    from services.learner.model import linear_weight_names

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.proj = torch.nn.Linear(4, 4, bias=True)
            self.norm = torch.nn.LayerNorm(4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    assert linear_weight_names(Tied()) == {"proj.weight"}


def test_a_generator_answer_no_generator_gives_fails_the_push_for_it_not_the_learner():
    """A 200 whose body is not a generator's (an impostor, a proxy's page) is that generator's failure, named;
    it never raises out of the push as a JSON or type error."""
    good = httpx.Response(200, json={"pause_seconds": 0.1, "load_seconds": 2})
    assert _phases_of(good) == {phase: {"pause_seconds": 0.1, "load_seconds": 2.0}.get(phase, 0.0) for phase in _PHASES}
    for body, why in (
        (b"<html>", "not JSON"),
        (b"[1, 2]", "list, not an object"),
        (b'{"load_seconds": "slow"}', "load_seconds not a finite number"),
        (b'{"load_seconds": -1}', "load_seconds not a finite number"),
        (b'{"load_seconds": true}', "load_seconds not a finite number"),
    ):
        answer = _phases_of(httpx.Response(200, content=body))
        assert isinstance(answer, str) and why in _describe(answer), (body, answer)
    refused = httpx.Response(401, text="missing or wrong bearer token")
    assert _phases_of(refused) is refused and _describe(refused).startswith("HTTP 401")
    assert _slowest_phases([_phases_of(good), {phase: 1.0 for phase in _PHASES}])["load_seconds"] == 2.0


# Deferred kernel handles (a CPU engine fed over gloo) ------------------------------------------------------------


def _deferred_push(model, named, buffers, joins):
    """One push of transposed linear weights through a deferring loader into ``buffers`` (kept by the caller,
    as the receiver keeps them); returns the loader."""
    specs, buckets = plan_buckets(named, bucket_bytes=1 << 20, dtype="float32", transposed=LINEAR)
    layout = [s.model_dump() for s in specs]
    packed = [
        pack_bucket([named[i][1] for i in indices], "float32", transposed=[named[i][0] in LINEAR for i in indices])
        for indices in buckets
    ]
    if not buffers:
        buffers.extend(torch.empty_like(b) for b in packed)
    for buffer, sent in zip(buffers, packed, strict=True):
        buffer.copy_(sent)  # what the receive does
    return _load_buckets(model, layout, buffers, defer=True, joins=joins)


def test_deferred_handles_are_made_by_the_first_call_after_the_push_from_the_pushed_weights():
    model = _CpuEngineModel()
    qkv = model.model.layers[0].self_attn.qkv_proj
    qkv.quant_method = _recording_method()
    x = torch.randn(3, 4)
    buffers, joins, join_memory = [], {}, set()
    for step in range(2):  # the second push reuses the buffers and the join memory
        named = _changed(_linear_named(), by=float(step))
        loader = _deferred_push(model, named, buffers, joins)
        assert {id(m) for m in loader.deferred} == {id(qkv), id(model.model.embed_tokens), id(model.lm_head)}
        assert isinstance(qkv.cpu_linear, PendingHandle) and qkv.quant_method.layouts == [True] * step
        join_memory.add(joins["model.layers.0.self_attn.qkv_proj.weight"].buffer.data_ptr())
        with torch.inference_mode():  # as the engine's forward runs
            first = model.outputs(x)  # makes the handles, from [in, out] contiguous weights
        assert qkv.quant_method.layouts == [True] * (step + 1) and qkv.weight.numel() == 0
        assert not isinstance(qkv.cpu_linear, PendingHandle)
        for buffer in buffers:  # the next push's receive: the handles hold their own copies
            buffer.fill_(7)
        for key in ("qkv", "lm_head"):
            torch.testing.assert_close(first[key], _expected(named, x)[key], msg=f"{key}, push {step}")
            torch.testing.assert_close(model.outputs(x)[key], first[key], msg=f"{key}, push {step}, again")
    assert len(join_memory) == 1  # the second push joined in the first one's memory


def test_a_replaced_handle_is_freed_by_the_first_call_after_the_push_not_during_it():
    """Freeing a oneDNN handle's packed weights is slow: the push leaves it to the step that makes the new one
    (freed there by reference counting, not by a later garbage collection)."""
    import weakref

    model = _CpuEngineModel()
    qkv = model.model.layers[0].self_attn.qkv_proj
    freed = weakref.ref(qkv.cpu_linear)
    _deferred_push(model, _linear_named(), [], {})
    gc.collect()
    assert freed() is not None, "the old handle was freed during the push"
    assert isinstance(qkv.cpu_linear, PendingHandle) and qkv.cpu_linear.replaced is freed()
    with torch.inference_mode():
        model.outputs(torch.randn(3, 4))  # the engine's first step
    assert freed() is None
    assert not isinstance(qkv.cpu_linear, PendingHandle)


def test_a_layer_not_called_between_two_pushes_lets_its_old_handle_go_in_the_second():
    """An embedding's handle is never called (it looks rows up) and two pushes may come with no step between:
    the second push frees the handle the first kept, so none is held for good or chained."""
    import weakref

    model = _CpuEngineModel()
    embed = model.model.embed_tokens
    original = weakref.ref(embed.cpu_linear)
    buffers, joins = [], {}
    _deferred_push(model, _linear_named(), buffers, joins)
    assert original() is not None and isinstance(embed.cpu_linear, PendingHandle)
    _deferred_push(model, _changed(_linear_named(), by=1.0), buffers, joins)
    assert original() is None
    assert isinstance(embed.cpu_linear, PendingHandle) and embed.cpu_linear.replaced is None


def test_a_pending_handle_passes_the_callers_bias_through():
    torch.manual_seed(0)
    layer = _Layer(torch.randn(3, 4), _cpu_method("UnquantizedLinearMethod", True))
    layer.bias = torch.nn.Parameter(torch.randn(3), requires_grad=False)
    weight = layer.weight
    layer.weight = torch.nn.Parameter(torch.randn(3, 4), requires_grad=False)  # what a push loads
    layer.cpu_linear = PendingHandle(layer)
    x = torch.randn(2, 4)
    expected = x @ layer.weight.detach().T
    # vLLM passes bias=None for a layer that adds its bias itself (skip_bias_add).
    torch.testing.assert_close(layer.cpu_linear(x, weight, None), expected)
    torch.testing.assert_close(layer.cpu_linear(x, layer.weight, layer.bias), expected + layer.bias)


def test_deferring_refuses_weights_that_do_not_stay_put():
    model = _CpuEngineModel()
    targets = describe_targets(model, tensor_parallel_size=1)
    for kind in ("alias", "borrowed"):
        with pytest.raises(ValueError, match="deferred handles need weights that stay put"):
            DirectLoader(model, {}, targets, defer=True, **{kind: True})


@pytest.mark.parametrize(
    ("device", "transport", "eager", "in_place", "defers"),
    [
        ("cpu", "gloo", True, False, True),
        ("cpu", "shm", True, False, False),  # the learner writes the next push where the weights would be read
        ("cpu", "gloo", False, False, False),  # a compiled engine
        ("cpu", "gloo", True, True, False),  # parameters alias the receive buffers: nothing to make
        ("cuda", "nccl", True, False, False),
        ("cuda", "ipc", True, False, False),
    ],
)
def test_only_a_cpu_engine_fed_over_gloo_defers_its_handles(device, transport, eager, in_place, defers):
    from weight_sync.receiver import _EnginePolicy

    class Policy(_EnginePolicy):
        def _engine_is_eager(self) -> bool:
            return eager

        def _in_place_wanted(self) -> bool:
            return in_place

        def _hides_views(self) -> bool:
            return False

    policy = Policy()
    policy.device, policy._weight_transport = torch.device(device), transport
    assert policy._deferring() == defers


def test_engine_runtime_names_stacked_layers_only_when_every_worker_agrees():
    from services.generator.engine import engine_runtime

    stacks = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
    worker = {"device_uuid": "", "dtype": "float32", "transposed_linear": True, "stacked_linear": stacks}
    worker |= {"torch": "2.13.0", "nccl": "", "vllm": "0.32.0"}
    assert engine_runtime([worker, {**worker, "device_uuid": "x"}])["stacked_linear"] == stacks
    assert engine_runtime([worker, {**worker, "stacked_linear": {}}])["stacked_linear"] == {}
    assert not engine_runtime([worker, {**worker, "transposed_linear": False}])["transposed_linear"]
    assert engine_runtime([{**worker, "glibc_tunables": "a=1"}, worker])["glibc_tunables"] == "a=1"  # the first's
    assert engine_runtime([worker])["glibc_tunables"] == ""  # a worker of an older generator says none


# Stacked pieces joined in the bucket (a CPU engine that stacks q/k/v and gate/up) ------------------------------


STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _pack_joined(named, buckets, transposed, joined) -> list[torch.Tensor]:
    """Every bucket packed as float32, the names in ``transposed`` transposed and those in ``joined`` joined."""
    return [
        pack_bucket(
            [named[i][1] for i in indices],
            "float32",
            transposed=[named[i][0] in transposed for i in indices],
            joined=[named[i][0] in joined for i in indices],
        )
        for indices in buckets
    ]


def test_joined_names_are_the_later_pieces_of_a_stacked_layer_right_after_the_one_before():
    named = _linear_named()
    assert joined_names(named, LINEAR, STACKED) == {
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
    }
    assert joined_names(named, LINEAR - {"model.layers.0.self_attn.q_proj.weight"}, STACKED) == {
        "model.layers.0.self_attn.v_proj.weight"  # k has nothing transposed to join
    }
    assert joined_names(named, LINEAR, {}) == frozenset()
    reordered = [named[0], named[2], named[1], named[3], named[4]]  # k, q, v: packed q, k, v all the same
    assert joined_names(reordered, LINEAR, STACKED) == joined_names(named, LINEAR, STACKED)
    assert [reordered[i][0].split(".")[-2] for i in stacked_order([n for n, _ in reordered], STACKED)][1:4] == [
        "q_proj",
        "k_proj",
        "v_proj",
    ]
    wider = [(n, torch.randn(2, 5)) if ".v_proj" in n else (n, t) for n, t in named]  # another input size
    assert joined_names(wider, LINEAR, STACKED) == {"model.layers.0.self_attn.k_proj.weight"}


def test_stacked_pieces_with_biases_are_packed_weights_first_so_both_stack_as_views():
    names = [f"l.self_attn.{p}_proj.{leaf}" for p in "qkv" for leaf in ("weight", "bias")]
    names += ["l.self_attn.o_proj.weight", "l.mlp.gate_proj.weight", "l.mlp.up_proj.weight", "norm.weight"]
    order = [names[i] for i in stacked_order(names, STACKED)]
    assert order == [
        "l.self_attn.q_proj.weight",
        "l.self_attn.k_proj.weight",
        "l.self_attn.v_proj.weight",
        "l.self_attn.q_proj.bias",
        "l.self_attn.k_proj.bias",
        "l.self_attn.v_proj.bias",
        "l.self_attn.o_proj.weight",
        "l.mlp.gate_proj.weight",
        "l.mlp.up_proj.weight",
        "norm.weight",
    ]
    assert stacked_order(names, {}) == list(range(len(names)))
    named = [(n, torch.randn(2 if "bias" in n else (2, 4))) for n in names]
    specs, _ = plan_buckets(named, 1 << 20, "float32", {n for n in names if n.endswith("weight")}, STACKED)
    assert [s.name for s in specs if s.joined] == [
        "l.self_attn.k_proj.weight",
        "l.self_attn.v_proj.weight",
        "l.mlp.up_proj.weight",
    ]
    assert [s.name for s in specs] == order


def test_joined_pieces_share_one_block_and_unpack_to_the_same_values_as_one_view():
    named = _linear_named()
    # Buckets of 40 bytes would cut q/k/v apart; joined pieces stay in the bucket of the piece before them.
    specs, buckets = plan_buckets(named, bucket_bytes=40, dtype="float32", transposed=LINEAR, stacked=STACKED)
    joined = [s.name for s in specs if s.joined]
    assert joined == ["model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"]
    by_name = {s.name: s.bucket for s in specs}
    assert len({by_name[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"}) == 1
    packed = _pack_joined(named, buckets, LINEAR, joined)
    layout = read_layout([s.model_dump() for s in specs])
    assert [b.numel() for b in packed] == bucket_byte_sizes(layout, len(buckets))
    qkv_bucket = by_name["model.layers.0.self_attn.q_proj.weight"]
    pieces = dict(unpack_bucket(packed[qkv_bucket], [s for s in layout if s.bucket == qkv_bucket]))
    w = dict(named)
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    # The bytes are the [in, q+k+v] block: each row holds q's, k's and v's column of that input.
    block = torch.cat([w[n].t() for n in names], dim=1).contiguous()
    assert torch.equal(packed[qkv_bucket].view(torch.float32), block.reshape(-1))
    for name in names:
        assert torch.equal(pieces[name], w[name])
    stacked = stack_rows([pieces[n] for n in names])  # one view of the bucket, no copy
    assert stacked.data_ptr() == packed[qkv_bucket].data_ptr() and stacked.t().is_contiguous()
    assert torch.equal(stacked, torch.cat([w[n] for n in names]))
    assert joined_view([pieces[names[0]], pieces[names[2]]]) is None  # not consecutive columns
    assert joined_view([pieces[n] for n in names[:2]]) is None  # leaves the block's last columns out


def test_a_joined_entry_must_continue_a_transposed_block_of_its_size():
    buffer = torch.zeros(64, dtype=torch.uint8)
    for entries in (
        [(torch.float32, (2, 4), False, True)],  # nothing before it
        [(torch.float32, (2, 4), False, False), (torch.float32, (2, 4), True, True)],  # block not transposed
        [(torch.float32, (2, 4), True, False), (torch.float32, (2, 2), True, True)],  # another input size
    ):
        with pytest.raises(ValueError, match="does not continue a transposed block"):
            list(bucket_views(buffer, entries, whole=False))
    with pytest.raises(ValueError, match="only a transposed tensor is joined"):
        TensorSpec(name="w", dtype="float32", shape=(2, 3), bucket=0, joined=True)


def test_a_fused_optimizer_s_learner_places_only_contiguous_parameters():
    """PyTorch's fused AdamW walks a parameter's memory flat: transposed homes are left out for it."""
    from services.learner.model import linear_weight_names
    from weight_sync.send_buffers import place_parameters

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    linear = linear_weight_names(model)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    _, buckets = plan_buckets(named, bucket_bytes=64, dtype="float32", transposed=linear)
    buffers = _pack_joined(named, buckets, linear, joined=frozenset())
    homes = slot_views(named, buckets, "float32", buffers, linear)
    placed = place_parameters(model, homes, contiguous_only=True)
    assert {id(p) for p in placed} == {id(model[0].bias), id(model[1].bias)}
    assert all(p.is_contiguous() for p in model.parameters())
    assert all(not lies_in(model[i].weight, homes[f"{i}.weight"]) for i in (0, 1))


def test_placed_joined_parameters_train_the_same_and_pack_by_no_copy():
    from weight_sync.send_buffers import place_parameters

    torch.manual_seed(0)

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(4, n, bias=False) for n in (4, 2, 2))

        def forward(self, x):
            return self.q_proj(x).sum(-1) * self.k_proj(x).sum(-1) + self.v_proj(x).square().sum(-1)

    model, twin = Attention(), Attention()
    twin.load_state_dict(model.state_dict())
    linear = frozenset(n for n, _ in model.named_parameters())
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    specs, buckets = plan_buckets(named, bucket_bytes=1 << 20, dtype="float32", transposed=linear, stacked=STACKED)
    joined = frozenset(s.name for s in specs if s.joined)
    assert joined == {"k_proj.weight", "v_proj.weight"}
    buffers = _pack_joined(named, buckets, linear, joined)
    placed = place_parameters(model, slot_views(named, buckets, "float32", buffers, linear, joined))
    assert len(placed) == 3 and model.k_proj.weight.stride() == (1, 8)
    _trains_like(model, twin)
    # The next push packs them by no copy: each parameter is its slot.
    slots = slot_views(named, buckets, "float32", buffers, linear, joined)
    assert all(lies_in(p, slots[n]) for n, p in model.named_parameters())
    before = buffers[0].clone()
    repacked = pack_bucket(
        [p.detach() for p in model.parameters()],
        "float32",
        out=buffers[0],
        transposed=[True] * 3,
        joined=[False, True, True],
    )
    assert repacked is buffers[0] and not torch.equal(before, torch.zeros_like(before))
    view = stack_rows([p.detach() for p in model.parameters()])
    torch.testing.assert_close(view, torch.cat([p.detach() for p in twin.parameters()]))


def test_a_deferring_loader_takes_joined_pieces_as_one_view_with_no_join_memory():
    model = _CpuEngineModel()
    qkv = model.model.layers[0].self_attn.qkv_proj
    qkv.quant_method = _recording_method()
    named = _linear_named()
    specs, buckets = plan_buckets(named, bucket_bytes=1 << 20, dtype="float32", transposed=LINEAR, stacked=STACKED)
    joined = {s.name for s in specs if s.joined}
    buffers = _pack_joined(named, buckets, LINEAR, joined)
    layout = read_layout([s.model_dump() for s in specs])
    targets = describe_targets(model, tensor_parallel_size=1)
    plan = plan_direct_load({s.name: tuple(s.shape) for s in layout}, targets)
    joins: dict = {}
    loader = DirectLoader(model, plan, targets, defer=True, joins=joins)
    for index, buffer in enumerate(buffers):
        loader.add_all(unpack_bucket(buffer, [s for s in layout if s.bucket == index]))
    loader.finish()
    assert all(join.buffer is None for join in joins.values())  # nothing joined in memory of its own
    assert qkv.weight.untyped_storage().data_ptr() == buffers[0].data_ptr()  # the bucket itself
    x = torch.randn(3, 4)
    for key, value in model.outputs(x).items():  # the first call makes the handles
        torch.testing.assert_close(value, _expected(named, x)[key], msg=key)
    assert qkv.quant_method.layouts == [True]  # packed from [in, out] contiguous
