"""TRL's adaptive entropy controller: the entropy bonus's coefficient, moved after each optimizer step.

The bonus applies only while the last measured entropy (over the tokens the loss acted on) is at or below
``entropy_target``; after each step :func:`~services.learner.objective.loss.adaptive_entropy_coef` moves the
coefficient by ``entropy_coef_delta`` within [``entropy_coef_min``, ``entropy_coef_max``]. Without
``adaptive_entropy`` the coefficient is the configured one throughout.
"""

from __future__ import annotations

import math

from services.learner.objective.loss import adaptive_entropy_coef
from shared.config.learner import LearnerSettings
from shared.config.objective import Objective


class EntropyController:
    """The entropy coefficient of each optimizer step, and its state for a checkpoint."""

    def __init__(self, settings: LearnerSettings) -> None:
        self.settings = settings
        self.coef = settings.entropy_coef  # moved by the adaptive controller
        self.last_entropy = math.inf  # TRL's start: the adaptive bonus waits for a first measurement

    def objective(self, objective: Objective) -> Objective:
        """``objective`` for this optimizer step: the adaptive bonus applies while the last entropy <= target."""
        s = self.settings
        coef = self.coef
        if s.adaptive_entropy and self.last_entropy > s.entropy_target:
            coef = 0.0
        return objective.model_copy(update={"entropy_coef": coef})

    def update(self, acting_entropy: float) -> dict[str, float]:
        """The controller after the step, from the entropy over the tokens the policy term acted on;
        ``entropy_coef`` logged as TRL does."""
        s = self.settings
        if s.adaptive_entropy:
            self.last_entropy = acting_entropy
            self.coef = adaptive_entropy_coef(
                self.coef,
                self.last_entropy,
                target=s.entropy_target,
                delta=s.entropy_coef_delta,
                coef_min=s.entropy_coef_min,
                coef_max=s.entropy_coef_max,
            )
        return {"entropy_coef": self.coef} if s.adaptive_entropy or s.entropy_coef else {}

    def state_dict(self) -> dict[str, float]:
        return {"entropy_coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, control: dict[str, float]) -> None:
        """Restore :meth:`state_dict` (a checkpoint without one keeps the start values)."""
        self.coef = control.get("entropy_coef", self.coef)
        self.last_entropy = control.get("last_entropy", self.last_entropy)
