"""The policy version a trajectory's sampled tokens come from, for staleness (docs/concepts/multi-turn-design.md §2.2).

One named pure function, in prime-rl's ``min_fresh_version`` style, read by the ``Rollout`` validator and
(from build step 12) the learner: numpy in, an int out, no Redis and no settings.

Why the result is a lower bound. Each turn's sampled tokens are stamped with the engine's policy version at the
turn's start. A weight push that lands mid-turn either preempts the turn's request and recomputes it under the new
weights, or keeps the KV computed so far and samples the rest with the new weights reading it
(``generator.in_flight_at_push``, ``services/generator/engine.py::_take_version``), and vLLM stamps no tokens of its
own, so a token may have been sampled by a *newer* version than its stamp, never an older one (versions only go up;
a restarted learner's ``reset`` push, which goes back, is the exception). Each load of weights salts the prefix
cache anew (the engine's ``cache_salt``), so a request meets only blocks of requests stamped with its own version,
computed under it or later ones: no token reads KV older than its stamp either. The minimum stamp is therefore at
most the oldest version that really sampled a token: staleness (the learner's version minus it) errs on the old
side, which is the safe side when dropping stale groups.
"""

from __future__ import annotations

import numpy as np

from shared.trajectory import MASKED_VERSION


def trajectory_version(token_versions: np.ndarray | None, loss_mask: np.ndarray | None) -> int | None:
    """The oldest policy version over a completion's sampled tokens.

    ``token_versions`` [N] int: the version stamped on each token, ``MASKED_VERSION`` (-1) on context tokens.
    ``loss_mask`` [N] (0/1): 1 on sampled tokens; None means every token was sampled (single-turn).
    Entries of ``MASKED_VERSION`` name no version and are ignored, with or without a mask.

    Returns None when there is nothing to bound: ``token_versions`` is None (the engine reported only the
    start version, which the rollout's ``policy_version`` carries) or no sampled token has a version.
    """
    if token_versions is None:
        return None
    versions = np.asarray(token_versions)
    if loss_mask is not None:
        mask = np.asarray(loss_mask)
        if mask.shape != versions.shape:
            raise ValueError(f"loss_mask has shape {mask.shape} but token_versions has shape {versions.shape}")
        versions = versions[mask == 1]
    versions = versions[versions != MASKED_VERSION]
    if not versions.size:
        return None
    return int(versions.min())
