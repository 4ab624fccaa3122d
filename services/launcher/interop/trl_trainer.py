"""``config from-trl``, the Trainer's side: steps and epochs, the learning-rate schedule, checkpoints, the
output directory, precision, LoRA, the dataset, evaluation, logging and trackers, and where vLLM runs.

These come from ``transformers.TrainingArguments`` (which ``GRPOConfig`` extends), from TRL's
``ModelConfig`` (``use_peft``, ``lora_*``) and from the ``trl grpo`` script's arguments (``dataset_*``), which
the ``trl grpo`` YAML mixes with GRPOConfig's fields. Each function takes the fields it reads out of
``fields``; a value with no faithful counterpart is refused with the reason, or translated to the nearest
setting and recorded as a :class:`~services.launcher.interop.translation.Difference`. The table of the
fields read, and of those that change nothing learned here, is :mod:`services.launcher.interop.trl`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from services.launcher.interop.translation import Draft, ours, run_from_directory, trackers, warmup_from_share

# The files the learner reads as data (shared/dataset/sources.py).
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
# transformers' lr_scheduler_type -> our min_lr_ratio (warm-up, then cosine decay to min_lr_ratio x lr).
_SCHEDULES = {"constant": 1.0, "constant_with_warmup": 1.0, "cosine": 0.0, "linear": 0.0}


def trl_trainer(fields: dict[str, Any], draft: Draft, steps_known: bool, lora_fields: tuple[str, ...]) -> None:
    """The Trainer's, ModelConfig's and the script's side after the steps: the schedule, checkpoints, the output
    directory, precision, LoRA, the data, evaluation and logging."""
    trl_schedule(fields, draft, steps_known)
    trl_checkpoints(fields, draft, steps_known)
    trl_output(fields, draft)
    trl_precision(fields, draft)
    trl_lora(fields, draft, lora_fields)
    test_split = trl_data(fields, draft)
    trl_evaluation(fields, draft, steps_known, test_split)
    trl_monitoring(fields, draft, steps_known)


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
    strategy = _option(fields.pop("save_strategy", None))
    every = fields.pop("save_steps", None)
    known_limit = "save_total_limit" in fields
    limit = fields.pop("save_total_limit", None)
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
        draft.learner["checkpoint_every"] = _interval("save_steps", every, max_steps, steps_known)
    if limit is not None:
        draft.learner["keep_checkpoints"] = int(limit)
    elif known_limit:
        _keep_every_checkpoint(draft, steps_known)


def _option(value: Any) -> str | None:
    """A TrainingArguments choice (a string or its enum) as its lower-case name."""
    return None if value is None else str(getattr(value, "value", value)).lower()


def _interval(name: str, every: float, max_steps: int, steps_known: bool) -> int:
    """TrainingArguments' ``*_steps``: a number of steps, or below 1 a share of the run (of ``max_steps``)."""
    if every >= 1:
        return int(every)
    if not steps_known:
        raise ValueError(
            f"{name} = {every} is a share of the run, whose length in steps the file does not give (or leaves "
            f"to num_train_epochs and the dataset): set {name} to a number of steps, or set max_steps"
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
    """output_dir -> the run's name (:func:`run_from_directory`); resume_from_checkpoint true / false ->
    ``resume``; None (TRL's default) -> ours: a run started again under its name continues, a new name starts
    afresh."""
    output = fields.pop("output_dir", None)
    if output:
        run_from_directory(output, "output_dir", draft)
    resume = fields.pop("resume_from_checkpoint", None)
    if isinstance(resume, str) and resume.lower() not in ("true", "false"):
        raise ValueError(
            f"resume_from_checkpoint = {resume!r}: a TRL checkpoint cannot be resumed here (optimizer state and "
            "data position are ours); start from its weights instead: model_name_or_path: " + resume
        )
    if resume is not None:
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


def trl_lora(fields: dict[str, Any], draft: Draft, lora_fields: tuple[str, ...]) -> None:
    """use_peft with ``lora_fields`` (ModelConfig's lora_*) -> our LoRA; without use_peft TRL ignores them, and
    so does the translation."""
    use_peft = bool(fields.pop("use_peft", False))
    lora = {name: fields.pop(name) for name in lora_fields if name in fields}
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


def trl_data(fields: dict[str, Any], draft: Draft) -> str | None:
    """The script's dataset_name, dataset_config and dataset_train_split -> ``[data]`` source, dataset_config
    and train_split; data_seed -> shuffle_seed. Returns dataset_test_split (evaluation's, ``trl_evaluation``)."""
    name = fields.pop("dataset_name", None)
    config = fields.pop("dataset_config", None)
    train = fields.pop("dataset_train_split", None)
    test = fields.pop("dataset_test_split", None)
    seed = fields.pop("data_seed", None)
    if seed is not None:
        draft.data["shuffle_seed"] = int(seed)
    if not name:
        given = sorted({"dataset_config", "dataset_train_split", "dataset_test_split"} & draft.given)
        if given:
            draft.notes.append(f"{', '.join(given)} left out: the file names no dataset_name they belong to")
        return None  # Draft.finish names the built-in task, with a warning
    draft.data["source"] = str(name)
    if config:
        draft.data["dataset_config"] = str(config)
    if train:
        draft.data["train_split"] = str(train)
    if _local(str(name)):
        draft.notes.append(
            f"data.source {name!r}: a local file or directory, read from the learner's working directory; a file "
            "is one split, 'train' (a directory's splits are its files named after them)"
        )
    else:
        draft.notes.append(
            f"data.source {name!r}: a dataset name is read with datasets.load_dataset on the learner's host, so "
            "where the Hub is out of reach it must be in the local Hugging Face cache"
        )
    return None if test is None else str(test)


def _local(name: str) -> bool:
    """Whether a dataset_name is a local file or directory rather than a Hub name (``owner/name``): it exists,
    has a data file's suffix, starts like a path or has more than one ``/`` (as the learner reads it)."""
    path = Path(name).expanduser()
    return (
        path.exists() or path.suffix.lower() in DATA_SUFFIXES or name.startswith(("/", ".", "~")) or name.count("/") > 1
    )


def trl_evaluation(fields: dict[str, Any], draft: Draft, steps_known: bool, test_split: str | None) -> None:
    """eval_strategy with eval_steps (None: logging_steps, as the Trainer does) -> ``eval_every`` on
    ``data.eval_split`` (the script's dataset_test_split); eval_on_start -> ``eval_on_start``."""
    strategy = _option(fields.pop("eval_strategy", None))
    steps = fields.pop("eval_steps", None)
    on_start = fields.pop("eval_on_start", None)
    if strategy in (None, "no"):
        if "dataset_test_split" in draft.given and test_split is not None:
            draft.notes.append(f"dataset_test_split {test_split!r} left out: eval_strategy is 'no', as TRL's")
        return
    if strategy not in ("steps", "epoch"):
        raise ValueError(f"eval_strategy = {strategy!r} is unknown here: 'no', 'steps' or 'epoch' translate")
    if test_split is None:
        draft.notes.append(f"eval_strategy {strategy!r} left out: the file names no dataset split to evaluate on")
        return
    if test_split == draft.data.get("train_split", "train"):
        raise ValueError(
            f"dataset_test_split = dataset_train_split = {test_split!r}: TRL would evaluate on training prompts, "
            "which evaluation here refuses; name another split, or set eval_strategy: 'no' and hold rows out with "
            "data.eval_fraction after translating"
        )
    draft.data["eval_split"] = test_split
    draft.learner["eval_on_start"] = bool(on_start)
    _eval_every(strategy, steps if steps is not None else fields.get("logging_steps"), draft, steps_known)
    draft.notes.append(
        f"each evaluation reads the first learner.eval_samples ({ours(draft.learner, 'eval_samples')}) prompts of "
        f"the {test_split!r} split; TRL evaluates the whole split: raise eval_samples to match"
    )


def _eval_every(strategy: str, every: float | None, draft: Draft, steps_known: bool) -> None:
    """'steps': every eval_steps (the caller's ``every``) optimizer steps; 'epoch' is listed as a difference."""
    if strategy == "steps" and every is not None:
        draft.learner["eval_every"] = _interval("eval_steps", every, ours(draft.learner, "max_steps"), steps_known)
    elif strategy == "epoch":
        here = draft.learner.setdefault("eval_every", ours(draft.learner, "eval_every"))
        draft.differ(
            "eval_strategy",
            "'epoch' (after every pass over the data)",
            f"eval_every = {here}",
            "evaluation here is every eval_every optimizer steps: set it to the steps of one epoch",
        )


def trl_monitoring(fields: dict[str, Any], draft: Draft, steps_known: bool) -> None:
    """gradient_checkpointing; report_to and project (the trackers); log_completions every logging_steps and
    num_completions_to_print (the completion tables); logging_steps itself has no effect here."""
    if "gradient_checkpointing" in fields:
        draft.learner["gradient_checkpointing"] = bool(fields.pop("gradient_checkpointing"))
    logging_steps = fields.pop("logging_steps", None)
    if "logging_steps" in draft.given:
        draft.ignore("logging_steps", "metrics are written every optimizer step here (metrics.jsonl, report_to)")
    if fields.pop("log_completions", False):
        every = 1 if logging_steps is None else logging_steps
        draft.learner["log_completions"] = _interval(
            "logging_steps", every, ours(draft.learner, "max_steps"), steps_known
        )
    shown = fields.pop("num_completions_to_print", None)
    if shown is not None and draft.learner.get("log_completions"):
        draft.learner["num_completions_to_log"] = int(shown)
    if "report_to" in fields:
        _report_to(fields.pop("report_to"), draft)
    project = fields.pop("project", None)
    if project:
        draft.learner["tracking_project"] = str(project)


def _report_to(value: Any, draft: Draft) -> None:
    """TRL's report_to: 'none', 'all' (every installed tracker: ours, TensorBoard), a name or a list."""
    names = [] if value is None else [value] if isinstance(value, str) else [str(name) for name in value]
    if "all" in names:
        draft.notes.append("report_to 'all' (every installed tracker) -> 'tensorboard'; add 'wandb' or 'trackio'")
    trackers(["tensorboard" if name == "all" else name for name in names if name != "none"], "report_to", draft)


def trl_deployment(fields: dict[str, Any], draft: Draft, use_vllm: bool | None) -> None:
    """vllm_mode -> a note naming the matching placement here (README, "GPU box")."""
    mode = fields.pop("vllm_mode", None)
    if mode is None or (not use_vllm and "vllm_mode" not in draft.given):
        return
    unused = "" if use_vllm else " (TRL uses it only with use_vllm: true; vLLM always generates here)"
    if mode == "colocate":
        draft.notes.append(
            f"deployment: vllm_mode 'colocate'{unused} runs vLLM on the training GPU; the matching setup here is the "
            "one-GPU placement, generator and learner sharing GPU 0 (README, GPU box: docker compose -f "
            "docker-compose.yml -f deploy/one-gpu.yml up, with configs/gpu-1.toml's generator.colocated = true and "
            "generator.gpu_memory_utilization + learner.gpu_memory_share at most 1)"
        )
    elif mode == "server":
        draft.notes.append(
            f"deployment: vllm_mode 'server'{unused} generates on GPUs of its own (trl vllm-serve); the matching "
            "setup here is generator replicas beside the learner, one GPU each (README, GPU box: docker compose up "
            "--scale generator=<GPUs minus the learner's>)"
        )
    else:
        raise ValueError(f"vllm_mode = {mode!r} is unknown: TRL's 'server' and 'colocate' translate")
