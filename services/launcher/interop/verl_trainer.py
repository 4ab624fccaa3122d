"""``config from-verl``, the trainer's side: epochs and steps, the optimizer's schedule, checkpoints, resuming,
LoRA, verl's rollout correction (its importance sampling), the data files, validation, loggers and gradient
checkpointing.

Each function takes the dotted keys it reads out of ``flat``; a value with no faithful counterpart is
refused with the reason, or translated to the nearest setting and recorded as a difference. The table of the
keys read, and of those that change nothing learned here, is :mod:`services.launcher.interop.verl`.
"""

from __future__ import annotations

import math
from typing import Any

from services.launcher.interop.translation import Draft, ours, run_from_directory, trackers, warmup_from_share

# The sections of verl's document this side reads (the table of its keys is services.launcher.interop.verl).
OPTIM = "actor_rollout_ref.actor.optim"
MODEL = "actor_rollout_ref.model"
CORRECTION = "algorithm.rollout_correction"


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
    betas = flat.pop(f"{OPTIM}.betas", None)
    if betas is not None:
        draft.learner["adam_beta1"], draft.learner["adam_beta2"] = (float(b) for b in betas)
    style = flat.pop(f"{OPTIM}.warmup_style", None)  # verl's older name of lr_scheduler_type
    kind = flat.pop(f"{OPTIM}.lr_scheduler_type", None) or style
    floor = flat.pop(f"{OPTIM}.min_lr_ratio", None)
    cycles = flat.pop(f"{OPTIM}.num_cycles", 0.5)
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
    steps = flat.pop(f"{OPTIM}.lr_warmup_steps", None)
    ratio = flat.pop(f"{OPTIM}.lr_warmup_steps_ratio", None)
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
        run_from_directory(directory, "trainer.default_local_dir", draft)
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
    rank = flat.pop(f"{MODEL}.lora_rank", None)
    alpha = flat.pop(f"{MODEL}.lora_alpha", None)
    targets = flat.pop(f"{MODEL}.target_modules", None)
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
    level = flat.pop(f"{CORRECTION}.rollout_is", None)
    threshold = flat.pop(f"{CORRECTION}.rollout_is_threshold", None)
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


def verl_data(flat: dict[str, Any], draft: Draft) -> None:
    """data.train_files -> ``data.source``, val_files -> ``learner.eval_data``, prompt_key -> ``prompt_column``,
    seed -> ``shuffle_seed``; what verl does with a prompt over max_prompt_length against what is done here."""
    files = flat.pop("data.train_files", None)
    if files:
        draft.data["source"] = files if isinstance(files, str) else [str(path) for path in files]
        draft.notes.append(
            "verl's preprocessed parquet files keep the reference answer in reward_model.ground_truth: for the "
            "built-in correctness reward set data.rename_columns = {'reward_model.ground_truth' = 'answer'}"
        )
    val = flat.pop("data.val_files", None)
    if val:
        draft.learner["eval_data"] = val if isinstance(val, str) else [str(path) for path in val]
    prompt_key = flat.pop("data.prompt_key", None)
    if prompt_key:
        draft.data["prompt_column"] = str(prompt_key)
    seed = flat.pop("data.seed", None)
    if seed is not None:
        draft.data["shuffle_seed"] = int(seed)
    _verl_long_prompts(flat, draft)


def _verl_long_prompts(flat: dict[str, Any], draft: Draft) -> None:
    """verl drops prompts over max_prompt_length (filter_overlong_prompts), as is done here, or else cuts them
    (truncation left/right/middle) or stops (error)."""
    dropped = flat.pop("data.filter_overlong_prompts", None)
    truncation = flat.pop("data.truncation", None)
    if dropped or (dropped is None and truncation is None):
        return
    theirs = "the run stops at one" if truncation in (None, "error") else f"they are cut ({truncation!r})"
    draft.differ(
        "data.filter_overlong_prompts",
        f"false (prompts longer than max_prompt_length are kept: {theirs})",
        "longer prompts are skipped, and counted",
        "raise max_prompt_length above your longest prompt",
    )


def verl_monitoring(flat: dict[str, Any], draft: Draft) -> None:
    """trainer.logger and project_name -> the trackers; validation (test_freq, val_before_train) ->
    ``eval_every`` and ``eval_on_start``; model.enable_gradient_checkpointing -> ``gradient_checkpointing``."""
    logger = flat.pop("trainer.logger", None)
    if logger is not None:
        names = [logger] if isinstance(logger, str) else [str(name) for name in logger]
        if "console" in names:
            draft.ignore("trainer.logger 'console'", "the learner logs every step to its log anyway")
        trackers([name for name in names if name != "console"], "trainer.logger", draft)
    project = flat.pop("trainer.project_name", None)
    if project:
        draft.learner["tracking_project"] = str(project)
    checkpointing = flat.pop(f"{MODEL}.enable_gradient_checkpointing", None)
    if checkpointing is not None:
        draft.learner["gradient_checkpointing"] = bool(checkpointing)
    frequency = flat.pop("trainer.test_freq", None)
    before = flat.pop("trainer.val_before_train", None)
    if "eval_data" not in draft.learner:
        return  # no val_files: verl validates nothing either
    if frequency is not None and frequency > 0:
        draft.learner["eval_every"] = int(frequency)
    if before is not None:
        draft.learner["eval_on_start"] = bool(before)
