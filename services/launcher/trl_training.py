"""``config from-trl``, the Trainer's side: steps and epochs, the learning-rate schedule, checkpoints, the
output directory, precision and LoRA.

These come from ``transformers.TrainingArguments`` (which ``GRPOConfig`` extends) and from TRL's
``ModelConfig`` (``use_peft``, ``lora_*``), which the ``trl grpo`` YAML mixes with GRPOConfig's fields. Each
function takes the fields it reads out of ``fields``; a value with no faithful counterpart is refused with
the reason, or translated to the nearest setting and recorded as a :class:`~translation.Difference`.
"""

from __future__ import annotations

import math
from typing import Any

from services.launcher.translation import Draft, ours, warmup_from_share

# TRL's ModelConfig fields that only mean something with use_peft.
LORA_FIELDS = (
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "lora_target_parameters",
    "lora_modules_to_save",
    "lora_task_type",
    "use_rslora",
    "use_dora",
)
# transformers' lr_scheduler_type -> our min_lr_ratio (warm-up, then cosine decay to min_lr_ratio x lr).
_SCHEDULES = {"constant": 1.0, "constant_with_warmup": 1.0, "cosine": 0.0, "linear": 0.0}


def trl_steps(fields: dict[str, Any], draft: Draft) -> bool:
    """``max_steps`` (> 0: the run's length, epochs ignored, as the Trainer does) or ``num_train_epochs``
    (TrainingArguments' ``max_steps = -1``): passes over the data, with the step count left to the user.
    Returns whether the run's length in steps is known."""
    max_steps = fields.pop("max_steps", None)
    epochs = fields.pop("num_train_epochs", None)
    if max_steps is not None and max_steps > 0:
        draft.learner["max_steps"] = int(max_steps)
        draft.data["epochs"] = 0  # the Trainer cycles the data until max_steps
        return True
    if epochs is None:
        if max_steps is not None:
            raise ValueError(
                f"max_steps = {max_steps} means 'train num_train_epochs epochs', but num_train_epochs is not given: "
                "set max_steps to the number of optimizer steps, or give num_train_epochs"
            )
        return False
    if epochs <= 0 or epochs != int(epochs):
        raise ValueError(
            f"num_train_epochs = {epochs}: here data.epochs counts whole passes over the data; give a whole "
            "number, or set max_steps to the optimizer steps that fraction takes"
        )
    draft.data["epochs"] = int(epochs)
    steps = draft.learner.setdefault("max_steps", ours(draft.learner, "max_steps"))
    draft.differ(
        "max_steps",
        f"-1 (train num_train_epochs = {int(epochs)} epochs; the learning-rate schedule spans them)",
        f"{steps} with data.epochs = {int(epochs)} (the run stops at whichever comes first; the schedule spans "
        "max_steps)",
        draft.steps_hint(int(epochs)),
    )
    return False


def trl_schedule(fields: dict[str, Any], draft: Draft, steps_known: bool) -> None:
    """lr_scheduler_type -> ``min_lr_ratio`` (ours: linear warm-up, then cosine decay to it) and the warm-up."""
    kind = fields.pop("lr_scheduler_type", None)
    kwargs = fields.pop("lr_scheduler_kwargs", None) or {}
    _trl_warmup(fields, draft, steps_known)
    if kind is None:
        return
    kind = str(getattr(kind, "value", kind)).lower()
    if kind == "cosine_with_min_lr" and ("min_lr_rate" in kwargs or "min_lr" in kwargs):
        rate = kwargs.get("min_lr_rate")
        draft.learner["min_lr_ratio"] = rate if rate is not None else kwargs["min_lr"] / ours(draft.learner, "lr")
        return
    if kind not in _SCHEDULES or (kwargs and kind != "cosine_with_min_lr"):
        raise ValueError(
            f"lr_scheduler_type = {kind!r} (kwargs {kwargs}) has no counterpart: the schedule here is a linear "
            "warm-up then cosine decay to min_lr_ratio x lr (TRL's 'cosine', 'constant', 'constant_with_warmup' "
            "and 'cosine_with_min_lr' translate; 'linear' becomes cosine to 0)"
        )
    draft.learner["min_lr_ratio"] = _SCHEDULES[kind]
    if kind == "linear":
        draft.differ(
            "lr_scheduler_type",
            "'linear' (decay to 0)",
            "cosine decay to 0 (min_lr_ratio = 0.0)",
            "no linear decay here; the same start and end, a different path between",
        )
    if kind == "constant" and draft.learner.get("warmup_steps"):
        draft.notes.append(
            f"warmup_steps = 0: TRL's 'constant' schedule ignores warmup_steps ({draft.learner['warmup_steps']})"
        )
        draft.learner["warmup_steps"] = 0


def _trl_warmup(fields: dict[str, Any], draft: Draft, steps_known: bool) -> None:
    """warmup_steps (a float below 1 is a share of the run, as warmup_ratio is) -> our warmup_steps."""
    ratio = fields.pop("warmup_ratio", None)
    steps = fields.pop("warmup_steps", None)
    if steps is not None and 0 < steps < 1:
        ratio, steps = steps, None
    if steps is not None:
        draft.learner["warmup_steps"] = int(steps)
    if ratio:
        warmup_from_share(
            draft,
            ratio,
            steps_known,
            f"a warm-up of {ratio} of the run needs the run's length in steps, which the file does not give "
            "(or leaves to num_train_epochs and the dataset): set max_steps, or warmup_steps to a number of steps",
        )


def trl_checkpoints(fields: dict[str, Any], draft: Draft, steps_known: bool) -> None:
    """save_strategy/save_steps -> ``checkpoint_every``; save_total_limit -> ``keep_checkpoints``."""
    strategy = fields.pop("save_strategy", None)
    every = fields.pop("save_steps", None)
    known_limit = "save_total_limit" in fields
    limit = fields.pop("save_total_limit", None)
    strategy = None if strategy is None else str(getattr(strategy, "value", strategy)).lower()
    max_steps = ours(draft.learner, "max_steps")
    if strategy == "no":
        draft.learner["checkpoint_every"] = max_steps
        draft.differ(
            "save_strategy",
            "'no' (no checkpoints)",
            f"one at the end (checkpoint_every = {max_steps})",
            "here the last step is always saved",
        )
    elif strategy not in (None, "steps"):
        raise ValueError(
            f"save_strategy = {strategy!r}: checkpoints here are taken every checkpoint_every optimizer steps; "
            "use save_strategy: steps with save_steps"
        )
    elif every is not None:
        draft.learner["checkpoint_every"] = _save_every(every, max_steps, steps_known)
    if limit is not None:
        draft.learner["keep_checkpoints"] = int(limit)
    elif known_limit:
        _keep_every_checkpoint(draft, steps_known)


def _save_every(every: float, max_steps: int, steps_known: bool) -> int:
    if every >= 1:
        return int(every)
    if not steps_known:
        raise ValueError(
            f"save_steps = {every} is a share of the run, whose length in steps the file does not give (or leaves "
            "to num_train_epochs and the dataset): set save_steps to a number of steps, or set max_steps"
        )
    return max(1, math.ceil(every * max_steps))


def _keep_every_checkpoint(draft: Draft, steps_known: bool) -> None:
    """TRL's save_total_limit = None keeps them all: as many as the run takes, where its length is known."""
    every = ours(draft.learner, "checkpoint_every")
    if steps_known:
        draft.learner["keep_checkpoints"] = max(1, math.ceil(ours(draft.learner, "max_steps") / every))
        return
    keep = draft.learner.setdefault("keep_checkpoints", ours(draft.learner, "keep_checkpoints"))
    draft.differ(
        "save_total_limit",
        "None (every checkpoint is kept)",
        f"keep_checkpoints = {keep}",
        "the run's length is not known here; raise keep_checkpoints to keep more",
    )


def trl_output(fields: dict[str, Any], draft: Draft) -> None:
    """output_dir -> the checkpoint and log directories under it; resume_from_checkpoint -> ``resume``."""
    output = fields.pop("output_dir", None)
    if output:
        draft.learner["checkpoint_dir"] = f"{output}/checkpoints"
        draft.learner["log_dir"] = f"{output}/logs"
    if "resume_from_checkpoint" not in fields:
        return
    resume = fields.pop("resume_from_checkpoint")
    if isinstance(resume, str) and resume.lower() not in ("true", "false"):
        raise ValueError(
            f"resume_from_checkpoint = {resume!r}: a TRL checkpoint cannot be resumed here (optimizer state and "
            "data position are ours); start from its weights instead: model_name_or_path: " + resume
        )
    draft.learner["resume"] = resume is True or str(resume).lower() == "true"


def trl_precision(fields: dict[str, Any], draft: Draft) -> None:
    """bf16/fp16 (autocast over the weights) -> ``compute_dtype``; the model's dtype -> ``param_dtype``."""
    if fields.pop("fp16", False):
        raise ValueError("fp16 = true: float16 mixed precision is not supported here; use bf16 (compute_dtype)")
    if "bf16" in fields:
        bf16 = fields.pop("bf16")
        # TRL's _BaseConfig.__post_init__: bf16 = None means "not fp16", and fp16 is refused above.
        draft.learner["compute_dtype"] = "bfloat16" if bf16 is None or bf16 else "float32"
    dtype = fields.pop("dtype", fields.pop("torch_dtype", None))
    if dtype in (None, "float32"):
        return
    if dtype == "bfloat16":
        draft.learner["param_dtype"] = draft.learner["compute_dtype"] = "bfloat16"
    elif dtype == "auto":
        draft.differ("dtype", "'auto' (the checkpoint's dtype)", "param_dtype = 'float32'", "float32 master weights")
    else:
        raise ValueError(f"dtype = {dtype!r}: the weights here are float32 or bfloat16 (param_dtype)")


def trl_lora(fields: dict[str, Any], draft: Draft) -> None:
    """use_peft with lora_* -> our LoRA; without use_peft TRL ignores them, and so does the translation."""
    use_peft = bool(fields.pop("use_peft", False))
    lora = {name: fields.pop(name) for name in LORA_FIELDS if name in fields}
    if not use_peft:
        given = sorted(set(lora) & draft.given)
        if given:
            draft.notes.append(f"{', '.join(given)} left out: use_peft is false, so TRL ignores them too")
        return
    for flag in ("use_rslora", "use_dora", "lora_modules_to_save", "lora_target_parameters"):
        if lora.get(flag):
            raise ValueError(f"{flag} = {lora[flag]!r}: not supported here (plain LoRA on lora_target_modules only)")
    if str(lora.get("lora_task_type", "CAUSAL_LM")).upper() != "CAUSAL_LM":
        raise ValueError(f"lora_task_type = {lora['lora_task_type']!r}: LoRA here adapts a causal LM only")
    if lora.get("lora_r") is None:
        raise ValueError("use_peft = true without lora_r: give the LoRA rank")
    draft.learner["lora_rank"] = int(lora["lora_r"])
    if lora.get("lora_alpha") is not None:
        draft.learner["lora_alpha"] = float(lora["lora_alpha"])
    _lora_targets(lora.get("lora_target_modules"), draft)
    if lora.get("lora_dropout"):
        draft.differ("lora_dropout", lora["lora_dropout"], 0.0, "there is no LoRA dropout here")


def _lora_targets(targets: Any, draft: Draft) -> None:
    everything = ours(draft.learner, "lora_target_modules")
    if targets is None:
        draft.learner["lora_target_modules"] = everything
        draft.differ(
            "lora_target_modules",
            "None (PEFT's choice for the architecture: q_proj and v_proj for Llama and Qwen)",
            everything,
            "set lora_target_modules = ['q_proj', 'v_proj'] to adapt what TRL adapts there",
        )
    elif targets == "all-linear":
        draft.learner["lora_target_modules"] = everything
        draft.notes.append("lora_target_modules 'all-linear': every linear projection of a Llama-style block")
    else:
        draft.learner["lora_target_modules"] = [targets] if isinstance(targets, str) else list(targets)
