"""The HTTP reward-plugin protocol ``asyncgrpo.reward/v1`` and ``/v2``: one request per group, one reward per item.

Scorer -> plugin: ``POST <url>`` with a :class:`RewardRequest` (v1) or :class:`RewardRequestV2`; plugin ->
scorer: a :class:`RewardResponse` (the same for both). The scorer builds the request (``services/scorer``),
the example plugin and ``--function`` plugins (``services/reward_plugin``) read it. The JSON Schema of each
version, generated from these models by :func:`json_schema`, is committed as ``shared/schemas/reward_v1.json``
and ``reward_v2.json`` (a test keeps them equal) and served by the example plugin at ``GET /schema`` and
``GET /schema/v2``, so a plugin in any language can validate against it.

v2 carries a multi-turn tool-use group (docs/concepts/multi-turn-design.md §2.9): its messages gain ``tool_calls``,
``tool_call_id``, ``name`` and ``reasoning_content`` (each left out where unset), and each item gains
``env_reward``. The scorer sends v2 only for such groups, so a v1 plugin keeps getting exactly what it got
before for every single-turn group; v1 is frozen.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from shared.columns import RESERVED_COLUMNS, json_problem
from shared.config.locations import import_named_module, search_dirs

PROTOCOL = "asyncgrpo.reward/v1"
PROTOCOL_V2 = "asyncgrpo.reward/v2"
SCHEMA_PATH = Path(__file__).parent / "schemas" / "reward_v1.json"
SCHEMA_V2_PATH = Path(__file__).parent / "schemas" / "reward_v2.json"
# v1 is frozen: its columns may take any name but these (env_reward became an argument in v2).
V1_RESERVED_COLUMNS = ("prompts", "completions", "completion_ids")
MAX_ITEMS = 4096  # a group is G completions; no sane G comes near this

# A JSON number, nothing else: not "1" (lax pydantic would read it), not true, not NaN or Infinity.
Reward = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class Message(BaseModel):
    """One chat turn, as the scorer sends it (the same fields as the dataset's chat messages)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str


NonEmptyMessages = Annotated[list[Message], Field(min_length=1)]  # a reward reads the last message
TokenId = Annotated[int, Field(ge=0, lt=2**31)]  # vocabulary ids travel as int32


class RewardItem(BaseModel):
    """One completion to judge, with what TRL would pass a reward function for it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt: str | NonEmptyMessages = Field(
        description="The prompt: a string for a text prompt, else the chat messages (system, user, ...)."
    )
    completion: str | NonEmptyMessages = Field(
        description="A string for a text prompt; for a chat prompt one assistant message whose content is "
        "the task's assistant prefill (if any) followed by the sampled text."
    )
    completion_ids: list[TokenId] = Field(description="The sampled token ids (the prefill is not included).")
    columns: dict[str, Any] = Field(
        description="The dataset row's other columns (e.g. answer), plus max_completion_length (an int); never "
        "one named after a reward-function argument.",
        json_schema_extra={"propertyNames": {"not": {"enum": list(V1_RESERVED_COLUMNS)}}},
    )

    @field_validator("columns")
    @classmethod
    def _plain_columns(cls, columns: dict[str, Any]) -> dict[str, Any]:
        return plain_columns(columns, V1_RESERVED_COLUMNS)


def plain_columns(columns: dict[str, Any], reserved_names: tuple[str, ...]) -> dict[str, Any]:
    """``columns`` when no column takes a reward-function argument's name (a plugin would pass it instead of
    the real argument) and every value is plain JSON (finite numbers, string keys); else ValueError."""
    reserved = sorted(set(columns) & set(reserved_names))
    if reserved:
        raise ValueError(f"column {', '.join(reserved)} has the name of a reward-function argument")
    for name, value in columns.items():
        problem = json_problem(value)
        if problem:
            raise ValueError(f"column {name!r} holds {problem}, which JSON cannot carry")
    return columns


class RewardRequest(BaseModel):
    """Scorer -> plugin: every completion of one group, in order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    protocol: Literal["asyncgrpo.reward/v1"] = Field(description="The protocol version.")
    items: list[RewardItem] = Field(min_length=1, max_length=MAX_ITEMS)


class _LeavesOutNone(BaseModel):
    """A v2 model whose optional fields are left out of the JSON while unset (not sent as ``null``)."""

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        return {key: value for key, value in data.items() if value is not None} if isinstance(data, dict) else data


class ToolCallFunction(BaseModel):
    """The function a tool call names, and its arguments (a JSON object, parsed)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(description="The call's arguments, a JSON object (not a JSON string).")


class ToolCall(_LeavesOutNone):
    """One tool call of an assistant turn, in TRL's shape plus the ``id`` its tool message answers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str | None = Field(None, description="The call's id; the tool message answering it has it as tool_call_id.")
    type: Literal["function"]
    function: ToolCallFunction


class MessageV2(_LeavesOutNone):
    """One chat turn of a tool-use conversation: v1's role and content, and where set (left out otherwise) an
    assistant turn's tool_calls and reasoning_content, a tool message's tool_call_id and name."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant turn's tool calls.")
    tool_call_id: str | None = Field(None, description="A tool message: the id of the call it answers.")
    name: str | None = Field(None, description="A tool message: the tool that answered.")
    reasoning_content: str | None = Field(None, description="An assistant turn: the reasoning split off its text.")

    @model_validator(mode="after")
    def _fields_fit_the_role(self) -> MessageV2:
        allowed = {"assistant": ("tool_calls", "reasoning_content"), "tool": ("tool_call_id", "name")}
        for field in ("tool_calls", "reasoning_content", "tool_call_id", "name"):
            if getattr(self, field) is not None and field not in allowed.get(self.role, ()):
                raise ValueError(f"a message with role {self.role} has no {field}")
        return self


NonEmptyMessagesV2 = Annotated[list[MessageV2], Field(min_length=1)]


class RewardItemV2(BaseModel):
    """One trajectory to judge, as TRL passes a tool-use completion to a reward function."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt: str | NonEmptyMessagesV2 = Field(
        description="This sample's prompt messages (with the environment's reset observation, if any)."
    )
    completion: NonEmptyMessagesV2 = Field(
        description="The conversation after the prompt: assistant turns (with tool_calls), tool messages, ..., "
        "and the final assistant turn."
    )
    completion_ids: list[TokenId] = Field(
        description="Every token after the prompt: sampled turns, tool results and template tokens."
    )
    env_reward: Reward | None = Field(description="The environment's reward (its get_reward), null if none.")
    columns: dict[str, Any] = Field(
        description="The dataset row's other columns (e.g. answer), plus max_completion_length (an int); never "
        "one named after a reward-function argument.",
        json_schema_extra={"propertyNames": {"not": {"enum": list(RESERVED_COLUMNS)}}},
    )

    @field_validator("columns")
    @classmethod
    def _plain_columns(cls, columns: dict[str, Any]) -> dict[str, Any]:
        return plain_columns(columns, RESERVED_COLUMNS)


class RewardRequestV2(BaseModel):
    """Scorer -> plugin: every trajectory of one tool-use group, in order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    protocol: Literal["asyncgrpo.reward/v2"] = Field(description="The protocol version.")
    items: list[RewardItemV2] = Field(min_length=1, max_length=MAX_ITEMS)


# What a plugin accepts: either version, told apart by ``protocol``.
AnyRewardRequest = Annotated[RewardRequest | RewardRequestV2, Field(discriminator="protocol")]


class RewardResponse(BaseModel):
    """Plugin -> scorer: one reward per item, in order; ``null`` means "cannot judge" (NaN, not a failure)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rewards: list[Reward | None] = Field(description="One finite number or null per item, in order.")
    extra: dict[str, Any] = Field(
        default_factory=dict, description="Optional, free-form; the scorer accepts and ignores it."
    )


def json_schema(version: int = 1) -> dict[str, Any]:
    """Protocol ``version``'s JSON Schema (draft 2020-12): request and response under ``$defs``."""
    request_model = {1: RewardRequest, 2: RewardRequestV2}[version]
    request = request_model.model_json_schema(ref_template="#/$defs/{model}")
    response = RewardResponse.model_json_schema(ref_template="#/$defs/{model}")
    defs = {**request.pop("$defs", {}), **response.pop("$defs", {})}
    defs[request_model.__name__] = request
    defs["RewardResponse"] = response
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://asyncgrpo.dev/schemas/reward_v{version}.json",
        "title": {1: PROTOCOL, 2: PROTOCOL_V2}[version],
        "description": f"Scorer -> plugin: POST a {request_model.__name__}; plugin -> scorer: HTTP 200 with a "
        "RewardResponse.",
        "oneOf": [{"$ref": f"#/$defs/{request_model.__name__}"}, {"$ref": "#/$defs/RewardResponse"}],
        "$defs": dict(sorted(defs.items())),
    }


def schema_text(version: int = 1) -> str:
    """:func:`json_schema` as the committed file's text."""
    return json.dumps(json_schema(version), indent=2, sort_keys=False) + "\n"


if __name__ == "__main__":  # python -m shared.reward_protocol: rewrite the committed schemas
    for number, path in ((1, SCHEMA_PATH), (2, SCHEMA_V2_PATH)):
        path.write_text(schema_text(number))
        print(f"wrote {path}")


def load_reward_function(path: str) -> Callable[..., Any]:
    """Import a reward function named ``module:function``; ValueError naming what is wrong when it cannot.
    The scorer's Python rewards and ``python -m services.reward_plugin --function`` both load theirs this way."""
    return load_callable(path, "reward function")


def load_callable(path: str, what: str) -> Callable[..., Any]:
    """Import the callable ``module:name`` (a reward function, an environment class, a tool) for ``what``;
    ValueError naming what is wrong when it cannot.

    The module is looked up by the configuration's one rule (:mod:`shared.config.locations`): beside the
    configuration file (``$ASYNCGRPO_CONFIG``), then in the working directory, then on ``sys.path``: a
    ``my_rewards.py`` next to the user's config imports wherever the services run."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"a {what} is named 'module:name' ('module:function', 'module:Class'), got {path!r}")
    try:
        module = import_named_module(module_name, search_dirs())
    except ImportError as exc:
        raise ValueError(
            f"cannot import {what} module {module_name!r}: {exc}; put it beside the configuration file or on PYTHONPATH"
        ) from exc
    found = getattr(module, attribute, None)
    if not callable(found):
        raise ValueError(f"{module_name!r} has no callable {attribute!r}")
    return found
