"""A consumer process for transport tests: copies entries from one stream to another through commits.

``--stall-after N`` commits N entries, then reads one more batch and holds it without committing (printing
``HOLDING <n>``) until it is killed - a consumer that dies with pending entries.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from shared.keys import Keys
from shared.redis_conn import connect
from shared.streams import Output, StreamConsumer, StreamProducer


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--source", required=True)
    parser.add_argument("--sink", required=True)
    parser.add_argument("--consumer", required=True)
    parser.add_argument("--stall-after", type=int, default=-1)
    args = parser.parse_args()

    client = await connect(args.redis_url)
    consumer = StreamConsumer(
        client,
        Keys(args.prefix),
        args.source,
        "workers",
        args.consumer,
        batch_size=5,
        block_ms=200,
        claim_idle_ms=60_000,
    )
    await consumer.start()
    sink = StreamProducer(client, args.sink)
    done = 0
    while True:
        deliveries = await consumer.read()
        if args.stall_after >= 0 and done >= args.stall_after and deliveries:
            print(f"HOLDING {len(deliveries)}", flush=True)
            await asyncio.Event().wait()
        for delivery in deliveries:
            await consumer.commit(delivery, [Output(sink, delivery.record_id, delivery.payload)])
            done += 1


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
