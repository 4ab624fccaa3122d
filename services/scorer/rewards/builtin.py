"""Built-in reward functions, named as in the GRPO write-ups this project follows.

Every function uses TRL's calling convention, ``f(prompts, completions, completion_ids, **columns)`` ->
``list[float | None]``, so it can be used with TRL too. ``completions`` are strings, or (for chat prompts,
as TRL passes them) one-message lists ``[{"role": "assistant", "content": ...}]``; for a tool-use
trajectory the whole conversation after the prompt, whose last message is the final answer (the text
rewards read it). Each reward is in [0, 1] (``overlong`` in [-1, 0], ``env_reward`` whatever the
environment gives); scale them with weights in the settings - the write-ups' 2.0 for correctness and 0.5
for the format rewards are ``weight = 2.0`` and ``weight = 0.5``.

=============  =====================================================================================
correctness    1 if the answer (inside ``<answer>...</answer>``, else after GSM8K's ``####``) equals the
               ``answer`` column: numbers compared as numbers ("1,000" = "1000.0"), anything else with
               math-verify (``\\frac{1}{2}`` = ``0.5``); None when the row has no reference answer
digit          1 if that answer is a number
hard_format    1 if the completion is exactly ``<think>...</think>`` then ``<answer>...</answer>``
soft_format    1 if ``<think>...</think>`` is followed somewhere by ``<answer>...</answer>``
mark           0.25 for each of the four tags that appears exactly once
overlong       DAPO's soft overlong penalty: 0 up to ``max_completion_length - buffer`` tokens, then
               linear down to -1 at ``max_completion_length``, -1 beyond (``buffer`` is a parameter)
env_reward     the environment's own reward of a tool-use trajectory (its ``get_reward``), as it gave it
               (not clipped to [0, 1]); None (NaN) where it gave none. What TRL's ``get_reward`` does; it
               needs an ``[environment]``, since only trajectories carry the ``env_reward`` column
=============  =====================================================================================
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

from shared.columns import ENV_REWARD_COLUMN

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_GSM8K = re.compile(r"####\s*(.+)")
_HARD = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)
_SOFT = re.compile(r"<think>.*?</think>.*?<answer>.*?</answer>", re.DOTALL)
_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")
_MATH_VERIFY_TIMEOUT_S = 5
TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def completion_text(completion: Any) -> str:
    """The text of a completion in either of TRL's formats (string, or a list of chat messages)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"a completion must be a string or a list of chat messages, got {type(completion).__name__}")


def extract_answer(text: str) -> str | None:
    """The last ``<answer>...</answer>`` content, else what follows GSM8K's ``####``; None if neither."""
    found = _ANSWER.findall(text)
    if found:
        return found[-1].strip()
    match = _GSM8K.search(text)
    return match.group(1).strip() if match else None


def _as_number(text: str) -> float | None:
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip("%").rstrip(".").strip()
    if cleaned and _NUMBER.fullmatch(cleaned):
        return float(cleaned)
    return None


def answers_equal(given: str, reference: str) -> bool:
    """Numeric-aware equality; math-verify for expressions."""
    a, b = _as_number(given), _as_number(reference)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    timeout = _MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints a notice when timeouts are off
            gold = parse(reference, parsing_timeout=timeout)
            return bool(verify(gold, parse(given, parsing_timeout=timeout), timeout_seconds=timeout))
    except Exception:  # math-verify raises on some unparsable input: not equal
        return False


def correctness(
    prompts: Sequence, completions: Sequence, completion_ids: Sequence = (), **columns
) -> list[float | None]:
    references = columns.get("answer") or [None] * len(completions)
    scores: list[float | None] = []
    for completion, reference in zip(completions, references, strict=True):
        if reference is None:
            scores.append(None)
            continue
        reference_text = extract_answer(str(reference)) or str(reference)
        given = extract_answer(completion_text(completion))
        scores.append(1.0 if given is not None and answers_equal(given, reference_text) else 0.0)
    return scores


def digit(prompts: Sequence, completions: Sequence, completion_ids: Sequence = (), **columns) -> list[float | None]:
    out: list[float | None] = []
    for completion in completions:
        given = extract_answer(completion_text(completion))
        out.append(1.0 if given is not None and _as_number(given) is not None else 0.0)
    return out


def hard_format(
    prompts: Sequence, completions: Sequence, completion_ids: Sequence = (), **columns
) -> list[float | None]:
    return [1.0 if _HARD.fullmatch(completion_text(c)) else 0.0 for c in completions]


def soft_format(
    prompts: Sequence, completions: Sequence, completion_ids: Sequence = (), **columns
) -> list[float | None]:
    return [1.0 if _SOFT.search(completion_text(c)) else 0.0 for c in completions]


def mark(prompts: Sequence, completions: Sequence, completion_ids: Sequence = (), **columns) -> list[float | None]:
    out: list[float | None] = []
    for completion in completions:
        text = completion_text(completion)
        out.append(sum(0.25 for tag in TAGS if text.count(tag) == 1))
    return out


def overlong_penalty(length: int, max_completion_length: int, buffer: int) -> float:
    """DAPO's soft overlong punishment for one completion of ``length`` tokens."""
    if buffer <= 0 or buffer > max_completion_length:
        raise ValueError(
            f"the overlong buffer ({buffer}) must be in 1..max_completion_length ({max_completion_length})"
        )
    expected = max_completion_length - buffer
    if length <= expected:
        return 0.0
    if length <= max_completion_length:
        return (expected - length) / buffer
    return -1.0


def make_overlong(buffer: int = 64) -> Callable[..., list[float | None]]:
    """``overlong`` with its buffer; reads ``max_completion_length`` from the columns (the task's budget)."""

    def overlong(
        prompts: Sequence, completions: Sequence, completion_ids: Sequence = (), **columns
    ) -> list[float | None]:
        limits = columns.get("max_completion_length")
        if not limits:
            raise ValueError("overlong needs max_completion_length (the scorer passes the task's max_tokens)")
        return [
            overlong_penalty(len(ids), int(limit), buffer) for ids, limit in zip(completion_ids, limits, strict=True)
        ]

    return overlong


def env_reward(
    prompts: Sequence, completions: Sequence, completion_ids: Sequence = (), **columns
) -> list[float | None]:
    values = columns.get(ENV_REWARD_COLUMN)
    if values is None:
        raise ValueError(
            "the env_reward reward reads the environment's reward, which only multi-turn trajectories carry: "
            "configure an [environment] for the generator, or remove env_reward from the rewards"
        )
    return [None if value is None else float(value) for value in values]


BUILTINS: dict[str, Callable[..., Callable[..., list[float | None]]]] = {
    "correctness": lambda: correctness,
    "digit": lambda: digit,
    "hard_format": lambda: hard_format,
    "soft_format": lambda: soft_format,
    "mark": lambda: mark,
    "overlong": make_overlong,
    "env_reward": lambda: env_reward,
}
