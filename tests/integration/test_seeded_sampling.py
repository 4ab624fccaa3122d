"""Seeded sampling through the real vLLM engine (CPU build) and a tiny Llama built here: the same seeds give the
same completions of the same prompts, in another engine (another run's first step) and in any order of
submission; other seeds give other completions, and a group's G completions differ from each other.

One prompt is longer than vLLM's default budget of 2048 tokens a step, which chunked prefill would split over
steps: the test also shows that the CPU engine survives seeded requests (with chunked prefill on, the engine
dies at that prompt: ``services.generator.engine.engine_scheduling``). Unseeded sampling of the same
prompts twice is the control: it differs, so the equalities come from the seeds.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from services.learner.data.feeder import prompt_seed
from shared.config.generator import GeneratorSettings
from shared.records import DatasetPosition, SamplingSpec
from tests.support.tiny_model import build_tiny_llama

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

MAX_MODEL_LEN = 4096
GROUP_SIZE = 4
SENTENCE = "the quick brown fox jumps over the lazy dog. "  # 45 tokens of the character tokenizer
PROMPTS = [f"prompt {i}: " + SENTENCE * repeats for i, repeats in enumerate([56, 7, 7, 7])]  # ~2560, ~320 tokens

Sampled = dict[int, list[list[int]]]  # prompt index -> its G completions' token ids


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("seeded") / "model", max_positions=MAX_MODEL_LEN)


@contextmanager
def _engine(model) -> Iterator:
    """An engine and the event loop every request to it runs in (vLLM's client binds to the first loop used)."""
    from services.generator.engine import Engine

    settings = GeneratorSettings(model=str(model), dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=16)
    engine = Engine.start(settings, str(model), policy_version=0)
    engine.loop = asyncio.new_event_loop()
    try:
        yield engine
    finally:

        async def shut_down() -> None:  # in vLLM's loop, so its sockets close (test_multi_turn_fidelity.py)
            engine.shutdown()
            await asyncio.sleep(0)

        engine.loop.run_until_complete(shut_down())
        engine.loop.close()
        gc.collect()


def _sample(engine, seed: int | None, order: list[int]) -> Sampled:
    """Every prompt's G completions, all prompts submitted at once in ``order``, each seeded as the learner seeds
    the prompt at that dataset position in a run with ``sampling_seed = seed``."""

    async def one(index: int) -> list[list[int]]:
        position = DatasetPosition(epoch=0, index=index)
        spec = SamplingSpec(temperature=1.0, max_tokens=24, seed=prompt_seed(seed, position))
        group = await engine.sample(engine.tokenize(PROMPTS[index]), spec, GROUP_SIZE)
        return [completion.token_ids.tolist() for completion in group.completions]

    async def every() -> list[list[list[int]]]:
        return await asyncio.gather(*(one(index) for index in order))

    return dict(zip(order, engine.loop.run_until_complete(every()), strict=True))


def test_the_same_seed_samples_the_same_completions_in_another_engine_and_any_order(model):
    forward, backward = list(range(len(PROMPTS))), list(reversed(range(len(PROMPTS))))
    with _engine(model) as engine:
        assert len(engine.tokenize(PROMPTS[0])) > 2048  # vLLM's chunked prefill would split it
        first = _sample(engine, 0, forward)
        reversed_order = _sample(engine, 0, backward)
        other_seed = _sample(engine, 1, forward)
        unseeded = [_sample(engine, None, forward) for _ in range(2)]
    with _engine(model) as fresh:
        another_run = _sample(fresh, 0, forward)

    assert unseeded[0] != unseeded[1]  # the control: without seeds the same engine samples other completions
    assert reversed_order == first
    assert another_run == first
    for index, group in first.items():
        assert len({tuple(ids) for ids in group}) == GROUP_SIZE, f"prompt {index}: G completions alike: {group}"
        assert other_seed[index] != group, f"prompt {index}: seeds 0 and 1 sampled the same group"
