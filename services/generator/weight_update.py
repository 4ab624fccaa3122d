"""The weight update's pieces that hold no engine state: where a replica joins a push, the push channel's
calls to the engine's workers, the seconds of each phase, the figures an update reports, and the error a
failed one raises.

:class:`~services.generator.engine.Engine` runs the update itself (pause, receive, load, resume) on its vLLM
engine; the byte protocol of the push is :mod:`weight_sync`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from shared.records import WeightVersionAnnouncement

log = logging.getLogger(__name__)


class WeightUpdateError(RuntimeError):
    """A weight push that could not be applied; ``applied_nothing`` says whether the engine was untouched."""

    def __init__(self, message: str, *, applied_nothing: bool) -> None:
        super().__init__(message)
        self.applied_nothing = applied_nothing


async def reachable(host: str, port: int, timeout_s: float) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout=timeout_s)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


@dataclass(frozen=True)
class Rendezvous:
    """Where this replica joins a push (the learner's store) and how it receives (gloo, nccl, ipc or shm)."""

    host: str
    port: int
    transport: str


class Phases:
    """Seconds per phase of one weight update, each measured from the end of the one before."""

    def __init__(self) -> None:
        self.started = self._last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase], self._last = now - self._last, now

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


async def rendezvous(announcement: WeightVersionAnnouncement, generator_id: str, default_transport: str) -> Rendezvous:
    """Where and how this replica joins the push (``default_transport`` where the announcement names none);
    checked before anything is touched."""
    if not announcement.participates(generator_id) or not announcement.rendezvous:
        raise WeightUpdateError(f"the announcement names no rank for {generator_id}", applied_nothing=True)
    transport = announcement.transport_of(generator_id, default_transport)
    host, _, port = announcement.rendezvous.rpartition(":")
    if not port.isdigit() or not await reachable(host, int(port), timeout_s=10.0):
        raise WeightUpdateError(
            f"the learner's store at {announcement.rendezvous} is not reachable", applied_nothing=True
        )
    return Rendezvous(host, int(port), transport)


def update_report(
    results: list[dict], transport: str, phases: Phases, policy_version: int, in_flight: int, in_flight_at_push: str
) -> dict[str, Any]:
    """The update's figures (bytes, seconds, phases: the slowest worker's receive and load; the prompts in flight
    at the pause and what the push did to them: ``generator.in_flight_at_push``), logged."""
    seconds = phases.elapsed()
    received = sum(r["bytes"] for r in results)
    phases.seconds["receive_wait_seconds"] = max(r["receive_wait_seconds"] for r in results)
    phases.seconds["load_seconds"] = max(r["load_seconds"] for r in results)
    deferred = int(sum(r.get("deferred_handles", 0.0) for r in results))
    joined = int(max(r.get("joined_pieces", 0.0) for r in results))
    direct = all(r["direct"] for r in results)
    in_place = sum(r.get("aliased_bytes", 0.0) for r in results)
    copied = sum(r.get("copied_borrowed_bytes", 0.0) for r in results)
    if copied:
        log.warning(
            "%.1f MB of layers kept pointing into the learner's shared memory and were copied (slower loads)",
            copied / 1e6,
        )
    log.info(
        "policy version %d loaded over %s (%s): %.1f MB in %.2f s, %.1f MB of it received in place, %d tensors "
        "joined to the one before, %d kernel handles left to the first step after it, %d prompts in flight (%s) "
        "(%s)",
        policy_version,
        transport,
        "direct copy" if direct else "layerwise reload",
        received / 1e6,
        seconds,
        in_place / 1e6,
        joined,
        deferred,
        in_flight,
        "kept" if in_flight_at_push == "keep" else "recomputed",
        ", ".join(f"{k.removesuffix('_seconds')} {v:.2f}" for k, v in phases.seconds.items()),
    )
    return {
        "bytes": received,
        "seconds": seconds,
        "transport": transport,
        "direct_load": direct,
        "in_place_bytes": in_place,
        "copied_shared_bytes": copied,
        "deferred_handles": deferred,
        "in_flight_requests": in_flight,
        "in_flight_at_push": in_flight_at_push,
        **phases.seconds,
    }


@dataclass(frozen=True)
class PushChannel:
    """The engine workers' end of a push (:mod:`weight_sync.receiver`, reached through vLLM's
    ``collective_rpc``): join the push's group, receive and load its buckets, leave the group."""

    llm: Any  # vLLM's AsyncLLM
    join_timeout_s: float
    timeout_s: float

    async def open(self, announcement: WeightVersionAnnouncement, generator_id: str, at: Rendezvous) -> None:
        """Join the push's group first: if a member never arrives, the engine has not been touched."""
        args = (
            at.host,
            at.port,
            announcement.namespace,
            announcement.ranks.get(generator_id, 0),
            announcement.world_size,
            self.join_timeout_s,
            self.timeout_s,
            at.transport,
            generator_id,
        )
        try:
            await self.llm.collective_rpc("weight_channel_open", args=args)
        except Exception as exc:
            raise WeightUpdateError(
                f"could not join the push's group: {type(exc).__name__}: {exc}", applied_nothing=True
            ) from exc

    async def receive(self, announcement: WeightVersionAnnouncement) -> list[dict]:
        """Receive and load every bucket: each worker's bytes and seconds."""
        layout = [spec.model_dump() for spec in announcement.layout]
        return await self.llm.collective_rpc("weight_channel_receive", args=(layout, announcement.num_buckets))

    async def close(self) -> None:
        """Leave the push's group; a failure is only logged (the next push's join starts by closing it)."""
        try:
            await self.llm.collective_rpc("weight_channel_close")
        except Exception:
            log.exception("could not close the weight push's channel")
