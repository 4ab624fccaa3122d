"""Pushes the learner's weights to every live generator, in dtype-grouped buckets, without a restart.

Protocol (the generator side is :mod:`weight_sync.receiver`; the bytes are :mod:`weight_sync.protocol`'s):

1. The learner listens with a ``TCPStore`` (one per learner process, port ``weight_sync_port``) on one
   interface: ``weight_sync_bind``, by default the address of ``weight_sync_host`` (the one generators are
   told to reach), never every interface unless asked.
2. For each push it picks the live generators whose URL's host is allowed (``allowed_generator_hosts``,
   :mod:`shared.allowed_hosts`: the others are refused, logged and counted, never contacted, so the API token
   goes only where the operator said) and plans the push (:mod:`weight_sync.plan`,
   pure): a transport per generator from the devices' physical UUIDs (CPU: gloo; the learner's own GPU: CUDA
   IPC; another GPU: NCCL), refusing duplicate GPUs in an NCCL group and members whose torch/NCCL/vLLM
   versions differ; a first rank for each group member (the learner is rank 0; a replica with tensor
   parallelism takes one rank per engine worker); the generators' engine dtype; a fresh store namespace.
3. It POSTs the ``WeightVersionAnnouncement`` (layout, ranks, transports, namespace) to every generator's
   ``/weights/update`` and, at the same time, joins the process group (when any member needs one: NCCL's is
   formed for the push, gloo's is the last push's while its members stay the same and every one still holds
   it, see :mod:`weight_sync.collective`) and sends the buckets: broadcast to the group, or through
   shared-memory segments to CPU generators on this host. Generators on the learner's own GPU get no
   buckets: one ``CudaIpcWeights`` record in the store hands them the learner's tensors where they lie, and
   they copy them into their parameters (:mod:`weight_sync.transport_ipc`); the push waits until they are
   done.
   Each generator pauses, receives, loads, recomputes or keeps its in-flight requests (its
   ``in_flight_at_push``), salts its prefix cache anew and resumes, then answers the POST.
4. When every POST answered 200 the push succeeded; a generator that failed or was refused is reported (the
   caller retries with the replicas that are live then - replicas that joined or left are handled that way).

Buckets hold tensors of one dtype back to back as raw bytes, at most ``bucket_bytes`` each (a tensor
larger than that gets a bucket of its own). Tensors are cast to the generators' engine dtype while being
packed (float32 master weights travel as bf16 to bf16 engines, at half the bytes). When every generator of a
push repacks its linear layers (``transposed_linear``: vLLM-CPU's oneDNN handles, which reorder a transposed
weight about twice as fast), the linear weights are stored transposed in the buckets; a parameter placed in
its slot (:func:`weight_sync.send_buffers.place_parameters`) is then a transposed view there, which trains the same.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import httpx
import torch

from shared.allowed_hosts import LOOPBACK, HostAllowList
from shared.records import (
    PUSH_ABORT_KEY,
    GeneratorRegistration,
    LearnerRuntime,
    RuntimeVersions,
    TensorSpec,
    WeightVersionAnnouncement,
)
from shared.shm import sweep_stale, usable_dir
from weight_sync.collective import GroupKeeper, listening_store
from weight_sync.plan import LearnerDevice, PushPlan, PushRefused, plan_push
from weight_sync.protocol import (
    announcement,
    bucket_byte_sizes,
    cuda_uuid,
    joined_names,
    layout_key,
    nccl_version,
    plan_buckets,
    vllm_version,
)
from weight_sync.push_thread import BucketPush, SendThread, send
from weight_sync.send_buffers import slot_views
from weight_sync.transport_ipc import IpcExports
from weight_sync.transport_shm import ShmSegments, shm_receivers

log = logging.getLogger(__name__)


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


def learner_device(device: torch.device) -> LearnerDevice:
    """This process's device: its physical GPU's UUID on CUDA, and torch/NCCL/vLLM versions."""
    versions = RuntimeVersions(torch=str(torch.__version__), nccl=nccl_version(device), vllm=vllm_version())
    return LearnerDevice("cuda" if device.type == "cuda" else "cpu", cuda_uuid(device), versions)


class GeneratorHosts:
    """Which registered generators the learner may contact: those whose URL's host is on
    ``learner.allowed_generator_hosts`` (:class:`~shared.allowed_hosts.HostAllowList` entries). Every push sends
    a generator the API token, so one registered at another host is never contacted; it is logged once per
    URL, not once per push, and counted."""

    def __init__(self, entries: Sequence[str]) -> None:
        self.allow_list = HostAllowList(entries)
        self.refused_urls: dict[str, str] = {}  # generator id -> the URL refused (logged once per URL)
        self.refused = 0  # registrations refused for their URL's host, in all

    def allowed(self, generators: Sequence[GeneratorRegistration]) -> list[GeneratorRegistration]:
        """``generators`` whose URL's host is allowed; each other one is logged (once per URL) and counted."""
        kept = []
        for generator in generators:
            if self.allow_list.allows(generator.url):
                kept.append(generator)
                continue
            if self.refused_urls.get(generator.generator_id) != generator.url:
                self.refused_urls[generator.generator_id] = generator.url
                self.refused += 1
                log.error(
                    "refusing generator %s: its URL %r is not on learner.allowed_generator_hosts, so it is never "
                    "contacted (it would get the API token); add its address or network there if it is yours",
                    generator.generator_id,
                    generator.url,
                )
        return kept


class WeightPusher:
    """Rank 0 of every push. ``advertise_host`` is the address generators reach the learner's store at;
    ``bind_host`` the one its store listens on (empty: ``advertise_host``'s). Only generators whose URL's host
    is in ``allowed_hosts`` (:class:`~shared.allowed_hosts.HostAllowList` entries) are contacted."""

    def __init__(
        self,
        *,
        bind_port: int,
        advertise_host: str,
        api_token: str,
        bind_host: str = "",
        allowed_hosts: Sequence[str] = LOOPBACK,
        bucket_bytes: int = 256 << 20,
        timeout_s: float = 300.0,
        join_timeout_s: float = 30.0,
        device: torch.device | None = None,
        shm_dir: str = "",
    ) -> None:
        self.timeout = timedelta(seconds=timeout_s)
        self.join_timeout = timedelta(seconds=join_timeout_s)
        # The store's timeout bounds how long group formation waits for a member that never comes.
        self.store = listening_store(bind_host or advertise_host, bind_port, self.join_timeout)
        self.port = self.store.port
        self.advertise_host = advertise_host
        self.api_token = api_token
        self.hosts = GeneratorHosts(allowed_hosts)
        self.bucket_bytes = bucket_bytes
        self.device = device or torch.device("cpu")
        self.learner = learner_device(self.device)
        self.refused = 0  # generators refused by push plans (duplicate GPU, versions, devices), in all
        # CPU generators that see this directory get pushes through shared memory (shared.shm).
        self.shm_dir = usable_dir(shm_dir) if self.device.type == "cpu" else None
        if self.shm_dir is not None:
            sweep_stale(self.shm_dir)
        # On the CPU, buckets are packed into the same buffers (or shared-memory segments) push after push: new
        # 64 MB buffers would cost page faults every time (on a GPU the caching allocator reuses memory).
        self._send_buffers: tuple[tuple, list[torch.Tensor], ShmSegments | None] | None = None
        self._sender: SendThread | None = None
        self._homes: dict[str, torch.Tensor] = {}  # slot_views of the last push, when its sending succeeded
        self._groups = GroupKeeper()  # the gloo group, kept while a push's members are the last one's
        # Generators on this GPU read the weights where they lie (CUDA IPC); the handles are kept push to push.
        self._ipc_exports = IpcExports(self.device, self.learner.uuid or "") if self.device.type == "cuda" else None
        _log_start(self.device, self.learner, self.shm_dir)

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

    def allowed(self, generators: Sequence[GeneratorRegistration]) -> list[GeneratorRegistration]:
        """``generators`` whose URL's host is allowed (:class:`GeneratorHosts`)."""
        return self.hosts.allowed(generators)

    @property
    def refused_by_host(self) -> int:
        """Registrations refused for their URL's host, in all."""
        return self.hosts.refused

    async def _answering(
        self, generators: Sequence[GeneratorRegistration], http: httpx.AsyncClient
    ) -> list[GeneratorRegistration]:
        alive = await asyncio.gather(*(_health(http, g.url) for g in generators))
        silent = [g.generator_id for g, ok in zip(generators, alive, strict=True) if not ok]
        if silent:
            log.warning("leaving out of this push generators that do not answer: %s", ", ".join(silent))
        return [g for g, ok in zip(generators, alive, strict=True) if ok]

    def close(self) -> None:
        """Remove this learner's shared-memory segments (also done at interpreter exit)."""
        if self._send_buffers is not None and self._send_buffers[2] is not None:
            self._send_buffers[2].close()
        self._send_buffers = None
        self._homes = {}  # parameters placed in those buffers keep their memory alive until they move
        self._groups.discard()

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
        key = (layout_key(specs), shared)
        last_ok = self._sender is None or self._sender.succeeded
        if self._send_buffers is not None and self._send_buffers[0] == key and last_ok:
            return self._send_buffers[1], self._send_buffers[2]
        self.close()
        sizes = bucket_byte_sizes(specs, num_buckets)
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
        return shm_receivers(self.shm_dir, generators)

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
        """Hand the tensors to the IPC receivers, join the push's group (when a generator needs one; on gloo the
        last push's while its members hold it) and send every bucket to it and to the shared-memory receivers
        (``buffers`` are then ``segments``' tensors); returns the bytes sent. On gloo, bucket k+1 is packed (into
        ``buffers[k+1]`` when given) while k is sent. ``transposed`` tensors are packed transposed (stacked: joined)."""
        store = torch.distributed.PrefixStore(namespace, self.store)
        self._homes = {}
        try:
            flipped, joins = frozenset(transposed), joined_names(named, transposed, plan.stacked_linear)
            push = BucketPush(store, namespace, plan, named, buckets, buffers, segments, flipped, self._groups, joins)
            sent = send(push, self.device, self.timeout, self._ipc_exports)
            if buffers is not None:  # every receiver is done with them until the next push
                self._homes = slot_views(named, buckets, plan.dtype, buffers, transposed, joins)
            return sent
        except BaseException as exc:
            if plan.ipc or plan.shm:  # receivers waiting for a record stop now, not at their timeout
                try:
                    store.set(PUSH_ABORT_KEY, f"{type(exc).__name__}: {exc}"[:500])
                except Exception:
                    log.exception("could not tell the IPC/shared-memory receivers that the push is off")
            raise

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

        Generators whose URL's host is not allowed are left out without being contacted (:meth:`allowed`).
        Generators that do not answer ``/health`` within 2 s are left out next (a replica that died since
        its last heartbeat would otherwise hold the others in group formation until the join timeout). A
        generator the plan refuses (see :mod:`weight_sync.plan`) fails the push before
        anyone joins a group, with that generator named; the caller's retry leaves it out.
        """
        generators = await self._answering(self.allowed(generators), http)
        if not generators:
            return PushReport(policy_version, (), 0, 0.0)
        plan = self._plan(generators)
        transposed = frozenset(linear) if plan.transposed_linear else frozenset()
        specs, buckets = plan_buckets(named, self.bucket_bytes, plan.dtype, transposed, plan.stacked_linear)
        plan, buffers, segments = self._send_buffers_or_gloo(plan, generators, specs, len(buckets))
        announced = announcement(
            policy_version,
            specs,
            len(buckets),
            f"{self.advertise_host}:{self.port}",
            ranks=plan.ranks,
            world_size=plan.world_size,
            transports=plan.transports,
            reset=reset,
        )
        started = time.perf_counter()
        sender = SendThread(
            lambda: self.send_buckets(announced.namespace, plan, named, buckets, buffers, segments, transposed)
        )
        self._sender = sender
        try:
            replies = await self._announce(announced, generators, http)
            sent = await self._sent(sender, announced)
        except WeightPushError:  # a generator may have left bytes unread in the group's sockets
            self._groups.discard()
            raise
        seconds = time.perf_counter() - started
        report = PushReport(policy_version, tuple(plan.transports), sent, seconds, _slowest_phases(replies))
        _log_push(report, plan)
        return report

    async def _sent(self, sender: SendThread, announcement: WeightVersionAnnouncement) -> int:
        """The bytes ``sender`` sent; WeightPushError naming every generator of the push if sending failed."""
        try:
            return await sender.wait(self.timeout.total_seconds())
        except Exception as exc:
            message = f"weight push {announcement.policy_version}: sending failed: {exc}"
            raise WeightPushError(message, list(announcement.transports)) from exc

    async def _announce(self, announcement: WeightVersionAnnouncement, generators, http) -> list[dict[str, float]]:
        """POST the announcement to every generator: each one's seconds per phase; raises WeightPushError naming
        those that failed, or answered 200 with a body no generator sends."""
        body = announcement.model_dump(mode="json")
        headers = {"Authorization": f"Bearer {self.api_token}"}
        timeout = self.timeout.total_seconds() + 30
        replies = await asyncio.gather(
            *(http.post(f"{g.url}/weights/update", json=body, headers=headers, timeout=timeout) for g in generators),
            return_exceptions=True,
        )
        return _phases_or_raise(announcement.policy_version, generators, replies)


def _log_start(device: torch.device, learner: LearnerDevice, shm_dir: Path | None) -> None:
    log.info(
        "weight pushes from %s%s (torch %s, NCCL %s, vLLM %s)",
        device,
        f" (GPU {learner.uuid})"
        if learner.uuid
        else f" (through shared memory in {shm_dir} to generators that see it, else gloo)"
        if shm_dir
        else " (gloo)",
        learner.versions.torch,
        learner.versions.nccl,
        learner.versions.vllm,
    )


def _phases_or_raise(policy_version: int, generators, replies) -> list[dict[str, float]]:
    """Each generator's seconds per phase; WeightPushError naming every generator whose answer is not one."""
    answers = [_phases_of(reply) for reply in replies]
    failed = {
        g.generator_id: _describe(answer)
        for g, answer in zip(generators, answers, strict=True)
        if not isinstance(answer, dict)
    }
    if failed:
        detail = ", ".join(f"{gid} ({why})" for gid, why in failed.items())
        raise WeightPushError(f"weight push {policy_version} failed on {detail}", list(failed))
    return [answer for answer in answers if isinstance(answer, dict)]  # all of them, by now


def _phases_of(reply: httpx.Response | BaseException) -> dict[str, float] | str | httpx.Response | BaseException:
    """A 200 answer's seconds per phase, or why the answer is not one a generator gives (a str); other
    answers as they are (the caller describes them)."""
    if isinstance(reply, BaseException) or reply.status_code != 200:
        return reply
    try:
        body = reply.json()
    except ValueError:
        return f"answered 200 with a body that is not JSON: {reply.text[:100]!r}"
    if not isinstance(body, dict):
        return f"answered 200 with {type(body).__name__}, not an object"
    phases = {phase: body.get(phase, 0.0) for phase in _PHASES}
    bad = [phase for phase, value in phases.items() if not _seconds(value)]
    if bad:
        return f"answered 200 with {', '.join(bad)} not a finite number of seconds"
    return {phase: float(value) for phase, value in phases.items()}


def _seconds(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _slowest_phases(answers: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per phase, the slowest generator's seconds (from each generator's answer to the announcement)."""
    return {phase: max(answer[phase] for answer in answers) for phase in _PHASES}


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
    if isinstance(reply, str):  # a 200 whose body no generator sends (_phases_of)
        return reply
    if isinstance(reply, BaseException):
        return f"{type(reply).__name__}: {reply}"
    return f"HTTP {reply.status_code}: {reply.text[:200]}"
