"""Reward functions behind one async interface: built-ins, Python plugins and HTTP plugins.

Every function is called with one group's :class:`RewardBatch` and returns G values (float, or None where
it cannot judge, which becomes NaN). :func:`run_function` calls one through its circuit breaker and returns
either the values or a :class:`RewardFailure` that names the reward, the group and what went wrong (the HTTP
status and a body excerpt, or a Python traceback summary); it logs and counts every failure. What a failure
means for the group - NaN for an optional reward, the group held back for a required one - is the scoring
loop's decision. :func:`score_batch` is the simple form: the [G, F] matrix with NaN wherever a function
failed.

A failure is an *outage*, a *bug* or a *bad input*. An HTTP plugin's failures, and a Python function's
``OSError`` (``ConnectionError``, ``TimeoutError``, what ``requests`` and ``urllib`` raise) or
``httpx.HTTPError``, say "not now": something the function needs is out of reach, and a later call may
succeed. A Python plugin that gives no answer within its ``timeout_s`` is such an outage too (its call is
abandoned, see :mod:`services.scorer.rewards.reward_threads`). Any other exception
from a Python function (built-in or plugin), or an answer that is not G numbers, is a bug in the function:
the same group would fail the same way again. A bug's traceback is logged at ERROR the first time each
function has one (later ones are one line each) and counted in ``rewards/<name>/bugs``; the scoring loop
stops the scorer on a required reward's bug (as TRL's trainer stops) instead of waiting it out. A *bad input*
(:class:`RewardInputError`: the group cannot even be put to the function, e.g. a column a plugin's JSON
request cannot carry) is the record's fault, not the function's: it never counts against the breaker, and
the scoring loop dead-letters the group as a bad record. A group whose row lacks a column the function needs
(a parameter without a default, :mod:`shared.reward_columns`) is such a bad input: it is checked
before the call, and a ``TypeError`` the call itself raises for a missing parameter is reported the same way.
A function without ``**kwargs`` that takes no keyword for something the scorer passes it (a column of the row,
not only those it uses, or ``max_completion_length``) is a bug in its signature, not a bad record: checked
before the call (or found in the call's ``TypeError``), its message says to add ``**kwargs``.

A failure names where the user's code raised it: the deepest frame in the function's own file (else the first
frame outside this project and the standard library), never the worker thread's or the event loop's. Functions
that take ``trainer_state`` (or ``**kwargs``, as TRL passes it always) get a :class:`TrainerState`. A Python
function is put behind this interface in TRL's calling convention by :mod:`services.scorer.rewards.trl_convention`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import os
import sysconfig
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from services.scorer.rewards.reward_threads import RewardThreads, RewardTimeoutError
from shared.redaction import redact, redacted_error
from shared.resilience import CircuitBreaker, CircuitOpenError

log = logging.getLogger(__name__)

__all__ = [
    "CircuitOpenError",
    "RewardBatch",
    "RewardError",
    "RewardFailure",
    "RewardFunction",
    "RewardInputError",
    "TrainerState",
]

# What a Python reward function raises when something it calls is out of reach: an outage, retried like an
# HTTP plugin's. Anything else it raises is a bug in the function.
OUTAGE_EXCEPTIONS: tuple[type[Exception], ...] = (OSError, httpx.HTTPError)

# Code that is not the user's, for finding the user's frame in a traceback: this project's services and shared
# packages (the scorer, the worker threads) and the standard library (asyncio, concurrent.futures, json, ...).
_PROJECT_ROOT = Path(__file__).resolve().parents[3]
SCORER_CODE = (str(_PROJECT_ROOT / "services") + os.sep, str(_PROJECT_ROOT / "shared") + os.sep)
_NOT_USER_CODE = SCORER_CODE + tuple(
    {os.path.realpath(sysconfig.get_paths()[key]) + os.sep for key in ("stdlib", "platstdlib")}
)
_FLOAT32_MAX = float(np.finfo(np.float32).max)  # a reward past it is inf once on the wire


class RewardError(RuntimeError):
    """A reward function failed or answered something that is not G rewards."""


class RewardInputError(RewardError):
    """The group cannot be put to the function (its columns cannot be encoded): a bad record, not an outage."""


class RewardBugError(RuntimeError):
    """A required reward's Python function has a bug: the scorer stops rather than retry or skip its groups."""

    def __init__(self, failure: RewardFailure) -> None:
        super().__init__(
            f"required {failure}: a bug in the function (the same group would fail the same way again), so the "
            "scorer stops, as TRL's trainer would. Fix the function and start the scorer again (the group is "
            "scored then), or set required = false to give this reward NaN where it raises"
        )
        self.failure = failure


@dataclass(frozen=True)
class TrainerState:
    """The ``trainer_state`` a reward function gets: the fields of TRL's ``transformers.TrainerState`` that mean
    the same here, under TRL's names (any other TrainerState attribute raises AttributeError).

    ``global_step``: the learner's optimizer step when the group's sampling started (its ``policy_version``; the
    newest of them when a batched reward is called over several groups). ``max_steps``: the learner's
    ``max_steps`` as the scorer is told it (``scorer.max_steps``), None when it is not. ``epoch``: TRL's fractional
    progress through the data; always None, since the scorer does not know the dataset's length.
    """

    global_step: int
    max_steps: int | None = None
    epoch: float | None = None


@dataclass(frozen=True)
class RewardBatch:
    """One group in TRL's reward-function vocabulary (every list has G entries).

    ``multi_turn``: the completions are tool-use conversations (an environment ran): each is a list of
    messages with tool calls and tool results, and ``columns`` holds ``env_reward``. HTTP plugins get such a
    group as protocol v2, every other group as v1."""

    prompts: list[Any]
    completions: list[Any]
    completion_ids: list[list[int]]
    columns: dict[str, list[Any]]
    group_id: str = ""  # for logs and errors only; reward functions never see it
    multi_turn: bool = False
    trainer_state: TrainerState | None = None  # what functions taking ``trainer_state`` get

    def __len__(self) -> int:
        return len(self.completions)


@dataclass
class RewardStats:
    calls: int = 0
    errors: int = 0
    short_circuited: int = 0
    nan_values: int = 0
    bugs: int = 0  # failures of an in-process function that are not outages (see the module docstring)
    bad_inputs: int = 0  # groups that could not be put to the function (RewardInputError)
    timeouts: int = 0  # Python calls abandoned at timeout_s (outages, also counted in errors)
    retried_5xx: int = 0
    retried_transport: int = 0
    latency_s_total: float = 0.0
    last_error: str = ""

    def as_metrics(self, name: str) -> dict[str, float]:
        return {
            f"rewards/{name}/calls": self.calls,
            f"rewards/{name}/errors": self.errors,
            f"rewards/{name}/short_circuited": self.short_circuited,
            f"rewards/{name}/nan_values": self.nan_values,
            f"rewards/{name}/bugs": self.bugs,
            f"rewards/{name}/bad_inputs": self.bad_inputs,
            f"rewards/{name}/timeouts": self.timeouts,
            f"rewards/{name}/retried_5xx": self.retried_5xx,
            f"rewards/{name}/retried_transport": self.retried_transport,
            f"rewards/{name}/latency_seconds_total": self.latency_s_total,
        }


@dataclass
class RewardFunction:
    """A named reward function: ``call(batch)`` -> G values, behind its own breaker.

    ``required``: a failure holds the group back (the scoring loop retries it) instead of giving NaN.
    ``in_process``: a Python function (built-in or plugin), whose failures other than outages are bugs.
    ``threads``: the worker threads a Python plugin runs in (their ``hung`` count is a gauge).
    ``source``: the file of a Python function, where its failures are located (:func:`failure_detail`).
    ``batched``: called once over several groups (:mod:`services.scorer.rewards.batching`), not once per group.
    """

    name: str
    call: Callable[[RewardBatch], Any]
    stats: RewardStats = field(default_factory=RewardStats)
    required: bool = True
    breaker: CircuitBreaker | None = None
    in_process: bool = False
    threads: RewardThreads | None = None
    source: str | None = None
    batched: bool = False

    def __post_init__(self) -> None:
        if self.breaker is None:
            self.breaker = CircuitBreaker(self.name, threshold=5, reset_s=30.0)


@dataclass(frozen=True)
class RewardFailure:
    """One reward function that gave no values for one group, and why."""

    reward: str
    group_id: str
    detail: str  # "HTTP 503 after 3 attempts: body 'boom'", "ValueError: x (at m.py:3 in f)", ...
    short_circuited: bool = False  # the breaker refused the call; nothing was sent
    bug: bool = False  # a bug in a Python function, not an outage: calling again would fail the same way
    bad_input: bool = False  # the group could not be put to the function: the record is bad (RewardInputError)

    def __str__(self) -> str:
        return f"reward {self.reward} on group {self.group_id}: {self.detail}"


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
            if abs(number) > _FLOAT32_MAX:
                raise RewardError(f"{name} returned {number:.6g}, beyond float32 (the wire's rewards), where it is inf")
            out.append(number)
        else:
            raise RewardError(f"{name} returned a {type(value).__name__} among its rewards")
    return out


def source_file(function: Callable[..., Any]) -> str | None:
    """The real path of the file ``function`` is defined in (a partial's or a callable object's too); None for
    a function without one (a builtin)."""
    target = inspect.unwrap(function)
    while isinstance(target, functools.partial):
        target = target.func
    for candidate in (target, type(target)):
        try:
            return os.path.realpath(inspect.getfile(candidate))
        except TypeError:
            continue
    return None


def failure_detail(exc: BaseException, source: str | None = None) -> str:
    """What went wrong, in one line: a RewardError's message, else the exception and where the user's code
    raised it (:func:`user_frame`; ``source``: the function's file), e.g. ``ValueError: x (at my_rewards.py:12
    in accuracy)``."""
    if isinstance(exc, RewardError):
        return redact(str(exc))
    if isinstance(exc, RewardTimeoutError):
        return redacted_error(exc)  # where the call was abandoned says nothing
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip() or type(exc).__name__
    frame = user_frame(traceback.extract_tb(exc.__traceback__), source)
    if frame is not None:
        text += f" (at {Path(frame.filename).name}:{frame.lineno} in {frame.name})"
    return redact(text)


def user_frame(frames: Sequence[traceback.FrameSummary], source: str | None) -> traceback.FrameSummary | None:
    """The frame to name for a failure, from the outermost ``frames`` to the innermost: the deepest one in the
    function's own file ``source``; else the first outside this project's services/ and shared/ and the standard
    library (the user's code that was called); else the innermost; None without frames."""
    if source is not None:
        own = [frame for frame in frames if os.path.realpath(frame.filename) == source]
        if own:
            return own[-1]
    outside = [frame for frame in frames if not os.path.realpath(frame.filename).startswith(_NOT_USER_CODE)]
    if outside:
        return outside[0]
    return frames[-1] if frames else None


async def run_function(function: RewardFunction, batch: RewardBatch) -> list[float] | RewardFailure:
    """Call one reward function on one group through its breaker: G floats (None -> NaN) or the failure."""
    breaker = function.breaker
    assert breaker is not None
    started = time.perf_counter()
    try:
        trial = breaker.before_call()
    except CircuitOpenError as exc:
        function.stats.short_circuited += 1
        log.debug("reward %s skipped group %s: %s", function.name, batch.group_id, exc)
        return RewardFailure(function.name, batch.group_id, str(exc), short_circuited=True)
    function.stats.calls += 1
    try:
        values = validate_rewards(function.name, await function.call(batch), len(batch))
    except RewardInputError as exc:
        breaker.release_trial(trial)  # no answer either way: the function was never asked
        return _bad_input(function, batch, exc)
    except Exception as exc:
        return _failed(function, batch, exc, trial, first=breaker.failures == 0)
    except BaseException:  # cancelled: the trial slot must not stay taken
        breaker.release_trial(trial)
        raise
    finally:
        function.stats.latency_s_total += time.perf_counter() - started
    breaker.success(trial)
    function.stats.nan_values += sum(math.isnan(v) for v in values)
    return values


def is_bug(function: RewardFunction, exc: Exception) -> bool:
    """Whether ``exc`` is a bug in ``function`` rather than an outage (see the module docstring)."""
    return function.in_process and not isinstance(exc, OUTAGE_EXCEPTIONS)


def _failed(function: RewardFunction, batch: RewardBatch, exc: Exception, trial: bool, *, first: bool) -> RewardFailure:
    bug = is_bug(function, exc)
    failure = RewardFailure(function.name, batch.group_id, failure_detail(exc, function.source), bug=bug)
    function.stats.errors += 1
    function.stats.timeouts += isinstance(exc, RewardTimeoutError)
    function.stats.last_error = failure.detail
    assert function.breaker is not None
    function.breaker.failure(f"group {batch.group_id}: {failure.detail}", trial=trial)
    if bug:
        function.stats.bugs += 1
        _log_bug(function, failure, exc)
        return failure
    what = "the group waits and is retried" if function.required else "its rewards are NaN for this group"
    # The first failure after a success carries the whole traceback; the rest one line each.
    log.warning("%s (%s)", failure, what, exc_info=exc if first and not isinstance(exc, RewardError) else None)
    return failure


def _bad_input(function: RewardFunction, batch: RewardBatch, exc: RewardInputError) -> RewardFailure:
    function.stats.bad_inputs += 1
    failure = RewardFailure(function.name, batch.group_id, str(exc), bad_input=True)
    log.warning("%s: the group cannot be sent, so it is dead-lettered as a bad record", failure)
    return failure


def _log_bug(function: RewardFunction, failure: RewardFailure, exc: Exception) -> None:
    """A function's first bug at ERROR with its traceback; later ones one line each."""
    what = "the scorer stops" if function.required else "its rewards are NaN for this group (required = false)"
    if function.stats.bugs == 1:
        log.error("%s: a bug in the function, %s", failure, what, exc_info=exc)
    else:
        log.warning("%s: a bug in the function (%d so far), %s", failure, function.stats.bugs, what)


async def score_batch(functions: Sequence[RewardFunction], batch: RewardBatch) -> np.ndarray:
    """Rewards [G, F] (float32), NaN wherever a function returned None or failed."""
    results = await asyncio.gather(*(run_function(f, batch) for f in functions))
    if not results:
        return np.zeros((len(batch), 0), dtype=np.float32)
    columns = [[math.nan] * len(batch) if isinstance(r, RewardFailure) else r for r in results]
    return np.asarray(columns, dtype=np.float32).T.copy()


def intake_state(functions: Sequence[RewardFunction]) -> tuple[str, list[str]]:
    """Whether the scorer may take new rollouts, from its *required* rewards' breakers.

    ``("closed", [])``: take as many as fit; ``("half_open", reasons)``: take one, as the trial, when
    nothing is in flight; ``("open", reasons)``: take none. Optional rewards never pause the scorer.
    """
    states, reasons = set(), []
    for function in functions:
        if not function.required or function.breaker is None:
            continue
        state = function.breaker.refresh()
        if state != "closed":
            states.add(state)
            reasons.append(function.breaker.describe())
    worst = "open" if "open" in states else "half_open" if states else "closed"
    return worst, reasons
