"""Optimizer steps that were not applied because their loss or gradient norm was not finite: each is logged
with the ids of its batch's groups, counted (``train/nonfinite_steps``), and a run of them stops the learner.

The optimizer (:meth:`services.learner.optimizer.OptimizerStep.apply`) decides, and leaves the weights, AdamW's
state and the schedule as they were; this module keeps the tally. One such step can be one bad batch (the
records were checked for non-finite numbers on the way, :mod:`shared.finite`, so what is left is the model's own
arithmetic: an overflow in the forward); several in a row are a model or a pipeline gone wrong, and training
on would only skip every batch that follows.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.learner.optimizer import NONFINITE_STEP
from shared.finite import step_problem

log = logging.getLogger(__name__)

# One step can be a bad batch; three in a row is the model or the pipeline gone wrong, not bad luck.
MAX_NONFINITE_STEPS_IN_A_ROW = 3
_IDS_SHOWN = 8  # group ids an error names per step (the log line names them all)


class NonFiniteTraining(RuntimeError):
    """``MAX_NONFINITE_STEPS_IN_A_ROW`` optimizer steps in a row were not applied; the message names them."""


@dataclass(frozen=True)
class SkippedStep:
    """One optimizer step not applied: the policy version it would have produced, why, its groups."""

    version: int
    problem: str
    group_ids: tuple[str, ...]

    def describe(self) -> str:
        ids = ", ".join(self.group_ids[:_IDS_SHOWN])
        more = f" and {len(self.group_ids) - _IDS_SHOWN} more" if len(self.group_ids) > _IDS_SHOWN else ""
        return f"step to version {self.version}: {self.problem} (groups {ids}{more})"


@dataclass
class NonfiniteSteps:
    """The steps not applied since the last applied one; ``limit`` in a row raise :class:`NonFiniteTraining`."""

    limit: int = MAX_NONFINITE_STEPS_IN_A_ROW
    in_a_row: list[SkippedStep] = field(default_factory=list)

    def applied(self) -> None:
        """A step was applied: the run of skipped steps is over."""
        self.in_a_row.clear()

    def skipped(self, step: SkippedStep) -> None:
        """A step was not applied: logged with every group id; the ``limit``-th in a row raises."""
        log.error(
            "optimizer step not applied (%d in a row, the limit is %d): %s; groups: %s",
            len(self.in_a_row) + 1,
            self.limit,
            step.problem,
            ", ".join(step.group_ids),
        )
        self.in_a_row.append(step)
        if len(self.in_a_row) >= self.limit:
            steps = "; ".join(s.describe() for s in self.in_a_row)
            raise NonFiniteTraining(
                f"{len(self.in_a_row)} optimizer steps in a row had a loss or gradient norm that is not finite and "
                f"were not applied (the weights are those of the last applied step): {steps}. Look at these "
                "groups' records and the learner's dtype settings (compute_dtype) before resuming"
            )

    def applied_of(
        self, results: Sequence[dict[str, float]], version: int, group_ids: tuple[str, ...]
    ) -> list[dict[str, float]]:
        """The figures of a batch's optimizer steps that were applied (``NONFINITE_STEP`` absent); each one that
        was not is passed to :meth:`skipped`. ``version``: the policy version after the batch's steps."""
        applied = [result for result in results if NONFINITE_STEP not in result]
        version -= len(applied)  # the version the batch's first step started from
        for result in results:
            if NONFINITE_STEP not in result:
                version += 1
                self.applied()
                continue
            problem = step_problem(result["loss"], result["grad_norm"]) or "not finite"
            self.skipped(SkippedStep(version + 1, problem, group_ids))
        return applied
