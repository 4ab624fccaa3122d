"""The learner's half of the CUDA IPC transport: generators on the learner's own GPU read each bucket where
it lies in GPU memory (no copy through the host, no NCCL, which refuses two ranks on one GPU).

Per bucket: the packed buffer's handle (``torch.multiprocessing.reductions.reduce_tensor``) goes into the
push's store namespace as a typed :class:`~shared.records.CudaIpcBucket` (bytes and ints, never a pickle)
under ``ipc/<bucket>``; the buffer is held until every IPC receiver has set ``ipc/<bucket>/done/<id>``. At most
``window`` buckets are held at once, so the learner's extra memory stays a few buckets, not a model copy.

The receiving half is ``WeightReceiverExtension`` in :mod:`services.generator.weight_receiver`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from shared.codec import encode
from shared.records import CudaIpcBucket

# Buckets published but not yet released by every receiver: receivers ask for bucket k+1 before they
# release bucket k (they receive ahead), so the window must be at least 2.
DEFAULT_WINDOW = 2


def ipc_record_from_args(bucket: int, device_uuid: str, args: Sequence[Any]) -> CudaIpcBucket:
    """The typed record of ``reduce_tensor``'s arguments for a flat uint8 CUDA tensor."""
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
        raise ValueError(f"an IPC bucket is a flat uint8 tensor, got {dtype} of shape {tuple(size)}")
    return CudaIpcBucket(
        bucket=bucket,
        device_uuid=device_uuid,
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


class IpcPublisher:
    """Publishes bucket handles in ``store`` (the push's namespace) for ``receivers`` (generator ids)."""

    def __init__(
        self, store: Any, receivers: Sequence[str], device_uuid: str, timeout: timedelta, window: int = DEFAULT_WINDOW
    ) -> None:
        if window < 2:
            raise ValueError("the IPC window must hold at least 2 buckets (receivers read one ahead)")
        self.store, self.receivers, self.device_uuid = store, list(receivers), device_uuid
        self.timeout, self.window = timeout, window
        self.held: deque[tuple[int, torch.Tensor]] = deque()

    def publish(self, index: int, buffer: torch.Tensor) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        # A receiver that opened this allocation before reads it from its cache without waiting on the
        # handle's event, so the data must be complete on the device before the handle is published.
        torch.cuda.current_stream(buffer.device).synchronize()
        _, args = reduce_tensor(buffer)
        self.store.set(f"ipc/{index}", encode(ipc_record_from_args(index, self.device_uuid, args)))
        self.held.append((index, buffer))
        while len(self.held) > self.window:
            self._release_oldest()

    def _release_oldest(self) -> None:
        index, _ = self.held.popleft()
        self.store.wait([f"ipc/{index}/done/{gid}" for gid in self.receivers], self.timeout)

    def finish(self) -> None:
        """Wait until every receiver is done with every bucket, then let CUDA free the shared blocks."""
        while self.held:
            self._release_oldest()
        torch.cuda.ipc_collect()
