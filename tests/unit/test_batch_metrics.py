"""TRL's batch figures on hand-built groups: terminated lengths and the token counts behind ``num_tokens``; the
multi-turn figures (docs/concepts/multi-turn-design.md §2.11)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.learner.metrics.batch_metrics import (
    batch_metrics,
    clip_ratio_extremes,
    sampling_logp_difference_metrics,
    terminated_length_metrics,
    trajectory_metrics,
)
from services.learner.metrics.counters import Counters
from shared.advantages import group_advantages
from shared.records import Completion, PromptTask, Rollout, RolloutTimings, SamplingSpec, ScoredGroup
from tests.support.factories import make_masked_completion, make_rollout, make_task


def _group(prompt_len: int, completions: list[tuple[int, str]]) -> ScoredGroup:
    """One group: a prompt of ``prompt_len`` tokens; completions of (length, finish_reason)."""
    size = len(completions)
    task = PromptTask(prompt="x", group_size=size, policy_version=0, sampling=SamplingSpec(temperature=1.0))
    rollout = Rollout(
        group_id=task.task_id,
        task=task,
        prompt_token_ids=np.arange(prompt_len, dtype=np.int32),
        completions=tuple(
            Completion(
                text="",
                token_ids=np.ones(n, dtype=np.int32),
                behaviour_logprobs=np.zeros(n, dtype=np.float32),
                finish_reason=reason,
            )
            for n, reason in completions
        ),
        policy_version=0,
        finished_policy_version=0,
        generator_id="g",
        timings=RolloutTimings(received_at=0, started_at=0, finished_at=0),
    )
    rewards = np.arange(size, dtype=np.float32)
    return ScoredGroup(
        rollout=rollout,
        reward_names=("r",),
        rewards_per_func=rewards[:, None],
        rewards=rewards,
        advantages=group_advantages(rewards, size),
    )


def test_terminated_lengths_count_only_completions_that_ended_by_themselves():
    groups = [_group(3, [(4, "stop"), (10, "length")]), _group(5, [(6, "stop"), (10, "length")])]
    metrics = batch_metrics(groups, policy_version=0)
    assert metrics["completions/mean_terminated_length"] == 5.0
    assert metrics["completions/min_terminated_length"] == 4.0
    assert metrics["completions/max_terminated_length"] == 6.0
    assert metrics["completions/mean_length"] == 7.5  # all four, as before


def test_terminated_lengths_are_zero_when_every_completion_was_cut():
    assert terminated_length_metrics([8, 8], [False, False]) == {
        "completions/mean_terminated_length": 0.0,
        "completions/min_terminated_length": 0.0,
        "completions/max_terminated_length": 0.0,
    }


def test_input_tokens_count_the_prompt_with_every_completion():
    groups = [_group(3, [(4, "stop"), (10, "length")]), _group(5, [(6, "stop"), (10, "length")])]
    metrics = batch_metrics(groups, policy_version=0)
    assert metrics["completion_tokens"] == 30.0  # 4 + 10 + 6 + 10
    assert metrics["input_tokens"] == 46.0  # 30 + 2 * 3 + 2 * 5
    assert "num_tokens" not in metrics  # the run's cumulative count comes from the learner's counters


def test_num_tokens_is_cumulative_and_survives_a_checkpoint():
    counters = Counters()
    assert counters.tokens_seen(46.0) == 46
    assert counters.tokens_seen(30.0) == 76
    restored = Counters.restore({name: float(value) for name, value in counters.as_dict().items()})
    assert restored.tokens_seen(4.0) == 80


def test_sampling_logp_difference_is_over_completion_tokens_only():
    behaviour = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, 9.0]])
    old = torch.tensor([[-1.5, -2.0, -2.0], [-0.25, -0.25, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])  # -4.0 and 9.0 are padding
    assert sampling_logp_difference_metrics(behaviour, old, mask) == {
        "sampling/sampling_logp_difference/mean": 0.4375,  # (0.5 + 0 + 1 + 0.25) / 4
        "sampling/sampling_logp_difference/max": 1.0,
    }
    assert sampling_logp_difference_metrics(behaviour, old, torch.zeros_like(mask)) == {}


def test_clip_ratio_extremes_take_the_smallest_low_and_the_largest_high():
    per_micro_batch = [
        {"clip_ratio/low_mean": 0.25, "clip_ratio/high_mean": 0.0},
        {"clip_ratio/low_mean": 0.125, "clip_ratio/high_mean": 0.5},
        {"loss": 1.0},  # an objective without these flags
    ]
    assert clip_ratio_extremes(per_micro_batch) == {"clip_ratio/low_min": 0.125, "clip_ratio/high_max": 0.5}
    assert clip_ratio_extremes([{"cispo_clip_ratio": 0.5}]) == {}


def _trajectories(*specs) -> ScoredGroup:
    """One group of trajectories; each spec: (loss mask, TrajectoryInfo fields)."""
    completions = tuple(make_masked_completion(np.arange(5, 5 + len(mask)), mask, **info) for mask, info in specs)
    task = make_task(group_size=len(specs))
    rollout = make_rollout(task, completions=completions)
    rewards = np.arange(len(specs), dtype=np.float32)
    return ScoredGroup(
        rollout=rollout,
        reward_names=("r",),
        rewards_per_func=rewards[:, None],
        rewards=rewards,
        advantages=group_advantages(rewards, len(specs)),
    )


def _latencies(*seconds: float) -> np.ndarray:
    return np.array(seconds, dtype=np.float32)


def test_tool_figures_come_from_summed_counts_and_latency_percentiles_from_every_call():
    groups = [
        _trajectories(
            ([1, 0, 1], dict(turns=2, tool_calls=1, tool_errors=1, env_latency_s=_latencies(0.1, 0.2))),
            ([1, 0, 0, 1, 0, 1], dict(turns=3, tool_calls=3, tool_errors=0, env_latency_s=_latencies(0.3, 0.4))),
        ),
        _trajectories(([1, 1], dict(turns=1, tool_calls=0, env_latency_s=_latencies(1.0)))),
    ]
    metrics = batch_metrics(groups, policy_version=0)
    assert metrics["tools/call_frequency"] == pytest.approx(4 / 3)
    # 1 failed of 4 calls: not the mean of the per-trajectory ratios (1/1 and 0/3: 0.5).
    assert metrics["tools/failure_frequency"] == 0.25
    assert (metrics["tools/num_turns/mean"], metrics["tools/num_turns/max"]) == (2.0, 3.0)
    latencies = [0.1, 0.2, 0.3, 0.4, 1.0]
    assert metrics["env/latency_seconds/p50"] == pytest.approx(0.3)
    assert metrics["env/latency_seconds/p95"] == pytest.approx(float(np.percentile(latencies, 95)))
    assert metrics["env/latency_seconds/p95"] == pytest.approx(0.88)


def test_lengths_count_sampled_tokens_and_mean_tokens_counts_every_token():
    groups = [_trajectories(([1, 0, 0, 1], {}), ([1, 1, 0, 1, 1, 1], {}))]
    metrics = batch_metrics(groups, policy_version=0)
    assert metrics["completions/mean_length"] == 3.5  # (2 + 5) sampled
    assert (metrics["completions/min_length"], metrics["completions/max_length"]) == (2.0, 5.0)
    assert metrics["completions/mean_terminated_length"] == 3.5
    assert metrics["completion_tokens"] == 7.0
    assert metrics["trajectories/mean_tokens"] == 5.0  # (4 + 6), tool tokens included
    assert metrics["input_tokens"] == 2 * 5 + 10.0  # each with its 5-token prompt, every token


def test_cut_figures_share_of_trajectories_by_reason_and_template_breaks_counted():
    groups = [
        _trajectories(
            ([1], dict(cut="max_turns")),
            ([1], dict(cut="template_break")),
            ([1], {}),
            ([1], dict(cut="max_turns")),
        )
    ]
    metrics = batch_metrics(groups, policy_version=0)
    assert metrics["trajectories/cut_frequency"] == 0.75
    assert metrics["trajectories/cut/max_turns"] == 0.5
    assert metrics["trajectories/cut/template_break"] == 0.25
    assert metrics["trajectories/cut/token_budget"] == metrics["trajectories/cut/context"] == 0.0
    assert metrics["trajectories/template_breaks"] == 1.0
    assert metrics["tools/failure_frequency"] == 0.0  # no call at all: none failed


def test_a_single_turn_batch_has_no_trajectory_figures():
    groups = [_group(3, [(4, "stop"), (10, "length")])]
    metrics = batch_metrics(groups, policy_version=0)
    assert not [name for name in metrics if name.split("/")[0] in ("tools", "env", "trajectories")]
    assert trajectory_metrics([c for g in groups for c in g.rollout.completions]) == {}
