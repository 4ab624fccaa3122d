"""Stands in for generators and scorers when a test is about the learner alone.

It consumes ``PromptTask``s from the prompts stream (as the generators' consumer group) and writes a
``ScoredGroup`` per task straight to the scored stream, through the same exactly-once commit the real
services use. Completions and rewards are derived from the task id, so a re-run produces the same groups.
``version_of(task)`` says which policy version "sampled" each group (a test makes some stale with it);
without it, groups carry the version the learner last announced, as real generators' would.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable

import numpy as np

from shared.advantages import group_advantages
from shared.codec import encode
from shared.keys import Keys
from shared.records import Completion, PromptTask, Rollout, RolloutTimings, ScoredGroup
from shared.streams import Output, StreamConsumer, StreamProducer


def scored_group_for(task: PromptTask, version: int, vocab: int = 100) -> ScoredGroup:
    seed = int.from_bytes(hashlib.sha256(task.task_id.encode()).digest()[:4], "little")
    rng = np.random.default_rng(seed)
    completions = []
    for _ in range(task.group_size):
        ids = rng.integers(5, vocab, size=int(rng.integers(2, task.sampling.max_tokens + 1))).astype(np.int32)
        completions.append(
            Completion(
                text="x" * len(ids),
                token_ids=ids,
                behaviour_logprobs=np.full(len(ids), -4.6, dtype=np.float32),
                finish_reason="stop",
            )
        )
    rollout = Rollout(
        group_id=task.task_id,
        task=task,
        prompt_token_ids=rng.integers(5, vocab, size=6).astype(np.int32),
        completions=tuple(completions),
        policy_version=version,
        finished_policy_version=version,
        generator_id="fake",
        timings=RolloutTimings(received_at=0.0, started_at=0.0, finished_at=0.0),
    )
    rewards = rng.random(task.group_size).astype(np.float32)
    return ScoredGroup(
        rollout=rollout,
        reward_names=("fake",),
        rewards_per_func=rewards[:, None],
        rewards=rewards,
        advantages=group_advantages(rewards, task.group_size),
    )


async def run_fake_pipeline(
    client, keys: Keys, stop: asyncio.Event, version_of: Callable[[PromptTask], int] | None = None
) -> None:
    from shared.codec import decode
    from shared.registry import RegistryStats, latest_weights_version

    consumer = StreamConsumer(client, keys, keys.prompts, Keys.GENERATORS, "fake", block_ms=100)
    await consumer.start()
    scored = StreamProducer(client, keys.scored)
    evaluated = StreamProducer(client, keys.evaluated)  # held-out prompts go there, as the scorer sends them
    while not stop.is_set():
        for delivery in await consumer.read():
            task = decode(delivery.payload, PromptTask)
            if version_of is not None:
                version = version_of(task)
            else:
                version = await latest_weights_version(client, keys, RegistryStats()) or 0
            group = scored_group_for(task, version)
            stream = scored if task.eval_step is None else evaluated
            await consumer.commit(delivery, [Output(stream, group.group_id, encode(group))])


async def run_loop_to_end(loop, redis_client, keys: Keys, timeout_s: float = 300) -> None:
    """Run a built learner ``loop`` to its end against :func:`run_fake_pipeline`, then stop the fake and close
    the loop's metrics sink, whatever happened."""
    stop = asyncio.Event()
    fake = asyncio.create_task(run_fake_pipeline(redis_client, keys, stop))
    try:
        await asyncio.wait_for(loop.run(stop, resumed=False), timeout=timeout_s)
    finally:
        stop.set()
        await fake
        loop.sink.close()
