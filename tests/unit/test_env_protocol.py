"""The environment protocol ``asyncgrpo.env/v1``: the committed JSON Schema matches the models, every body
round-trips through JSON, and the models refuse what the protocol forbids (extra fields, each validator's case)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel, ValidationError

from environments.protocol import (
    MESSAGES,
    PROTOCOL,
    SCHEMA_PATH,
    CreateSession,
    CreateSessionResponse,
    Error,
    Health,
    RewardResponse,
    Step,
    StepResponse,
    ToolCallIn,
    ToolResult,
    ToolSchema,
    json_schema,
    schema_text,
)
from shared.trajectory import ChatMessage, ToolCall, ToolFunction

ADD_TOOL = {  # what transformers.utils.get_json_schema writes for `def add(a: int, b: int) -> int`
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "description": "first"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
        "return": {"type": "integer"},
    },
}
CALL = {"id": "call_0", "name": "add", "arguments": {"a": 2, "b": 3}}
RESULT = {"tool_call_id": "call_0", "name": "add", "content": "5", "error": False}

BODIES: dict[type[BaseModel], dict[str, Any]] = {
    Health: {"status": "ok", "protocol": PROTOCOL},
    CreateSession: {"protocol": PROTOCOL, "session_key": "task-1/0", "row": {"prompt": "2+3?", "answer": 5}},
    CreateSessionResponse: {"session_id": "s1", "observation": "Ready.", "tools": [ADD_TOOL]},
    Step: {"protocol": PROTOCOL, "step": 0, "tool_calls": [CALL]},
    StepResponse: {"results": [RESULT], "done": True, "reward": 1.0},
    RewardResponse: {"reward": None},
    Error: {"detail": "no such session"},
}


def _validator(definition: str) -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA_PATH.read_text())
    return jsonschema.Draft202012Validator({**schema, "oneOf": [{"$ref": f"#/$defs/{definition}"}]})


def test_committed_schema_is_the_models_schema():
    assert SCHEMA_PATH.read_text() == schema_text(), "regenerate: python -m environments.protocol"
    jsonschema.Draft202012Validator.check_schema(json_schema())


def test_every_object_in_the_schema_refuses_extra_properties():
    defs = json_schema()["$defs"]
    expected = {"ToolSchema", "ToolCallIn", "ToolResult", "ToolFunctionSchema"} | {m.__name__ for m in MESSAGES}
    assert set(defs) == expected
    assert all(d["additionalProperties"] is False for d in defs.values())


@pytest.mark.parametrize("model", list(BODIES), ids=lambda m: m.__name__)
def test_each_body_round_trips_and_validates_against_the_schema(model):
    body = BODIES[model]
    parsed = model.model_validate_json(json.dumps(body))
    assert parsed.model_dump(mode="json") == body
    _validator(model.__name__).validate(body)


@pytest.mark.parametrize("model", list(BODIES), ids=lambda m: m.__name__)
def test_extra_fields_are_refused_by_the_models_and_the_schema(model):
    body = {**BODIES[model], "surprise": 1}
    with pytest.raises(ValidationError, match="surprise"):
        model.model_validate(body)
    with pytest.raises(jsonschema.ValidationError):
        _validator(model.__name__).validate(body)


@pytest.mark.parametrize(
    ("where", "body"),
    [
        ("tool", {**ADD_TOOL, "extra": 1}),
        ("function", {**ADD_TOOL, "function": {**ADD_TOOL["function"], "strict": True}}),
        ("call", {**CALL, "type": "function"}),
        ("result", {**RESULT, "is_error": True}),
    ],
)
def test_extra_fields_in_nested_objects_are_refused(where, body):
    if where in ("tool", "function"):
        outer: dict[str, Any] = {"session_id": "s1", "observation": None, "tools": [body]}
        model: type[BaseModel] = CreateSessionResponse
    elif where == "call":
        outer, model = {"protocol": PROTOCOL, "step": 0, "tool_calls": [body]}, Step
    else:
        outer, model = {"results": [body], "done": False, "reward": None}, StepResponse
    with pytest.raises(ValidationError):
        model.model_validate(outer)
    with pytest.raises(jsonschema.ValidationError):
        _validator(model.__name__).validate(outer)


def test_a_tool_schema_without_return_and_a_null_observation_are_accepted():
    function = {k: v for k, v in ADD_TOOL["function"].items() if k != "return"}
    response = CreateSessionResponse.model_validate({"session_id": "s", "observation": None, "tools": []})
    assert response.observation is None
    assert ToolSchema.model_validate({"type": "function", "function": function}).function.returns is None


def _refused(model: type[BaseModel], body: dict[str, Any], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        model.model_validate(body)


@pytest.mark.parametrize(
    ("model", "change", "match"),
    [
        (Health, {"status": "degraded"}, "status"),
        (Health, {"protocol": "asyncgrpo.env/v2"}, "protocol"),
        (CreateSession, {"protocol": "asyncgrpo.reward/v1"}, "protocol"),
        (CreateSession, {"session_key": ""}, "session_key"),
        (CreateSession, {"row": {"answer": 5}}, "prompt"),
        (CreateSession, {"row": {"prompt": "x", "weight": float("nan")}}, "JSON"),
        (CreateSessionResponse, {"session_id": ""}, "session_id"),
        (CreateSessionResponse, {"tools": [ADD_TOOL, ADD_TOOL]}, "repeated: add"),
        (CreateSessionResponse, {"observation": 3}, "observation"),
        (Step, {"step": -1}, "step"),
        (Step, {"tool_calls": []}, "tool_calls"),
        (Step, {"tool_calls": [CALL, CALL]}, "unique"),
        (Step, {"tool_calls": [{**CALL, "arguments": [1, 2]}]}, "arguments"),
        (Step, {"tool_calls": [{**CALL, "arguments": {"x": float("inf")}}]}, "JSON"),
        (Step, {"tool_calls": [{**CALL, "name": "add numbers"}]}, "name"),
        (Step, {"tool_calls": [{**CALL, "id": ""}]}, "id"),
        (StepResponse, {"reward": "1"}, "reward"),
        (StepResponse, {"reward": float("nan")}, "reward"),
        (StepResponse, {"reward": True}, "reward"),
        (StepResponse, {"results": [{**RESULT, "content": None}]}, "content"),
        (RewardResponse, {"reward": float("inf")}, "reward"),
    ],
)
def test_each_validator_refuses_its_bad_case(model, change, match):
    _refused(model, {**BODIES[model], **change}, match)


@pytest.mark.parametrize(
    ("function", "match"),
    [
        ({"parameters": {"type": "array"}}, "type 'object'"),
        ({"parameters": {"type": "object", "default": float("nan")}}, "JSON"),
        ({"return": {"type": "number", "maximum": float("inf")}}, "JSON"),
        ({"name": ""}, "name"),
        ({"name": "x" * 65}, "name"),
    ],
)
def test_tool_schema_validators_refuse_their_bad_case(function, match):
    tool = {**ADD_TOOL, "function": {**ADD_TOOL["function"], **function}}
    _refused(ToolSchema, tool, match)


def test_the_step_response_must_answer_the_calls_in_order():
    second = {**CALL, "id": "call_1"}
    step = Step.model_validate({"protocol": PROTOCOL, "step": 1, "tool_calls": [CALL, second]})
    results = [RESULT, {**RESULT, "tool_call_id": "call_1"}]
    answer = StepResponse.model_validate({"results": results, "done": False, "reward": None})
    answer.check_answers(step)
    swapped = StepResponse.model_validate({**answer.model_dump(), "results": answer.results[::-1]})
    with pytest.raises(ValueError, match="in order"):
        swapped.check_answers(step)
    with pytest.raises(ValueError, match="in order"):
        StepResponse.model_validate({**answer.model_dump(), "results": [RESULT]}).check_answers(step)


def test_calls_and_results_convert_to_the_trajectory_records():
    call = ToolCall(id="call_0", function=ToolFunction(name="add", arguments={"a": 2, "b": 3}))
    assert ToolCallIn.from_tool_call(call) == ToolCallIn.model_validate(CALL)
    assert ToolCallIn.from_tool_call(call).to_tool_call() == call
    message = ToolResult.model_validate(RESULT).to_message()
    assert message == ChatMessage(role="tool", content="5", tool_call_id="call_0", name="add")


def test_the_models_are_frozen():
    with pytest.raises(ValidationError):
        Health.model_validate(BODIES[Health]).status = "ok"  # type: ignore[misc]


def test_the_protocol_imports_neither_torch_nor_vllm_nor_a_service():
    code = (
        "import sys, environments.protocol; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert 'vllm' not in sys.modules, 'vllm imported'; "
        "assert not [m for m in sys.modules if m.startswith('services')], 'a service imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
