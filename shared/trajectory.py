"""Wire records of a completion and its conversation: chat messages, tool calls, multi-turn trajectories.

Schema version 2 (docs/concepts/multi-turn-design.md §2.2) adds tool calls to :class:`ChatMessage` and a trajectory's
loss mask, messages and counters to :class:`Completion`. Every v2 field is optional and is left out of the
encoding while it holds its default, so a single-turn record is written as schema v1 byte for byte and an
old reader keeps reading it; :func:`uses_v2` tells the codec which version a record needs. The records that
hold these (``PromptTask``, ``Rollout``) are in :mod:`shared.records`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from shared.arrays import Float32Array, Int32Array, UInt8Array
from shared.columns import json_problem
from shared.finite import logprob_problem

MASKED_VERSION = -1  # token_versions where loss_mask is 0: context the policy did not sample


def _is_default(value: Any) -> bool:
    """Every v2 field defaults to None, False, or an empty tuple or dict."""
    return value is None or value is False or (isinstance(value, tuple | dict) and not value)


class SinceV2(BaseModel):
    """A model with fields added in schema v2 (``V2_FIELDS``): left out of every dump while at their default,
    so a record that uses none of them serializes exactly as schema v1 did."""

    V2_FIELDS: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_unused_v2(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            for name in self.V2_FIELDS:
                if _is_default(getattr(self, name)):
                    data.pop(name, None)
        return data


def uses_v2(value: Any) -> bool:
    """Whether ``value`` (a record, or anything inside one) sets a schema-v2 field anywhere."""
    if isinstance(value, BaseModel):
        if any(not _is_default(getattr(value, name)) for name in getattr(value, "V2_FIELDS", ())):
            return True
        return any(uses_v2(getattr(value, name)) for name in type(value).model_fields)
    if isinstance(value, tuple | list):
        return any(uses_v2(item) for item in value)
    return False


class ToolFunction(BaseModel):
    """The function a tool call names and its arguments (a JSON object)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)

    @field_validator("arguments")
    @classmethod
    def _arguments_are_json(cls, arguments: dict[str, Any]) -> dict[str, Any]:
        problem = json_problem(arguments)
        if problem:
            raise ValueError(f"tool call arguments hold {problem}; they must be a JSON object")
        return arguments


class ToolCall(BaseModel):
    """One tool call of an assistant turn, in TRL's (and OpenAI's) shape."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: ToolFunction


class ChatMessage(SinceV2):
    """One chat turn: role and text content; since v2, the tool calls of an assistant turn and the call a
    tool message answers."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    V2_FIELDS: ClassVar[tuple[str, ...]] = ("tool_calls", "tool_call_id", "name", "reasoning_content")

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: tuple[ToolCall, ...] | None = None  # an assistant turn that calls tools
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None  # a tool message: the tool that answered
    reasoning_content: str | None = None  # an assistant turn: what the parser split off as reasoning

    @model_validator(mode="after")
    def _fields_fit_the_role(self) -> ChatMessage:
        if self.role != "assistant":
            for name in ("tool_calls", "reasoning_content"):
                if getattr(self, name) is not None:
                    raise ValueError(f"only an assistant message has {name}, not one with role {self.role}")
        if self.role != "tool":
            for name in ("tool_call_id", "name"):
                if getattr(self, name) is not None:
                    raise ValueError(f"only a tool message has {name}, not one with role {self.role}")
        return self


Cut = Literal["max_turns", "token_budget", "context", "template_break"]


def _no_latencies() -> np.ndarray:
    empty = np.zeros(0, dtype=np.float32)
    empty.flags.writeable = False
    return empty


class TrajectoryInfo(BaseModel):
    """How a multi-turn trajectory went: its turns, tool calls and errors, the environment's reward, and why
    it was cut (None: it ended as the environment and the model said)."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True, allow_inf_nan=False)

    turns: int = Field(ge=1)
    tool_calls: int = Field(0, ge=0)
    tool_errors: int = Field(0, ge=0)
    env_reward: float | None = None
    cut: Cut | None = None
    env_latency_s: Float32Array = Field(default_factory=_no_latencies)  # [calls] one per environment call

    @model_validator(mode="after")
    def _counts_agree(self) -> TrajectoryInfo:
        if self.tool_errors > self.tool_calls:
            raise ValueError(f"tool_errors ({self.tool_errors}) exceeds tool_calls ({self.tool_calls})")
        if not (np.all(np.isfinite(self.env_latency_s)) and np.all(self.env_latency_s >= 0)):
            raise ValueError("env_latency_s must be finite and not negative")
        return self


FinishReason = Literal["stop", "length"]


class Completion(SinceV2):
    """One sampled completion: token ids as sampled (never re-tokenized), their behaviour logprobs.

    A multi-turn trajectory (v2) also holds the tokens the environment and the template put between turns:
    ``loss_mask`` is 1 exactly on sampled tokens; elsewhere ``behaviour_logprobs`` is 0 and ``token_versions``
    is -1. ``text`` (decoded with special tokens kept) is for logs; rewards read ``messages``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)
    V2_FIELDS: ClassVar[tuple[str, ...]] = ("loss_mask", "messages", "prompt_token_ids", "prompt", "trajectory")

    text: str
    token_ids: Int32Array  # [N]
    behaviour_logprobs: Float32Array  # [N]
    finish_reason: FinishReason
    # Policy version that sampled each token, where the engine reports it (a weight update can land while a
    # completion is being generated); None when only the start version is known. [N]
    token_versions: Int32Array | None = None
    loss_mask: UInt8Array | None = None  # [N] 1 on sampled tokens; None: every token sampled (single-turn)
    messages: tuple[ChatMessage, ...] = ()  # the conversation after the prompt (assistant, tool, ...)
    prompt_token_ids: Int32Array | None = None  # this sample's prompt where it differs from the rollout's
    prompt: tuple[ChatMessage, ...] | None = None  # its prompt messages where reset() added an observation
    trajectory: TrajectoryInfo | None = None

    @model_validator(mode="after")
    def _lengths_agree(self) -> Completion:
        n = len(self.token_ids)
        for name in ("behaviour_logprobs", "token_versions", "loss_mask"):
            array = getattr(self, name)
            if array is not None and len(array) != n:
                raise ValueError(f"{name} has {len(array)} entries but token_ids has {n}")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt, where given, must not be empty")
        if self.prompt_token_ids is not None and not len(self.prompt_token_ids):
            raise ValueError("prompt_token_ids, where given, must not be empty")
        if self.loss_mask is not None:
            _check_mask(self, self.loss_mask)
        if problem := logprob_problem(self.behaviour_logprobs):
            raise ValueError(problem)
        return self


def _check_mask(completion: Completion, mask: np.ndarray) -> None:
    """I3: the mask marks sampled tokens; context tokens carry logprob 0 and version -1; the last is sampled."""
    versions = completion.token_versions
    if completion.trajectory is None:
        raise ValueError("a completion with a loss_mask needs its trajectory (TrajectoryInfo)")
    if not np.all(mask <= 1):
        raise ValueError("loss_mask must hold only 0 (context) and 1 (sampled)")
    if len(mask) and mask[-1] != 1:
        raise ValueError("a trajectory's last token must be sampled (loss_mask[-1] == 1)")
    context = mask == 0
    if np.any(completion.behaviour_logprobs[context] != 0.0):
        raise ValueError("behaviour_logprobs must be 0.0 where loss_mask is 0 (tokens the policy did not sample)")
    if versions is None:
        raise ValueError("a completion with a loss_mask needs token_versions (-1 where loss_mask is 0)")
    if np.any(versions[context] != MASKED_VERSION):
        raise ValueError(f"token_versions must be {MASKED_VERSION} where loss_mask is 0")
    if np.any(versions[~context] < 0):
        raise ValueError("token_versions must be >= 0 where loss_mask is 1 (the version that sampled it)")
