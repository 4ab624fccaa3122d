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
from shared.trajectory import ToolCall, ToolFunction, TrajectoryInfo


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


def make_trajectory_completion(**overrides) -> Completion:
    """A two-turn tool-using completion (schema v2): sampled call, tool result (context), sampled answer."""
    fields = dict(
        text="<tool_call>{}</tool_call><tool>5</tool><answer>5</answer>",
        token_ids=np.array([10, 11, 12, 20, 21, 30, 31], dtype=np.int32),
        behaviour_logprobs=np.array([-0.5, -0.25, -0.125, 0.0, 0.0, -1.0, -0.75], dtype=np.float32),
        finish_reason="stop",
        token_versions=np.array([3, 3, 3, -1, -1, 4, 4], dtype=np.int32),
        loss_mask=np.array([1, 1, 1, 0, 0, 1, 1], dtype=np.uint8),
        messages=(
            ChatMessage(
                role="assistant",
                content="",
                tool_calls=(ToolCall(id="call-0", function=ToolFunction(name="add", arguments={"a": 2, "b": 3})),),
                reasoning_content="2+3 needs the tool",
            ),
            ChatMessage(role="tool", content="5", tool_call_id="call-0", name="add"),
            ChatMessage(role="assistant", content="<answer>5</answer>"),
        ),
        trajectory=TrajectoryInfo(
            turns=2, tool_calls=1, tool_errors=0, env_reward=1.0, env_latency_s=np.array([0.01, 0.02], np.float32)
        ),
    )
    fields.update(overrides)
    return Completion(**fields)


def make_trajectory_rollout(group_size: int = 2) -> Rollout:
    """A group of tool-using trajectories (schema v2)."""
    task = make_task(group_size=group_size, policy_version=3)
    completions = tuple(make_trajectory_completion() for _ in range(group_size))
    return make_rollout(task, completions=completions, finished_policy_version=4)


def make_masked_completion(
    token_ids,
    loss_mask,
    behaviour_logprobs=None,
    *,
    versions=0,
    prompt_token_ids=None,
    finish_reason: str = "stop",
    **trajectory,
) -> Completion:
    """A trajectory completion (schema v2) from its tokens and loss mask: behaviour logprobs (default -0.5) and
    ``versions`` (one int, or one per token) on the sampled tokens, 0 and -1 on the context tokens (I3);
    ``trajectory``: TrajectoryInfo fields (default one turn per sampled span, one tool call per context span)."""
    mask = np.asarray(loss_mask, dtype=np.uint8)
    sampled = mask == 1
    behaviour = np.full(len(mask), -0.5, np.float32) if behaviour_logprobs is None else behaviour_logprobs
    behaviour = np.where(sampled, np.asarray(behaviour, np.float32), np.float32(0.0)).astype(np.float32)
    stamped = np.broadcast_to(np.asarray(versions, np.int32), mask.shape)
    spans = int(np.count_nonzero(np.diff(np.concatenate([[0], mask.astype(np.int8)])) == 1))
    info = dict(turns=max(spans, 1), tool_calls=max(spans - 1, 0))
    info.update(trajectory)
    return Completion(
        text="",
        token_ids=np.asarray(token_ids, dtype=np.int32),
        behaviour_logprobs=behaviour,
        finish_reason=finish_reason,
        token_versions=np.where(sampled, stamped, -1).astype(np.int32),
        loss_mask=mask,
        prompt_token_ids=None if prompt_token_ids is None else np.asarray(prompt_token_ids, dtype=np.int32),
        trajectory=TrajectoryInfo(**info),
    )
