"""The HTTP environment protocol ``asyncgrpo.env/v1``: open a session on a dataset row, step it with tool calls.

Generator (``environments/client.py``) -> environment server (``environments/server.py``, or any server in any
language). Both halves import these models, so the bytes each side writes are checked by the same code. The
JSON Schema of every body, generated from these models by :func:`json_schema`, is committed as
``shared/schemas/env_v1.json`` (a test keeps the two equal) and served at ``GET /schema``.

``Authorization: Bearer`` goes on every path except ``/health``::

    GET    /health               -> 200 Health
    GET    /schema               -> 200 the JSON Schema
    POST   /sessions             CreateSession -> 201 CreateSessionResponse
    POST   /sessions/{id}/step   Step -> 200 StepResponse
    POST   /sessions/{id}/reward -> 200 RewardResponse          (the environment's get_reward; null: none)
    DELETE /sessions/{id}        -> 204; 404 counts as closed (idempotent)
    errors: 4xx/5xx Error; 408, 429 and 5xx are retryable (shared/resilience.py)

Exactly once under retries: a create whose ``session_key`` is already live closes the old session and opens a
fresh one; a step retried with the same ``step`` index is answered from the server's last response, never run
twice (stateful tools).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

import shared
from shared.columns import json_problem
from shared.trajectory import ChatMessage, ToolCall, ToolFunction

PROTOCOL = "asyncgrpo.env/v1"
SCHEMA_PATH = Path(shared.__file__).parent / "schemas" / "env_v1.json"
MAX_TOOL_CALLS = 256  # per assistant turn; no sane turn comes near this
MAX_TOOLS = 1024  # per environment

# A JSON number, nothing else: not "1" (lax pydantic would read it), not true, not NaN or Infinity.
Reward = Annotated[float, Field(strict=True, allow_inf_nan=False)]
# OpenAI's rule for function names, which every chat template's tool rendering can carry.
ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
NonEmpty = Annotated[str, Field(min_length=1)]
Protocol = Literal["asyncgrpo.env/v1"]

_FROZEN = ConfigDict(frozen=True, extra="forbid")


def _json_object(value: dict[str, Any], what: str) -> dict[str, Any]:
    problem = json_problem(value)
    if problem:
        raise ValueError(f"{what} hold {problem}; they must be a JSON object")
    return value


class Health(BaseModel):
    """Server -> anyone, ``GET /health``: the process is alive and speaks this protocol."""

    model_config = _FROZEN

    status: Literal["ok"]
    protocol: Protocol


class CreateSession(BaseModel):
    """Generator -> server, ``POST /sessions``: open a session on one dataset row (``reset(**row)``)."""

    model_config = _FROZEN

    protocol: Protocol = Field(description="The protocol version.")
    session_key: str = Field(
        min_length=1,
        max_length=512,
        description="'<task_id>/<sample>': a create whose key is already live closes that session and opens a "
        "fresh one, so a retried create leaves exactly one live session.",
    )
    row: dict[str, Any] = Field(description="The dataset row: 'prompt' plus the task's columns (plain JSON).")

    @field_validator("row")
    @classmethod
    def _row_has_a_prompt(cls, row: dict[str, Any]) -> dict[str, Any]:
        if "prompt" not in row:
            raise ValueError("row must hold the dataset row's 'prompt' (reset(**row) receives it)")
        return _json_object(row, "row's columns")


class ToolFunctionSchema(BaseModel):
    """A tool's name, description and JSON Schema of its arguments, as ``transformers``' ``get_json_schema``
    writes them (``return`` is there when the function annotates or documents its result)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True, serialize_by_alias=True)

    name: ToolName
    description: str
    parameters: dict[str, Any] = Field(description="A JSON Schema of type 'object' for the arguments.")
    returns: dict[str, Any] | None = Field(None, alias="return", description="A JSON Schema of the result.")

    @field_validator("parameters")
    @classmethod
    def _parameters_are_an_object(cls, parameters: dict[str, Any]) -> dict[str, Any]:
        if parameters.get("type") != "object":
            raise ValueError("parameters must be a JSON Schema with type 'object' (a tool takes keyword arguments)")
        return _json_object(parameters, "parameters")

    @field_validator("returns")
    @classmethod
    def _returns_is_json(cls, returns: dict[str, Any] | None) -> dict[str, Any] | None:
        return returns if returns is None else _json_object(returns, "return")


class ToolSchema(BaseModel):
    """One tool the model may call, in ``get_json_schema``'s (and TRL's) shape; the chat template renders it."""

    model_config = _FROZEN

    type: Literal["function"]
    function: ToolFunctionSchema


class CreateSessionResponse(BaseModel):
    """Server -> generator, ``201`` to :class:`CreateSession`: the session, its first observation and tools."""

    model_config = _FROZEN

    session_id: NonEmpty = Field(description="Names the session in every later path.")
    observation: str | None = Field(
        description="What reset() returned, appended to the last user message's content (TRL); null: nothing."
    )
    tools: list[ToolSchema] = Field(max_length=MAX_TOOLS, description="The tools, in the order the model sees them.")

    @field_validator("tools")
    @classmethod
    def _names_are_unique(cls, tools: list[ToolSchema]) -> list[ToolSchema]:
        names = [tool.function.name for tool in tools]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"tool names must be unique; repeated: {', '.join(repeated)}")
        return tools


class ToolCallIn(BaseModel):
    """One tool call of the assistant turn, as the environment receives it."""

    model_config = _FROZEN

    id: NonEmpty = Field(description="The call's id; its result answers with it as tool_call_id.")
    name: ToolName
    arguments: dict[str, Any] = Field(description="The keyword arguments, a JSON object.")

    @field_validator("arguments")
    @classmethod
    def _arguments_are_json(cls, arguments: dict[str, Any]) -> dict[str, Any]:
        return _json_object(arguments, "arguments")

    @classmethod
    def from_tool_call(cls, call: ToolCall) -> ToolCallIn:
        """The wire form of a parsed call of the trajectory's assistant message."""
        return cls(id=call.id, name=call.function.name, arguments=call.function.arguments)

    def to_tool_call(self) -> ToolCall:
        """The call as the trajectory's assistant message holds it."""
        return ToolCall(id=self.id, function=ToolFunction(name=self.name, arguments=self.arguments))


class Step(BaseModel):
    """Generator -> server, ``POST /sessions/{id}/step``: run one assistant turn's tool calls, in order."""

    model_config = _FROZEN

    protocol: Protocol = Field(description="The protocol version.")
    step: int = Field(
        ge=0, description="0 for the session's first step, then +1; a repeated index is answered, not re-run."
    )
    tool_calls: list[ToolCallIn] = Field(min_length=1, max_length=MAX_TOOL_CALLS)

    @field_validator("tool_calls")
    @classmethod
    def _ids_are_unique(cls, calls: list[ToolCallIn]) -> list[ToolCallIn]:
        ids = [call.id for call in calls]
        if len(set(ids)) != len(ids):
            raise ValueError("tool call ids must be unique within a step (each result names its call by id)")
        return calls


class ToolResult(BaseModel):
    """The answer to one tool call: its content, and whether the tool raised (the model sees the error)."""

    model_config = _FROZEN

    tool_call_id: NonEmpty
    name: ToolName
    content: str = Field(description='What the model reads; for an error, \'{"error": "<Type>: <message>"}\'.')
    error: bool = Field(description="The tool raised; counted in the trajectory's tool_errors.")

    def to_message(self) -> ChatMessage:
        """The tool message the conversation gains."""
        return ChatMessage(role="tool", content=self.content, tool_call_id=self.tool_call_id, name=self.name)


class StepResponse(BaseModel):
    """Server -> generator, ``200`` to :class:`Step`: one result per call in the step's order, and whether the
    environment has ended the trajectory (with its reward, if it gives one then)."""

    model_config = _FROZEN

    results: list[ToolResult] = Field(max_length=MAX_TOOL_CALLS)
    done: bool
    reward: Reward | None = Field(description="A finite number, or null: none (yet).")

    def check_answers(self, step: Step) -> None:
        """ValueError unless the results answer ``step``'s calls one for one, in order (id and name)."""
        asked = [(call.id, call.name) for call in step.tool_calls]
        answered = [(result.tool_call_id, result.name) for result in self.results]
        if answered != asked:
            raise ValueError(f"the step's results answer {answered}, not its calls {asked} in order")


class RewardResponse(BaseModel):
    """Server -> generator, ``200`` to ``POST /sessions/{id}/reward``: the environment's ``get_reward()``."""

    model_config = _FROZEN

    reward: Reward | None = Field(description="A finite number, or null: the environment gives none.")


class Error(BaseModel):
    """Server -> generator, any 4xx or 5xx: what went wrong, for the generator's log."""

    model_config = _FROZEN

    detail: str


MESSAGES: tuple[type[BaseModel], ...] = (
    Health,
    CreateSession,
    CreateSessionResponse,
    Step,
    StepResponse,
    RewardResponse,
    Error,
)


def json_schema() -> dict[str, Any]:
    """The protocol's JSON Schema (draft 2020-12): every body under ``$defs``, nested objects too."""
    defs: dict[str, Any] = {}
    for model in MESSAGES:
        schema = model.model_json_schema(ref_template="#/$defs/{model}")
        defs.update(schema.pop("$defs", {}))
        defs[model.__name__] = schema
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://asyncgrpo.dev/schemas/env_v1.json",
        "title": PROTOCOL,
        "description": "Generator -> environment server: POST /sessions a CreateSession (201 "
        "CreateSessionResponse), POST /sessions/{id}/step a Step (200 StepResponse), POST /sessions/{id}/reward "
        "(200 RewardResponse), DELETE /sessions/{id} (204; 404 counts as closed); GET /health (200 Health); "
        "errors are 4xx/5xx with an Error, and 408, 429 and 5xx are retryable.",
        "oneOf": [{"$ref": f"#/$defs/{model.__name__}"} for model in MESSAGES],
        "$defs": dict(sorted(defs.items())),
    }


def schema_text() -> str:
    """:func:`json_schema` as the committed file's text."""
    return json.dumps(json_schema(), indent=2, sort_keys=False) + "\n"


if __name__ == "__main__":  # python -m environments.protocol: rewrite the committed schema
    SCHEMA_PATH.write_text(schema_text())
    print(f"wrote {SCHEMA_PATH}")
