"""Python reward functions in TRL's calling convention, ``f(prompts, completions, completion_ids, **columns)``
(plus ``trainer_state`` when the function takes it or ``**kwargs``), behind the scorer's one interface
(:class:`~services.scorer.rewards.functions.RewardFunction`).

The keywords are checked before each call: one the function cannot take is a bug in its signature
(:class:`~services.scorer.rewards.functions.RewardError`), a column it needs that the group's rows lack is a
bad record (:class:`~services.scorer.rewards.functions.RewardInputError`); a ``TypeError`` the call itself
raises for either (a wrapper that hides its signature) is reported the same way (:func:`call_problem`). How a
call runs - awaited, on a worker thread of its own, or inline - and its time limit are set here too.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from services.scorer.rewards.functions import (
    SCORER_CODE,
    RewardBatch,
    RewardError,
    RewardFunction,
    RewardInputError,
    source_file,
)
from services.scorer.rewards.reward_threads import RewardThreads, RewardTimeoutError
from shared.resilience import CircuitBreaker
from shared.reward_columns import (
    missing_columns,
    missing_columns_message,
    unaccepted_keywords,
    unaccepted_keywords_message,
)

# What Python's TypeError says when a call's keywords do not fit the function's parameters.
_UNEXPECTED_KEYWORD = re.compile(r"got an unexpected keyword argument '(\w+)'")
_MISSING_ARGUMENTS = re.compile(r"missing \d+ required (?:positional|keyword-only) arguments?: (.+)$")


def trl_style(
    name: str,
    function: Callable[..., Any],
    *,
    in_thread: bool,
    required: bool = True,
    breaker: CircuitBreaker | None = None,
    timeout_s: float | None = None,
    threads: int = 8,
    batched: bool = False,
) -> RewardFunction:
    """Wrap a function with TRL's convention ``f(prompts, completions, completion_ids, **columns)``, plus
    ``trainer_state`` when it takes that parameter or ``**kwargs``.

    Coroutine functions are awaited; plain ones run in one of ``threads`` worker threads of their own when
    ``in_thread`` (plugins, whose cost is unknown) or inline (the fast built-ins). A call that gives no answer
    within ``timeout_s`` (None: no limit; an inline call has none) raises :class:`RewardTimeoutError`, an
    outage. A group whose row lacks a column the function needs raises :class:`RewardInputError` unasked; a
    keyword the function cannot take (it has no ``**kwargs``) raises :class:`RewardError`, a bug, unasked.
    """
    runner = RewardThreads(name, threads) if in_thread else None
    takes_state = takes_trainer_state(function)

    async def call(batch: RewardBatch) -> Any:
        kwargs = trl_keywords(name, function, batch, takes_state)
        try:
            if inspect.iscoroutinefunction(function):
                return await _awaited(function(**kwargs), timeout_s)
            if runner is not None:
                return await runner.run(function, kwargs, timeout_s, batch.group_id)
            return function(**kwargs)
        except TypeError as exc:
            problem = call_problem(name, exc, batch.columns, function)
            if problem is None:
                raise
            raise problem from exc

    return RewardFunction(
        name,
        call,
        required=required,
        breaker=breaker,
        in_process=True,
        threads=runner,
        source=source_file(function),
        batched=batched,
    )


def trl_keywords(name: str, function: Callable[..., Any], batch: RewardBatch, takes_state: bool) -> dict[str, Any]:
    """The keywords TRL would call ``function`` with on ``batch``, checked before the call: one the function
    cannot take raises :class:`RewardError` (a bug in its signature), a column it needs that the group's rows
    lack raises :class:`RewardInputError` (the group's fault)."""
    kwargs: dict[str, Any] = dict(
        prompts=batch.prompts,
        completions=batch.completions,
        completion_ids=batch.completion_ids,
        **batch.columns,
    )
    if takes_state:
        kwargs["trainer_state"] = batch.trainer_state
    unaccepted = unaccepted_keywords(function, kwargs)
    if unaccepted:
        raise RewardError(unaccepted_keywords_message(name, function, unaccepted))
    missing = missing_columns(function, batch.columns)
    if missing:
        raise RewardInputError(missing_columns_message(name, missing, batch.columns))
    return kwargs


def takes_trainer_state(function: Callable[..., Any]) -> bool:
    """Whether ``function`` has a ``trainer_state`` parameter or ``**kwargs`` (where TRL passes it too)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # no Python signature: pass only what TRL's convention requires
        return False
    return any(p.name == "trainer_state" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def call_problem(
    reward: str, exc: TypeError, columns: Mapping[str, Any], function: Callable[..., Any]
) -> RewardError | None:
    """What a ``TypeError`` raised by the call of ``function`` itself (binding the keywords, not inside the
    function) stands for: a :class:`RewardError` (a bug in its signature) for a keyword it cannot take; a
    :class:`RewardInputError` (a bad record) for a parameter no column fills; None when it is neither (then it
    is the function's own error). Both are checked before the call; this finds them where the function's
    signature hides its parameters (a wrapper's ``*args, **kwargs``)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames or not os.path.realpath(frames[-1].filename).startswith(SCORER_CODE):
        return None  # raised inside the user's code
    text = str(exc)
    unexpected = _UNEXPECTED_KEYWORD.search(text)
    if unexpected:
        return RewardError(unaccepted_keywords_message(reward, function, [unexpected.group(1)]))
    missing_arguments = _MISSING_ARGUMENTS.search(text)
    if missing_arguments:
        missing = [n for n in re.findall(r"'(\w+)'", missing_arguments.group(1)) if n not in columns]
        if missing:
            return RewardInputError(missing_columns_message(reward, missing, columns))
    return None


async def _awaited(coroutine: Any, timeout_s: float | None) -> Any:
    """A coroutine reward's answer; :class:`RewardTimeoutError` (it is cancelled) after ``timeout_s``."""
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            return await coroutine
    except TimeoutError:
        if not deadline.expired():
            raise  # the function's own TimeoutError: an outage it reports itself
        raise RewardTimeoutError(f"no answer within timeout_s={timeout_s:g}") from None
