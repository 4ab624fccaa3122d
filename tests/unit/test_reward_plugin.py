"""The reward-plugin protocol: the committed JSON Schema matches the models, the scorer's real requests
(text and chat) validate against it, and the ``--function`` plugin app serves a TRL reward function."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import jsonschema
import pytest
from fastapi.testclient import TestClient

from services.reward_plugin.app import build_app, make_brevity, trl_arguments
from services.scorer.rewards.http_plugin import PROTOCOL, PluginCallError, _items, parse_answer
from services.scorer.scoring import reward_batch
from shared.records import ChatMessage
from shared.resilience import body_excerpt, transport_detail
from shared.reward_protocol import SCHEMA_PATH, RewardRequest, schema_text
from tests.support.factories import make_rollout, make_task
from tests.support.trl_doc_rewards import broken_reward, format_reward_func, reward_len


def _validator(definition: str) -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA_PATH.read_text())
    return jsonschema.Draft202012Validator({**schema, "oneOf": [{"$ref": f"#/$defs/{definition}"}]})


def _request(prompt) -> dict:
    """The body the scorer POSTs for one group, built by the scorer's own code."""
    rollout = make_rollout(make_task(group_size=2, prompt=prompt))
    return {"protocol": PROTOCOL, "items": _items(reward_batch(rollout))}


def test_committed_schema_is_the_models_schema():
    assert SCHEMA_PATH.read_text() == schema_text(), "regenerate: python -m shared.reward_protocol"
    jsonschema.Draft202012Validator.check_schema(json.loads(SCHEMA_PATH.read_text()))


def test_the_scorers_text_and_chat_requests_validate_against_the_schema():
    text = _request("What is 2+3?")
    chat = _request((ChatMessage(role="user", content="2+3?"), ChatMessage(role="assistant", content="<think>")))
    for body in (text, chat):
        _validator("RewardRequest").validate(body)
        RewardRequest.model_validate(body)
    assert text["items"][0]["prompt"] == "What is 2+3?" and isinstance(text["items"][0]["completion"], str)
    item = chat["items"][0]
    assert item["prompt"][-1] == {"role": "assistant", "content": "<think>"}
    assert item["completion"][0]["content"].startswith("<think><answer>")  # the prefill comes first
    assert item["columns"] == {"answer": "5", "max_completion_length": 32}
    bad = {**text, "items": [{**text["items"][0], "completion": 3}]}
    with pytest.raises(jsonschema.ValidationError):
        _validator("RewardRequest").validate(bad)


def test_response_schema_allows_null_and_optional_extra_and_rejects_other_fields():
    response = _validator("RewardResponse")
    response.validate({"rewards": [1.0, None]})
    response.validate({"rewards": [0.5], "extra": {"why": "short"}})
    for bad in ({"rewards": ["1"]}, {"scores": [1.0]}, {"rewards": [1.0], "debug": 1}):
        with pytest.raises(jsonschema.ValidationError):
            response.validate(bad)


def test_trl_arguments_fill_missing_columns_with_none():
    body = RewardRequest.model_validate(
        {
            "protocol": PROTOCOL,
            "items": [
                {"prompt": "p", "completion": "a", "completion_ids": [1], "columns": {"answer": "1"}},
                {"prompt": "p", "completion": "b", "completion_ids": [2], "columns": {}},
            ],
        }
    )
    kwargs = trl_arguments(list(body.items))
    assert kwargs == {
        "prompts": ["p", "p"],
        "completions": ["a", "b"],
        "completion_ids": [[1], [2]],
        "answer": ["1", None],
    }


def test_function_plugin_serves_trl_functions_schema_and_auth():
    chat = _request((ChatMessage(role="user", content="2+3?"),))
    client = TestClient(build_app(format_reward_func, name="format", token="s3cret"))
    assert client.get("/health").json() == {"status": "ok", "reward": "format"}
    assert client.get("/schema").json() == json.loads(SCHEMA_PATH.read_text())
    assert client.post("/score", json=chat).status_code == 401
    reply = client.post("/score", json=chat, headers={"Authorization": "Bearer s3cret"})
    assert reply.status_code == 200 and reply.json() == {"rewards": [0.0, 0.0], "extra": {"reward": "format"}}
    text = _request("What is 2+3?")

    def open_plugin(function) -> TestClient:  # --allow-no-token
        return TestClient(build_app(function, token=None))

    assert open_plugin(reward_len).post("/score", json=text).json()["rewards"] == [-2.0, -2.0]
    assert open_plugin(make_brevity(5)).post("/score", json=text).json()["rewards"] == [0.0, 0.0]
    failing = open_plugin(broken_reward).post("/score", json=text)
    assert failing.status_code == 500 and failing.json()["detail"] == "RuntimeError: this plugin always fails"
    short = open_plugin(lambda completions, **kw: [1.0]).post("/score", json=text)
    assert short.status_code == 500 and "returned 1 values for 2 items" in short.json()["detail"]
    assert open_plugin(reward_len).post("/score", json={**text, "protocol": "v0"}).status_code == 422


def test_protocol_and_plugin_stay_light():
    """shared/ stays torch-free, and a plugin process needs neither torch nor the scorer."""
    code = (
        "import sys, shared.reward_protocol, services.reward_plugin.__main__; "
        "bad = [m for m in ('torch', 'vllm', 'services.scorer') if m in sys.modules]; "
        "assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_scorer_reads_answers_strictly_and_quotes_the_body():
    def answer(body: str, expected: int = 2):
        return parse_answer(httpx.Response(200, content=body.encode()), expected)

    assert answer('{"rewards": [1, null]}') == [1.0, None]
    assert answer('{"rewards": [0.5, 0.25], "extra": {"why": "x"}}') == [0.5, 0.25]
    for body, problem in (
        ('{"rewards": ["1", 0]}', "rewards.0: Input should be a valid number"),
        ('{"rewards": [true, 0]}', "rewards.0: Input should be a valid number"),
        ('{"rewards": [NaN, 0]}', "rewards.0: Input should be a finite number"),
        ('{"rewards": [1, 0], "debug": 1}', "debug: Extra inputs are not permitted"),
        ('{"rewards": [1.0,', "Invalid JSON"),
        ('{"rewards": [1.0]}', "HTTP 200 with 1 rewards for 2 items"),
    ):
        with pytest.raises(PluginCallError, match=re.escape(problem)) as caught:
            answer(body)
        assert f"body {body!r}" in str(caught.value)
    assert body_excerpt("") == "empty body"
    assert body_excerpt("x" * 300) == f"body {'x' * 200!r} (first 200 of 300 chars)"
    timeout = transport_detail(httpx.ReadTimeout(""), 2.5)
    assert timeout == "ReadTimeout: no answer within timeout_s=2.5"
