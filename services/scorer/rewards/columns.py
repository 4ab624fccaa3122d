"""Which dataset columns a Python reward function needs, and the one message for a column that is missing.

A TRL-style reward function is called as ``f(prompts, completions, completion_ids, **columns)``: every
parameter without a default that the scorer does not pass itself must be a column of the dataset's rows. The
start-up check (before any process starts) and the scorer's call (a group whose row lacks one) report a
missing column with :func:`missing_columns_message`, so the user reads the same cause and the same fix
wherever it is found.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from shared.columns import BUDGET_COLUMN, RESERVED_COLUMNS

# What the scorer passes to every reward function itself, whatever the dataset holds.
SCORER_ARGUMENTS = (*RESERVED_COLUMNS, BUDGET_COLUMN, "trainer_state")


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
