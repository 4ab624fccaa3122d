"""Which numbers may reach the weights: logprobs finite and at most 0, rewards finite (NaN where a reward is
None), advantages finite, and an optimizer step's loss and gradient norm finite.

One NaN in a batch makes the loss and the gradient norm NaN, and AdamW then writes NaN into every weight it
updates: weights that would be pushed to every generator and checkpointed. These checks run where the numbers
enter: the generator's output (:mod:`services.generator.engine`), the wire records every reader decodes
(:class:`shared.trajectory.Completion`, :class:`shared.records.ScoredGroup`, so the scorer and the learner
dead-letter a bad entry with the reason) and the learner's optimizer step
(:meth:`services.learner.optimizer.OptimizerStep.apply`), which never applies a step whose loss or gradient norm
is not finite. Each check returns the problem as a sentence, or None; the callers raise or count.
"""

from __future__ import annotations

import math

import numpy as np

# log p of a token is at most log 1 = 0; engines compute log_softmax in float32, which keeps that exactly.
LOGPROB_MAX = 0.0
_SHOWN = 3  # positions a problem names


def _positions(where: np.ndarray) -> str:
    """The first few indices where ``where`` [N] is true, for a problem's sentence."""
    indices = np.flatnonzero(where)
    shown = ", ".join(str(int(i)) for i in indices[:_SHOWN])
    more = f" and {len(indices) - _SHOWN} more" if len(indices) > _SHOWN else ""
    return f"{shown}{more}"


def _non_finite(values: np.ndarray, name: str, *, nan_allowed: bool) -> str | None:
    """The problem with ``values`` holding +-inf (or NaN, unless ``nan_allowed``), or None."""
    flat = np.asarray(values, dtype=np.float64).reshape(-1)
    for label, where in (("NaN", np.isnan(flat)), ("+inf", np.isposinf(flat)), ("-inf", np.isneginf(flat))):
        if label == "NaN" and nan_allowed:
            continue
        if where.any():
            return f"{name} holds {label} at {_positions(where)} (flat index)"
    return None


def logprob_problem(logprobs: np.ndarray, name: str = "behaviour_logprobs") -> str | None:
    """Why ``logprobs`` [N] cannot be trained on (NaN, +-inf, or above :data:`LOGPROB_MAX`), or None."""
    problem = _non_finite(logprobs, name, nan_allowed=False)
    if problem:
        return problem
    above = np.asarray(logprobs, dtype=np.float64) > LOGPROB_MAX
    if above.any():
        worst = float(np.max(logprobs))
        return f"{name} holds positive values (largest {worst:.6g}) at {_positions(above)}: a logprob is at most 0"
    return None


def reward_problem(rewards: np.ndarray, name: str = "rewards") -> str | None:
    """Why ``rewards`` cannot be trained on (+-inf; NaN stands for a reward that is None, and is allowed)."""
    return _non_finite(rewards, name, nan_allowed=True)


def finite_problem(values: np.ndarray, name: str) -> str | None:
    """Why ``values`` (advantages, importance weights) are not all finite, or None."""
    return _non_finite(values, name, nan_allowed=False)


def step_problem(loss: float, grad_norm: float) -> str | None:
    """Why an optimizer step must not be applied: its loss or gradient norm (before clipping) is not finite."""
    bad = [f"{name} {value}" for name, value in (("loss", loss), ("grad_norm", grad_norm)) if not math.isfinite(value)]
    return f"not finite: {', '.join(bad)}" if bad else None
