"""Transport benchmark: our producer/consumer against raw XADD/XREADGROUP/XACK of the same bytes.

One group = one ``Rollout`` of G completions of T tokens (token ids int32 + behaviour logprobs float32).

* **ours**: the producer process encodes each group and adds it through ``StreamProducer`` (backpressure
  on); the consumer process reads through ``StreamConsumer``, decodes and validates every record, and
  commits (ack + applied mark, one MULTI/EXEC per batch).
* **raw**: the same encoded bytes with bare XADD in one process and XREADGROUP + XACK in the other; no
  encoding, no checks.

Producer and consumer are separate processes, as a generator and a scorer are; both modes run in the same
invocation against the same Redis, alternating, and the best of ``--repeats`` is kept. The last line is the
ratio ours/raw in groups/s (goal: >= 0.5).

    python bench/transport.py [--groups 1000] [--group-size 8] [--tokens 1024] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.record import add_record_flag, record, refuse_quick  # noqa: E402
from shared.codec import decode, encode  # noqa: E402
from shared.keys import Keys  # noqa: E402
from shared.records import Rollout  # noqa: E402
from shared.redis_conn import connect  # noqa: E402
from shared.streams import StreamConsumer, StreamProducer, ensure_group  # noqa: E402
from tests.support.factories import make_rollout, make_task  # noqa: E402
from tests.support.redis_server import use_or_start_redis  # noqa: E402

BATCH = 16
GROUP = "bench"


def _rollouts(args) -> list[Rollout]:
    return [make_rollout(make_task(group_size=args.group_size), tokens=args.tokens, seed=i) for i in range(args.groups)]


async def _produce(mode: str, url: str, prefix: str, args, ready, go) -> None:
    client = await connect(url)
    rollouts = _rollouts(args)
    payloads = [encode(r) for r in rollouts] if mode == "raw" else []
    producer = StreamProducer(client, Keys(prefix).rollouts, max_backlog=256)
    ready.set()
    await asyncio.to_thread(go.wait)
    if mode == "raw":
        for payload in payloads:
            await client.xadd(Keys(prefix).rollouts, {b"data": payload})
    else:
        for rollout in rollouts:
            await producer.add(rollout.group_id, encode(rollout))
    await client.aclose()


async def _consume(mode: str, url: str, prefix: str, args, ready, go, result) -> None:
    client = await connect(url)
    keys = Keys(prefix)
    consumer = StreamConsumer(client, keys, keys.rollouts, GROUP, "c0", batch_size=BATCH, block_ms=100)
    ready.set()
    await asyncio.to_thread(go.wait)
    done = 0
    while done < args.groups:
        if mode == "raw":
            reply = await client.xreadgroup(GROUP, "c0", {keys.rollouts: ">"}, count=BATCH, block=100)
            entries = reply[0][1] if reply else []
            if entries:
                await client.xack(keys.rollouts, GROUP, *[entry_id for entry_id, _ in entries])
            done += len(entries)
        else:
            deliveries = await consumer.read()
            for delivery in deliveries:
                decode(delivery.payload, Rollout)
            await consumer.commit_many([(d, ()) for d in deliveries])
            done += len(deliveries)
    result.value = time.perf_counter()
    await client.aclose()


def _producer_main(*a) -> None:
    asyncio.run(_produce(*a))


def _consumer_main(*a) -> None:
    asyncio.run(_consume(*a))


async def _setup(url: str, prefix: str) -> None:
    client = await connect(url)
    await ensure_group(client, Keys(prefix).rollouts, GROUP)
    await client.aclose()


async def _cleanup(url: str, prefix: str) -> None:
    client = await connect(url)
    doomed = [key async for key in client.scan_iter(match=f"{prefix}:*", count=1000)]
    if doomed:
        await client.delete(*doomed)
    await client.aclose()


def run_once(mode: str, url: str, args) -> float:
    ctx = mp.get_context("spawn")
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    asyncio.run(_setup(url, prefix))
    ready_p, ready_c, go = ctx.Event(), ctx.Event(), ctx.Event()
    finished = ctx.Value("d", 0.0)
    consumer = ctx.Process(target=_consumer_main, args=(mode, url, prefix, args, ready_c, go, finished))
    producer = ctx.Process(target=_producer_main, args=(mode, url, prefix, args, ready_p, go))
    consumer.start()
    producer.start()
    try:
        if not (ready_p.wait(300) and ready_c.wait(300)):
            raise RuntimeError("benchmark processes did not start")
        start = time.perf_counter()
        go.set()
        producer.join(600)
        consumer.join(600)
        if producer.exitcode != 0 or consumer.exitcode != 0:
            raise RuntimeError(f"benchmark process failed (producer {producer.exitcode}, consumer {consumer.exitcode})")
        return finished.value - start
    finally:
        for process in (producer, consumer):
            if process.is_alive():
                process.kill()
        asyncio.run(_cleanup(url, prefix))


def main(args) -> None:
    url, server = use_or_start_redis()
    group_bytes = len(encode(_rollouts(argparse.Namespace(**{**vars(args), "groups": 1}))[0]))
    best = {"raw": float("inf"), "ours": float("inf")}
    try:
        for _ in range(args.repeats):
            for mode in ("raw", "ours"):
                best[mode] = min(best[mode], run_once(mode, url, args))
    finally:
        if server:
            server.stop()
    print(
        f"transport: {args.groups} groups of G={args.group_size} x {args.tokens} tokens "
        f"({group_bytes / 1e3:.1f} kB each), producer and consumer in separate processes, "
        f"best of {args.repeats}"
    )
    print(f"{'path':<6} {'seconds':>9} {'groups/s':>10} {'MB/s':>9} {'us/group':>9}")
    for mode in ("raw", "ours"):
        seconds = best[mode]
        rate = args.groups / seconds
        print(f"{mode:<6} {seconds:>9.3f} {rate:>10.1f} {rate * group_bytes / 1e6:>9.1f} {1e6 / rate:>9.0f}")
    ratio = best["raw"] / best["ours"]
    print(f"ratio ours/raw (groups/s): {ratio:.2f}  (goal >= 0.50)")
    if args.record:
        rates = {f"{mode}_groups_per_s": args.groups / best[mode] for mode in ("raw", "ours")}
        record("transport", rates, args, ratio=ratio, goal=">= 0.50")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=1000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a few groups, one repeat (smoke test)")
    add_record_flag(parser)
    arguments = parser.parse_args()
    refuse_quick(arguments)
    if arguments.quick:
        arguments.groups, arguments.repeats = 50, 1
    main(arguments)
