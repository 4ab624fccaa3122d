"""Reward functions behind one async interface: built-ins, Python plugins and HTTP plugins.

Every function is called with one group's :class:`RewardBatch` and returns G values (float, or None where
it cannot judge). :func:`score_batch` runs all of them concurrently and returns the [G, F] matrix with NaN
wherever a function returned None, raised, timed out, or answered something malformed - never a silent 0 -
and counts every failure in the function's :class:`RewardStats`.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


class RewardError(RuntimeError):
    """A reward function failed or answered something that is not G rewards."""


@dataclass(frozen=True)
class RewardBatch:
    """One group in TRL's reward-function vocabulary (every list has G entries)."""

    prompts: list[Any]
    completions: list[Any]
    completion_ids: list[list[int]]
    columns: dict[str, list[Any]]

    def __len__(self) -> int:
        return len(self.completions)


@dataclass
class RewardStats:
    calls: int = 0
    errors: int = 0
    short_circuited: int = 0
    nan_values: int = 0
    latency_s_total: float = 0.0
    last_error: str = ""

    def as_metrics(self, name: str) -> dict[str, float]:
        return {
            f"rewards/{name}/calls": self.calls,
            f"rewards/{name}/errors": self.errors,
            f"rewards/{name}/short_circuited": self.short_circuited,
            f"rewards/{name}/nan_values": self.nan_values,
            f"rewards/{name}/latency_seconds_total": self.latency_s_total,
        }


@dataclass
class RewardFunction:
    """A named reward function: ``call(batch)`` -> G values."""

    name: str
    call: Callable[[RewardBatch], Any]
    stats: RewardStats = field(default_factory=RewardStats)


def validate_rewards(name: str, values: Any, expected: int) -> list[float]:
    """G rewards as floats (None -> NaN); anything else raises RewardError naming the function."""
    if not isinstance(values, list | tuple):
        raise RewardError(f"{name} returned {type(values).__name__}, expected a list of {expected} rewards")
    if len(values) != expected:
        raise RewardError(f"{name} returned {len(values)} rewards for {expected} completions")
    out = []
    for value in values:
        if value is None:
            out.append(math.nan)
        elif isinstance(value, bool | int | float | np.floating | np.integer):
            number = float(value)
            if math.isinf(number):
                raise RewardError(f"{name} returned an infinite reward")
            out.append(number)
        else:
            raise RewardError(f"{name} returned a {type(value).__name__} among its rewards")
    return out


def trl_style(name: str, function: Callable[..., Any], *, in_thread: bool) -> RewardFunction:
    """Wrap a function with TRL's convention ``f(prompts, completions, completion_ids, **columns)``.

    Coroutine functions are awaited; plain ones run in a worker thread when ``in_thread`` (plugins, whose
    cost is unknown) or inline (the fast built-ins).
    """

    async def call(batch: RewardBatch) -> Any:
        kwargs = dict(
            prompts=batch.prompts,
            completions=batch.completions,
            completion_ids=batch.completion_ids,
            **batch.columns,
        )
        if inspect.iscoroutinefunction(function):
            return await function(**kwargs)
        if in_thread:
            return await asyncio.to_thread(function, **kwargs)
        return function(**kwargs)

    return RewardFunction(name, call)


def load_python_plugin(path: str) -> Callable[..., Any]:
    """Import ``module:function`` (the module must be importable, e.g. on PYTHONPATH)."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"a Python reward plugin is 'module:function', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import reward plugin module {module_name!r}: {exc}") from exc
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(f"{module_name!r} has no callable {attribute!r}")
    return function


async def _run_one(function: RewardFunction, batch: RewardBatch) -> list[float]:
    started = time.perf_counter()
    function.stats.calls += 1
    try:
        values = validate_rewards(function.name, await function.call(batch), len(batch))
    except Exception as exc:
        function.stats.errors += 1
        function.stats.last_error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, CircuitOpenError):
            function.stats.short_circuited += 1
        else:
            log.warning("reward %s failed; its rewards are NaN for this group: %s", function.name, exc)
        values = [math.nan] * len(batch)
    finally:
        function.stats.latency_s_total += time.perf_counter() - started
    function.stats.nan_values += sum(math.isnan(v) for v in values)
    return values


async def score_batch(functions: Sequence[RewardFunction], batch: RewardBatch) -> np.ndarray:
    """Rewards [G, F] (float32), NaN where a function could not give a value."""
    columns = await asyncio.gather(*(_run_one(f, batch) for f in functions))
    if not columns:
        return np.zeros((len(batch), 0), dtype=np.float32)
    return np.asarray(columns, dtype=np.float32).T.copy()


class CircuitOpenError(RewardError):
    """The plugin failed too often; calls fail fast until its reset time passes."""
