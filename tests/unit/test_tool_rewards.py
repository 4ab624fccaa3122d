"""The scorer on multi-turn tool-use groups (docs/concepts/multi-turn-design.md §2.9): reward functions get TRL's
tool-use shape and the ``env_reward`` column; the ``env_reward`` built-in; HTTP plugins get protocol v2 for
tool-use groups only, while a single-turn group's v1 request stays byte for byte what it was before v2."""

from __future__ import annotations

import json
import math

import httpx
import jsonschema
import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from pydantic import ValidationError

from services.reward_plugin.app import build_app
from services.scorer.rewards.builtin import BUILTINS, correctness
from services.scorer.rewards.functions import RewardFailure, run_function, score_batch
from services.scorer.rewards.http_plugin import HttpRewardPlugin, request_body
from services.scorer.rewards.trl_convention import trl_style
from services.scorer.scoring import reward_batch, scored_group
from shared.columns import ENV_REWARD_COLUMN, column_problem
from shared.records import AdvantageSpec, ChatMessage, Completion, Rollout
from shared.reward_protocol import (
    PROTOCOL,
    PROTOCOL_V2,
    SCHEMA_PATH,
    SCHEMA_V2_PATH,
    MessageV2,
    RewardRequest,
    RewardRequestV2,
    schema_text,
)
from shared.trajectory import ToolCall, ToolFunction, TrajectoryInfo
from tests.support.factories import make_rollout, make_task, make_trajectory_completion

# The v1 requests of two single-turn groups (G = 2, 3 tokens each; a chat prompt with an assistant prefill,
# and a text prompt), encoded by the scorer before protocol v2 existed (commit adad9f1): a v1 plugin must
# keep receiving exactly these bytes.
V1_CHAT_GOLDEN = (
    b'{"protocol":"asyncgrpo.reward/v1","items":[{"prompt":[{"role":"user","content":"2+3?"},{"role":"assistant",'
    b'"content":"<think>"}],"completion":[{"role":"assistant","content":"<think><answer>0</answer>"}],'
    b'"completion_ids":[42531,31848,25556],"columns":{"answer":"5","max_completion_length":32}},{"prompt":[{"role":'
    b'"user","content":"2+3?"},{"role":"assistant","content":"<think>"}],"completion":[{"role":"assistant",'
    b'"content":"<think><answer>1</answer>"}],"completion_ids":[3762,826,8763],"columns":{"answer":"5",'
    b'"max_completion_length":32}}]}'
)
V1_TEXT_GOLDEN = (
    b'{"protocol":"asyncgrpo.reward/v1","items":[{"prompt":"What is 2+3?","completion":"<answer>0</answer>",'
    b'"completion_ids":[42531,31848,25556],"columns":{"answer":"5","max_completion_length":32}},{"prompt":'
    b'"What is 2+3?","completion":"<answer>1</answer>","completion_ids":[3762,826,8763],"columns":{"answer":'
    b'"5","max_completion_length":32}}]}'
)
PREFILLED = (ChatMessage(role="user", content="2+3?"), ChatMessage(role="assistant", content="<think>"))


def _trajectory(answer: str, *, env_reward: float | None = 1.0, **overrides) -> Completion:
    """A two-turn trajectory: call add(2, 3), the tool answers 5, then ``<answer>{answer}</answer>``."""
    call = ToolCall(id="call-0", function=ToolFunction(name="add", arguments={"a": 2, "b": 3}))
    messages = (
        ChatMessage(role="assistant", content="", tool_calls=(call,), reasoning_content="2+3 needs the tool"),
        ChatMessage(role="tool", content="5", tool_call_id="call-0", name="add"),
        ChatMessage(role="assistant", content=f"<answer>{answer}</answer>"),
    )
    info = TrajectoryInfo(turns=2, tool_calls=1, env_reward=env_reward)
    return make_trajectory_completion(messages=messages, trajectory=info, **overrides)


def _tool_group(*completions: Completion) -> Rollout:
    task = make_task(group_size=len(completions), policy_version=3)
    return make_rollout(task, completions=completions, finished_policy_version=4)


def uses_the_tool_result(prompts, completions, completion_ids, **kwargs):
    """A reward written as for TRL's tool use: 1 when the final answer is the last tool result."""
    rewards = []
    for completion in completions:
        results = [message["content"] for message in completion if message["role"] == "tool"]
        final = completion[-1]["content"]
        rewards.append(1.0 if results and final == f"<answer>{results[-1]}</answer>" else 0.0)
    return rewards


def test_reward_functions_get_trls_tool_use_shape():
    rollout = _tool_group(_trajectory("5"), _trajectory("6"))
    batch = reward_batch(rollout)
    assert batch.multi_turn
    assert batch.completions[0] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call-0", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
            ],
            "reasoning_content": "2+3 needs the tool",
        },
        {"role": "tool", "content": "5", "tool_call_id": "call-0", "name": "add"},  # None fields left out
        {"role": "assistant", "content": "<answer>5</answer>"},
    ]
    task_prompt = [{"role": "system", "content": "Answer."}, {"role": "user", "content": "What is 2+3?"}]
    assert batch.prompts == [task_prompt, task_prompt]
    # Every token after the prompt, the tool result's (loss_mask 0) included.
    assert batch.completion_ids == [c.token_ids.tolist() for c in rollout.completions]
    assert len(batch.completion_ids[0]) == 7 and batch.completion_ids[0][3:5] == [20, 21]
    assert batch.columns == {"answer": ["5", "5"], "max_completion_length": [32, 32], "env_reward": [1.0, 1.0]}


async def test_a_trl_style_tool_reward_and_the_built_ins_read_the_conversation():
    batch = reward_batch(_tool_group(_trajectory("5"), _trajectory("6"), _trajectory("5", env_reward=None)))
    functions = [
        trl_style("tool", uses_the_tool_result, in_thread=False),
        trl_style("correctness", correctness, in_thread=False),  # reads the final assistant turn
    ]
    assert (await score_batch(functions, batch)).tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]


def test_group_lengths_count_sampled_tokens_only():
    """completions/*_length and REINFORCE++'s token weights count what the policy sampled, not tool results."""
    short = _trajectory("5")  # 7 tokens, 5 sampled
    longer = _trajectory(
        "6",
        token_ids=np.arange(9, dtype=np.int32),
        behaviour_logprobs=np.array([-1, -1, 0, 0, 0, 0, -1, -1, -1], np.float32),
        token_versions=np.array([3, 3, -1, -1, -1, -1, 4, 4, 4], np.int32),
        loss_mask=np.array([1, 1, 0, 0, 0, 0, 1, 1, 1], np.uint8),
    )  # 9 tokens, 5 sampled
    rollout = _tool_group(short, longer)
    per_func = np.array([[1.0], [0.0]], dtype=np.float32)
    group = scored_group(rollout, ["r"], [1.0], per_func, AdvantageSpec(estimator="reinforce_pp"), drop_zero_std=False)
    assert group.metrics["completions/mean_length"] == 5.0 and group.metrics["completions/max_length"] == 5.0
    equal_weights = scored_group(
        _tool_group(short, short), ["r"], [1.0], per_func, group.advantage_spec, drop_zero_std=False
    )
    assert group.advantages.tolist() == equal_weights.advantages.tolist()  # 9 tokens weigh as 7: both sample 5


def test_a_per_sample_prompt_is_that_samples_prompt():
    observed = (ChatMessage(role="user", content="What is 2+3? The calculator is ready."),)
    batch = reward_batch(_tool_group(_trajectory("5"), _trajectory("5", prompt=observed)))
    assert batch.prompts[0][-1] == {"role": "user", "content": "What is 2+3?"}
    assert batch.prompts[1] == [{"role": "user", "content": "What is 2+3? The calculator is ready."}]


async def test_env_reward_is_a_column_and_a_built_in_with_nan_where_none():
    batch = reward_batch(
        _tool_group(_trajectory("5"), _trajectory("5", env_reward=None), _trajectory("5", env_reward=-0.5))
    )
    seen = {}

    def explicit(prompts, completions, env_reward, **kwargs):  # a TRL reward naming the column
        seen["env_reward"] = env_reward
        return [0.0] * len(completions)

    functions = [
        trl_style("env_reward", BUILTINS["env_reward"](), in_thread=False),
        trl_style("x", explicit, in_thread=False),
    ]
    values = (await score_batch(functions, batch))[:, 0]
    assert values[0] == 1.0 and math.isnan(values[1]) and values[2] == -0.5
    assert seen["env_reward"] == [1.0, None, -0.5]


async def test_env_reward_without_an_environment_is_a_bug_naming_the_fix():
    single_turn = reward_batch(make_rollout(make_task(group_size=2)))
    assert not single_turn.multi_turn and ENV_REWARD_COLUMN not in single_turn.columns  # unchanged
    function = trl_style("env_reward", BUILTINS["env_reward"](), in_thread=False)
    failure = await run_function(function, single_turn)
    assert isinstance(failure, RewardFailure) and failure.bug
    assert "configure an [environment]" in failure.detail


def test_no_dataset_column_can_shadow_env_reward():
    assert "rename it with data.rename_columns" in (column_problem(ENV_REWARD_COLUMN, 1.0) or "")
    with pytest.raises(ValidationError, match="column env_reward has the name of a reward-function argument"):
        make_task(columns={"answer": "5", ENV_REWARD_COLUMN: 1.0})


def test_single_turn_requests_are_v1_byte_for_byte():
    chat = make_rollout(make_task(group_size=2, prompt=PREFILLED), tokens=3)
    text = make_rollout(make_task(group_size=2, prompt="What is 2+3?"), tokens=3)
    assert request_body(reward_batch(chat)) == V1_CHAT_GOLDEN
    assert request_body(reward_batch(text)) == V1_TEXT_GOLDEN


def test_tool_groups_are_v2_valid_against_the_committed_schema():
    body = request_body(reward_batch(_tool_group(_trajectory("5"), _trajectory("6", env_reward=None))))
    request = json.loads(body)
    assert request["protocol"] == PROTOCOL_V2
    schema = json.loads(SCHEMA_V2_PATH.read_text())
    jsonschema.Draft202012Validator({**schema, "oneOf": [{"$ref": "#/$defs/RewardRequestV2"}]}).validate(request)
    RewardRequestV2.model_validate(request)
    first, second = request["items"]
    assert (first["env_reward"], second["env_reward"]) == (1.0, None)  # an item field, not a column
    assert first["columns"] == {"answer": "5", "max_completion_length": 32}
    assert first["completion"][1] == {"role": "tool", "content": "5", "tool_call_id": "call-0", "name": "add"}
    assert b":null" not in body.replace(b'"env_reward":null', b"")  # unset message fields are left out
    with pytest.raises(ValidationError):  # a v1 plugin refuses it (protocol and fields), as it should
        RewardRequest.model_validate(request)


def test_committed_v2_schema_is_the_models_schema_and_v1_is_unchanged():
    assert SCHEMA_V2_PATH.read_text() == schema_text(2), "regenerate: python -m shared.reward_protocol"
    assert SCHEMA_PATH.read_text() == schema_text(1), "regenerate: python -m shared.reward_protocol"
    v2 = json.loads(SCHEMA_V2_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(v2)
    assert v2["title"] == PROTOCOL_V2 and "env_reward" in v2["$defs"]["RewardItemV2"]["required"]
    v1_columns = json.loads(SCHEMA_PATH.read_text())["$defs"]["RewardItem"]["properties"]["columns"]
    assert "env_reward" not in v1_columns["propertyNames"]["not"]["enum"]  # v1 is frozen


def test_v2_messages_take_only_the_fields_of_their_role():
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    assert MessageV2(role="assistant", content="", tool_calls=[call]).model_dump(mode="json") == {
        "role": "assistant",
        "content": "",
        "tool_calls": [call],  # TRL's own shape, no id, is accepted
    }
    for bad in (
        {"role": "user", "content": "x", "tool_calls": [call]},
        {"role": "assistant", "content": "x", "tool_call_id": "c"},
        {"role": "tool", "content": "x", "reasoning_content": "r"},
        {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {"name": "add", "arguments": "{}"}}]},
    ):
        with pytest.raises(ValidationError):
            MessageV2.model_validate(bad)


def _v1_only_plugin(received: list[bytes]) -> FastAPI:
    """A plugin written against v1 alone: it validates with v1's model and records the bytes it got."""
    app = FastAPI()

    @app.post("/score")
    async def score(request: Request):
        received.append(await request.body())
        body = RewardRequest.model_validate_json(received[-1])
        return {"rewards": [float(len(item.completion_ids)) for item in body.items]}

    return app


def _plugin(http: httpx.AsyncClient) -> HttpRewardPlugin:
    return HttpRewardPlugin("p", "http://plugin/score", http, timeout_s=5, retries=0, backoff_s=0.01)


async def test_a_v1_plugin_receives_exactly_the_v1_bytes_over_http():
    received: list[bytes] = []
    transport = httpx.ASGITransport(app=_v1_only_plugin(received))
    chat = make_rollout(make_task(group_size=2, prompt=PREFILLED), tokens=3)
    async with httpx.AsyncClient(transport=transport) as http:
        plugin = _plugin(http)
        assert await plugin.score(reward_batch(chat)) == [3.0, 3.0]
    assert received == [V1_CHAT_GOLDEN]


async def test_the_function_plugin_gets_a_tool_group_as_the_scorer_would_call_it_in_process():
    seen: list[dict] = []

    def recording(**kwargs):
        seen.append(kwargs)
        return uses_the_tool_result(**kwargs)

    batch = reward_batch(_tool_group(_trajectory("5"), _trajectory("6", env_reward=None)))
    transport = httpx.ASGITransport(app=build_app(recording, token=None))
    async with httpx.AsyncClient(transport=transport) as http:
        assert await _plugin(http).score(batch) == [1.0, 0.0]
    in_process = {"prompts": batch.prompts, "completions": batch.completions, "completion_ids": batch.completion_ids}
    assert seen == [{**in_process, **batch.columns}]


def test_the_plugin_app_takes_both_protocols_and_serves_both_schemas():
    client = TestClient(build_app(uses_the_tool_result, token=None))
    tool = json.loads(request_body(reward_batch(_tool_group(_trajectory("5"), _trajectory("6")))))
    single = json.loads(V1_CHAT_GOLDEN)
    assert client.post("/score", json=tool).json()["rewards"] == [1.0, 0.0]
    assert client.post("/score", json=single).json()["rewards"] == [0.0, 0.0]  # v1: no tool message to read
    assert client.post("/score", json={**tool, "protocol": PROTOCOL}).status_code == 422  # v1 has no tool fields
    assert client.get("/schema").json() == json.loads(SCHEMA_PATH.read_text())
    assert client.get("/schema/v2").json() == json.loads(SCHEMA_V2_PATH.read_text())
