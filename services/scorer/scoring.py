"""Turning one ``Rollout`` into one ``ScoredGroup``: reward inputs, combination, advantages, metrics.

The reward functions see what TRL would pass them: for a chat prompt, ``prompts`` are the message lists and
``completions`` one-message lists ``[{"role": "assistant", "content": ...}]``; for a text prompt, strings.
When the task prefills the assistant turn (its last message is the assistant's start, e.g. ``<think>``),
the completion text the rewards judge is that prefill followed by the sampled text, since that is the
answer the model gave.

Functions that take ``trainer_state`` (or ``**kwargs``) get a :class:`TrainerState`: ``global_step`` is the
group's ``policy_version`` (the learner step its sampling started at), ``max_steps`` the scorer's ``max_steps``.

A multi-turn tool-use group (its completions carry ``messages``, docs/concepts/multi-turn-design.md §2.9) gets TRL's
tool-use shape instead: ``prompts[i]`` is that sample's prompt messages (with the environment's reset
observation where it added one), ``completions[i]`` the conversation after the prompt as message dicts
(assistant turns with ``tool_calls`` ``[{"id", "type": "function", "function": {"name", "arguments": dict}}]``,
tool messages ``{"role": "tool", "name", "content", "tool_call_id"}``, ..., the final assistant turn; unset
fields left out), ``completion_ids[i]`` every token after the prompt (sampled turns, tool results, template
tokens), and the column ``env_reward`` (the environment's reward, None where it gave none).

Advantages are computed here over the group. When the configured normalisation needs the whole training
batch (``scale_rewards="batch"`` or BNPO) the learner recomputes them over exactly its batch with the same
functions (:mod:`shared.advantages`), using the ``advantage_spec`` carried in the record.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np

from services.scorer.rewards.builtin import BUILTINS
from services.scorer.rewards.functions import RewardBatch, RewardFunction, TrainerState
from services.scorer.rewards.http_plugin import HttpRewardPlugin
from services.scorer.rewards.trl_convention import trl_style
from shared.advantages import (
    combine_rewards,
    completion_metrics,
    compute_advantages,
    reward_function_metrics,
    zero_std_groups,
)
from shared.columns import BUDGET_COLUMN, ENV_REWARD_COLUMN
from shared.config.scorer import RewardSpec
from shared.records import AdvantageSpec, ChatMessage, Rollout, ScoredGroup
from shared.resilience import CircuitBreaker
from shared.reward_protocol import load_reward_function


def reward_batch(rollout: Rollout, max_steps: int | None = None) -> RewardBatch:
    """TRL-style reward inputs for one group (see the module docstring); ``max_steps``: the learner's, for
    the functions' ``trainer_state`` (None: not known)."""
    if any(c.messages for c in rollout.completions):
        return conversation_batch(rollout, max_steps)
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
    state = trainer_state(rollout, max_steps)
    return RewardBatch(prompts, completions, completion_ids, columns, group_id=rollout.group_id, trainer_state=state)


def trainer_state(rollout: Rollout, max_steps: int | None) -> TrainerState:
    """What reward functions taking ``trainer_state`` get for this group (:class:`TrainerState`): the learner
    step it was sampled at (its policy version), ``max_steps`` and no epoch."""
    return TrainerState(global_step=rollout.policy_version, max_steps=max_steps)


def conversation_batch(rollout: Rollout, max_steps: int | None = None) -> RewardBatch:
    """A tool-use group's reward inputs, in TRL's tool-use shape (see the module docstring)."""
    task = rollout.task
    size = rollout.group_size
    prompts = [_messages(c.prompt) if c.prompt is not None else _prompt(task.prompt) for c in rollout.completions]
    completions = [_messages(c.messages) for c in rollout.completions]
    columns = {key: [value] * size for key, value in task.columns.items()}
    columns.setdefault(BUDGET_COLUMN, [task.sampling.max_tokens] * size)
    columns[ENV_REWARD_COLUMN] = [c.trajectory.env_reward if c.trajectory else None for c in rollout.completions]
    completion_ids = [c.token_ids.tolist() for c in rollout.completions]
    state = trainer_state(rollout, max_steps)
    return RewardBatch(
        prompts, completions, completion_ids, columns, group_id=rollout.group_id, multi_turn=True, trainer_state=state
    )


def _prompt(prompt: str | Sequence[ChatMessage]) -> str | list[dict[str, Any]]:
    return prompt if isinstance(prompt, str) else _messages(prompt)


def _messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Message dicts as TRL passes them: lists, not tuples; a field that is not set is left out (the record's
    own serializer drops unset v2 fields)."""
    return [message.model_dump(mode="json") for message in messages]


def sampled_lengths(rollout: Rollout) -> list[int]:
    """Each completion's sampled tokens [G]: a trajectory's tool results and template tokens are context, not
    completion length (TRL counts ``tool_mask == 1``); a single-turn completion's are all its tokens."""
    return [len(c.token_ids) if c.loss_mask is None else int(c.loss_mask.sum()) for c in rollout.completions]


def group_metrics(
    rollout: Rollout, names: Sequence[str], per_func: np.ndarray, rewards: np.ndarray
) -> dict[str, float]:
    """TRL's per-batch figures, for one group: rewards [G], per_func [G, F]."""
    present = rewards[~np.isnan(rewards)]
    completions = rollout.completions
    return {
        "reward": float(present.mean()) if present.size else math.nan,
        "reward_std": float(present.std(ddof=1)) if present.size > 1 else 0.0,
        **completion_metrics(sampled_lengths(rollout), [c.finish_reason == "length" for c in completions]),
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
    lengths = np.array(sampled_lengths(rollout))
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
                batched=spec.batched,
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
