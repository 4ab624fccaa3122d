"""The sending of one weight push, on a thread of its own: hand the tensors to the CUDA IPC receivers, pack
every bucket and send it to the push's gloo/NCCL group and to the shared-memory receivers, and wait until
every receiver is done (:mod:`weight_sync.sender` runs it beside the announcement it posts).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from weight_sync.collective import GroupKeeper, KeptGroup, form_group, learner_group, start_broadcast
from weight_sync.plan import PushPlan, group_members
from weight_sync.protocol import pack_bucket
from weight_sync.transport_ipc import IpcExports, publish_ipc, wait_ipc
from weight_sync.transport_shm import ShmPublisher, ShmSegments


@dataclass(frozen=True)
class BucketPush:
    """One push's sending: the store namespace (and its name), the plan, the tensors, their buckets, where they
    pack, and the learner's kept gloo group (None: a group for this push alone, as on NCCL)."""

    store: Any
    namespace: str
    plan: PushPlan
    named: Sequence[tuple[str, torch.Tensor]]
    buckets: Sequence[Sequence[int]]
    buffers: Sequence[torch.Tensor] | None
    segments: ShmSegments | None
    transposed: frozenset[str]
    groups: GroupKeeper | None = None
    joined: frozenset[str] = frozenset()  # transposed pieces packed into the block of the one before


def send(push: BucketPush, device: torch.device, timeout: timedelta, ipc_exports: IpcExports | None) -> int:
    plan, store = push.plan, push.store
    sent = 0
    if plan.ipc:  # receivers copy from the learner's tensors themselves while the buckets go to the rest
        if ipc_exports is None:
            raise ValueError("IPC pushes are sent from a CUDA learner")
        sent += publish_ipc(store, ipc_exports, push.named)
    if plan.ranks or plan.shm:
        sent += _send_buckets(push, device, timeout)
    if plan.ipc:
        wait_ipc(store, plan.ipc, timeout)
    return sent


def _send_buckets(push: BucketPush, device: torch.device, timeout: timedelta) -> int:
    plan = push.plan
    if plan.shm and push.segments is None:
        raise ValueError("a push with shared-memory receivers packs into shared-memory segments")
    group, generation = _join_group(push, device, timeout) if plan.ranks else (None, None)
    try:
        sent = _pack_and_send(push, device, timeout, group.group if group is not None else None)
    except BaseException:
        if group is not None:  # a push cut short may leave bytes in the group's sockets
            group.retire()
        raise
    if group is not None and generation is not None and push.groups is not None:
        push.groups.keep(group, generation)
    elif group is not None:  # torn down in the background: the push is over
        group.retire()
    return sent


def _join_group(push: BucketPush, device: torch.device, timeout: timedelta) -> tuple[KeptGroup, int | None]:
    """The push's process group, and the keeper's generation when it is the learner's kept gloo group (reused
    when every member still holds it, see :func:`learner_group`); NCCL's is made for this push alone."""
    if device.type == "cuda" or push.groups is None:
        group = form_group(push.store, 0, push.plan.world_size, device, timeout)
        return KeptGroup(group, push.namespace, None), None
    members = group_members(push.plan)
    kept, generation = push.groups.take(members)
    return learner_group(push.store, push.namespace, kept, members, push.plan.world_size, timeout), generation


def _pack_and_send(push: BucketPush, device: torch.device, timeout: timedelta, group: Any) -> int:
    """Pack every bucket, broadcast it to ``group`` (when given) and publish it to the shared-memory receivers.
    Bucket k+1 is packed while gloo sends k, and sent once k is: one bucket at a time, as a raw broadcast
    sends them, so each arrives whole as early as it can and the receivers load it while the next one comes
    (two buckets sent at once share the link, and both arrive late)."""
    plan, named = push.plan, push.named
    shm = ShmPublisher(push.store, plan.shm, push.segments, timeout) if push.segments is not None and plan.shm else None
    in_flight = None
    sent = 0
    for index, indices in enumerate(push.buckets):
        out = push.buffers[index] if push.buffers is not None else None
        flags = [named[i][0] in push.transposed for i in indices]
        joins = [named[i][0] in push.joined for i in indices]
        buffer = pack_bucket([named[i][1] for i in indices], plan.dtype, out, flags, joins).to(device)
        if shm is not None:
            shm.publish(index)
        if group is not None:
            if in_flight is not None:
                in_flight.wait()
            in_flight = start_broadcast(group, buffer)
        sent += buffer.numel()
    if in_flight is not None:
        in_flight.wait()
    if shm is not None:
        shm.finish()
    return sent


class SendThread:
    """Runs a push's sending on a daemon thread (while the event loop posts the announcement), so a group
    that never forms cannot keep the process alive at exit."""

    def __init__(self, send: Callable[[], int]) -> None:
        self.sent = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(send,), daemon=True)
        self._thread.start()

    def _run(self, send: Callable[[], int]) -> None:
        try:
            self.sent = send()
        except BaseException as exc:  # re-raised by wait(), in the awaiting coroutine
            self.error = exc

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def succeeded(self) -> bool:
        """Sending is over and raised nothing."""
        return not self._thread.is_alive() and self.error is None

    async def wait(self, timeout_s: float) -> int:
        """The bytes sent; raises what sending raised, or TimeoutError after ``timeout_s``."""
        await asyncio.to_thread(self._thread.join, timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"still sending after {timeout_s:.0f} s")
        if self.error is not None:
            raise self.error
        return self.sent
