"""Pushes the learner's weights to every live generator, in dtype-grouped buckets, without a restart.

Protocol (the generator side is :mod:`services.generator.weight_receiver`):

1. The learner listens with a ``TCPStore`` (one per learner process, port ``weight_sync_port``).
2. For each push it picks the live generators, gives each a first rank (the learner is rank 0; a replica
   with tensor parallelism takes one rank per engine worker), and a fresh store namespace.
3. It POSTs the ``WeightVersionAnnouncement`` (layout, ranks, namespace) to every generator's
   ``/weights/update`` and, at the same time, forms the process group (gloo on CPU, NCCL on GPU) and
   broadcasts the buckets. Each generator pauses, receives, loads, resets its prefix cache and resumes,
   then answers the POST.
4. When every POST answered 200 the push succeeded; a generator that failed is reported (the caller
   retries with the replicas that are live then - replicas that joined or left are handled that way).

Buckets hold tensors of one dtype back to back as raw bytes, at most ``bucket_bytes`` each (a tensor
larger than that gets a bucket of its own).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import httpx
import torch

from shared.records import GeneratorRegistration, TensorSpec, WeightVersionAnnouncement

log = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


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
    named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
) -> tuple[list[TensorSpec], list[list[int]]]:
    """Layout of a push: specs in order, and per bucket the indices of its tensors (one dtype each)."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, (name, tensor) in enumerate(named):
        if tensor.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{name} has dtype {tensor.dtype}; pushes carry float32, float16 or bfloat16")
        by_dtype.setdefault(tensor.dtype, []).append(index)
    specs: list[TensorSpec | None] = [None] * len(named)
    buckets: list[list[int]] = []
    for indices in by_dtype.values():
        current: list[int] = []
        size = 0
        for index in indices:
            nbytes = named[index][1].numel() * named[index][1].element_size()
            if current and size + nbytes > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(index)
            size += nbytes
        if current:
            buckets.append(current)
    for bucket, indices in enumerate(buckets):
        for index in indices:
            name, tensor = named[index]
            specs[index] = TensorSpec(
                name=name, dtype=_DTYPE_NAMES[tensor.dtype], shape=tuple(tensor.shape), bucket=bucket
            )
    ordered = [spec for bucket in buckets for spec in (specs[i] for i in bucket)]
    return [s for s in ordered if s is not None], buckets


def pack_bucket(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Tensors of one dtype as one flat uint8 buffer, back to back."""
    return torch.cat([t.detach().contiguous().view(torch.uint8).reshape(-1) for t in tensors])


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
        self.pushes = 0
        self.failures = 0
        self.skipped = 0  # generators left out of a push because they did not answer

    async def _answering(
        self, generators: Sequence[GeneratorRegistration], http: httpx.AsyncClient
    ) -> list[GeneratorRegistration]:
        alive = await asyncio.gather(*(_health(http, g.url) for g in generators))
        silent = [g.generator_id for g, ok in zip(generators, alive, strict=True) if not ok]
        if silent:
            self.skipped += len(silent)
            log.warning("leaving out of this push generators that do not answer: %s", ", ".join(silent))
        return [g for g, ok in zip(generators, alive, strict=True) if ok]

    def _group(self, namespace: str, world_size: int):
        if self.device.type == "cuda":
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup

            group = StatelessProcessGroup.create(
                host=self.advertise_host,
                port=self.port,
                rank=0,
                world_size=world_size,
                store_timeout=int(self.timeout.total_seconds()),
            )
            return PyNcclCommunicator(group, device=self.device)
        return torch.distributed.ProcessGroupGloo(
            torch.distributed.PrefixStore(namespace, self.store), 0, world_size, self.timeout
        )

    def _broadcast_all(self, namespace: str, world_size: int, named, buckets, done: dict) -> None:
        """Form the push's group and broadcast every bucket; on gloo, bucket k+1 is packed while k is sent."""
        try:
            group = self._group(namespace, world_size)
            in_flight = None
            for indices in buckets:
                buffer = pack_bucket([named[i][1] for i in indices]).to(self.device)
                if self.device.type == "cuda":
                    group.broadcast(buffer, src=0, stream=torch.cuda.current_stream())
                    torch.cuda.current_stream().synchronize()
                else:
                    options = torch.distributed.BroadcastOptions()
                    options.rootRank = 0
                    work = group.broadcast([buffer], options)
                    if in_flight is not None:
                        in_flight.wait()
                    in_flight = work
                done["bytes"] = done.get("bytes", 0) + buffer.numel()
            if in_flight is not None:
                in_flight.wait()
        except BaseException as exc:  # reported to the awaiting coroutine
            done["error"] = exc

    async def push(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        policy_version: int,
        generators: Sequence[GeneratorRegistration],
        http: httpx.AsyncClient,
        *,
        reset: bool = False,
    ) -> PushReport:
        """Broadcast ``named`` tensors to ``generators`` as ``policy_version``; raises WeightPushError.

        Generators that do not answer ``/health`` within 2 s are left out first (a replica that died since
        its last heartbeat would otherwise hold the others in group formation until the join timeout).
        """
        generators = await self._answering(generators, http)
        if not generators:
            return PushReport(policy_version, (), 0, 0.0)
        specs, buckets = plan_buckets(named, self.bucket_bytes)
        ranks, next_rank = {}, 1
        for registration in generators:
            ranks[registration.generator_id] = next_rank
            next_rank += registration.engine_world_size
        namespace = f"push/{policy_version}/{uuid.uuid4().hex[:8]}"
        announcement = WeightVersionAnnouncement(
            policy_version=policy_version,
            layout=tuple(specs),
            num_buckets=len(buckets),
            rendezvous=f"{self.advertise_host}:{self.port}",
            namespace=namespace,
            ranks=ranks,
            world_size=next_rank,
            reset=reset,
        )
        started = time.perf_counter()
        done: dict = {}
        sender = threading.Thread(
            target=self._broadcast_all, args=(namespace, next_rank, named, buckets, done), daemon=True
        )
        sender.start()
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
            self.failures += 1
            detail = ", ".join(f"{gid} ({why})" for gid, why in failed.items())
            raise WeightPushError(f"weight push {policy_version} failed on {detail}", list(failed))
        await asyncio.to_thread(sender.join, self.timeout.total_seconds())
        if "error" in done or sender.is_alive():
            self.failures += 1
            raise WeightPushError(f"weight push {policy_version}: broadcast failed: {done.get('error')}", list(ranks))
        seconds = time.perf_counter() - started
        self.pushes += 1
        phases = {k: max(r.json().get(k, 0.0) for r in replies) for k in _PHASES}
        report = PushReport(policy_version, tuple(ranks), int(done.get("bytes", 0)), seconds, phases)
        log.info(
            "pushed version %d to %d generator(s): %.1f MB in %.2f s (%.3f GB/s; slowest generator: %s)",
            policy_version,
            len(generators),
            report.bytes / 1e6,
            seconds,
            report.gb_per_s,
            ", ".join(f"{k.removesuffix('_seconds')} {v:.2f}" for k, v in phases.items()),
        )
        return report


async def _health(http: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await http.get(f"{url}/health", timeout=2.0)).status_code == 200
    except httpx.HTTPError:
        return False


def _describe(reply) -> str:
    if isinstance(reply, BaseException):
        return f"{type(reply).__name__}: {reply}"
    return f"HTTP {reply.status_code}: {reply.text[:200]}"
