"""The columns of a prompt: which values may ride along with it to the reward functions.

A dataset row's columns travel in every :class:`~shared.records.PromptTask` and reach each reward function (a
Python call or a plugin's JSON request) under their own names. The checks here are made once when the learner
loads its data and again when any record carrying columns is decoded, so a hostile value is refused at either.
"""

from __future__ import annotations

import math
from typing import Any, Final

# The environment's reward of each trajectory (multi-turn tool use), passed to the reward functions as a column
# of this name (None where the environment gave none); the HTTP plugin protocol's v2 items carry it as env_reward.
ENV_REWARD_COLUMN: Final = "env_reward"
# The keyword arguments every reward call passes itself (TRL's names; the HTTP plugin protocol's items carry
# them as prompt, completion, completion_ids and env_reward): a column of one of these names would clash with
# them (a TypeError in a Python reward) or silently replace them (in a plugin), so no record may carry one.
RESERVED_COLUMNS: Final = ("prompts", "completions", "completion_ids", ENV_REWARD_COLUMN)
# The scorer passes the task's token budget under this name unless the row has its own (the overlong reward
# reads it as an int), so a row's own value must be one.
BUDGET_COLUMN: Final = "max_completion_length"
_MAX_COLUMN_DEPTH = 32  # lists and maps within a column; bounds the check's recursion on a hostile record
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1  # the integers msgpack carries


def json_problem(value: Any, depth: int = 0) -> str | None:
    """Why ``value`` cannot travel as JSON and msgpack alike (None when it can): JSON's types only (tuples
    count as lists), finite numbers, integers msgpack carries, string keys, at most 32 levels deep."""
    if value is None or isinstance(value, bool | str):
        return None
    if isinstance(value, int):
        return None if _INT64_MIN <= value <= _UINT64_MAX else f"the integer {value}, beyond 64 bits"
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value} (JSON has no NaN or infinity)"
    if isinstance(value, list | tuple | dict) and depth >= _MAX_COLUMN_DEPTH:
        return f"lists or maps nested deeper than {_MAX_COLUMN_DEPTH} levels"
    if isinstance(value, list | tuple):
        return next((p for p in (json_problem(v, depth + 1) for v in value) if p), None)
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            return "a map with a key that is not a string"
        return next((p for p in (json_problem(v, depth + 1) for v in value.values()) if p), None)
    return f"a value of type {type(value).__name__}"


def _is_budget(value: Any) -> bool:
    whole = isinstance(value, int) and not isinstance(value, bool)
    whole = whole or (isinstance(value, float) and math.isfinite(value) and value.is_integer())
    return whole and value >= 1


def column_problem(name: str, value: Any) -> str | None:
    """Why a column cannot reach the reward functions (None when it can); the message names the fix."""
    if name in RESERVED_COLUMNS:
        return (
            f"column {name} has the name of a reward-function argument (the scorer passes "
            f"{', '.join(RESERVED_COLUMNS)} to every reward function itself); rename it with data.rename_columns"
        )
    if name == BUDGET_COLUMN and not _is_budget(value):
        return f"column {name} is the token budget the reward functions get: a positive integer, not {value!r}"
    problem = json_problem(value)
    if problem:
        return f"column {name!r} holds {problem}, which a reward plugin's JSON request cannot carry"
    return None
