"""The learner's half of the CUDA IPC transport: generators on the learner's own GPU copy the pushed tensors
straight from the learner's GPU memory into their parameters (no packing, no copy through the host, no NCCL,
which refuses two ranks on one GPU). One copy in all, the receiver's, which also casts to the engine's dtype.

Per push: one :class:`~shared.records.CudaIpcWeights` record (every tensor's IPC handle, name, dtype and
shape; bytes and ints, never a pickle) under ``ipc/weights`` in the push's store namespace, then a wait for
``ipc/done/<generator>`` from every IPC receiver (``"ok"``, or the receiver's error). The learner's weights
must not change until then: the learner awaits the push before its next optimizer step.

Handles are made once and kept (:class:`IpcExports`): while the pushed tensors are the same memory (the
learner's parameters, updated in place), the next push publishes the same record, and a receiver that kept
the tensors it opened from it reads the new values with no new handle to open. The kept references also keep
that memory alive, so an address in a kept record always names the tensor it was made for.

The receiving half is ``WeightReceiverExtension`` in :mod:`services.generator.weight_receiver`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from shared.codec import encode
from shared.records import IPC_DONE_OK, IPC_WEIGHTS_KEY, CudaIpcTensor, CudaIpcWeights, ipc_done_key

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


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
    if tensor.dtype not in _DTYPE_NAMES:
        raise ValueError(f"{name} has dtype {tensor.dtype}; pushes carry float32, float16 or bfloat16")
    return CudaIpcTensor(
        name=name,
        dtype=_DTYPE_NAMES[tensor.dtype],
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
    """What a kept record depends on: each tensor's name, memory, dtype, shape and strides."""
    return tuple(
        (name, t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), t.stride())
        for name, t in named
    )


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

    def wire(self, named: Sequence[tuple[str, torch.Tensor]]) -> bytes:
        """The encoded record for ``named``: the kept one while they are the same memory, else a new one."""
        for name, tensor in named:
            if tensor.device != self.device:
                raise ValueError(f"{name} is on {tensor.device}; an IPC push sends tensors on {self.device}")
        key = _memory_key(named)
        if key != self._key:
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
        self.made += 1

    def clear(self) -> None:
        """Drop the kept record and references (their memory is freed once no receiver holds it either)."""
        self._key, self._wire, self._kept, self._staged = None, b"", [], []
        torch.cuda.ipc_collect()


def publish_ipc(store: Any, exports: IpcExports, named: Sequence[tuple[str, torch.Tensor]]) -> int:
    """Publish ``named`` for the IPC receivers in ``store`` (the push's namespace); returns the bytes they
    will read. The weights must stay as they are until :func:`wait_ipc` returns."""
    wire = exports.wire(named)
    # Receivers read with their own streams: everything written to the weights must be on the device first.
    torch.cuda.current_stream(exports.device).synchronize()
    store.set(IPC_WEIGHTS_KEY, wire)
    return sum(t.numel() * t.element_size() for _, t in named)


def wait_ipc(store: Any, receivers: Sequence[str], timeout: timedelta) -> None:
    """Wait until every IPC receiver has copied the weights; RuntimeError naming those that failed."""
    keys = [ipc_done_key(gid) for gid in receivers]
    store.wait(keys, timeout)
    failed = {
        gid: answer for gid, key in zip(receivers, keys, strict=True) if (answer := store.get(key)) != IPC_DONE_OK
    }
    if failed:
        detail = "; ".join(f"{gid}: {answer.decode(errors='replace')}" for gid, answer in failed.items())
        raise RuntimeError(f"IPC receivers could not load the weights: {detail}")
    torch.cuda.ipc_collect()  # memory of an earlier record, once no receiver holds it any more
