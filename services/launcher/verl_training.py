"""``config from-verl``, the trainer's side: epochs and steps, the optimizer's schedule, checkpoints, resuming,
LoRA, and verl's rollout correction (its importance sampling).

Each function takes the dotted keys it reads out of ``flat``; a value with no faithful counterpart is
refused with the reason, or translated to the nearest setting and recorded as a difference.
"""

from __future__ import annotations

import math
from typing import Any

from services.launcher.translation import Draft, ours, warmup_from_share

_OPTIM = "actor_rollout_ref.actor.optim"
_MODEL = "actor_rollout_ref.model"
_CORRECTION = "algorithm.rollout_correction"
# Every key read here (filled from the composed verl defaults when they are given).
VERL_TRAINING_READ = (
    "trainer.total_epochs",
    "trainer.total_training_steps",
    "trainer.save_freq",
    "trainer.max_actor_ckpt_to_keep",
    "trainer.default_local_dir",
    "trainer.resume_mode",
    f"{_OPTIM}.betas",
    f"{_OPTIM}.lr_scheduler_type",
    f"{_OPTIM}.warmup_style",
    f"{_OPTIM}.min_lr_ratio",
    f"{_OPTIM}.num_cycles",
    f"{_OPTIM}.lr_warmup_steps",
    f"{_OPTIM}.lr_warmup_steps_ratio",
    f"{_MODEL}.lora_rank",
    f"{_MODEL}.lora_alpha",
    f"{_MODEL}.target_modules",
    f"{_CORRECTION}.rollout_is",
    f"{_CORRECTION}.rollout_is_threshold",
)


def verl_steps(flat: dict[str, Any], draft: Draft) -> bool:
    """total_epochs -> ``data.epochs``; total_training_steps -> ``max_steps`` (verl stops at whichever comes
    first, as we do). Returns whether the run's length in steps is known."""
    epochs = flat.pop("trainer.total_epochs", None)
    steps = flat.pop("trainer.total_training_steps", None)
    if epochs is not None:
        draft.data["epochs"] = int(epochs)
    if steps is not None and steps > 0:
        draft.learner["max_steps"] = int(steps)
        return True
    if epochs is not None:
        here = draft.learner.setdefault("max_steps", ours(draft.learner, "max_steps"))
        draft.differ(
            "trainer.total_training_steps",
            f"null (train total_epochs = {epochs} epochs; the learning-rate schedule spans them)",
            f"max_steps = {here} with data.epochs = {epochs}",
            draft.steps_hint(epochs),
        )
    return False


def verl_optimizer(flat: dict[str, Any], draft: Draft, steps_known: bool) -> None:
    """AdamW's betas, and verl's constant or cosine schedule with its warm-up."""
    betas = flat.pop(f"{_OPTIM}.betas", None)
    if betas is not None:
        draft.learner["adam_beta1"], draft.learner["adam_beta2"] = (float(b) for b in betas)
    style = flat.pop(f"{_OPTIM}.warmup_style", None)  # verl's older name of lr_scheduler_type
    kind = flat.pop(f"{_OPTIM}.lr_scheduler_type", None) or style
    floor = flat.pop(f"{_OPTIM}.min_lr_ratio", None)
    cycles = flat.pop(f"{_OPTIM}.num_cycles", 0.5)
    if kind == "constant":
        draft.learner["min_lr_ratio"] = 1.0
    elif kind == "cosine" and cycles == 0.5:
        draft.learner["min_lr_ratio"] = float(floor or 0.0)
    elif kind is not None:
        raise ValueError(
            f"optim.lr_scheduler_type = {kind!r} (num_cycles {cycles}): the schedule here is a warm-up, then a "
            "half cosine to min_lr_ratio x lr; verl's 'constant' and 'cosine' (num_cycles 0.5) translate"
        )
    _verl_warmup(flat, draft, steps_known)


def _verl_warmup(flat: dict[str, Any], draft: Draft, steps_known: bool) -> None:
    steps = flat.pop(f"{_OPTIM}.lr_warmup_steps", None)
    ratio = flat.pop(f"{_OPTIM}.lr_warmup_steps_ratio", None)
    if steps is not None and steps > 0:
        draft.learner["warmup_steps"] = int(steps)
    elif ratio:
        warmup_from_share(
            draft,
            ratio,
            steps_known,
            f"optim.lr_warmup_steps_ratio = {ratio} is a share of the run, whose length follows from the "
            "dataset here: set trainer.total_training_steps, or optim.lr_warmup_steps",
        )


def verl_checkpoints(flat: dict[str, Any], draft: Draft, steps_known: bool) -> None:
    """save_freq -> ``checkpoint_every``, max_actor_ckpt_to_keep -> ``keep_checkpoints``, the directory, resume."""
    every = flat.pop("trainer.save_freq", None)
    known_keep = "trainer.max_actor_ckpt_to_keep" in flat
    keep = flat.pop("trainer.max_actor_ckpt_to_keep", None)
    if every is not None and every > 0:
        draft.learner["checkpoint_every"] = int(every)
    elif every is not None:
        last = draft.learner["checkpoint_every"] = ours(draft.learner, "max_steps")
        draft.differ(
            "trainer.save_freq",
            f"{every} (no checkpoints)",
            f"one at the end (checkpoint_every = {last})",
            "here the last step is always saved",
        )
    if keep is not None:
        draft.learner["keep_checkpoints"] = int(keep)
    elif known_keep and steps_known:
        draft.learner["keep_checkpoints"] = max(
            1, math.ceil(draft.learner["max_steps"] / ours(draft.learner, "checkpoint_every"))
        )
    elif known_keep:
        here = draft.learner.setdefault("keep_checkpoints", ours(draft.learner, "keep_checkpoints"))
        draft.differ(
            "trainer.max_actor_ckpt_to_keep",
            "null (every checkpoint is kept)",
            f"keep_checkpoints = {here}",
            "the run's length is not known here; raise keep_checkpoints to keep more",
        )
    _verl_directory(flat, draft)


def _verl_directory(flat: dict[str, Any], draft: Draft) -> None:
    directory = flat.pop("trainer.default_local_dir", None)
    if directory:
        draft.learner["checkpoint_dir"] = str(directory)
    mode = flat.pop("trainer.resume_mode", None)
    if mode in ("auto", "disable"):
        draft.learner["resume"] = mode == "auto"
    elif mode is not None:
        raise ValueError(
            f"trainer.resume_mode = {mode!r}: a verl checkpoint cannot be resumed here (its optimizer and data "
            "state are verl's); 'auto' (resume from checkpoint_dir) and 'disable' translate"
        )


def verl_lora(flat: dict[str, Any], draft: Draft) -> None:
    """model.lora_rank (> 0: LoRA), lora_alpha and target_modules."""
    rank = flat.pop(f"{_MODEL}.lora_rank", None)
    alpha = flat.pop(f"{_MODEL}.lora_alpha", None)
    targets = flat.pop(f"{_MODEL}.target_modules", None)
    if not rank:
        return
    draft.learner["lora_rank"] = int(rank)
    if alpha is not None:
        draft.learner["lora_alpha"] = float(alpha)
    if targets == "all-linear" or targets is None:
        draft.learner["lora_target_modules"] = ours(draft.learner, "lora_target_modules")
    else:
        draft.learner["lora_target_modules"] = [targets] if isinstance(targets, str) else list(targets)


def verl_correction(flat: dict[str, Any], draft: Draft) -> None:
    """rollout_correction.rollout_is (token or sequence weights, truncated at rollout_is_threshold) -> our
    importance correction; verl's default, none, differs from ours."""
    level = flat.pop(f"{_CORRECTION}.rollout_is", None)
    threshold = flat.pop(f"{_CORRECTION}.rollout_is_threshold", None)
    if level in ("token", "sequence"):
        draft.learner.update(importance_correction=True, importance_level=level, importance_mode="truncate")
        if threshold is not None:
            draft.learner["importance_cap"] = float(threshold)
        return
    if level is not None:
        raise ValueError(f"algorithm.rollout_correction.rollout_is = {level!r}: 'token' or 'sequence' translate")
    if ours(draft.learner, "importance_correction"):
        draft.learner["importance_correction"] = True
        draft.differ(
            "algorithm.rollout_correction.rollout_is",
            "null (no correction of the rollout engine's sampling)",
            f"importance_correction on ({ours(draft.learner, 'importance_level')} "
            f"{ours(draft.learner, 'importance_mode')}, cap {ours(draft.learner, 'importance_cap')})",
            "here vLLM samples from weights up to max_staleness versions old; the weights correct for it",
        )
