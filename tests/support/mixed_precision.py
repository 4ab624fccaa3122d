"""Measures what a few small AdamW steps do to the master weights under a precision policy.

Shared by the CPU test (tests/unit/test_mixed_precision.py) and the CUDA one (tests/gpu/): the tiny Llama
takes ``steps`` optimizer steps at lr 1e-6 on one fixed batch, and the update (weights after minus before,
in float32) is compared across policies.
"""

from __future__ import annotations

from pathlib import Path

import torch

from services.learner.data.batch import collate
from services.learner.model import load_policy
from services.learner.trainer import Trainer
from shared.config.learner import LearnerSettings
from tests.support.factories import make_task
from tests.support.fake_pipeline import scored_group_for


def fixed_batch(vocab: int = 100):
    """Two groups of four completions (up to 16 tokens), the same every call."""
    groups = [scored_group_for(make_task(group_size=4, task_id=f"mixed-{i}"), version=0, vocab=vocab) for i in (0, 1)]
    return collate(groups, [torch.from_numpy(g.advantages.copy()) for g in groups], pad_id=4)


def train_update(
    model_path: Path, device: str, param_dtype: str, compute_dtype: str, *, steps: int = 5, lr: float = 1e-6
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(weights before, weights after) of ``steps`` steps on :func:`fixed_batch`, in the master dtype."""
    settings = LearnerSettings(
        model=str(model_path),
        device=device,
        param_dtype=param_dtype,
        compute_dtype=compute_dtype,
        group_size=4,
        groups_per_step=2,
        micro_batch_size=8,
        num_iterations=steps,
        max_steps=1000,
        lr=lr,
        max_completion_length=16,
        seed=0,
    )
    torch.manual_seed(0)
    model, _ = load_policy(settings, str(model_path))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    Trainer(model, settings).train(fixed_batch())
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    return before, after


def moved_fraction(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """Share of the weights whose stored value changed at all."""
    changed = sum(int((after[n] != before[n]).sum()) for n in before)
    return changed / sum(t.numel() for t in before.values())


def update_of(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> torch.Tensor:
    """after - before, flattened, float64 (exact for float32 and bf16 weights)."""
    return torch.cat([(after[n].double() - before[n].double()).flatten().cpu() for n in sorted(before)])


def relative_l2(update: torch.Tensor, reference: torch.Tensor) -> float:
    """||update - reference|| / ||reference||."""
    return float((update - reference).norm() / reference.norm())
