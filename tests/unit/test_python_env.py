"""The in-process environment adapter (docs/concepts/multi-turn-design.md §2.3, §3 step 5): TRL's environment class and
tool functions, their schemas, tool errors, faults, the instance pool and the session lifecycle."""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers.utils import get_json_schema

from environments.build import build_environment
from environments.protocol import ToolCallIn
from environments.python_env import PythonEnvironment
from environments.session import EnvFault
from shared.config.environment import EnvironmentSettings
from shared.reward_protocol import load_callable
from tests.support import tool_envs
from tests.support.tool_envs import AsyncRewardEnv, BadRewardEnv, BrokenResetEnv, IncrementEnv, add, slow_upper


def _env(factory=IncrementEnv, functions=(), **options) -> PythonEnvironment:
    return PythonEnvironment(factory, functions, name="test", **options)


def _call(name: str, i: int = 0, **arguments) -> ToolCallIn:
    return ToolCallIn(id=f"call_{i}", name=name, arguments=arguments)


def test_schemas_are_get_json_schemas_of_the_public_methods_and_functions():
    env = _env(functions=[add, slow_upper])
    probe = IncrementEnv()
    expected = [get_json_schema(getattr(probe, name)) for name in ("divide", "double", "hang", "increment", "whoami")]
    assert list(env.tool_schemas()) == [*expected, get_json_schema(add), get_json_schema(slow_upper)]
    names = [schema["function"]["name"] for schema in env.tool_schemas()]
    assert "reset" not in names and "get_reward" not in names
    assert env.tool_schemas()[3]["function"]["parameters"]["properties"]["step"]["type"] == "integer"


async def test_reset_none_or_observation_sync_and_async_tools_and_sync_reward():
    env = _env()
    async with env.session({"prompt": "p"}, "t/0") as session:
        assert session.observation is None
        response = await session.step([_call("increment", 0, step=3), _call("double", 1)])
        assert [(r.tool_call_id, r.content, r.error) for r in response.results] == [
            ("call_0", "3", False),
            ("call_1", "6", False),
        ]
        assert not response.done and response.reward is None
        assert await session.reward() == 6.0
        assert len(session.latencies_s) == 3  # reset, the step, get_reward
    async with env.session({"prompt": "p", "greet": True, "start": 4}, "t/1") as session:
        assert session.observation == "The counter starts at 4."
    assert env.stats.sessions_opened == env.stats.sessions_closed == 2


async def test_async_reward_and_absent_reward():
    async with _env(AsyncRewardEnv).session({"prompt": "hi"}, "k") as session:
        assert session.observation == "Ready." and await session.reward() == 0.5
    async with _env(None, [add]).session({"prompt": "hi"}, "k") as session:
        assert session.observation is None and session.latencies_s == []
        assert (await session.step([_call("add", a=2, b=5)])).results[0].content == "7"
        assert await session.reward() is None


async def test_tool_exception_and_unknown_tool_are_error_results_not_faults():
    env = _env()
    async with env.session({"prompt": "p"}, "k") as session:
        response = await session.step([_call("divide", 0, by=0), _call("nope", 1), _call("increment", 2, step="x")])
        first, second, third = response.results
        assert json.loads(first.content) == {"error": "ZeroDivisionError: division by zero"} and first.error
        assert second.error and "unknown tool 'nope'" in json.loads(second.content)["error"]
        assert third.error and json.loads(third.content)["error"] == (
            "the arguments of increment do not match its schema: step: 'x' is not of type 'integer'"
        )
    assert env.stats.calls["tool_error"] == 3 and env.stats.calls["fault"] == 0
    assert env.accepting()


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ({"self": 1}, "unexpected argument(s) 'self'; the tool takes: step"),
        ({"step": 1, "extra": 2}, "unexpected argument(s) 'extra'; the tool takes: step"),
        ({}, "'step' is a required property"),
        ({"step": 1.5}, "step: 1.5 is not of type 'integer'"),
    ],
)
async def test_arguments_outside_the_tools_schema_never_reach_it(arguments, problem):
    """The model reads the schema's complaint (a failed call, counted), never Python's TypeError, and the tool
    is not called: ``{"self": 1}`` does not reach a method."""
    env = _env()
    before = tool_envs.calls["increment"]
    async with env.session({"prompt": "p"}, "k") as session:
        [result] = (await session.step([_call("increment", 0, **arguments)])).results
    assert result.error and json.loads(result.content) == {
        "error": f"the arguments of increment do not match its schema: {problem}"
    }
    assert tool_envs.calls["increment"] == before and env.stats.calls["tool_error"] == 1


async def test_a_sync_tool_past_timeout_is_a_fault_and_the_instance_is_discarded():
    env = _env(timeout_s=0.3, breaker_failures=1)
    tool_envs.release.clear()
    try:
        with pytest.raises(EnvFault, match=r"tool hang: no answer within timeout_s=0\.3"):
            async with env.session({"prompt": "p"}, "k") as session:
                await session.step([_call("hang", seconds=10)])
        assert env.stats.calls["fault"] == 1 and env.threads.hung == 1
        assert not env.accepting() and "breaker open" in env.describe()
        with pytest.raises(EnvFault, match="breaker open"):
            async with env.session({"prompt": "p"}, "k"):
                pass
    finally:
        tool_envs.release.set()
    assert env._pool == [] and env.stats.sessions_opened == env.stats.sessions_closed == 1


async def test_an_async_tool_past_timeout_is_a_fault():
    env = _env(None, [slow_upper], timeout_s=0.2)
    async with env.session({"prompt": "p"}, "k") as session:
        with pytest.raises(EnvFault, match="no answer within"):
            await session.step([_call("slow_upper", text="a", seconds=5)])
        with pytest.raises(EnvFault, match="faulted earlier"):
            await session.step([_call("slow_upper", text="a")])


async def test_reset_and_get_reward_exceptions_are_faults():
    with pytest.raises(EnvFault, match="reset raised RuntimeError: the sandbox did not start"):
        async with _env(BrokenResetEnv).session({"prompt": "p"}, "k"):
            pass
    env = _env(BadRewardEnv)
    async with env.session({"prompt": "p"}, "k") as session:
        with pytest.raises(EnvFault, match="get_reward returned nan"):
            await session.reward()
    assert env._pool == []  # thrown away after the fault


async def test_instances_are_pooled_reset_per_trajectory_and_one_trajectory_each():
    env = _env()
    async with env.session({"prompt": "p"}, "a") as first:
        await first.step([_call("increment", step=5)])
        async with env.session({"prompt": "p"}, "b") as second:  # concurrent: another instance
            ids = {(await s.step([_call("whoami")])).results[0].content for s in (first, second)}
            assert len(ids) == 2
    async with env.session({"prompt": "p"}, "c") as again:
        assert (await again.step([_call("increment", step=1)])).results[0].content == "1"  # reset
    assert len(env._pool) == 2


async def test_a_cancelled_trajectory_closes_its_session_and_discards_the_instance():
    env = _env()
    entered = asyncio.Event()
    tool_envs.release.clear()

    async def trajectory() -> None:
        async with env.session({"prompt": "p"}, "k") as session:
            entered.set()
            await session.step([_call("hang", seconds=10)])

    task = asyncio.create_task(trajectory())
    await entered.wait()
    await asyncio.sleep(0.05)
    task.cancel()
    try:
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        tool_envs.release.set()
    assert env.stats.sessions_opened == env.stats.sessions_closed == 1
    assert env._pool == [] and env.accepting()


def test_classes_and_functions_load_like_reward_modules(monkeypatch, tmp_path):
    monkeypatch.setenv("ASYNCGRPO_CONFIG", "configs/demo-cpu.toml")
    assert load_callable("calculator_env:CalculatorEnv", "environment class").__name__ == "CalculatorEnv"
    with pytest.raises(ValueError, match="cannot import environment class module 'no_such_env'"):
        load_callable("no_such_env:X", "environment class")
    env = build_environment(EnvironmentSettings(tools=["tests.support.tool_envs:add"]))
    assert env.name == "tools tests.support.tool_envs:add" and env.tool_schemas() == (get_json_schema(add),)


def test_a_class_without_reset_or_undocumented_tools_is_refused():
    class NoReset:
        def tool(self) -> str:
            """Nothing."""
            return ""

    with pytest.raises(ValueError, match="no reset"):
        _env(NoReset)

    def undocumented(x):
        return x

    with pytest.raises(ValueError, match="Google docstring"):
        _env(None, [undocumented])


async def test_calculator_env(monkeypatch):
    monkeypatch.setenv("ASYNCGRPO_CONFIG", "configs/demo-cpu.toml")
    env = build_environment(EnvironmentSettings(python="calculator_env:CalculatorEnv"))
    assert [s["function"]["name"] for s in env.tool_schemas()] == ["calculate"]
    async with env.session({"prompt": "p", "answer": 42}, "k") as session:
        calls = ["(12 + 3) * 47", "7 / 2", "2 ** 10 // 3 % 5", "-4 + +2", "__import__('os')", "9 ** 999", "1 / 0"]
        response = await session.step([_call("calculate", i, expression=e) for i, e in enumerate(calls)])
        assert await session.reward() is None
    contents = [r.content for r in response.results]
    assert contents[:4] == ["705", "3.5", "1", "-2"]
    assert all(r.error for r in response.results[4:])
    assert "ValueError: only numbers" in contents[4] and "exponents are at most" in contents[5]
    assert "division by zero" in contents[6]
