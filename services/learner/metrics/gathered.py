"""Figures over every rank's rows: each rank's tensors gathered to all (a collective every rank calls at the
same point), then the single-process figure of :mod:`services.learner.metrics.batch_metrics` or
:mod:`services.learner.objective.importance` over the whole batch. On one process the gather is the identity.
"""

from __future__ import annotations

import torch

from services.learner import distributed
from services.learner.data.batch import TrainBatch
from services.learner.metrics.batch_metrics import sampling_logp_difference_metrics
from services.learner.objective.importance import importance_weight_metrics


def logp_difference(local: TrainBatch, old: torch.Tensor | None) -> dict[str, float]:
    """|behaviour - recomputed old| logprob figures over every rank's sampled tokens; ``old`` [B_r, T]."""
    if old is None:
        return {}
    parts = distributed.gather_objects((local.behaviour_logprobs.cpu(), old.cpu(), local.loss_mask.cpu()))
    behaviour, recomputed, mask = (torch.cat(column) for column in zip(*parts, strict=True))
    return sampling_logp_difference_metrics(behaviour, recomputed, mask)


def importance_metrics(weights: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The importance weights' figures over every rank's active tokens; ``weights`` and ``mask`` [B_r, T]."""
    pairs = distributed.gather_objects((weights.cpu(), mask.cpu()))
    return importance_weight_metrics(torch.cat([w for w, _ in pairs]), torch.cat([m for _, m in pairs]))
