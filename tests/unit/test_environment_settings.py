"""``[environment]`` and ``[env_server]`` settings: one kind of environment, the limits' bounds, HTTP-only fields,
and the server's token check, each refusal naming the fix."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from shared.config.environment import EnvironmentSettings, EnvServerSettings


def test_defaults_and_the_three_kinds():
    python = EnvironmentSettings(python="calculator_env:CalculatorEnv")
    assert (python.kind, python.max_turns, python.max_tool_response_tokens, python.tool_parser) == (
        "python",
        8,
        256,
        "hermes",
    )
    assert python.chat_template == "" and python.chat_template_kwargs == {}
    assert EnvironmentSettings(tools=["m:f", "m:g"]).kind == "tools"
    assert EnvironmentSettings(python="m:C", tools=["m:f"]).label == "m:C"
    assert EnvironmentSettings(tools=["m:f"]).label == "tools m:f"
    assert EnvironmentSettings(url="https://env:8010").kind == "http"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "names no environment: set python"),
        ({"url": "http://e", "python": "m:C"}, "not both"),
        ({"url": "http://e", "tools": ["m:f"]}, "not both"),
        ({"url": "ftp://e"}, "must start with http:// or https://"),
        ({"python": "MyEnv"}, "'module:name'"),
        ({"tools": ["m:f", "m:f"]}, "repeats m:f"),
        ({"python": "m:C", "max_turns": 0}, "greater than or equal to 1"),
        ({"python": "m:C", "max_tool_response_tokens": 0}, "greater than or equal to 1"),
        ({"python": "m:C", "bearer_token": "x"}, "for an environment server (set url)"),
        ({"url": "http://e", "bearer_token": "x", "bearer_token_env": "T"}, "not both"),
        ({"url": "http://e", "bearer_token": "x", "headers": {"Authorization": "y"}}, "keep one"),
        ({"python": "m:C", "surprise": 1}, "Extra inputs are not permitted"),
    ],
)
def test_refusals_name_the_fix(fields, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        EnvironmentSettings(**fields)


def test_request_headers_reveal_the_token_and_start_problems_name_a_missing_variable(monkeypatch):
    settings = EnvironmentSettings(url="http://e", bearer_token_env="ENV_TOKEN_FOR_TEST", headers={"X-A": "b"})
    monkeypatch.delenv("ENV_TOKEN_FOR_TEST", raising=False)
    assert "ENV_TOKEN_FOR_TEST" in settings.start_problems()[0]
    monkeypatch.setenv("ENV_TOKEN_FOR_TEST", "secret")
    assert settings.start_problems() == []
    assert settings.request_headers() == {"X-A": "b", "Authorization": "Bearer secret"}
    assert "secret" not in repr(EnvironmentSettings(url="http://e", bearer_token="secret"))


def test_env_server_settings_refuse_a_missing_or_weak_token():
    assert "is not set" in EnvServerSettings().start_problems()[0]
    assert "at least 32" in EnvServerSettings(api_token="short").start_problems()[0]
    assert "placeholder" in EnvServerSettings(api_token="change-me" + "x" * 40).start_problems()[0]
    assert EnvServerSettings(api_token="t" * 40).start_problems() == []
    with pytest.raises(ValidationError):
        EnvServerSettings(session_idle_ttl_s=0)
