"""Where a CUDA IPC push's time goes (needs a GPU): stamps on both sides of the real push code.

The pusher on CUDA and a stand-in receiver process (:mod:`tests.gpu.standin`) as in ``test_weight_path``, with
every store call, the receiver's steps and the sender's publish and wait stamped with ``time.perf_counter``
(CLOCK_MONOTONIC: one clock for both processes). Ten pushes each of 17 float32 tensors of 0.54 GB and 2.15 GB
and of 289 tensors of 0.60 GB (a model's tensor count); prints the median steady push's timeline, then the
limits measured in the same run: one contiguous device copy of the same bytes, the same tensors copied in
this process (one multi-tensor copy, one ``copy_`` each), a store round trip, an idle stream synchronize.

    python tests/gpu/ipc_timeline.py      (from the repository root)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.getcwd())

import torch

STAMPS: list[tuple[str, float]] = []


def stamp(label: str) -> None:
    STAMPS.append((label, time.perf_counter()))


def stamped(function, label):
    """``function`` with a stamp ``label>`` before each call and ``label<`` after it."""

    def call(*a, **k):
        stamp(f"{label}>")
        try:
            return function(*a, **k)
        finally:
            stamp(f"{label}<")

    return call


class StoreProxy:
    def __init__(self, store, tag):
        self._s, self._tag = store, tag

    def __getattr__(self, name):
        attr = getattr(self._s, name)
        return stamped(attr, f"{self._tag}.store.{name}") if callable(attr) else attr


def wrap(owner, name, tag):
    setattr(owner, name, stamped(getattr(owner, name), f"{tag}.{name}"))


class ConnProxy:
    def __init__(self, conn):
        self._c = conn

    def __getattr__(self, name):
        return getattr(self._c, name)

    def send(self, obj):
        if isinstance(obj, dict) and "result" in obj:
            obj = {**obj, "stamps": list(STAMPS)}
            STAMPS.clear()
        elif isinstance(obj, dict) and "opened" in obj:
            STAMPS.clear()
            stamp("R.opened")
        return self._c.send(obj)


def receive_stamped(conn, device_name, seed, hidden, layers):
    from tests.gpu import standin
    from weight_sync import receiver as rmod
    from weight_sync import transport_ipc as tipc

    standin.digests = lambda model: {}  # sha256 of GBs per push would dominate the run
    ext = rmod.WeightReceiverExtension
    original_open = ext.weight_channel_open

    def opened(self, *a, **k):
        original_open(self, *a, **k)
        self._weight_store = StoreProxy(self._weight_store, "R")

    ext.weight_channel_open = opened
    wrap(ext, "weight_channel_receive", "R")
    wrap(tipc.IpcReceiver, "tensors", "R")
    wrap(tipc.IpcReceiver, "copy_plan", "R")
    if hasattr(tipc, "CopyPlan"):
        wrap(tipc.CopyPlan, "run", "R")
    wrap(torch, "_foreach_copy_", "R")
    wrap(torch.cuda.Stream, "synchronize", "R")
    standin.receive(ConnProxy(conn), device_name, seed, hidden, layers)


def start(hidden, layers):
    from tests.gpu.weight_path import Receiver

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=receive_stamped, args=(child, "cuda:0", 2, hidden, layers), daemon=True)
    process.start()
    assert parent.poll(120), "receiver did not start"
    hello = parent.recv()
    return Receiver(process, parent, hello["uuid"], hello["shm_probe"])


def event_seconds(fn, repeats=10):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        wall = time.perf_counter()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append((start.elapsed_time(end) / 1000, time.perf_counter() - wall))
    return min(t[0] for t in times), min(t[1] for t in times)


def main():
    from tests.gpu import standin
    from tests.gpu.test_weight_path import _pusher
    from tests.gpu.weight_path import push, stop_receiver
    from weight_sync import push_thread as sending
    from weight_sync import transport_ipc

    print(torch.cuda.get_device_name(0), torch.__version__)
    wrap(transport_ipc, "_memory_key", "S")
    for hidden, layers in ((4096, 8), (8192, 8), (1024, 144)):
        pusher = _pusher()
        wrap(pusher, "send_buckets", "S")
        original_pub, original_wait = sending.publish_ipc, sending.wait_ipc

        # The store each is given is stamped too.
        sending.publish_ipc = stamped(
            lambda store, *rest, f=original_pub: f(StoreProxy(store, "S"), *rest), "S.publish"
        )
        sending.wait_ipc = stamped(lambda store, *rest, f=original_wait: f(StoreProxy(store, "S"), *rest), "S.wait_ipc")
        receiver = start(hidden, layers)
        model = standin.build_model(seed=1, hidden=hidden, layers=layers, device="cuda")
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        pushes = []
        try:
            for version in range(1, 11):
                STAMPS.clear()
                _plan, answer, seconds = push(pusher, receiver, model, version, "float32")
                assert "error" not in answer, answer
                events = list(STAMPS) + answer["stamps"]
                pushes.append((seconds, events, answer["result"]))
                with torch.no_grad():
                    for param in model.parameters():
                        param.mul_(-0.5)
        finally:
            stop_receiver(receiver)
            sending.publish_ipc, sending.wait_ipc = original_pub, original_wait
        steady = sorted(pushes[1:], key=lambda p: p[0])
        seconds, events, result = steady[len(steady) // 2]
        print(
            f"\n== {nbytes / 1e9:.2f} GB in {len(list(model.parameters()))} tensors; pushes (ms): "
            + " ".join(f"{p[0] * 1e3:.2f}" for p in pushes)
        )
        print(
            f"median steady push {seconds * 1e3:.3f} ms; receiver load {result['load_seconds'] * 1e3:.3f} ms, "
            f"wait {result['receive_wait_seconds'] * 1e3:.3f} ms"
        )
        t0 = next(t for label, t in events if label == "S.send_buckets>")
        for label, t in sorted(events, key=lambda e: e[1]):
            print(f"  {(t - t0) * 1e6:9.1f} us  {label}")
        # Limits in the same run
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        raw = event_seconds(lambda dst=dst, src=src: dst.copy_(src))
        params = [p.detach() for p in model.parameters()]
        copies = [torch.empty_like(p) for p in params]
        multi = event_seconds(lambda copies=copies, params=params: torch._foreach_copy_(copies, params))
        loop = event_seconds(
            lambda copies=copies, params=params: [c.copy_(p) for c, p in zip(copies, params, strict=True)]
        )
        print(f"raw one copy: {raw[0] * 1e3:.3f} ms (events) {raw[1] * 1e3:.3f} ms (wall incl. sync)")
        print(f"foreach_copy_ same tensors in-process: {multi[0] * 1e3:.3f} / {multi[1] * 1e3:.3f} ms")
        print(f"copy_ loop same tensors in-process: {loop[0] * 1e3:.3f} / {loop[1] * 1e3:.3f} ms")
        store = pusher.store
        store.set("probe", b"x")
        for _ in range(10):
            store.get("probe")
        begin = time.perf_counter()
        for _ in range(200):
            store.get("probe")
        print(f"store get round trip: {(time.perf_counter() - begin) / 200 * 1e6:.1f} us")
        begin = time.perf_counter()
        for _ in range(200):
            torch.cuda.current_stream().synchronize()
        print(f"idle stream synchronize: {(time.perf_counter() - begin) / 200 * 1e6:.1f} us")
        begin = time.perf_counter()
        for _ in range(50):
            torch.cuda.ipc_collect()
        print(f"ipc_collect: {(time.perf_counter() - begin) / 50 * 1e6:.1f} us")


if __name__ == "__main__":
    main()
