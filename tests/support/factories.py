"""Builders of valid wire records for tests."""

from __future__ import annotations

import numpy as np

from shared.records import (
    ChatMessage,
    Completion,
    DatasetPosition,
    PromptTask,
    Rollout,
    RolloutTimings,
    SamplingSpec,
    ScoredGroup,
)


def make_task(group_size: int = 4, policy_version: int = 0, **overrides) -> PromptTask:
    fields = dict(
        prompt=(
            ChatMessage(role="system", content="Answer."),
            ChatMessage(role="user", content="What is 2+3?"),
        ),
        columns={"answer": "5"},
        group_size=group_size,
        sampling=SamplingSpec(temperature=1.0, max_tokens=32),
        dataset_position=DatasetPosition(epoch=0, index=3),
        policy_version=policy_version,
    )
    fields.update(overrides)
    return PromptTask(**fields)


def make_rollout(task: PromptTask | None = None, tokens: int = 8, seed: int = 0, **overrides) -> Rollout:
    task = task or make_task()
    rng = np.random.default_rng(seed)
    completions = tuple(
        Completion(
            text=f"<answer>{i}</answer>",
            token_ids=rng.integers(0, 50_000, size=tokens, dtype=np.int32),
            behaviour_logprobs=-rng.random(tokens, dtype=np.float32),
            finish_reason="stop" if i % 2 else "length",
        )
        for i in range(task.group_size)
    )
    fields = dict(
        group_id=task.task_id,
        task=task,
        prompt_token_ids=np.arange(5, dtype=np.int32),
        completions=completions,
        policy_version=task.policy_version,
        finished_policy_version=task.policy_version,
        generator_id="gen-0",
        timings=RolloutTimings(received_at=1.0, started_at=2.0, finished_at=3.0),
    )
    fields.update(overrides)
    return Rollout(**fields)


def make_scored(rollout: Rollout | None = None, num_funcs: int = 2) -> ScoredGroup:
    rollout = rollout or make_rollout()
    g = rollout.group_size
    rewards_per_func = np.arange(g * num_funcs, dtype=np.float32).reshape(g, num_funcs)
    rewards = rewards_per_func.sum(axis=1)
    return ScoredGroup(
        rollout=rollout,
        reward_names=tuple(f"f{i}" for i in range(num_funcs)),
        rewards_per_func=rewards_per_func,
        rewards=rewards,
        advantages=(rewards - rewards.mean()).astype(np.float32),
        metrics={"reward": float(rewards.mean())},
    )
