"""TRL 1.16's built-in reward functions (``trl.rewards``), with the same names, signatures and results, so that a
recipe naming them (``config from-trl`` writes ``function = "shared.trl_rewards:accuracy_reward"``) runs in the
scorer without TRL installed.

==============================  ==========================================================================
``accuracy_reward``             1.0 / 0.0: the completion's first LaTeX answer (``\\boxed{}`` first) verifies
                                against the solution (math_verify); None where the solution does not parse
``reasoning_accuracy_reward``   the same on what follows the last reasoning delimiter (``</think>``); 0.0
                                when no delimiter closes the reasoning
``think_format_reward``         1.0 when the completion opens with one ``<think>...</think>``, else 0.0
``get_cosine_scaled_reward``    a factory: correctness scaled by completion length on a cosine schedule
``get_soft_overlong_punishment`` a factory: DAPO's soft penalty for completions near or over a length
``get_repetition_penalty_reward`` a factory: the share of repeated token n-grams, times a negative penalty
==============================  ==========================================================================

Each takes TRL's keyword arguments (``completions`` as conversational messages, ``solution``,
``completion_ids``) and ignores the rest, as TRL's do. math_verify (in the scorer's lock) is imported when a
function that verifies answers first runs, so importing this module costs nothing. Like TRL's, a call off the
main thread runs math_verify without its timeouts, which use ``signal.alarm`` (main thread only).
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

Completions = Sequence[Sequence[dict[str, Any]]]
_THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)
_PARSE_TIMEOUT_S, _VERIFY_TIMEOUT_S = 10, 5  # TRL's: math_verify's own limits, main thread only


def think_format_reward(completions: Completions, **kwargs: Any) -> list[float]:
    """1.0 where the completion's text opens with ``<think>``, holds no second ``<think>`` and closes it."""
    return [1.0 if _THINK.match(completion[0]["content"]) else 0.0 for completion in completions]


def accuracy_reward(
    completions: Completions, solution: Sequence[str], log_extra: Callable | None = None, **kwargs: Any
) -> list[float | None]:
    """1.0 where the completion's answer verifies against ``solution``, 0.0 where not, None where the solution
    does not parse (TRL skips such a row)."""
    return _verified([completion[0]["content"] for completion in completions], solution, log_extra)


def reasoning_accuracy_reward(
    completions: Completions,
    solution: Sequence[str],
    reasoning_delimiters: Sequence[str] | None = None,
    log_extra: Callable | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """:func:`accuracy_reward` on the text after the first of ``reasoning_delimiters`` (default ``</think>``)
    found, split at its last occurrence; 0.0 (not None) for a completion whose reasoning never closes."""
    delimiters = ["</think>"] if reasoning_delimiters is None else list(reasoning_delimiters)
    answers: list[str | None] = []
    for completion in completions:
        content = completion[0]["content"]
        delimiter = next((d for d in delimiters if d in content), None)
        answers.append(None if delimiter is None else content.split(delimiter)[-1])
    closed = [(answer, gold) for answer, gold in zip(answers, solution, strict=True) if answer is not None]
    scored = iter(_verified([answer for answer, _ in closed], [gold for _, gold in closed], None))
    rewards = [0.0 if answer is None else next(scored) for answer in answers]
    if log_extra is not None:
        log_extra("solution", list(solution))
    return rewards


def get_cosine_scaled_reward(
    max_len: int,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
) -> Callable[..., list[float | None]]:
    """Correctness (:func:`accuracy_reward`) scaled by length: a correct completion gets from
    ``max_value_correct`` (empty) down to ``min_value_correct`` (``max_len`` tokens or more), a wrong one from
    ``min_value_wrong`` up to ``max_value_wrong``, along half a cosine; None where the solution does not parse."""

    def cosine_scaled_reward(
        completions: Completions, solution: Sequence[str], completion_ids: Sequence[Sequence[int]], **kwargs: Any
    ) -> list[float | None]:
        rewards: list[float | None] = []
        for correct, ids in zip(accuracy_reward(completions, solution), completion_ids, strict=True):
            if correct is None:
                rewards.append(None)
                continue
            low, high = (min_value_correct, max_value_correct) if correct else (max_value_wrong, min_value_wrong)
            progress = min(len(ids) / max_len, 1.0)  # past max_len the cosine would climb back
            rewards.append(float(low + 0.5 * (high - low) * (1.0 + math.cos(progress * math.pi))))
        return rewards

    return cosine_scaled_reward


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Callable[..., list[float]]:
    """0 up to ``max_completion_len - soft_punish_cache`` tokens, then falling linearly to -1 at
    ``max_completion_len``, and -1 past it (DAPO, eq. 13)."""
    free = max_completion_len - soft_punish_cache

    def soft_overlong_punishment_reward(completion_ids: Sequence[Sequence[int]], **kwargs: Any) -> list[float]:
        return [
            0.0
            if len(ids) <= free
            else (free - len(ids)) / soft_punish_cache
            if len(ids) <= max_completion_len
            else -1.0
            for ids in completion_ids
        ]

    return soft_overlong_punishment_reward


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0) -> Callable[..., list[float]]:
    """``(1 - unique / total token n-grams) x max_penalty`` per completion; 0.0 below ``ngram_size`` tokens."""
    if max_penalty > 0:
        raise ValueError(f"max_penalty {max_penalty} should not be positive")

    def repetition_penalty_reward(completion_ids: Sequence[Sequence[int]], **kwargs: Any) -> list[float]:
        rewards = []
        for ids in completion_ids:
            grams = [tuple(ids[i : i + ngram_size]) for i in range(len(ids) - ngram_size + 1)]
            rewards.append((1 - len(set(grams)) / len(grams)) * max_penalty if grams else 0.0)
        return rewards

    return repetition_penalty_reward


def _verified(answers: Sequence[str], solutions: Sequence[str], log_extra: Callable | None) -> list[float | None]:
    """Each answer verified against its solution with math_verify as TRL configures it (LaTeX, ``\\boxed{}``
    first, units normalised, the first match); None where the solution does not parse."""
    try:
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError as exc:
        raise ImportError(
            f"TRL's answer-checking rewards need math_verify ({exc}): pip install math-verify (the scorer's "
            "image and requirements/scorer.txt have it)"
        ) from exc
    main = threading.current_thread() is threading.main_thread()
    parse_timeout, verify_timeout = (_PARSE_TIMEOUT_S, _VERIFY_TIMEOUT_S) if main else (None, None)
    if not main:  # math_verify warns on every call that its timeouts are off
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).setLevel(logging.ERROR)
    normalization = type(LatexExtractionConfig().normalization_config)  # latex2sympy2_extended's, as math_verify has it
    extraction = [
        LatexExtractionConfig(
            normalization_config=normalization(units=True),
            boxed_match_priority=0,
            try_extract_without_anchor=False,
        )
    ]
    rewards: list[float | None] = []
    for answer, gold_text in zip(answers, solutions, strict=True):
        gold = parse(gold_text, parsing_timeout=parse_timeout)
        if not gold:
            rewards.append(None)
            continue
        parsed = parse(
            answer, extraction_config=extraction, extraction_mode="first_match", parsing_timeout=parse_timeout
        )
        rewards.append(float(verify(gold, parsed, timeout_seconds=verify_timeout)))
    if log_extra is not None:
        log_extra("solution", list(solutions))
    return rewards
