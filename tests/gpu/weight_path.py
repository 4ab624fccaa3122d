"""The push driven the way ``WeightPusher.push`` drives it, minus HTTP: plan, layout, ``send_buckets`` to a
stand-in receiver process (:mod:`tests.gpu.standin`). Shared by the CPU (gloo) and GPU (IPC) tests."""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass
from typing import Any

import torch

from shared.records import STORE_TRANSPORTS, GeneratorRegistration
from tests.gpu import standin
from weight_sync.plan import PushPlan, plan_push
from weight_sync.protocol import plan_buckets
from weight_sync.sender import WeightPusher


@dataclass
class Receiver:
    process: Any
    conn: Any
    uuid: str | None
    shm_probe: dict[str, str] | None = None


def start_receiver(
    device: str, seed: int, hidden: int, layers: int, shm_dir: str = "", dtype: str = "float32"
) -> Receiver:
    """A stand-in receiver process whose engine computes in ``dtype``; with ``shm_dir`` it leaves a
    shared-memory probe there (a CPU learner using that directory then pushes to it through shared memory)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(
        target=standin.receive, args=(child, device, seed, hidden, layers, shm_dir, dtype), daemon=True
    )
    process.start()
    if not parent.poll(120):
        raise TimeoutError("the stand-in receiver did not start")
    hello = parent.recv()
    return Receiver(process, parent, hello["uuid"], hello["shm_probe"])


def stop_receiver(receiver: Receiver) -> None:
    receiver.conn.send(None)
    receiver.process.join(30)
    if receiver.process.is_alive():
        receiver.process.kill()


def registration(receiver: Receiver, pusher: WeightPusher, dtype: str) -> GeneratorRegistration:
    return GeneratorRegistration(
        generator_id="standin",
        url="http://127.0.0.1:1",
        policy_version=0,
        device="cuda:0" if receiver.uuid else "cpu",
        device_uuids=(receiver.uuid,) if receiver.uuid else (),
        engine_dtype=dtype,
        versions=pusher.learner.versions,
        shm_probe=receiver.shm_probe,
    )


def push(
    pusher: WeightPusher,
    receiver: Receiver,
    model: torch.nn.Module,
    version: int,
    dtype: str,
    transposed: frozenset[str] = frozenset(),
) -> tuple[PushPlan, dict[str, Any], float]:
    """One push to the stand-in: returns the plan, the receiver's answer (with ``opened``: the seconds it took
    to join the push) and the sender's seconds, from when the receiver has joined until every byte is
    loaded (the sender waits for that over IPC and shared memory; over gloo, until the last bucket is sent).
    ``transposed``: names of the 2-D tensors that travel transposed."""
    generator = registration(receiver, pusher, dtype)
    plan = plan_push(pusher.learner, [generator], pusher._shares_memory([generator]))
    named = [(name, param.detach()) for name, param in model.named_parameters()]
    specs, buckets = plan_buckets(named, pusher.bucket_bytes, plan.dtype, transposed)
    buffers, segments = pusher._buffers_for(specs, len(buckets), shared=bool(plan.shm))
    namespace = f"push/{version}/test"
    receiver.conn.send(
        {
            "open": (
                "127.0.0.1",
                pusher.port,
                namespace,
                plan.ranks.get("standin", 0),
                plan.world_size,
                30.0,
                120.0,
                plan.transports["standin"],
                "standin",
            ),
            "layout": [s.model_dump() for s in specs],
            "num_buckets": len(buckets),
        }
    )
    joined: dict[str, Any] = {}
    if plan.transports["standin"] in STORE_TRANSPORTS:  # joining a group would wait for the sender instead
        joined = _answer(receiver, "did not join the push")
        if "error" in joined:  # nothing to send to
            return plan, joined, 0.0
    started = time.perf_counter()
    try:
        pusher.send_buckets(namespace, plan, named, buckets, buffers, segments, transposed)
    finally:
        seconds = time.perf_counter() - started
        if not joined:
            joined = _answer(receiver, "did not join the push")
        answer = joined if "error" in joined else _answer(receiver, "did not answer")
    return plan, {**answer, **joined}, seconds


def _answer(receiver: Receiver, what: str) -> dict[str, Any]:
    if not receiver.conn.poll(120):
        raise TimeoutError(f"the stand-in receiver {what}")
    return receiver.conn.recv()


def digests(receiver: Receiver) -> dict[str, str]:
    """The receiver's parameter digests now."""
    receiver.conn.send("digests")
    if not receiver.conn.poll(60):
        raise TimeoutError("the stand-in receiver did not answer")
    return receiver.conn.recv()["digests"]
