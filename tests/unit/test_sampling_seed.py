"""Seeded sampling's pure parts: each prompt's seed from the run's ``sampling_seed`` and its dataset position,
carried on the task's sampling spec, and the CPU engine's scheduling that keeps seeded requests alive
(the engine itself: ``tests/integration/test_seeded_sampling.py``)."""

from __future__ import annotations

from services.generator.engine import CPU_TOKEN_BUDGET, engine_scheduling
from services.learner.data.feeder import PromptFeeder, prompt_seed
from shared.config.data import DataSettings
from shared.dataset.rows import load_rows
from shared.records import DatasetPosition, SamplingSpec

GROUP_SIZE = 8


def _seeds(sampling_seed: int | None) -> list[int | None]:
    data = DataSettings(builtin_size=20, epochs=0)
    rows = load_rows(data)
    feeder = PromptFeeder(rows, data, SamplingSpec(max_tokens=8), GROUP_SIZE, sampling_seed=sampling_seed)
    return [feeder.next_task(0).sampling.seed for _ in range(2 * len(rows))]  # two epochs


def test_unseeded_runs_send_no_seed():
    assert set(_seeds(None)) == {None}
    assert prompt_seed(None, DatasetPosition(epoch=0, index=0)) is None


def test_the_same_seed_gives_every_position_the_same_seed_and_other_seeds_others():
    first, again, other = _seeds(7), _seeds(7), _seeds(8)
    assert first == again
    assert not set(first) & set(other)


def test_no_two_prompts_share_a_completion_seed_and_every_group_stays_in_vllms_range():
    seeds = _seeds(0)
    completion_seeds = [seed + child for seed in seeds for child in range(GROUP_SIZE)]  # vLLM's seed + index
    assert len(set(completion_seeds)) == len(completion_seeds)  # both epochs too: a position is (epoch, index)
    assert all(0 <= seed < 2**63 for seed in completion_seeds)


def test_the_cpu_engine_never_splits_a_prefill():
    assert engine_scheduling(512, on_cpu=True) == {"enable_chunked_prefill": False, "max_num_batched_tokens": 2048}
    long = engine_scheduling(8192, on_cpu=True)
    assert long["max_num_batched_tokens"] == 8192 > CPU_TOKEN_BUDGET  # a whole context fits in one step
    assert engine_scheduling(8192, on_cpu=False) == {}  # GPUs keep vLLM's chunked prefill
