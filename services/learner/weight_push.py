"""Pushes the learner's weights to every live generator, in dtype-grouped buckets, without a restart.

Protocol (the generator side is :mod:`services.generator.weight_receiver`):

1. The learner listens with a ``TCPStore`` (one per learner process, port ``weight_sync_port``).
2. For each push it picks the live generators and plans the push (:mod:`services.learner.weight_transport`,
   pure): a transport per generator from the devices' physical UUIDs (CPU: gloo; the learner's own GPU: CUDA
   IPC; another GPU: NCCL), refusing duplicate GPUs in an NCCL group and members whose torch/NCCL/vLLM
   versions differ; a first rank for each group member (the learner is rank 0; a replica with tensor
   parallelism takes one rank per engine worker); the generators' engine dtype; a fresh store namespace.
3. It POSTs the ``WeightVersionAnnouncement`` (layout, ranks, transports, namespace) to every generator's
   ``/weights/update`` and, at the same time, forms the process group (gloo or NCCL, when any member needs
   one) and sends the buckets: broadcast to the group, or through shared-memory segments to CPU generators
   on this host. Generators on the learner's own GPU get no buckets: one ``CudaIpcWeights`` record in the
   store hands them the learner's tensors where they lie, and they copy them into their parameters
   (:mod:`services.learner.weight_transport_ipc`); the push waits until they are done.
   Each generator pauses, receives, loads, resets its prefix cache and resumes, then answers the POST.
4. When every POST answered 200 the push succeeded; a generator that failed or was refused is reported (the
   caller retries with the replicas that are live then - replicas that joined or left are handled that way).

Buckets hold tensors of one dtype back to back as raw bytes, at most ``bucket_bytes`` each (a tensor
larger than that gets a bucket of its own). Tensors are cast to the generators' engine dtype while being
packed (float32 master weights travel as bf16 to bf16 engines, at half the bytes). When every generator of a
push repacks its linear layers (``transposed_linear``: vLLM-CPU's oneDNN handles, which reorder a transposed
weight about twice as fast), the linear weights are stored transposed in the buckets; a parameter placed in
its slot (:func:`place_parameters`) is then a transposed view there, which trains the same.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import httpx
import torch

from services.learner.weight_transport import LearnerDevice, PushPlan, PushRefused, plan_push
from services.learner.weight_transport_ipc import IpcExports, publish_ipc, wait_ipc
from services.learner.weight_transport_shm import ShmPublisher, ShmSegments
from shared.records import (
    PUSH_ABORT_KEY,
    DType,
    GeneratorRegistration,
    LearnerRuntime,
    RuntimeVersions,
    TensorSpec,
    WeightVersionAnnouncement,
)
from shared.release import release_in_background
from shared.shm import probe_matches, sweep_stale, usable_dir
from shared.weights import bucket_byte_sizes

log = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


class WeightPushError(RuntimeError):
    def __init__(self, message: str, failed: Sequence[str]) -> None:
        super().__init__(message)
        self.failed = list(failed)


_PHASES = (
    "pause_seconds",
    "join_seconds",
    "transfer_seconds",
    "receive_wait_seconds",
    "load_seconds",
    "close_seconds",
    "reset_seconds",
    "resume_seconds",
)


@dataclass(frozen=True)
class PushReport:
    policy_version: int
    generators: tuple[str, ...]
    bytes: int
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)  # the slowest generator's, per phase

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / max(self.seconds, 1e-9)


def plan_buckets(
    named: Sequence[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    dtype: DType | None = None,
    transposed: Collection[str] = (),
) -> tuple[list[TensorSpec], list[list[int]]]:
    """Layout of a push: specs in order, and per bucket the indices of its tensors (one dtype each).

    ``dtype``: every tensor travels cast to it (the generators' engine dtype); None keeps each one's own.
    Within a dtype, tensors keep their order, so pieces of one stacked engine parameter (``q, k, v``) lie
    back to back in a bucket and the receiver can load them without a copy. ``transposed``: names of 2-D
    tensors that travel transposed (linear weights for engines that repack them, see
    ``GeneratorRegistration.transposed_linear``); a name that is not pushed is ignored.
    """
    target = _DTYPES[dtype] if dtype is not None else None
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, (name, tensor) in enumerate(named):
        if tensor.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{name} has dtype {tensor.dtype}; pushes carry float32, float16 or bfloat16")
        by_dtype.setdefault(target or tensor.dtype, []).append(index)
    buckets = [
        bucket
        for travels_as, indices in by_dtype.items()
        for bucket in _cut_into_buckets(named, indices, travels_as, bucket_bytes)
    ]
    specs: list[TensorSpec | None] = [None] * len(named)
    for bucket, indices in enumerate(buckets):
        for index in indices:
            name, tensor = named[index]
            specs[index] = TensorSpec(
                name=name,
                dtype=dtype or _DTYPE_NAMES[tensor.dtype],
                shape=tuple(tensor.shape),
                bucket=bucket,
                transposed=name in transposed,
            )
    ordered = [spec for bucket in buckets for spec in (specs[i] for i in bucket)]
    return [s for s in ordered if s is not None], buckets


def _cut_into_buckets(
    named: Sequence[tuple[str, torch.Tensor]], indices: list[int], travels_as: torch.dtype, bucket_bytes: int
) -> list[list[int]]:
    """``indices`` (tensors of one dtype) in order, cut into buckets of at most ``bucket_bytes`` each (a larger
    tensor gets a bucket of its own)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index in indices:
        nbytes = named[index][1].numel() * travels_as.itemsize
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(index)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def pack_bucket(
    tensors: Sequence[torch.Tensor],
    dtype: DType | None = None,
    out: torch.Tensor | None = None,
    transposed: Sequence[bool] | None = None,
) -> torch.Tensor:
    """Tensors as one flat uint8 buffer, back to back, each cast to ``dtype`` while copied (None: as they
    are; they must then share one dtype), and stored transposed where ``transposed`` says so (2-D tensors).
    Into ``out`` when given (its size must match), else a new buffer on the tensors' device."""
    target = _DTYPES[dtype] if dtype is not None else None
    travels = [target or t.dtype for t in tensors]
    if len(set(travels)) != 1:
        raise ValueError(f"a bucket carries one dtype; got {sorted(str(d) for d in set(travels))}")
    nbytes = sum(t.numel() * d.itemsize for t, d in zip(tensors, travels, strict=True))
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=tensors[0].device)
    elif out.numel() != nbytes or out.dtype != torch.uint8:
        raise ValueError(f"bucket buffer holds {out.numel()} {out.dtype}; the tensors need {nbytes} uint8")
    for tensor, slot in zip(tensors, _slots(tensors, target, out, transposed), strict=True):
        if not lies_in(tensor, slot):  # a parameter kept in its slot (place_parameters) is packed already
            slot.copy_(tensor.detach())
    return out


def _slots(
    tensors: Sequence[torch.Tensor],
    target: torch.dtype | None,
    out: torch.Tensor,
    transposed: Sequence[bool] | None = None,
) -> Iterator[torch.Tensor]:
    """Each tensor's place in the bucket ``out``: back to back, in ``target`` (None: its own dtype) and its
    shape; a transposed one is the transpose of its ``[shape[1], shape[0]]`` contiguous bytes (a view with
    strides ``(1, shape[0])``, so copying the tensor into it stores the transpose)."""
    flags = transposed if transposed is not None else [False] * len(tensors)
    if len(flags) != len(tensors):
        raise ValueError(f"{len(flags)} transposed flags for {len(tensors)} tensors")
    offset = 0
    for tensor, flip in zip(tensors, flags, strict=True):
        travels = target or tensor.dtype
        size = tensor.numel() * travels.itemsize
        flat = out[offset : offset + size].view(travels)
        if flip:
            if tensor.dim() != 2:
                raise ValueError(f"only a 2-D tensor travels transposed, not one of shape {tuple(tensor.shape)}")
            yield flat.view(tensor.shape[1], tensor.shape[0]).t()
        else:
            yield flat.view(tensor.shape)
        offset += size


def lies_in(tensor: torch.Tensor, slot: torch.Tensor) -> bool:
    """Whether ``tensor`` is ``slot``'s memory, seen the same way (same address, dtype, shape and strides)."""
    return (
        tensor.data_ptr() == slot.data_ptr()
        and tensor.dtype == slot.dtype
        and tensor.shape == slot.shape
        and tensor.stride() == slot.stride()
    )


def slot_views(
    named: Sequence[tuple[str, torch.Tensor]],
    buckets: Sequence[Sequence[int]],
    dtype: DType | None,
    buffers: Sequence[torch.Tensor],
    transposed: Collection[str] = (),
) -> dict[str, torch.Tensor]:
    """Where :func:`pack_bucket` puts each of ``named`` in ``buffers`` (one per bucket), as a tensor of its
    dtype and shape (with the strides of a transposed slot for the names in ``transposed``); only the
    tensors that travel in their own dtype (a cast copy is not the tensor)."""
    target = _DTYPES[dtype] if dtype is not None else None
    views: dict[str, torch.Tensor] = {}
    for indices, buffer in zip(buckets, buffers, strict=True):
        tensors = [named[i][1] for i in indices]
        flags = [named[i][0] in transposed for i in indices]
        for index, slot in zip(indices, _slots(tensors, target, buffer, flags), strict=True):
            name, tensor = named[index]
            if slot.dtype == tensor.dtype:
                views[name] = slot
    return views


def place_parameters(model: torch.nn.Module, homes: dict[str, torch.Tensor]) -> list[torch.nn.Parameter]:
    """Move each parameter of ``model`` named in ``homes`` into that memory (its values copied there first)
    and return the parameters that live there now. The next push then packs them by no copy at all. Their
    values must not change while a push reads them: the learner pushes between optimizer steps."""
    placed = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            home = homes.get(name)
            if home is None or home.dtype != param.dtype or home.shape != param.shape or home.device != param.device:
                continue  # (a home stored transposed has the parameter's shape, and strides of its own)
            if not lies_in(param, home):
                home.copy_(param)
                param.data = home
            placed.append(param)
    return placed


def own_parameters(params: Sequence[torch.nn.Parameter]) -> None:
    """Give ``params`` private memory again (after a push that failed, a receiver or a sending thread may
    still read the buffers they lie in, which the next optimizer step would change under it)."""
    with torch.no_grad():
        for param in params:
            param.data = param.data.clone()


def installed_version(*distributions: str) -> str | None:
    """Version of the first of ``distributions`` that is installed (vLLM ships as ``vllm`` or ``vllm-cpu``)."""
    from importlib import metadata

    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def learner_device(device: torch.device) -> LearnerDevice:
    """This process's device: its physical GPU's UUID on CUDA, and torch/NCCL/vLLM versions."""
    if device.type != "cuda":
        return LearnerDevice(
            "cpu", None, RuntimeVersions(torch=str(torch.__version__), vllm=installed_version("vllm", "vllm-cpu"))
        )
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return LearnerDevice(
        "cuda",
        str(torch.cuda.get_device_properties(device).uuid),
        RuntimeVersions(torch=str(torch.__version__), nccl=nccl, vllm=installed_version("vllm", "vllm-cpu")),
    )


class WeightPusher:
    """Rank 0 of every push. ``advertise_host`` is the address generators reach the learner's store at."""

    def __init__(
        self,
        *,
        bind_port: int,
        advertise_host: str,
        api_token: str,
        bucket_bytes: int = 256 << 20,
        timeout_s: float = 300.0,
        join_timeout_s: float = 30.0,
        device: torch.device | None = None,
        shm_dir: str = "",
    ) -> None:
        self.timeout = timedelta(seconds=timeout_s)
        self.join_timeout = timedelta(seconds=join_timeout_s)
        # The store's timeout bounds how long group formation waits for a member that never comes.
        self.store = torch.distributed.TCPStore(
            "0.0.0.0", bind_port, is_master=True, wait_for_workers=False, timeout=self.join_timeout
        )
        self.port = self.store.port
        self.advertise_host = advertise_host
        self.api_token = api_token
        self.bucket_bytes = bucket_bytes
        self.device = device or torch.device("cpu")
        self.learner = learner_device(self.device)
        self.refused = 0  # generators refused by push plans (duplicate GPU, versions, devices), in all
        # CPU generators that see this directory get pushes through shared memory (shared.shm).
        self.shm_dir = usable_dir(shm_dir) if self.device.type == "cpu" else None
        if self.shm_dir is not None:
            sweep_stale(self.shm_dir)
        # On the CPU, buckets are packed into the same buffers push after push (new 64 MB buffers would cost
        # page faults every time; on a GPU the caching allocator reuses memory by itself): plain memory, or
        # shared-memory segments when a generator receives through them.
        self._send_buffers: tuple[tuple, list[torch.Tensor], ShmSegments | None] | None = None
        self._sender: _Sender | None = None
        self._homes: dict[str, torch.Tensor] = {}  # slot_views of the last push, when its sending succeeded
        # Generators on this GPU read the weights where they lie (CUDA IPC); the handles are kept push to push.
        self._ipc_exports = IpcExports(self.device, self.learner.uuid or "") if self.device.type == "cuda" else None
        log.info(
            "weight pushes from %s%s (torch %s, NCCL %s, vLLM %s)",
            self.device,
            f" (GPU {self.learner.uuid})"
            if self.learner.uuid
            else f" (through shared memory in {self.shm_dir} to generators that see it, else gloo)"
            if self.shm_dir
            else " (gloo)",
            self.learner.versions.torch,
            self.learner.versions.nccl,
            self.learner.versions.vllm,
        )

    def runtime(self, ranks: Sequence[tuple[str, str | None]] = ()) -> LearnerRuntime:
        """What the learner publishes about itself at start: device UUID and versions, and ``ranks``: every
        rank's device and GPU UUID in rank order (this process's alone when empty)."""
        ranks = ranks or [(str(self.device), self.learner.uuid)]
        return LearnerRuntime(
            device=str(self.device),
            device_uuid=self.learner.uuid,
            versions=self.learner.versions,
            rank_devices=tuple(device for device, _ in ranks),
            rank_device_uuids=tuple(uuid for _, uuid in ranks),
        )

    async def _answering(
        self, generators: Sequence[GeneratorRegistration], http: httpx.AsyncClient
    ) -> list[GeneratorRegistration]:
        alive = await asyncio.gather(*(_health(http, g.url) for g in generators))
        silent = [g.generator_id for g, ok in zip(generators, alive, strict=True) if not ok]
        if silent:
            log.warning("leaving out of this push generators that do not answer: %s", ", ".join(silent))
        return [g for g, ok in zip(generators, alive, strict=True) if ok]

    def _group(self, store, world_size: int):
        if self.device.type == "cuda":
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup

            # On the learner's own store under the push's namespace: ``StatelessProcessGroup.create`` would
            # bind ``weight_sync_port`` a second time for rank 0.
            return PyNcclCommunicator(StatelessProcessGroup(rank=0, world_size=world_size, store=store), self.device)
        return torch.distributed.ProcessGroupGloo(store, 0, world_size, self.timeout)

    def close(self) -> None:
        """Remove this learner's shared-memory segments (also done at interpreter exit)."""
        if self._send_buffers is not None and self._send_buffers[2] is not None:
            self._send_buffers[2].close()
        self._send_buffers = None
        self._homes = {}  # parameters placed in those buffers keep their memory alive until they move

    def weight_homes(self) -> dict[str, torch.Tensor]:
        """After a push whose sending succeeded on the CPU: where each pushed tensor that travelled uncast
        lies in the buffers kept for the next push (:func:`slot_views`), for :func:`place_parameters`. A
        later push with the same layout packs parameters living there by no copy. Empty otherwise."""
        return dict(self._homes)

    def _buffers_for(
        self, specs: Sequence[TensorSpec], num_buckets: int, shared: bool
    ) -> tuple[list[torch.Tensor] | None, ShmSegments | None]:
        """The CPU buffers this push packs its buckets into (shared-memory segments when ``shared``): the last
        push's when the layout is the same and that push succeeded (after one that failed or timed out, a
        receiver or the sending thread may still use them), else new ones; None on a GPU."""
        if self.device.type != "cpu":
            return None, None
        key = (tuple((s.name, s.dtype, s.shape, s.bucket, s.transposed) for s in specs), shared)
        last_ok = self._sender is None or self._sender.succeeded
        if self._send_buffers is not None and self._send_buffers[0] == key and last_ok:
            return self._send_buffers[1], self._send_buffers[2]
        self.close()
        sizes = bucket_byte_sizes(((s.dtype, s.shape, s.bucket) for s in specs), num_buckets)
        if shared:
            assert self.shm_dir is not None
            segments = ShmSegments(self.shm_dir, sizes)
            self._send_buffers = (key, segments.tensors, segments)
        else:
            self._send_buffers = (key, [torch.empty(n, dtype=torch.uint8) for n in sizes], None)
        return self._send_buffers[1], self._send_buffers[2]

    def _send_buffers_or_gloo(
        self, plan: PushPlan, generators: Sequence[GeneratorRegistration], specs: Sequence[TensorSpec], num_buckets: int
    ) -> tuple[PushPlan, list[torch.Tensor] | None, ShmSegments | None]:
        """The plan and the buffers to pack into. When the shared-memory segments cannot be made (no room in
        the directory), the error is logged with its fix and this learner pushes over gloo from then on."""
        try:
            return plan, *self._buffers_for(specs, num_buckets, shared=bool(plan.shm))
        except OSError as exc:
            log.error("shared-memory weight pushes are off for this learner (%s); pushing over gloo", exc)
            self.shm_dir = None
            plan = self._plan(generators)
            return plan, *self._buffers_for(specs, num_buckets, shared=False)

    def _shares_memory(self, generators: Sequence[GeneratorRegistration]) -> set[str]:
        """Generators whose shared-memory probe this learner sees (same host, directory and user)."""
        if self.shm_dir is None:
            return set()
        return {
            g.generator_id
            for g in generators
            if g.shm_probe is not None and probe_matches(g.shm_probe.path, g.shm_probe.token, self.shm_dir)
        }

    def send_buckets(
        self,
        namespace: str,
        plan: PushPlan,
        named,
        buckets: Sequence[Sequence[int]],
        buffers: Sequence[torch.Tensor] | None = None,
        segments: ShmSegments | None = None,
        transposed: Collection[str] = (),
    ) -> int:
        """Hand the tensors to the IPC receivers, form the push's group (when a generator needs one) and send
        every bucket to it and to the shared-memory receivers (``buffers`` are then ``segments``' tensors);
        returns the bytes sent. On gloo, bucket k+1 is packed (into ``buffers[k+1]`` when given) while k is
        sent. The tensors named in ``transposed`` are packed transposed (as the layout says)."""
        store = torch.distributed.PrefixStore(namespace, self.store)
        self._homes = {}
        try:
            sent = self._send(store, plan, named, buckets, buffers, segments, transposed)
            if buffers is not None:  # every receiver is done with them until the next push
                self._homes = slot_views(named, buckets, plan.dtype, buffers, transposed)
            return sent
        except BaseException as exc:
            if plan.ipc or plan.shm:  # receivers waiting for a record stop now, not at their timeout
                try:
                    store.set(PUSH_ABORT_KEY, f"{type(exc).__name__}: {exc}"[:500])
                except Exception:
                    log.exception("could not tell the IPC/shared-memory receivers that the push is off")
            raise

    def _send(self, store, plan: PushPlan, named, buckets, buffers, segments, transposed) -> int:
        sent = 0
        if plan.ipc:  # receivers copy from the learner's tensors themselves while the buckets go to the rest
            if self._ipc_exports is None:
                raise ValueError("IPC pushes are sent from a CUDA learner")
            sent += publish_ipc(store, self._ipc_exports, named)
        if plan.ranks or plan.shm:
            sent += self._send_buckets(store, plan, named, buckets, buffers, segments, transposed)
        if plan.ipc:
            wait_ipc(store, plan.ipc, self.timeout)
        return sent

    def _send_buckets(self, store, plan: PushPlan, named, buckets, buffers, segments, transposed) -> int:
        group = self._group(store, plan.world_size) if plan.ranks else None
        shm = None
        if plan.shm:
            if segments is None:
                raise ValueError("a push with shared-memory receivers packs into shared-memory segments")
            shm = ShmPublisher(store, plan.shm, segments, self.timeout)
        in_flight = None
        sent = 0
        for index, indices in enumerate(buckets):
            out = buffers[index] if buffers is not None else None
            flags = [named[i][0] in transposed for i in indices]
            buffer = pack_bucket([named[i][1] for i in indices], plan.dtype, out, flags).to(self.device)
            if shm is not None:
                shm.publish(index)
            if group is not None:
                in_flight = self._broadcast(group, buffer, in_flight)
            sent += buffer.numel()
        if in_flight is not None:
            in_flight.wait()
        if shm is not None:
            shm.finish()
        if group is not None:  # torn down in the background: the push is over
            retired = [group]
            del group
            release_in_background(retired, "weight-group-release")
        return sent

    def _broadcast(self, group, buffer: torch.Tensor, previous):
        """Send one bucket to the group: NCCL at once; gloo in the background once the previous bucket is
        through. Returns the gloo send still in flight (None on NCCL)."""
        if self.device.type == "cuda":
            group.broadcast(buffer, src=0, stream=torch.cuda.current_stream())
            torch.cuda.current_stream().synchronize()
            return None
        options = torch.distributed.BroadcastOptions()
        options.rootRank = 0
        work = group.broadcast([buffer], options)
        if previous is not None:
            previous.wait()
        return work

    def _plan(self, generators: Sequence[GeneratorRegistration]) -> PushPlan:
        try:
            return plan_push(self.learner, generators, self._shares_memory(generators))
        except PushRefused as exc:
            self.refused += len(exc.generator_ids)
            log.error("weight push refused: %s", exc)
            raise WeightPushError(str(exc), exc.generator_ids) from None

    async def push(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        policy_version: int,
        generators: Sequence[GeneratorRegistration],
        http: httpx.AsyncClient,
        *,
        reset: bool = False,
        linear: Collection[str] = (),
    ) -> PushReport:
        """Send ``named`` tensors to ``generators`` as ``policy_version``; raises WeightPushError.

        ``linear``: names of linear layers' weights; they travel transposed when every generator of the push
        repacks linear weights (``transposed_linear``: vLLM-CPU's oneDNN kernels read that layout faster).

        Generators that do not answer ``/health`` within 2 s are left out first (a replica that died since
        its last heartbeat would otherwise hold the others in group formation until the join timeout). A
        generator the plan refuses (see :mod:`services.learner.weight_transport`) fails the push before
        anyone joins a group, with that generator named; the caller's retry leaves it out.
        """
        generators = await self._answering(generators, http)
        if not generators:
            return PushReport(policy_version, (), 0, 0.0)
        plan = self._plan(generators)
        transposed = frozenset(linear) if plan.transposed_linear else frozenset()
        specs, buckets = plan_buckets(named, self.bucket_bytes, plan.dtype, transposed)
        plan, buffers, segments = self._send_buffers_or_gloo(plan, generators, specs, len(buckets))
        announcement = self._announcement(policy_version, plan, specs, len(buckets), reset)
        started = time.perf_counter()
        sender = _Sender(
            lambda: self.send_buckets(announcement.namespace, plan, named, buckets, buffers, segments, transposed)
        )
        self._sender = sender
        replies = await self._announce(announcement, generators, http)
        sent = await self._sent(sender, announcement)
        seconds = time.perf_counter() - started
        report = PushReport(policy_version, tuple(plan.transports), sent, seconds, _slowest_phases(replies))
        _log_push(report, plan)
        return report

    async def _sent(self, sender: _Sender, announcement: WeightVersionAnnouncement) -> int:
        """The bytes ``sender`` sent; WeightPushError naming every generator of the push if sending failed."""
        try:
            return await sender.wait(self.timeout.total_seconds())
        except Exception as exc:
            message = f"weight push {announcement.policy_version}: sending failed: {exc}"
            raise WeightPushError(message, list(announcement.transports)) from exc

    def _announcement(
        self, policy_version: int, plan: PushPlan, specs: Sequence[TensorSpec], num_buckets: int, reset: bool
    ) -> WeightVersionAnnouncement:
        """What every generator of the push is told: the layout, its rank and transport, a fresh namespace."""
        return WeightVersionAnnouncement(
            policy_version=policy_version,
            layout=tuple(specs),
            num_buckets=num_buckets,
            rendezvous=f"{self.advertise_host}:{self.port}",
            namespace=f"push/{policy_version}/{uuid.uuid4().hex[:8]}",
            ranks=plan.ranks,
            world_size=plan.world_size,
            transports=plan.transports,
            reset=reset,
        )

    async def _announce(self, announcement: WeightVersionAnnouncement, generators, http) -> list:
        """POST the announcement to every generator; raises WeightPushError naming those that failed."""
        body = announcement.model_dump(mode="json")
        headers = {"Authorization": f"Bearer {self.api_token}"}
        timeout = self.timeout.total_seconds() + 30
        replies = await asyncio.gather(
            *(http.post(f"{g.url}/weights/update", json=body, headers=headers, timeout=timeout) for g in generators),
            return_exceptions=True,
        )
        failed = {
            g.generator_id: _describe(reply)
            for g, reply in zip(generators, replies, strict=True)
            if isinstance(reply, BaseException) or reply.status_code != 200
        }
        if failed:
            detail = ", ".join(f"{gid} ({why})" for gid, why in failed.items())
            raise WeightPushError(f"weight push {announcement.policy_version} failed on {detail}", list(failed))
        return replies


class _Sender:
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


def _slowest_phases(replies: Sequence[httpx.Response]) -> dict[str, float]:
    """Per phase, the slowest generator's seconds (from each generator's answer to the announcement)."""
    return {phase: max(reply.json().get(phase, 0.0) for reply in replies) for phase in _PHASES}


def _log_push(report: PushReport, plan: PushPlan) -> None:
    log.info(
        "pushed version %d to %d generator(s) over %s: %.1f MB in %.2f s (%.3f GB/s; slowest generator: %s)",
        report.policy_version,
        len(report.generators),
        ", ".join(sorted(set(plan.transports.values()))),
        report.bytes / 1e6,
        report.seconds,
        report.gb_per_s,
        ", ".join(f"{k.removesuffix('_seconds')} {v:.2f}" for k, v in report.phases.items()),
    )


async def _health(http: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await http.get(f"{url}/health", timeout=2.0)).status_code == 200
    except httpx.HTTPError:
        return False


def _describe(reply) -> str:
    if isinstance(reply, BaseException):
        return f"{type(reply).__name__}: {reply}"
    return f"HTTP {reply.status_code}: {reply.text[:200]}"
