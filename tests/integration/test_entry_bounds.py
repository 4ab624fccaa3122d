"""Size bounds at decode (:class:`shared.config.bounds.EntryBoundsSettings`), against real Redis: a prompt task
asking for too large a group, an entry of too many bytes, a rollout with too long a completion or too large a
group are dead-lettered by their reader with the bound they broke, never worked on; and a group the engine gave
non-finite logprobs is dead-lettered by the generator with the reason."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import pytest

from services.generator.engine import NonFiniteOutput, SampledGroup, _completion
from services.generator.rollout_loop import RolloutLoop
from shared.codec import encode
from shared.config.bounds import EntryBoundsSettings
from shared.config.scorer import RewardSpec
from shared.keys import Keys
from shared.streams import StreamConsumer, StreamProducer
from tests.integration.test_reward_outages import _feed, _score_in_process
from tests.support.factories import make_rollout, make_task

pytestmark = pytest.mark.integration


class _Engine:
    """Samples every prompt with the factory's completions, or raises ``fails`` (what the real engine raises)."""

    weights_ok, paused_by_operator = True, False

    def __init__(self, fails: Exception | None = None) -> None:
        self.fails, self.calls = fails, 0

    def tokenize(self, prompt) -> list[int]:
        return [1, 2, 3]

    async def sample(self, prompt_ids, sampling, n: int) -> SampledGroup:
        self.calls += 1
        if self.fails is not None:
            raise self.fails
        completions = make_rollout(make_task(group_size=n)).completions
        return SampledGroup(completions, 0, 0, time.time(), time.time(), prompt_ids, 0)


async def _generate(redis_client, keys: Keys, engine: _Engine, entries, bounds=None) -> dict[str, str]:
    """Run the rollout loop over ``entries`` (record id, payload) until each is written or dead-lettered."""
    await StreamProducer(redis_client, keys.prompts).add_many(entries)
    consumer = StreamConsumer(redis_client, keys, keys.prompts, Keys.GENERATORS, "gen-0", claim_idle_ms=60_000)
    await consumer.start()
    loop = RolloutLoop(engine, consumer, StreamProducer(redis_client, keys.rollouts), "gen-0", 2, bounds=bounds)
    stop = asyncio.Event()
    running = asyncio.create_task(loop.run(stop))
    deadline = time.monotonic() + 20
    while await redis_client.xlen(keys.rollouts) + await redis_client.xlen(keys.dead_letter) < len(entries):
        assert time.monotonic() < deadline and not running.done()
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(running, 10)
    return {f[b"id"].decode(): f[b"reason"].decode() for _, f in await redis_client.xrange(keys.dead_letter)}


async def test_the_generator_dead_letters_a_prompt_past_its_bounds_and_samples_the_rest(redis_client, keys):
    huge_group = make_task(group_size=100_000)
    big_entry = make_task(group_size=2, columns={"blob": "x" * 5000})
    fine = make_task(group_size=4)
    engine = _Engine()
    bounds = EntryBoundsSettings(max_entry_bytes=4096)
    dead = await _generate(
        redis_client, keys, engine, [(t.task_id, encode(t)) for t in (huge_group, big_entry, fine)], bounds
    )
    assert dead[huge_group.task_id] == "EntryTooLarge: group_size of 100000 completions is over max_group_size (1024)"
    assert dead[big_entry.task_id].startswith("EntryTooLarge: the entry has ")
    assert dead[big_entry.task_id].endswith(" bytes, over max_entry_bytes (4096)")
    assert fine.task_id not in dead and await redis_client.xlen(keys.rollouts) == 1 and engine.calls == 1


async def test_the_generator_dead_letters_a_group_the_engine_gave_non_finite_logprobs(redis_client, keys):
    logprob = [SimpleNamespace(logprob=-0.5), SimpleNamespace(logprob=math.nan)]
    # vLLM's CompletionOutput, as far as _completion reads it
    output = SimpleNamespace(
        index=2, text="x", finish_reason="stop", token_ids=[5, 6], logprobs=[{5: logprob[0]}, {6: logprob[1]}]
    )
    with pytest.raises(NonFiniteOutput) as raised:
        _completion(output)
    assert str(raised.value) == "the engine's completion 2: behaviour_logprobs holds NaN at 1 (flat index)"
    task = make_task(group_size=4)
    engine = _Engine(fails=raised.value)
    dead = await _generate(redis_client, keys, engine, [(task.task_id, encode(task))])
    assert dead == {task.task_id: f"NonFiniteOutput: {raised.value}"} and engine.calls == 1
    assert await redis_client.xlen(keys.rollouts) == 0


async def test_the_scorer_dead_letters_rollouts_past_its_bounds(redis_client, keys):
    keys = Keys(keys.prefix)
    fed = await _feed(redis_client, keys, 1)
    long_one = make_rollout(make_task(group_size=2), tokens=65, seed=1)
    wide_one = make_rollout(make_task(group_size=8), tokens=3, seed=2)
    await StreamProducer(redis_client, keys.rollouts).add_many([(r.group_id, encode(r)) for r in (long_one, wide_one)])
    fed += [long_one.group_id, wide_one.group_id]
    bounds = EntryBoundsSettings(max_sequence_tokens=64, max_group_size=4)
    accounting, groups, _ = await _score_in_process(redis_client, keys, [RewardSpec(name="digit")], fed, bounds=bounds)
    accounting.check(fed)
    assert len(groups) == 1 and accounting.dead == {
        long_one.group_id: "EntryTooLarge: completion 0 has 65 tokens, over max_sequence_tokens (64)",
        wide_one.group_id: "EntryTooLarge: group of 8 completions is over max_group_size (4)",
    }
