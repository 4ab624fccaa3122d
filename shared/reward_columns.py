"""Which dataset columns a Python reward function needs, and the one message for a column that is missing.

A TRL-style reward function is called as ``f(prompts, completions, completion_ids, **columns)``: every
parameter without a default that the scorer does not pass itself must be a column of the dataset's rows. The
start-up check (before any process starts) and the scorer's call (a group whose row lacks one) report a
missing column with :func:`missing_columns_message`, so the user reads the same cause and the same fix
wherever it is found.

A function without ``**kwargs`` must take every keyword the scorer passes it (:func:`passed_keywords`): every
column of the row, not only those it uses, and the scorer's own arguments. :func:`unaccepted_keywords` names
those it cannot take, a bug in its signature that the start-up check and the scorer's call report with
:func:`unaccepted_keywords_message`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from shared.columns import BUDGET_COLUMN, ENV_REWARD_COLUMN, RESERVED_COLUMNS

# What the scorer passes to every reward function itself, whatever the dataset holds.
SCORER_ARGUMENTS = (*RESERVED_COLUMNS, BUDGET_COLUMN, "trainer_state")
# The keywords of every call (TRL's); ``max_completion_length`` is passed as a column unless the row has its own.
CALL_ARGUMENTS = ("prompts", "completions", "completion_ids")


def required_columns(function: Callable[..., Any]) -> list[str]:
    """The parameters of ``function`` that must come from the dataset: those without a default, passable by
    keyword, that the scorer does not pass itself (``SCORER_ARGUMENTS``). ``*args`` / ``**kwargs`` need none."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin or C function without a signature: nothing can be checked
        return []
    return [
        p.name
        for p in parameters
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and p.name not in SCORER_ARGUMENTS
    ]


def missing_columns(function: Callable[..., Any], columns: Iterable[str]) -> list[str]:
    """The required columns of ``function`` (:func:`required_columns`) that ``columns`` lacks, in order."""
    present = set(columns)
    return [name for name in required_columns(function) if name not in present]


def missing_columns_message(reward: str, missing: list[str], columns: Iterable[str]) -> str:
    """The data error for reward ``reward`` whose parameters ``missing`` are not among the row's ``columns``:
    what is wrong, what the dataset has, and the two fixes."""
    have = sorted(set(columns))
    names = ", ".join(repr(m) for m in missing)
    plural = "s" if len(missing) > 1 else ""
    return (
        f"reward {reward!r} needs the column{plural} {names} (parameter{plural} without a default), which the "
        f"dataset's rows lack; their columns: {', '.join(have) if have else '(none besides the prompt)'}. Fix: "
        f"rename a column to {missing[0]!r} with data.rename_columns = {{ <column> = {missing[0]!r} }}, or give "
        f"the parameter a default in the function (def {missing[0]}=None ...)"
    )


def passed_keywords(columns: Iterable[str], *, multi_turn: bool) -> list[str]:
    """Every keyword the scorer passes a reward function for a row with ``columns`` (the prepared row's, the
    prompt taken out), besides ``trainer_state``, which only a function that takes it gets: TRL's three
    arguments, the columns, ``max_completion_length``, and ``env_reward`` when an environment runs."""
    extra = (BUDGET_COLUMN, ENV_REWARD_COLUMN) if multi_turn else (BUDGET_COLUMN,)
    return list(dict.fromkeys((*CALL_ARGUMENTS, *columns, *extra)))


def takes_every_keyword(function: Callable[..., Any]) -> bool:
    """Whether ``function`` has ``**kwargs``, or no Python signature (a builtin: nothing can be checked)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def unaccepted_keywords(function: Callable[..., Any], keywords: Iterable[str]) -> list[str]:
    """The ``keywords`` (in order) that ``function`` cannot take: none when it has ``**kwargs`` or no Python
    signature (nothing can be checked); else those that are not the name of a parameter passable by keyword."""
    if takes_every_keyword(function):
        return []
    parameters = inspect.signature(function).parameters.values()
    takes = {
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return [keyword for keyword in dict.fromkeys(keywords) if keyword not in takes]


def unaccepted_keywords_message(reward: str, function: Callable[..., Any], unaccepted: list[str]) -> str:
    """The bug of reward ``reward`` whose ``function`` takes none of the keywords ``unaccepted``: which, why the
    scorer passes them, and the fix (``**kwargs``, shown on the function's own signature)."""
    name = getattr(function, "__name__", type(function).__name__)
    names = ", ".join(repr(k) for k in unaccepted)
    plural = "s" if len(unaccepted) > 1 else ""
    return (
        f"reward {reward!r}: its function {name} takes no keyword argument{plural} {names}, which the scorer passes "
        f"it (as TRL does: prompts, completions, completion_ids, {BUDGET_COLUMN}, every column of the dataset's "
        f"rows, and {ENV_REWARD_COLUMN} with an environment), so every call would fail. Fix: add **kwargs to its "
        f"parameters, as TRL's reward functions have: {_with_kwargs(function, name)}"
    )


def _with_kwargs(function: Callable[..., Any], name: str) -> str:
    """``def name(its parameters, **kwargs)``; TRL's minimal signature when its own cannot be read."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        signature = None
    parameters = [] if signature is None else list(signature.parameters.values())
    if signature is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return f"def {name}(prompts, completions, **kwargs)"  # no signature, or one that hides the real one
    kwargs = inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)
    return f"def {name}{signature.replace(parameters=[*parameters, kwargs])}"
