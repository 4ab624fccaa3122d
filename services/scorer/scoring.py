"""Turning one ``Rollout`` into one ``ScoredGroup``: reward inputs, combination, advantages, metrics.

The reward functions see what TRL would pass them: for a chat prompt, ``prompts`` are the message lists and
``completions`` one-message lists ``[{"role": "assistant", "content": ...}]``; for a text prompt, strings.
When the task prefills the assistant turn (its last message is the assistant's start, e.g. ``<think>``),
the completion text the rewards judge is that prefill followed by the sampled text, since that is the
answer the model gave.

Advantages are computed here over the group. When the configured normalisation needs the whole training
batch (``scale_rewards="batch"`` or BNPO) the learner recomputes them over exactly its batch with the same
functions (:mod:`shared.advantages`), using the ``advantage_spec`` carried in the record.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import httpx
import numpy as np

from services.scorer.rewards.builtin import BUILTINS
from services.scorer.rewards.functions import RewardBatch, RewardFunction, trl_style
from services.scorer.rewards.http_plugin import HttpRewardPlugin
from shared.advantages import (
    combine_rewards,
    completion_metrics,
    compute_advantages,
    reward_function_metrics,
    zero_std_groups,
)
from shared.config.scorer import RewardSpec
from shared.records import AdvantageSpec, Rollout, ScoredGroup
from shared.resilience import CircuitBreaker
from shared.reward_protocol import load_reward_function


def reward_batch(rollout: Rollout) -> RewardBatch:
    """TRL-style reward inputs for one group (see the module docstring)."""
    task = rollout.task
    size = rollout.group_size
    texts = [c.text for c in rollout.completions]
    if isinstance(task.prompt, str):
        prompts: list = [task.prompt] * size
        completions: list = texts
    else:
        messages = [m.model_dump() for m in task.prompt]
        prefill = messages[-1]["content"] if messages[-1]["role"] == "assistant" else ""
        prompts = [messages] * size
        completions = [[{"role": "assistant", "content": prefill + text}] for text in texts]
    columns = {key: [value] * size for key, value in task.columns.items()}
    columns.setdefault("max_completion_length", [task.sampling.max_tokens] * size)
    completion_ids = [c.token_ids.tolist() for c in rollout.completions]
    return RewardBatch(prompts, completions, completion_ids, columns, group_id=rollout.group_id)


def group_metrics(
    rollout: Rollout, names: Sequence[str], per_func: np.ndarray, rewards: np.ndarray
) -> dict[str, float]:
    """TRL's per-batch figures, for one group: rewards [G], per_func [G, F]."""
    present = rewards[~np.isnan(rewards)]
    completions = rollout.completions
    return {
        "reward": float(present.mean()) if present.size else math.nan,
        "reward_std": float(present.std(ddof=1)) if present.size > 1 else 0.0,
        **completion_metrics(
            [len(c.token_ids) for c in completions], [c.finish_reason == "length" for c in completions]
        ),
        **reward_function_metrics(names, per_func),
    }


def scored_group(
    rollout: Rollout,
    names: Sequence[str],
    weights: Sequence[float],
    per_func: np.ndarray,
    spec: AdvantageSpec,
    *,
    drop_zero_std: bool,
    scorer_id: str = "",
) -> ScoredGroup:
    """Combine [G, F] rewards, compute the group's advantages and metrics, and build the record."""
    per_func64 = per_func.astype(np.float64)
    rewards = combine_rewards(per_func64, np.asarray(weights, dtype=np.float64))
    lengths = np.array([len(c.token_ids) for c in rollout.completions])
    advantages = compute_advantages(rewards, rollout.group_size, spec, rewards_per_func=per_func64, lengths=lengths)
    zero = bool(zero_std_groups(rewards, rollout.group_size)[0])
    metrics = group_metrics(rollout, names, per_func, rewards)
    metrics["frac_reward_zero_std"] = float(zero)
    return ScoredGroup(
        rollout=rollout,
        reward_names=tuple(names),
        rewards_per_func=per_func.astype(np.float32),
        rewards=rewards.astype(np.float32),
        advantages=advantages.astype(np.float32),
        advantage_spec=spec,
        zero_std=zero,
        dropped=zero and drop_zero_std,
        metrics=metrics,
        scorer_id=scorer_id,
    )


def evaluated_group(
    rollout: Rollout, names: Sequence[str], weights: Sequence[float], per_func: np.ndarray, *, scorer_id: str = ""
) -> ScoredGroup:
    """A held-out prompt's completions, scored for evaluation: rewards and metrics, no advantages (zeros: the
    group is never trained, and a group of one completion has no group-relative advantage)."""
    rewards = combine_rewards(per_func.astype(np.float64), np.asarray(weights, dtype=np.float64))
    return ScoredGroup(
        rollout=rollout,
        reward_names=tuple(names),
        rewards_per_func=per_func.astype(np.float32),
        rewards=rewards.astype(np.float32),
        advantages=np.zeros(rollout.group_size, dtype=np.float32),
        metrics=group_metrics(rollout, names, per_func, rewards),
        scorer_id=scorer_id,
    )


def build_functions(
    specs: Sequence[RewardSpec], http: httpx.AsyncClient
) -> tuple[list[RewardFunction], list[HttpRewardPlugin]]:
    """Reward functions from the settings, in order; also the HTTP plugins (to probe at start)."""
    functions, plugins = [], []
    for spec in specs:
        if spec.url:  # RewardSpec.kind == "http"; testing the url itself gives _http_plugin a str
            plugin = _http_plugin(spec, spec.url, http)
            plugins.append(plugin)
            functions.append(plugin.as_function())
            continue
        in_thread = spec.kind == "python"  # a plugin's cost is unknown; the built-ins are fast (and inline)
        call = load_reward_function(spec.function) if spec.function else BUILTINS[spec.name](**spec.params)
        breaker = CircuitBreaker(spec.name, spec.breaker_failures, spec.breaker_reset_s)
        functions.append(
            trl_style(
                spec.name,
                call,
                in_thread=in_thread,
                required=spec.required,
                breaker=breaker,
                timeout_s=spec.timeout_s if in_thread else None,
                threads=spec.concurrency,
            )
        )
    return functions, plugins


def _http_plugin(spec: RewardSpec, url: str, http: httpx.AsyncClient) -> HttpRewardPlugin:
    return HttpRewardPlugin(
        spec.name,
        url,
        http,
        timeout_s=spec.timeout_s,
        retries=spec.retries,
        backoff_s=spec.backoff_s,
        concurrency=spec.concurrency,
        breaker_failures=spec.breaker_failures,
        breaker_reset_s=spec.breaker_reset_s,
        health_url=spec.health_url,
        headers=spec.request_headers(),
        required=spec.required,
    )
