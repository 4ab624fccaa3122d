"""The scorer's start-up check of its Python rewards: each ``function = "module:name"`` imports, and a name
that is not there is refused with the closest names the module has (:mod:`shared.reward_imports`).

The scorer runs it before it builds its reward functions (``__main__``), so a misspelled function stops it
with one line (exit status 2) instead of a traceback; ``asyncgrpo run`` and ``asyncgrpo config explain`` run
the same check before anything starts (``services/launcher/preflight.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import httpx

from services.scorer.rewards.functions import RewardFunction
from services.scorer.rewards.http_plugin import HttpRewardPlugin
from services.scorer.scoring import build_functions
from shared.config.scorer import RewardSpec
from shared.lifecycle import NotStarting
from shared.reward_imports import reward_problems


def build_rewards(
    specs: Sequence[RewardSpec], http: httpx.AsyncClient
) -> tuple[list[RewardFunction], list[HttpRewardPlugin]]:
    """:func:`~services.scorer.scoring.build_functions` once every Python reward imports; else
    :class:`NotStarting` naming each one that does not (the scorer exits with status 2, no traceback)."""
    problems = reward_problems(specs)
    if problems:
        raise NotStarting("; ".join(problems))
    return build_functions(specs, http)
