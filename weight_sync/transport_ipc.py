"""The CUDA IPC transport, both halves: generators on the learner's own GPU copy the pushed tensors straight
from the learner's GPU memory into their parameters (no packing, no copy through the host, no NCCL, which
refuses two ranks on one GPU). One copy in all, the receiver's, which also casts to the engine's dtype.

Per push: one :class:`~shared.records.CudaIpcWeights` record (every tensor's IPC handle - the fields of
torch's ``reduce_tensor``, as bytes and ints, never a pickle - with its name, dtype and shape) under
``ipc/weights`` in the push's store namespace, then a wait for ``ipc/done/<generator>`` from every IPC
receiver (``"ok"`` once its copies are done, or its error), read in one ``multi_get``. The learner's weights
must not change until then: the learner awaits the push before its next optimizer step.

Handles are made once and kept (:class:`IpcExports`): while the pushed tensors are the same memory (the
learner's parameters, updated in place), the next push publishes the same record, and a receiver
(:class:`IpcReceiver`) that kept the tensors it opened from it (``rebuild_cuda_tensor``) and its copy list
reads the new values with no new handle to open: a push is then one batched copy (``torch._foreach_copy_``).
The kept references also keep that memory alive, so an address in a kept record always names the tensor it
was made for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from shared.codec import decode, encode
from shared.records import IPC_DONE_OK, IPC_WEIGHTS_KEY, CudaIpcTensor, CudaIpcWeights, TensorSpec, ipc_done_key
from weight_sync.protocol import DTYPES, cuda_uuid, dtype_name

if TYPE_CHECKING:
    from weight_sync.direct_load import DirectLoader

log = logging.getLogger(__name__)


def ipc_record_from_args(name: str, tensor: torch.Tensor, args: Sequence[Any]) -> CudaIpcTensor:
    """The typed record of ``reduce_tensor``'s arguments for ``tensor``'s bytes viewed as flat uint8."""
    (
        _,
        size,
        stride,
        tensor_offset,
        _,
        dtype,
        _,
        handle,
        storage_bytes,
        storage_offset,
        _,
        counter,
        counter_offset,
        event,
        sync,
    ) = args
    if dtype != torch.uint8 or len(size) != 1 or tuple(stride) != (1,):
        raise ValueError(f"an IPC handle is made for a flat uint8 view, got {dtype} of shape {tuple(size)}")
    return CudaIpcTensor(
        name=name,
        dtype=dtype_name(name, tensor.dtype),
        shape=tuple(tensor.shape),
        nbytes=int(size[0]),
        tensor_offset=int(tensor_offset),
        storage_handle=bytes(handle),
        storage_size_bytes=int(storage_bytes),
        storage_offset_bytes=int(storage_offset),
        ref_counter_handle=bytes(counter),
        ref_counter_offset=int(counter_offset),
        event_handle=bytes(event),
        event_sync_required=bool(sync),
    )


def _memory_key(named: Sequence[tuple[str, torch.Tensor]]) -> tuple:
    """What a kept record depends on: each tensor's name, address, dtype, shape and strides. The address
    stands for the memory: the kept references hold every recorded tensor's storage, so no other allocation
    can start where one of them does, and CUDA's one address space for host and devices keeps a tensor
    elsewhere from matching (the device is checked when a record is made). Computed on every push: 0.27 ms
    for 290 tensors on one slow core, where storage objects and offsets took 0.53."""
    return tuple((name, t.data_ptr(), t.dtype, t.shape, t.stride()) for name, t in named)


class IpcExports:
    """The IPC record of the tensors pushed last, with the references that keep their memory alive.

    A non-contiguous tensor travels through a contiguous copy that is kept too and refreshed on every push."""

    def __init__(self, device: torch.device, device_uuid: str) -> None:
        self.device, self.device_uuid = device, device_uuid
        self._key: tuple | None = None
        self._wire = b""
        self._kept: list[torch.Tensor] = []
        self._staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (source, its contiguous copy)
        self.made = 0  # records made (a new one whenever the pushed memory changed)
        self.nbytes = 0  # bytes the kept record names

    def wire(self, named: Sequence[tuple[str, torch.Tensor]]) -> bytes:
        """The encoded record for ``named``: the kept one while they are the same memory, else a new one."""
        key = _memory_key(named)
        if key != self._key:
            for name, tensor in named:
                if tensor.device != self.device:
                    raise ValueError(f"{name} is on {tensor.device}; an IPC push sends tensors on {self.device}")
            self._export(named, key)
        for source, copy in self._staged:
            copy.copy_(source)
        return self._wire

    def _export(self, named: Sequence[tuple[str, torch.Tensor]], key: tuple) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        kept: list[torch.Tensor] = []
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        records = []
        for name, tensor in named:
            tensor = tensor.detach()
            shared = tensor
            if not tensor.is_contiguous():
                shared = torch.empty_like(tensor, memory_format=torch.contiguous_format)
                staged.append((tensor, shared))
            kept.append(tensor)
            kept.append(shared)
            _, args = reduce_tensor(shared.reshape(-1).view(torch.uint8))
            records.append(ipc_record_from_args(name, shared, args))
        self._wire = encode(CudaIpcWeights(device_uuid=self.device_uuid, tensors=tuple(records)))
        self._key, self._kept, self._staged = key, kept, staged
        self.nbytes = sum(record.nbytes for record in records)
        self.made += 1

    def clear(self) -> None:
        """Drop the kept record and references (their memory is freed once no receiver holds it either)."""
        self._key, self._wire, self._kept, self._staged = None, b"", [], []
        self.nbytes = 0
        torch.cuda.ipc_collect()


def publish_ipc(store: Any, exports: IpcExports, named: Sequence[tuple[str, torch.Tensor]]) -> int:
    """Publish ``named`` for the IPC receivers in ``store`` (the push's namespace); returns the bytes they
    will read. The weights must stay as they are until :func:`wait_ipc` returns."""
    wire = exports.wire(named)
    # Receivers read with their own streams: everything written to the weights must be on the device first.
    torch.cuda.current_stream(exports.device).synchronize()
    store.set(IPC_WEIGHTS_KEY, wire)
    return exports.nbytes


def _answers(store: Any, keys: list[str], timeout: timedelta) -> list[bytes]:
    """The values under ``keys`` once all are set, within ``timeout``. ``multi_get`` waits for its keys itself
    (one request fewer than a wait and then the reads), but only for the store's own timeout (the join
    timeout), so it runs in such slices; the last slice is an explicit wait for what is left of ``timeout``."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= store.timeout.total_seconds():
            store.wait(keys, timedelta(seconds=max(remaining, 0.001)))
            return store.multi_get(keys)
        try:
            return store.multi_get(keys)
        except torch.distributed.DistStoreError:  # a timeout (a broken connection is a DistNetworkError)
            continue


def wait_ipc(store: Any, receivers: Sequence[str], timeout: timedelta) -> None:
    """Wait until every IPC receiver has copied the weights; RuntimeError naming those that failed."""
    answers = _answers(store, [ipc_done_key(gid) for gid in receivers], timeout)
    failed = {gid: answer for gid, answer in zip(receivers, answers, strict=True) if answer != IPC_DONE_OK}
    if failed:
        detail = "; ".join(f"{gid}: {answer.decode(errors='replace')}" for gid, answer in failed.items())
        raise RuntimeError(f"IPC receivers could not load the weights: {detail}")
    torch.cuda.ipc_collect()  # memory of an earlier record, once no receiver holds it any more


# The receiving half --------------------------------------------------------------------------------------


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


Pairs = list[tuple[str, torch.Tensor]]


class IpcReceiver:
    """A generator worker's half: opens the learner's record and copies its tensors into the model."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.opened: tuple[bytes, Pairs] | None = None  # kept while the learner resends the same record
        self.copies: tuple | None = None  # (record, specs, params, their data pointers, the copy plan)

    def forget(self) -> None:
        """Let go of the learner's memory kept open (the next push is not over IPC)."""
        self.opened = self.copies = None

    def receive(
        self,
        store: Any,
        receiver_id: str,
        specs: Sequence[TensorSpec],
        published: Callable[[str], bytes],
        direct_loader: Callable[[], DirectLoader | None],
        layerwise: Callable[[Pairs], None],
    ) -> dict[str, float]:
        """Copy the learner's tensors into the model; answer ``ipc/done/<receiver_id>`` with ``ok``, or with the
        error (which is raised here too), so the learner stops waiting either way."""
        start = time.perf_counter()
        done = ipc_done_key(receiver_id)
        try:
            wire = published(IPC_WEIGHTS_KEY)
            waiting = time.perf_counter() - start
            pairs = self.tensors(wire, specs)
            direct = self._load(wire, specs, pairs, direct_loader, layerwise)
            torch.cuda.current_stream(self.device).synchronize()
        except BaseException as exc:
            try:
                store.set(done, f"{type(exc).__name__}: {exc}"[:500].encode())
            except Exception:
                log.exception("could not tell the learner that this IPC push failed")
            raise
        store.set(done, IPC_DONE_OK)
        return {
            "bytes": float(sum(t.numel() * t.element_size() for _, t in pairs)),
            "seconds": time.perf_counter() - start,
            "receive_wait_seconds": waiting,
            "load_seconds": time.perf_counter() - start - waiting,
            "direct": float(direct),
            "aliased_bytes": 0.0,
            "copied_borrowed_bytes": 0.0,
        }

    def _load(self, wire: bytes, specs, pairs: Pairs, direct_loader, layerwise) -> bool:
        """The fastest load that applies: the kept copy list, a direct load, else layerwise; whether direct."""
        copies = self.copy_plan(wire, specs, pairs, direct_loader)
        if copies is not None:
            copies.run()
            return True
        direct = direct_loader()
        if direct is None:
            layerwise(pairs)
            return False
        direct.add_all(pairs)
        direct.finish()
        return True

    def tensors(self, wire: bytes, specs: Sequence[TensorSpec]) -> Pairs:
        """The learner's tensors named in ``wire`` (a CudaIpcWeights record), opened on this worker's GPU; the
        ones opened for the last push when the learner sent the same record."""
        if self.opened is not None and self.opened[0] == wire:
            return self.opened[1]
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        self.forget()  # let go of the last record's memory first
        record = decode(wire, CudaIpcWeights)
        if record.device_uuid != cuda_uuid(self.device):
            raise RuntimeError(
                f"the learner's tensors are on GPU {record.device_uuid}; this worker is on {cuda_uuid(self.device)}"
            )
        expected = {spec.name: tuple(spec.shape) for spec in specs}
        pushed = {t.name: tuple(t.shape) for t in record.tensors}
        if pushed != expected:
            wrong = sorted(set(pushed.items()) ^ set(expected.items()))
            raise RuntimeError(f"the IPC record and the announced layout disagree, first on {wrong[0]}")
        pairs = []
        for tensor in record.tensors:
            flat = rebuild_cuda_tensor(*ipc_rebuild_args(tensor, self.device.index))
            pairs.append((tensor.name, flat.view(DTYPES[tensor.dtype]).view(tensor.shape)))
        self.opened = (wire, pairs)
        return pairs

    def copy_plan(self, wire: bytes, specs, pairs: Pairs, direct_loader) -> CopyPlan | None:
        """:meth:`DirectLoader.in_place_copies` for this push, kept while the record, the layout (the same
        specs object: :class:`~weight_sync.protocol.KeptLayout` gives an unchanged layout's specs back, and
        new ones only for a changed layout) and the parameters' memory stay the same."""
        kept = self.copies
        if kept is not None and kept[0] == wire and kept[1] is specs and [p.data_ptr() for p in kept[2]] == kept[3]:
            return kept[4]
        self.copies = None
        direct = direct_loader()
        copies = direct.in_place_copies(pairs) if direct is not None else None
        if copies is None:
            return None
        plan = CopyPlan.of(*copies)
        params = list(direct.params.values())
        self.copies = (wire, specs, params, [p.data_ptr() for p in params], plan)
        return plan


# A tensor of at least this many bytes is copied on its own (a device-to-device copy at full speed), the
# rest together in one multi-tensor kernel. Measured on an H200 (tests/gpu/ipc_timeline.py, the pushed
# tensors copied in one process): 8 tensors of 268 MB took 1.20 ms in one multi-tensor copy, 1.05 ms one
# copy_ each (1.01 ms as one contiguous copy); 8 of 67 MB 0.31 ms either way; 144 of 4 MB 0.40 ms together
# but 1.95 ms one by one, each copy_ costing its own launch.
SEPARATE_COPY_BYTES = 128 << 20


@dataclass(frozen=True, eq=False)
class CopyPlan:
    """The copies of one IPC push into the model: large tensors one by one, small ones in one batch, then
    the padding rows zeroed."""

    separate: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # (destination, source)
    batched: tuple[list[torch.Tensor], list[torch.Tensor]]  # (destinations, sources)
    padding: list[torch.Tensor]

    @classmethod
    def of(
        cls,
        destinations: Sequence[torch.Tensor],
        sources: Sequence[torch.Tensor],
        padding: Sequence[torch.Tensor],
        separate_bytes: int = SEPARATE_COPY_BYTES,
    ) -> CopyPlan:
        separate, small_destinations, small_sources = [], [], []
        for destination, source in zip(destinations, sources, strict=True):
            if destination.numel() * destination.element_size() >= separate_bytes:
                separate.append((destination, source))
            else:
                small_destinations.append(destination)
                small_sources.append(source)
        return cls(tuple(separate), (small_destinations, small_sources), list(padding))

    def run(self) -> None:
        for destination, source in self.separate:
            destination.copy_(source)
        if self.batched[0]:
            torch._foreach_copy_(*self.batched)
        if self.padding:
            torch._foreach_zero_(self.padding)
