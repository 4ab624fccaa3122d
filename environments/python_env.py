"""A TRL environment in this process: an ``environment_factory`` class, plain tool functions, or both
(docs/concepts/multi-turn-design.md §2.3). A TRL user's class and tool functions work unchanged.

- The class needs a callable ``reset(**row)``, which receives the dataset row (``prompt`` plus the task's columns)
  and may return a first observation (``str``) or None. Its public methods other than ``reset`` and
  ``get_reward`` are its tools, described by ``transformers.utils.get_json_schema`` (type hints and a Google
  docstring with ``Args:``). An optional ``get_reward()`` (sync or async) gives the trajectory's ``env_reward``.
- Instances are pooled and reset per trajectory ("construct once, reset often"), serve one trajectory at a time,
  go back to the pool when it ends and are thrown away after a fault or a cancellation.
- Sync methods run in daemon threads, at most ``concurrency`` at once, never on the event loop; async ones are
  awaited. A call with no answer within ``timeout_s`` is an :class:`~environments.session.EnvFault` (a thread
  cannot be stopped: it is abandoned, and its slot comes back when it returns), as is an exception in ``reset``
  or ``get_reward``. An exception *inside a tool* is a tool error the model reads, ``{"error": "<Type>:
  <message>"}`` (TRL's shape), as is a call naming no tool of the environment.
- One breaker counts consecutive faulted sessions; while it is open no session is opened.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import math
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from environments.protocol import StepResponse, ToolCallIn, ToolResult
from environments.session import EnvFault, EnvStats, timed
from shared.resilience import OPEN, CircuitBreaker, CircuitOpenError
from shared.reward_protocol import load_callable
from shared.threads import CallTimeoutError, DaemonThreads

NOT_TOOLS = frozenset({"reset", "get_reward"})  # TRL: every other public method is a tool


def tool_schema(function: Callable[..., Any]) -> dict[str, Any]:
    """``get_json_schema(function)``: ``{"type": "function", "function": {name, description, parameters, ...}}``;
    ValueError naming the fix when the function cannot be described."""
    from transformers.utils import get_json_schema  # transformers is heavy: only an environment needs it

    try:
        return get_json_schema(function)
    except Exception as exc:  # transformers raises its own TypeError/ValueError subclasses
        name = getattr(function, "__qualname__", repr(function))
        raise ValueError(
            f"tool {name} cannot be described for the model ({type(exc).__name__}: {exc}); give it type hints and a "
            "Google docstring whose Args: section describes every parameter"
        ) from exc


def tool_methods(instance: Any) -> dict[str, Callable[..., Any]]:
    """The instance's tools: its public bound methods other than ``reset`` and ``get_reward``, by name."""
    return {
        name: method
        for name, method in inspect.getmembers(instance, inspect.ismethod)
        if not name.startswith("_") and name not in NOT_TOOLS
    }


def argument_problem(schema: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """Why a call's ``arguments`` do not fit its tool's ``schema`` (``tool_schema``'s answer), or None: an argument
    the tool does not take (its own ``self`` included), a required one missing, a value of the wrong type. Checked
    before the call, so the model reads the schema's complaint instead of Python's ``TypeError``, and nothing
    outside the schema reaches the function."""
    import jsonschema  # pinned with the environment's dependencies; only a tool call needs it

    parameters = schema.get("function", {}).get("parameters") or {"type": "object", "properties": {}}
    unknown = sorted(set(arguments) - set(parameters.get("properties", {})))
    if unknown:
        takes = ", ".join(parameters.get("properties", {})) or "none"
        return f"unexpected argument(s) {', '.join(map(repr, unknown))}; the tool takes: {takes}"
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(parameters).iter_errors(arguments))
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path)
    return f"{where + ': ' if where else ''}{error.message}"


def error_content(exc: BaseException) -> str:
    """What the model reads when a tool raised: ``{"error": "<Type>: <message>"}``."""
    return json.dumps({"error": f"{type(exc).__name__}: {exc}"})


class EnvThreadTimeout(CallTimeoutError):
    """A sync environment call gave no answer within ``timeout_s`` (raised only by the environment's threads, so
    a tool's own TimeoutError is never mistaken for it); :meth:`PythonEnvironment.invoke` makes it an EnvFault."""


def env_threads(name: str, size: int) -> DaemonThreads:
    """Daemon threads named ``env-<name>``, at most ``size`` at once (:mod:`shared.threads`)."""
    return DaemonThreads(name, size, subject="environment", thread_prefix="env", error=EnvThreadTimeout)


class PythonSession:
    """One trajectory on one pooled instance (or on plain functions alone)."""

    def __init__(self, environment: PythonEnvironment, instance: Any, observation: str | None) -> None:
        self.environment, self.instance, self.observation = environment, instance, observation
        self.tools = environment.tool_schemas()
        self.latencies_s: list[float] = []
        self.fault: str | None = None
        self.steps = 0

    async def step(self, calls: Sequence[ToolCallIn]) -> StepResponse:
        """Each call in order; a tool's exception and an unknown tool are error results, a timeout is a fault."""
        self._check_usable()
        with self._faults():
            results = await timed(self.latencies_s, self._run_calls(calls))
        response = StepResponse(results=results, done=False, reward=None)
        self.steps += 1
        self.environment.stats.calls["ok"] += 1
        self.environment.stats.count_results(response)
        return response

    async def reward(self) -> float | None:
        """``get_reward()``, or None when the class has none; an exception or a non-number is a fault."""
        get_reward = getattr(self.instance, "get_reward", None) if self.instance is not None else None
        if get_reward is None:
            return None
        self._check_usable()
        with self._faults():
            value = await timed(self.latencies_s, self.environment.invoke(get_reward, {}, "get_reward", fault=True))
            reward = checked_reward(value)
        self.environment.stats.calls["ok"] += 1
        return reward

    async def _run_calls(self, calls: Sequence[ToolCallIn]) -> list[ToolResult]:
        return [await self._run_call(call) for call in calls]

    async def _run_call(self, call: ToolCallIn) -> ToolResult:
        tool = self.environment.tool(self.instance, call.name)
        if tool is None:
            known = ", ".join(self.environment.tool_names) or "none"
            content = json.dumps({"error": f"unknown tool {call.name!r}; the tools are: {known}"})
            return ToolResult(tool_call_id=call.id, name=call.name, content=content, error=True)
        problem = argument_problem(self.environment.schema_of(call.name), dict(call.arguments))
        if problem is not None:  # never called: a failed call the model reads
            content = json.dumps({"error": f"the arguments of {call.name} do not match its schema: {problem}"})
            return ToolResult(tool_call_id=call.id, name=call.name, content=content, error=True)
        try:
            value = await self.environment.invoke(tool, dict(call.arguments), f"tool {call.name}")
        except EnvFault:
            raise
        except Exception as exc:  # inside the tool: the model reads it (TRL)
            return ToolResult(tool_call_id=call.id, name=call.name, content=error_content(exc), error=True)
        content = value if isinstance(value, str) else str(value)  # TRL: str(result)
        return ToolResult(tool_call_id=call.id, name=call.name, content=content, error=False)

    def _check_usable(self) -> None:
        if self.fault is not None:
            raise EnvFault(f"the session faulted earlier ({self.fault}); open a new one")

    @contextlib.contextmanager
    def _faults(self) -> Any:
        try:
            yield
        except EnvFault as exc:
            self.fault = exc.reason
            self.environment.stats.calls["fault"] += 1
            raise


def checked_reward(value: Any) -> float | None:
    """``get_reward``'s value as a finite float or None; EnvFault for anything else (never a made-up reward)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(float(value)):
        raise EnvFault(f"get_reward returned {value!r}; it must return a finite number or None")
    return float(value)


def reset_observation(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise EnvFault(f"reset returned a {type(value).__name__}; TRL's reset returns a str observation or None")


class PythonEnvironment:
    """An :class:`~environments.session.Environment` around a TRL environment class and/or tool functions."""

    def __init__(
        self,
        factory: Callable[[], Any] | None,
        functions: Sequence[Callable[..., Any]] = (),
        *,
        name: str,
        concurrency: int = 16,
        timeout_s: float = 30.0,
        breaker_failures: int = 5,
        breaker_reset_s: float = 30.0,
    ) -> None:
        if factory is None and not functions:
            raise ValueError("an environment needs a class (python = 'mod:Class') or tools = ['mod:fn', ...]")
        self.name, self.factory, self.timeout_s = name, factory, timeout_s
        self.stats = EnvStats()
        self.threads = env_threads(name, concurrency)
        self.breaker = CircuitBreaker(name, breaker_failures, breaker_reset_s, subject="environment")
        self.functions = {function.__name__: function for function in functions}
        self._pool: list[Any] = []
        self._schemas = self._describe(factory)

    def _describe(self, factory: Callable[[], Any] | None) -> tuple[dict[str, Any], ...]:
        """Construct one instance (kept in the pool) to read its tools; check names and schemas at start."""
        methods: dict[str, Callable[..., Any]] = {}
        if factory is not None:
            probe = factory()
            if not callable(getattr(probe, "reset", None)):
                raise ValueError(f"environment {self.name}: the class has no reset(**row) method (TRL requires one)")
            methods = tool_methods(probe)
            self._pool.append(probe)
        clash = sorted(set(methods) & set(self.functions))
        if clash:
            raise ValueError(f"environment {self.name}: tools {', '.join(clash)} are both methods and functions")
        self.tool_names = (*methods, *self.functions)
        if not self.tool_names:
            raise ValueError(f"environment {self.name} has no tools: give the class a public method other than reset")
        return tuple(tool_schema(tool) for tool in (*methods.values(), *self.functions.values()))

    def tool_schemas(self) -> tuple[dict[str, Any], ...]:
        return self._schemas

    def schema_of(self, name: str) -> dict[str, Any]:
        """The schema of the tool ``name`` (one of ``tool_names``)."""
        return self._schemas[self.tool_names.index(name)]

    def tool(self, instance: Any, name: str) -> Callable[..., Any] | None:
        if name in self.functions:
            return self.functions[name]
        if instance is None or name not in self.tool_names:
            return None
        return getattr(instance, name)

    async def invoke(self, function: Callable[..., Any], kwargs: dict[str, Any], what: str, fault: bool = False) -> Any:
        """Await an async ``function``, or run a sync one in a thread; EnvFault after ``timeout_s``. Its own
        exception propagates unless ``fault`` (reset, get_reward), where it is an EnvFault naming it."""
        try:
            if not inspect.iscoroutinefunction(function):
                return await self.threads.run(function, kwargs, self.timeout_s, what)
            deadline = asyncio.timeout(self.timeout_s)
            try:
                async with deadline:
                    return await function(**kwargs)
            except TimeoutError:
                if deadline.expired():
                    raise EnvFault(f"{what}: no answer within timeout_s={self.timeout_s:g}") from None
                raise
        except EnvThreadTimeout as exc:
            raise EnvFault(f"{what}: {exc}") from None
        except EnvFault:
            raise
        except Exception as exc:
            if fault:
                raise EnvFault(f"{what} raised {type(exc).__name__}: {exc}") from exc
            raise

    @contextlib.asynccontextmanager
    async def session(self, row: dict[str, Any], key: str) -> AsyncIterator[PythonSession]:
        """An instance from the pool, reset on ``row``; back to the pool on success, thrown away otherwise."""
        try:
            trial = await self.breaker.admit()  # a prompt's other sessions wait for a half-open trial
        except CircuitOpenError as exc:
            raise EnvFault(str(exc)) from None
        session = await self._open(row, key, trial)
        succeeded = False
        try:
            yield session
            succeeded = session.fault is None
        finally:
            self._finish(session, succeeded, trial)

    async def _open(self, row: dict[str, Any], key: str, trial: bool) -> PythonSession:
        latencies: list[float] = []
        instance = None
        try:
            if self.factory is not None:
                instance = self._pool.pop() if self._pool else await self.invoke(self.factory, {}, "construct", True)
                value = await timed(latencies, self.invoke(instance.reset, dict(row), "reset", fault=True))
                observation = reset_observation(value)
            else:
                observation = None
        except EnvFault as exc:
            self.stats.calls["fault"] += 1
            self.breaker.failure(f"session {key}: {exc.reason}", trial)
            raise
        except BaseException:
            self.breaker.release_trial(trial)
            raise
        if self.factory is not None:
            self.stats.calls["ok"] += 1
        self.stats.sessions_opened += 1
        session = PythonSession(self, instance, observation)
        session.latencies_s.extend(latencies)
        return session

    def _finish(self, session: PythonSession, succeeded: bool, trial: bool) -> None:
        self.stats.sessions_closed += 1
        if session.fault is not None:
            self.breaker.failure(session.fault, trial)
        elif succeeded:
            self.breaker.success(trial)
        else:
            self.breaker.release_trial(trial)  # cancelled, or the caller's own error: no verdict on the env
        if succeeded and session.instance is not None:
            self._pool.append(session.instance)

    def accepting(self) -> bool:
        return self.breaker.refresh() != OPEN

    def describe(self) -> str:
        return self.breaker.describe()

    async def aclose(self) -> None:
        self._pool.clear()


def python_environment(python: str | None, tools: Sequence[str], *, name: str, **options: Any) -> PythonEnvironment:
    """A :class:`PythonEnvironment` from import paths: ``python = 'mod:Class'`` and/or ``tools = ['mod:fn']``."""
    factory = load_callable(python, "environment class") if python else None
    functions = [load_callable(path, "tool function") for path in tools]
    return PythonEnvironment(factory, functions, name=name, **options)
