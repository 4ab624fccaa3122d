"""One trajectory's tokens, masks, versions and messages, and its per-turn budget: values in, values out.

The runner (``runner.py``) drives a :class:`Trajectory` turn by turn; this module keeps the invariants of
docs/concepts/multi-turn-design.md §2.1 where they are made:

- I1: the engine reads ``prompt_ids ++ tokens`` before every turn (:meth:`Trajectory.engine_input`);
- I2: sampled ids are the engine's own, appended unchanged (:meth:`Trajectory.add_sampled`);
- I3: ``loss_mask`` 1 exactly on sampled tokens, behaviour logprob 0 and version -1 on context tokens
  (:meth:`Trajectory.add_context`), and a trajectory ends on a sampled token (nothing is appended after the
  last turn).

The budget (§2.6): ``limit`` (the task's ``max_tokens``, the learner's ``max_completion_length``) counts every
token after the prompt, sampled or not; the engine's context bounds ``prompt + tokens``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared.trajectory import (
    MASKED_VERSION,
    ChatMessage,
    Completion,
    Cut,
    FinishReason,
    ToolCall,
    ToolFunction,
    TrajectoryInfo,
)

TRUNCATION_MARK = "…[truncated]"  # ends a tool result cut to max_tool_response_tokens


@dataclass(frozen=True)
class SampledTurn:
    """One assistant turn from the engine: its ids as sampled (the close token included when it stopped on
    it), their behaviour logprobs, why it stopped, and the policy versions at its start and end and the lowest
    served in between (below its start: the weights went back while it sampled)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"
    version: int
    finished_version: int
    lowest_version: int


@dataclass(frozen=True)
class TurnBudget:
    """How many tokens the next turn may sample; ``cut`` says which bound stops the trajectory when none."""

    max_tokens: int
    cut: Cut | None = None


def turn_budget(limit: int, max_model_len: int, prompt_len: int, used: int) -> TurnBudget:
    """The next turn's ``max_tokens``: what is left of ``limit`` after ``used`` tokens, and of the context."""
    by_limit = limit - used
    by_context = max_model_len - prompt_len - used
    if min(by_limit, by_context) >= 1:
        return TurnBudget(min(by_limit, by_context))
    return TurnBudget(0, "token_budget" if by_limit <= by_context else "context")


def delta_room(limit: int, max_model_len: int, prompt_len: int, used: int, delta_len: int) -> Cut | None:
    """None when a template delta of ``delta_len`` tokens fits with room for one more sampled token; else the
    bound it would pass (the turn's tool messages are then rolled back: nothing follows them)."""
    if used + delta_len + 1 > limit:
        return "token_budget"
    if prompt_len + used + delta_len + 1 > max_model_len:
        return "context"
    return None


def derived_seed(seed: int | None, sample: int, turn: int) -> int | None:
    """A per-(sample, turn) seed from the task's: each trajectory is its own n=1 request, so one shared seed
    would make the G samples identical. None stays None (vLLM draws its own)."""
    if seed is None:
        return None
    return (seed * 1_000_003 + sample * 10_007 + turn) % 2**63


def cut_tool_content(content: str, limit: int, encode: Any, decode: Any) -> str:
    """A tool result's content cut to ``limit`` content tokens (before templating), marked when cut."""
    ids = encode(content)
    if len(ids) <= limit:
        return content
    return decode(ids[:limit]) + TRUNCATION_MARK


@dataclass
class Trajectory:
    """One sample of a prompt: everything after its prompt, token by token, and the messages they carry."""

    prompt_ids: list[int]
    prompt: list[dict[str, Any]]  # the prompt messages this sample's engine read (reset's observation included)
    limit: int  # tokens after the prompt, sampled or not: the task's max_tokens (max_completion_length)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)  # after the prompt: assistant, tool, ...
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    cut: Cut | None = None
    finish_reason: FinishReason = "stop"
    env_reward: float | None = None
    latencies_s: list[float] = field(default_factory=list)

    def engine_input(self) -> list[int]:
        """I1: what the engine reads before the next turn."""
        return self.prompt_ids + self.tokens

    def add_sampled(self, token_ids: Sequence[int], logprobs: Sequence[float], version: int) -> None:
        """A turn the engine sampled at ``version``: its ids unchanged, mask 1."""
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(token_ids)} sampled tokens but {len(logprobs)} logprobs")
        self.tokens += token_ids
        self.logprobs += logprobs
        self.versions += [version] * len(token_ids)
        self.mask += [1] * len(token_ids)
        self.turns += 1

    def add_context(self, token_ids: Sequence[int]) -> None:
        """Tokens the template and the environment put between two turns: read by the engine, never trained."""
        self.tokens += token_ids
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [MASKED_VERSION] * len(token_ids)
        self.mask += [0] * len(token_ids)

    @property
    def used(self) -> int:
        return len(self.tokens)

    def completion(self, text: str, own_prompt_ids: bool, own_prompt: bool) -> Completion:
        """The record of this trajectory. ``own_prompt_ids``: its prompt's ids differ from the rollout's (sample
        0's); ``own_prompt``: its prompt messages differ from the task's (``reset`` added an observation)."""
        return Completion(
            text=text,
            token_ids=np.asarray(self.tokens, dtype=np.int32),
            behaviour_logprobs=np.asarray(self.logprobs, dtype=np.float32),
            finish_reason=self.finish_reason,
            token_versions=np.asarray(self.versions, dtype=np.int32),
            loss_mask=np.asarray(self.mask, dtype=np.uint8),
            messages=tuple(chat_message(m) for m in self.messages),
            prompt_token_ids=np.asarray(self.prompt_ids, dtype=np.int32) if own_prompt_ids else None,
            prompt=tuple(chat_message(m) for m in self.prompt) if own_prompt else None,
            trajectory=TrajectoryInfo(
                turns=max(self.turns, 1),
                tool_calls=self.tool_calls,
                tool_errors=self.tool_errors,
                env_reward=self.env_reward,
                cut=self.cut,
                env_latency_s=np.asarray(self.latencies_s, dtype=np.float32),
            ),
        )


def chat_message(message: Mapping[str, Any]) -> ChatMessage:
    """The wire form of a message dict in ``apply_chat_template``'s shape."""
    calls = message.get("tool_calls")
    return ChatMessage(
        role=message["role"],
        content=message.get("content") or "",
        tool_calls=None
        if not calls
        else tuple(
            ToolCall(
                id=call["id"],
                function=ToolFunction(name=call["function"]["name"], arguments=call["function"]["arguments"]),
            )
            for call in calls
        ),
        tool_call_id=message.get("tool_call_id"),
        name=message.get("name"),
        reasoning_content=message.get("reasoning_content"),
    )
