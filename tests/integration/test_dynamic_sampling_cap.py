"""Dynamic sampling's cap against real Redis: when the scorer drops most groups (zero reward spread), a step
waits for at most ``max_replacement_groups`` replacements, then trains on what it has and says so; without a cap
it waits for as many as it takes and says how many it has skipped while it waits."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections import Counter

import httpx
import pytest
from prometheus_client import CollectorRegistry

from services.learner.data.collector import SKIPS_REPORTED_EVERY
from services.learner.startup import build_learner
from shared.codec import decode, encode
from shared.config.learner import LearnerSettings
from shared.keys import Keys
from shared.records import PromptTask
from shared.streams import Output, StreamConsumer, StreamProducer
from tests.support.fake_pipeline import scored_group_for
from tests.support.tiny_model import build_tiny_llama

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=7, logit_scale=1.0)


async def mostly_dropping_pipeline(client, keys: Keys, stop: asyncio.Event, keep_every: int) -> None:
    """Scores every task at policy version 0 and marks all but every ``keep_every``-th group dropped, as the
    scorer does with ``drop_zero_std_groups`` when rewards agree."""
    consumer = StreamConsumer(client, keys, keys.prompts, Keys.GENERATORS, "fake", block_ms=100)
    await consumer.start()
    scored = StreamProducer(client, keys.scored)
    served = Counter()
    while not stop.is_set():
        for delivery in await consumer.read():
            served["n"] += 1
            group = scored_group_for(decode(delivery.payload, PromptTask), 0)
            if served["n"] % keep_every:
                group = group.model_copy(update={"zero_std": True, "dropped": True})
            await consumer.commit(delivery, [Output(scored, group.group_id, encode(group))])


def _settings(tiny, tmp_path, redis_url, keys, **overrides) -> LearnerSettings:
    fields = dict(
        model=str(tiny),
        redis_url=redis_url,
        stream_prefix=keys.prefix,
        api_token="t",
        group_size=4,
        groups_per_step=2,
        micro_batch_size=4,
        max_steps=3,
        max_staleness=10,
        max_completion_length=8,
        max_prompt_length=200,
        checkpoint_dir=str(tmp_path / "ckpt"),
        log_dir=str(tmp_path / "logs"),
        weight_sync_port=0,
        min_generators=0,
        progress="off",
    )
    return LearnerSettings(**(fields | overrides))


async def _train(settings: LearnerSettings, redis_client, keys, keep_every: int):
    async with httpx.AsyncClient() as http:
        loop, _ = await build_learner(settings, redis_client, http, CollectorRegistry())
        stop = asyncio.Event()
        fake = asyncio.create_task(mostly_dropping_pipeline(redis_client, Keys(keys.prefix), stop, keep_every))
        await asyncio.wait_for(loop.run(stop, resumed=False), timeout=300)
        stop.set()
        await fake
        loop.sink.close()
    return loop


async def test_a_step_past_the_replacement_cap_trains_on_what_it_has(tiny, tmp_path, redis_client, redis_url, keys):
    settings = _settings(tiny, tmp_path, redis_url, keys, max_replacement_groups=2)
    loop = await _train(settings, redis_client, keys, keep_every=4)
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert loop.trainer.step == 3
    assert any(r["dynamic_sampling/capped"] == 1.0 for r in records)
    for record in records:
        if record["dynamic_sampling/capped"]:
            assert record["dynamic_sampling/skipped_groups"] > settings.max_replacement_groups
    assert loop.counters.groups_trained < 3 * settings.groups_per_step  # some steps trained on fewer groups
    assert loop.counters.groups_zero_std_dropped >= 3


async def test_without_a_cap_a_step_waits_for_every_replacement_and_says_how_many_it_skipped(
    tiny, tmp_path, redis_client, redis_url, keys, caplog
):
    settings = _settings(tiny, tmp_path, redis_url, keys, max_steps=2, max_replacement_groups=None)
    with caplog.at_level(logging.INFO, logger="services.learner.data.collector"):
        loop = await _train(settings, redis_client, keys, keep_every=12)  # 11 of every 12 groups dropped
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert loop.trainer.step == 2 and loop.counters.groups_trained == 2 * settings.groups_per_step
    assert all(r["dynamic_sampling/capped"] == 0.0 for r in records)
    assert loop.counters.groups_zero_std_dropped >= 2 * SKIPS_REPORTED_EVERY
    waits = [r.getMessage() for r in caplog.records if "waiting for replacements" in r.getMessage()]
    assert waits and all("max_replacement_groups None" in line for line in waits), waits
    said = [int(re.search(r"dynamic sampling: (\d+) zero-std groups skipped for this step", w).group(1)) for w in waits]
    assert said[0] >= SKIPS_REPORTED_EVERY, waits  # said once a step had skipped that many, not before
