"""Batch-level figures and advantage finalisation for the groups of one optimizer step (pure).

The advantage maths is :mod:`shared.advantages` (numpy, shared with the scorer); tensors appear only in
what :func:`finalize_advantages` returns, for :func:`services.learner.data.batch.collate`.

Lengths are sampled tokens (:func:`sampled_tokens`; TRL counts ``tool_mask == 1``): a multi-turn trajectory's
tool results and template tokens are context, counted only by ``trajectories/mean_tokens``. The ``tools/*``,
``env/*`` and ``trajectories/*`` figures (:func:`trajectory_metrics`, docs/concepts/multi-turn-design.md §2.11) appear
only when the batch has trajectories; a single-turn batch's figures are what they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args

import numpy as np
import torch

from services.learner.data.batch import row_prompt
from services.learner.data.staleness import staleness
from shared.advantages import completion_metrics, compute_advantages, reward_function_metrics, reward_metrics
from shared.records import Completion, ScoredGroup
from shared.trajectory import Cut, TrajectoryInfo


def sampled_tokens(completion: Completion) -> int:
    """The tokens the policy sampled: every token of a single-turn completion, the loss mask's ones of a
    trajectory."""
    if completion.loss_mask is None:
        return len(completion.token_ids)
    return int(np.count_nonzero(completion.loss_mask))


def _batch_advantages(groups: Sequence[ScoredGroup]) -> np.ndarray:
    """[N] float64 advantages of all the groups' completions, recomputed over exactly this batch."""
    spec = groups[0].advantage_spec
    sizes = {g.rollout.group_size for g in groups}
    if len(sizes) != 1 or any(g.advantage_spec != spec for g in groups):
        raise ValueError("batch-level advantages need one group size and one advantage spec per batch")
    rewards = np.concatenate([g.rewards for g in groups]).astype(np.float64)
    per_func = None
    if spec.reward_aggregation == "normalize_then_sum":
        if len({g.reward_names for g in groups}) != 1:
            raise ValueError("GDPO (normalize_then_sum) needs the same reward functions in every group of a batch")
        per_func = np.concatenate([g.rewards_per_func for g in groups]).astype(np.float64)
    lengths = np.array([sampled_tokens(c) for g in groups for c in g.rollout.completions])
    return compute_advantages(rewards, sizes.pop(), spec, rewards_per_func=per_func, lengths=lengths)


def finalize_advantages(groups: Sequence[ScoredGroup]) -> list[torch.Tensor]:
    """Per-group float32 advantages [G] for training. Groups normalised per group keep the scorer's values;
    when a group's spec needs the whole batch (``scale_rewards="batch"``, BNPO, REINFORCE++, GDPO) they are
    recomputed from the rewards (per function for GDPO; with token counts for REINFORCE++) over exactly this
    batch, so they match a synchronous trainer's numbers."""
    if not groups or not any(g.advantage_spec.needs_batch for g in groups):
        return [torch.from_numpy(g.advantages.copy()) for g in groups]
    advantages = _batch_advantages(groups).astype(np.float32)
    boundaries = np.cumsum([g.rollout.group_size for g in groups])[:-1]
    return [torch.from_numpy(part) for part in np.split(advantages, boundaries)]


def batch_metrics(groups: Sequence[ScoredGroup], policy_version: int) -> dict[str, float]:
    """TRL's reward and completion figures over the batch, plus staleness and, when the batch has trajectories,
    :func:`trajectory_metrics`. ``completion_tokens``: the batch's sampled tokens; ``input_tokens``: its prompt and
    completion tokens (context included), each completion counted with its prompt as TRL counts them (the train
    loop adds these up into the run's cumulative ``num_tokens``)."""
    metrics = _reward_figures(groups)
    completions = [c for g in groups for c in g.rollout.completions]
    lengths = [sampled_tokens(c) for c in completions]
    metrics.update(completion_metrics(lengths, [c.finish_reason == "length" for c in completions]))
    ages = [staleness(policy_version, g.rollout.policy_version) for g in groups]
    metrics["staleness/mean"] = float(np.mean(ages))
    metrics["staleness/max"] = float(max(ages))
    metrics.update(terminated_length_metrics(lengths, [c.finish_reason == "stop" for c in completions]))
    metrics["completion_tokens"] = float(sum(lengths))
    metrics["input_tokens"] = float(
        sum(len(row_prompt(g.rollout, c)) + len(c.token_ids) for g in groups for c in g.rollout.completions)
    )
    metrics.update(trajectory_metrics(completions))
    return metrics


def _reward_figures(groups: Sequence[ScoredGroup]) -> dict[str, float]:
    """TRL's reward figures (per function when every group has the same functions)."""
    size = groups[0].rollout.group_size
    rewards = np.concatenate([g.rewards for g in groups]).astype(np.float64)
    metrics: dict[str, float] = {}
    if all(g.rollout.group_size == size for g in groups):
        metrics.update(reward_metrics(rewards, size))
    else:
        metrics["reward"] = float(np.nanmean(rewards))
    names = groups[0].reward_names
    if all(g.reward_names == names for g in groups):
        per_func = np.concatenate([g.rewards_per_func for g in groups]).astype(np.float64)
        metrics.update(reward_function_metrics(names, per_func))
    return metrics


def trajectory_metrics(completions: Sequence[Completion]) -> dict[str, float]:
    """The multi-turn figures of docs/concepts/multi-turn-design.md §2.11 over the completions that are trajectories;
    empty when none is. ``tools/failure_frequency`` is the batch's failed calls over its calls (summed counts, not
    a mean of per-trajectory ratios); the latency percentiles are over every environment call of the batch."""
    infos = [c.trajectory for c in completions if c.trajectory is not None]
    if not infos:
        return {}
    calls = sum(t.tool_calls for t in infos)
    turns = np.array([t.turns for t in infos], dtype=np.float64)
    metrics = {
        "tools/call_frequency": calls / len(infos),
        "tools/failure_frequency": sum(t.tool_errors for t in infos) / calls if calls else 0.0,
        "tools/num_turns/mean": float(turns.mean()),
        "tools/num_turns/max": float(turns.max()),
        "trajectories/mean_tokens": float(np.mean([len(c.token_ids) for c in completions if c.trajectory is not None])),
        **_cut_metrics(infos),
    }
    latencies = np.concatenate([t.env_latency_s for t in infos]).astype(np.float64)
    if latencies.size:
        metrics["env/latency_seconds/p50"] = float(np.percentile(latencies, 50))
        metrics["env/latency_seconds/p95"] = float(np.percentile(latencies, 95))
    return metrics


def _cut_metrics(infos: Sequence[TrajectoryInfo]) -> dict[str, float]:
    """The share of trajectories cut, overall and by reason (every reason, 0 included, so each series is
    continuous), and the count of runtime template breaks (which must stay 0)."""
    cuts = [t.cut for t in infos]
    metrics = {"trajectories/cut_frequency": sum(c is not None for c in cuts) / len(cuts)}
    for reason in get_args(Cut):
        metrics[f"trajectories/cut/{reason}"] = cuts.count(reason) / len(cuts)
    metrics["trajectories/template_breaks"] = float(cuts.count("template_break"))
    return metrics


def terminated_length_metrics(lengths: Sequence[int], terminated: Sequence[bool]) -> dict[str, float]:
    """TRL's ``completions/{mean,min,max}_terminated_length``: token counts of the completions that ended
    by themselves (EOS or a stop string, not cut at the token limit); 0 when none did, as TRL."""
    ended = np.asarray(lengths, dtype=np.float64)[np.asarray(terminated, dtype=bool)]
    if ended.size == 0:
        ended = np.zeros(1)
    return {
        "completions/mean_terminated_length": float(ended.mean()),
        "completions/min_terminated_length": float(ended.min()),
        "completions/max_terminated_length": float(ended.max()),
    }


def sampling_logp_difference_metrics(
    behaviour: torch.Tensor, old: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """TRL's ``sampling/sampling_logp_difference/{mean,max}``: |behaviour logprob - recomputed old logprob|
    over the completion tokens of ``mask`` (all [B, T]); empty when there is no token."""
    diff = (behaviour.float() - old.float()).abs()[mask.bool()]
    if diff.numel() == 0:
        return {}
    return {
        "sampling/sampling_logp_difference/mean": float(diff.mean()),
        "sampling/sampling_logp_difference/max": float(diff.max()),
    }


def clip_ratio_extremes(per_micro_batch: Sequence[dict[str, float]]) -> dict[str, float]:
    """TRL's ``clip_ratio/low_min`` and ``clip_ratio/high_max``: the smallest ``clip_ratio/low_mean`` and the
    largest ``clip_ratio/high_mean`` of the micro-batches (of every rank) that had any, empty otherwise."""
    out: dict[str, float] = {}
    lows = [m["clip_ratio/low_mean"] for m in per_micro_batch if "clip_ratio/low_mean" in m]
    highs = [m["clip_ratio/high_mean"] for m in per_micro_batch if "clip_ratio/high_mean" in m]
    if lows:
        out["clip_ratio/low_min"] = min(lows)
    if highs:
        out["clip_ratio/high_max"] = max(highs)
    return out
