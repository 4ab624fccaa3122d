"""Importing a Python reward function (or an environment class, a tool) by its ``module:name``, with a message
that says what to change when it does not import: the closest names its module has for a misspelled name, the
file and line for a module that raises while it is imported.

Pure and light (no HTTP server, no scoring), so ``asyncgrpo run`` can run the scorer's own check before it
starts anything (``services/launcher/preflight.py``); the scorer runs it at its start
(:func:`services.scorer.startup.build_rewards`).
"""

from __future__ import annotations

import difflib
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from shared.config.scorer import RewardSpec
from shared.reward_protocol import load_callable

_SUGGESTIONS = 3  # closest names shown for a misspelled one
_LISTED = 12  # a module's own callables listed when none is close


def reward_problems(specs: Sequence[RewardSpec]) -> list[str]:
    """Why each Python reward of ``specs`` cannot be imported (built-ins and HTTP plugins are not imported)."""
    problems = []
    for spec in specs:
        if spec.function is not None:
            _, problem = import_callable(spec.function, "reward function")
            if problem is not None:
                problems.append(f"reward {spec.name!r}: {problem}")
    return problems


def import_callable(path: str, what: str) -> tuple[Callable[..., Any] | None, str | None]:
    """The callable ``module:name`` and None, or None and why it cannot be had (with the closest names when
    the module has no such callable, and the file and line when importing the module raised)."""
    try:
        return load_callable(path, what), None
    except Exception as exc:  # load_callable's own ValueError, or whatever the user's module raised on import
        if not (isinstance(exc, ValueError) and _raised_in(exc, load_callable)):
            return None, f"importing {path.partition(':')[0]!r} for {what} {path!r} raised {_summary(exc)}"
        module_name, _, attribute = path.partition(":")
        module = sys.modules.get(module_name)
        if module is None:
            return None, str(exc)  # the module did not import: load_callable's message says where it looked
        return None, f"{exc}{closest_names_hint(attribute, public_callables(vars(module)), module_name)}"


def public_callables(namespace: dict[str, Any]) -> dict[str, bool]:
    """The public callables of a module's ``namespace``, each with whether the module defines it (True) or
    imports it (False)."""
    own = namespace.get("__name__")
    return {
        name: getattr(value, "__module__", None) == own
        for name, value in namespace.items()
        if not name.startswith("_") and callable(value)
    }


def closest_names_hint(name: str, callables: dict[str, bool], module_name: str) -> str:
    """``; did you mean 'a' or 'b'?`` for the callables closest to ``name``; when none is close, the module's
    own callables; '' when it has none."""
    close = difflib.get_close_matches(name, list(callables), n=_SUGGESTIONS)
    if close:
        return f"; did you mean {' or '.join(repr(c) for c in close)}?"
    own = sorted(n for n, defined_here in callables.items() if defined_here)
    if not own:
        return ""
    more = f", ... ({len(own) - _LISTED} more)" if len(own) > _LISTED else ""
    return f"; {module_name!r} defines {', '.join(own[:_LISTED])}{more}"


def _summary(exc: BaseException) -> str:
    """``TypeName: message (at file:line)``: where in the user's code an exception was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _raised_in(exc: BaseException, function: Callable[..., Any]) -> bool:
    """Whether ``exc`` was raised by ``function``'s own code (not by code it called)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return (
        bool(frames) and frames[-1].filename == function.__code__.co_filename and frames[-1].name == function.__name__
    )
