"""``asyncgrpo config from-trl``: our TOML tables from a ``trl grpo`` configuration.

The file holds ``GRPOConfig`` fields (with the ``TrainingArguments`` it extends) and, as the ``trl grpo``
YAML does, TRL's ``ModelConfig`` (``model_name_or_path``, ``use_peft``, ``lora_*``) and script arguments
(``reward_funcs``, ``dataset_name``). Options the file leaves out take TRL's own defaults (read from the
installed TRL's dataclasses; without TRL, those of the TRL release the project pins, packaged in
``trl_defaults/``), never ours, so a translated run means what the TRL run meant; where it cannot, the value is
refused with the reason or listed as a difference with both values. Options that change nothing learned
(logging, the Hub, dataloader workers) are listed as "no effect here". The README's TRL mapping table is the
map; every option read is listed in ``_TRL_READ``. This module holds the algorithm's side; ``trl_training``
the Trainer's (steps, schedule, checkpoints, precision, LoRA, data, evaluation, logging) and ``trl_rewards``
the reward functions.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from services.launcher.explain import trl_batch
from services.launcher.translation import Draft, Translation, fit_micro_batch, ours, staleness_difference
from services.launcher.trl_rewards import trl_rewards
from services.launcher.trl_training import (
    LORA_FIELDS,
    trl_checkpoints,
    trl_data,
    trl_deployment,
    trl_evaluation,
    trl_lora,
    trl_monitoring,
    trl_no_effect,
    trl_output,
    trl_precision,
    trl_schedule,
    trl_steps,
)
from shared.config.objective import CLIPPED_LOSSES, LOSS_TYPES

# The TRL release the project pins (Makefile's bench-env); its defaults ship in trl_defaults/.
PINNED_TRL_VERSION = "1.16.0"
_PINNED_DEFAULTS = "trl_1_16_grpo_defaults.json"

_TRL_LOSS = tuple(name for name in LOSS_TYPES if name not in ("geo_mean", "kl_cov"))  # verl's two are not TRL's

# TRL GRPOConfig field -> our learner field, copied as they are.
_TRL_DIRECT = {
    "learning_rate": "lr",
    "beta": "beta",
    "delta": "delta",
    "num_iterations": "num_iterations",
    "max_completion_length": "max_completion_length",
    "max_prompt_length": "max_prompt_length",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
    "weight_decay": "weight_decay",
    "max_grad_norm": "max_grad_norm",
    "seed": "seed",
    "adam_beta1": "adam_beta1",
    "adam_beta2": "adam_beta2",
    "model_name_or_path": "model",
    "sapo_temperature_pos": "sapo_temperature_pos",
    "sapo_temperature_neg": "sapo_temperature_neg",
    "vespo_k_pos": "vespo_k_pos",
    "vespo_lambda_pos": "vespo_lambda_pos",
    "vespo_k_neg": "vespo_k_neg",
    "vespo_lambda_neg": "vespo_lambda_neg",
    "mask_truncated_completions": "mask_truncated_completions",
    "off_policy_mask_threshold": "off_policy_mask_threshold",
    "top_entropy_quantile": "top_entropy_quantile",
    "entropy_coef": "entropy_coef",
    "use_adaptive_entropy": "adaptive_entropy",
    "entropy_coef_min": "entropy_coef_min",
    "entropy_coef_max": "entropy_coef_max",
    "entropy_coef_delta": "entropy_coef_delta",
    "entropy_target": "entropy_target",
    "use_bias_correction_kl": "kl_bias_correction",
    "importance_sampling_level": "ratio_level",
}
# Every GRPOConfig field the translation reads; a default is filled in for these only.
_TRL_READ = (
    *_TRL_DIRECT,
    "per_device_train_batch_size",
    "num_generations",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "epsilon",
    "epsilon_high",
    "loss_type",
    "min_p",
    "scale_rewards",
    "multi_objective_aggregation",
    "reward_weights",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_cap",
    "sync_ref_model",
    "generation_batch_size",
    "max_prompt_length",
    "use_vllm",
    # TrainingArguments (GRPOConfig's base)
    "max_steps",
    "num_train_epochs",
    "lr_scheduler_type",
    "lr_scheduler_kwargs",
    "warmup_ratio",
    "warmup_steps",
    "save_strategy",
    "save_steps",
    "save_total_limit",
    "output_dir",
    "resume_from_checkpoint",
    "bf16",
    "fp16",
    "gradient_checkpointing",
    "logging_steps",
    "log_completions",
    "num_completions_to_print",
    "eval_strategy",
    "eval_steps",
    "eval_on_start",
    # ModelConfig and the trl grpo script's arguments
    "use_peft",
    *LORA_FIELDS,
    "reward_funcs",
    "reward_model_name_or_path",
    "dataset_name",
    "dataset_config",
    "dataset_train_split",
    "dataset_test_split",
)


def installed_trl_defaults() -> dict[str, Any] | None:
    """Field defaults of the installed TRL's ``GRPOConfig``, ``ModelConfig`` and ``trl grpo`` script arguments
    (read from the dataclasses, never from memory); None when TRL is not importable here."""
    try:
        from trl import GRPOConfig, ModelConfig
    except ImportError:
        return None
    classes: list[type] = [GRPOConfig, ModelConfig]
    try:
        from trl.scripts.grpo import GRPOScriptArguments

        classes.append(GRPOScriptArguments)
    except ImportError:
        pass  # an older TRL without the script module: its reward_funcs default (None) is not needed
    out: dict[str, Any] = {}
    for cls in reversed(classes):  # GRPOConfig's value wins where two classes share a name
        out.update(_dataclass_defaults(cls))
    return out


def pinned_trl_defaults() -> dict[str, Any]:
    """The defaults of TRL :data:`PINNED_TRL_VERSION` that the translation reads, packaged with asyncgrpo for
    where TRL is not installed (read from that release's dataclasses; the file's ``_comment`` says how)."""
    text = resources.files("services.launcher").joinpath("trl_defaults", _PINNED_DEFAULTS).read_text()
    return {name: value for name, value in json.loads(text).items() if not name.startswith("_")}


def _dataclass_defaults(cls: type) -> dict[str, Any]:
    import dataclasses

    out: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            out[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            out[field.name] = field.default_factory()
    return out


def from_trl(fields: dict[str, Any], defaults: dict[str, Any] | None = None) -> Translation:
    """Our TOML tables from TRL fields. ``defaults``: TRL's own defaults (:func:`installed_trl_defaults`),
    used for the fields the file leaves out; None leaves them at ours (and their differences unlisted)."""
    draft = Draft("TRL", given=set(fields))
    fields = _with_defaults(fields, defaults)
    staleness = _trl_batch_fields(fields, draft.learner)
    for theirs, ours_name in _TRL_DIRECT.items():
        if theirs in fields:
            value = fields.pop(theirs)
            if value is not None:
                draft.learner[ours_name] = value
    steps_known = trl_steps(fields, draft)
    _trl_algorithm(fields, draft, staleness, defaults is not None)
    _trl_trainer(fields, draft, steps_known)
    return draft.finish(fields, "dataset_name")


def _trl_algorithm(fields: dict[str, Any], draft: Draft, staleness: int, defaults_known: bool) -> None:
    """The objective, the importance correction, sampling, rewards and what differs from TRL there."""
    _trl_objective(fields, draft.learner, draft.notes)
    use_vllm = fields.pop("use_vllm", None)
    _trl_importance(fields, draft.learner)
    _trl_sampling(fields, draft.learner)
    draft.scorer.update(_trl_scorer(fields))
    trl_rewards(fields, draft)
    if not fields.get("sync_ref_model", True):
        for name in ("sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps"):
            fields.pop(name, None)  # off: nothing to translate
    _trl_generator(fields, draft.generator)
    trl_deployment(fields, draft, use_vllm)
    staleness_difference(
        draft,
        staleness,
        "on-policy: each generation block is trained on, then the next one is generated",
        "set max_staleness = 0 for TRL's on-policy batches; generation then waits for every step",
    )
    _importance_difference(draft, use_vllm)
    _prompt_length_difference(draft, defaults_known)


def _trl_trainer(fields: dict[str, Any], draft: Draft, steps_known: bool) -> None:
    """The Trainer's, ModelConfig's and the script's side (``trl_training``), what has no effect here, and a
    micro-batch that divides the step."""
    trl_schedule(fields, draft, steps_known)
    trl_checkpoints(fields, draft, steps_known)
    trl_output(fields, draft)
    trl_precision(fields, draft)
    trl_lora(fields, draft)
    test_split = trl_data(fields, draft)
    trl_evaluation(fields, draft, steps_known, test_split)
    trl_monitoring(fields, draft, steps_known)
    trl_no_effect(fields, draft)
    fit_micro_batch(draft.learner, draft.notes)


def _with_defaults(fields: dict[str, Any], defaults: dict[str, Any] | None) -> dict[str, Any]:
    if defaults is None:
        return dict(fields)
    filled = {k: defaults[k] for k in _TRL_READ if k in defaults and k not in fields}
    return {**filled, **fields}


def _trl_batch_fields(fields: dict[str, Any], learner: dict[str, Any]) -> int:
    """Prompts per step, G and the micro-batch; returns TRL's staleness: a generation block trains several
    optimizer steps, the last of them on samples that many versions old (steps_per_generation /
    gradient_accumulation_steps - 1). Written as ``max_staleness`` when the file sets steps_per_generation or
    generation_batch_size; without them TRL is on-policy and ours is kept (listed as a difference)."""
    per_device = int(fields.pop("per_device_train_batch_size", 8))
    num_generations = int(fields.pop("num_generations", 8))
    num_processes = int(fields.pop("num_processes", 1))
    accumulation = int(fields.pop("gradient_accumulation_steps", 1))
    steps_per_generation = fields.pop("steps_per_generation", None)
    generation_batch = fields.pop("generation_batch_size", None)
    if generation_batch is not None and steps_per_generation is None:
        steps_per_generation = int(generation_batch) // (per_device * num_processes)
    batch = trl_batch(
        per_device,
        num_generations,
        num_processes=num_processes,
        steps_per_generation=steps_per_generation,
        gradient_accumulation_steps=accumulation,
    )
    learner.update(
        group_size=num_generations, groups_per_step=batch.prompts_per_optimizer_step, micro_batch_size=per_device
    )
    staleness = batch.optimizer_steps_per_generation - 1
    if steps_per_generation is not None or staleness:  # the file sized its generation blocks: the formula's value
        learner["max_staleness"] = staleness
    return staleness


def _prompt_length_difference(draft: Draft, defaults_known: bool) -> None:
    """TRL truncates long prompts from the left (older TRL) or has no limit (TRL 1.x); here they are skipped."""
    length = draft.learner.get("max_prompt_length")
    if length is not None:
        theirs = f"{length} (longer prompts are cut from the left)"
    elif defaults_known:
        length = draft.learner["max_prompt_length"] = ours(draft.learner, "max_prompt_length")
        theirs = "none (prompts are used whole)"
    else:
        return
    draft.differ(
        "max_prompt_length",
        theirs,
        f"{length} (longer prompts are skipped, and counted)",
        "a longer prompt is never trained on here, where TRL trains on what it keeps of it; raise it above your "
        "longest prompt to train on every row",
    )


def _importance_difference(draft: Draft, use_vllm: bool | None) -> None:
    """TRL corrects vLLM's sampling only with use_vllm; here vLLM always samples, often a version behind."""
    here = draft.learner.setdefault("importance_correction", ours(draft.learner, "importance_correction"))
    if use_vllm is False and here:
        draft.differ(
            "importance_correction",
            "off (use_vllm = false: the trained model samples its own completions, nothing to correct)",
            f"on ({ours(draft.learner, 'importance_level')} {ours(draft.learner, 'importance_mode')}, cap "
            f"{ours(draft.learner, 'importance_cap')})",
            "vLLM always samples here, from weights up to max_staleness versions old",
        )
    elif here:
        draft.notes.append(
            "TRL's importance weights correct vLLM's sampling against the trainer's; here the same weights also "
            "correct for staleness (a behaviour policy up to max_staleness versions old)"
        )


def _trl_objective(fields: dict[str, Any], learner: dict[str, Any], notes: list[str]) -> None:
    """loss_type, the clip range (TRL's epsilon_high is cispo's absolute cap) and what TRL ignores."""
    loss_type = fields.pop("loss_type", None)
    if loss_type is not None and loss_type not in _TRL_LOSS:
        raise ValueError(f"TRL loss_type {loss_type!r} is unknown here (known: {', '.join(_TRL_LOSS)})")
    if loss_type is not None:
        learner["loss_type"] = loss_type
    epsilon = fields.pop("epsilon", None)
    epsilon_high = fields.pop("epsilon_high", None)
    high = epsilon_high if epsilon_high is not None else epsilon  # TRL: epsilon_high defaults to epsilon
    if epsilon is not None:
        learner["epsilon_low"] = epsilon
    if loss_type == "cispo":
        if high is not None:
            learner["cispo_clip_max"] = high
        if epsilon_high is None:
            notes.append(f"cispo caps the ratio at TRL's epsilon_high, here epsilon = {high}; ScaleRL uses 5.0")
    elif high is not None:
        learner["epsilon_high"] = high
    if learner.get("delta") is not None and learner.get("loss_type", "grpo") not in CLIPPED_LOSSES:
        notes.append(f"delta = {learner.pop('delta')} dropped: TRL ignores it for loss_type {loss_type!r}")
    if learner.get("beta"):
        learner["kl_estimator"] = "k3"  # TRL's only estimator


def _trl_importance(fields: dict[str, Any], learner: dict[str, Any]) -> None:
    """TRL's vllm_importance_sampling_* options -> our behaviour-importance correction."""
    if "vllm_importance_sampling_correction" in fields:
        learner["importance_correction"] = bool(fields.pop("vllm_importance_sampling_correction"))
    mode = fields.pop("vllm_importance_sampling_mode", None)
    if mode is not None:
        level, _, kind = str(mode).partition("_")
        if level not in ("token", "sequence") or kind not in ("truncate", "mask"):
            raise ValueError(f"TRL vllm_importance_sampling_mode {mode!r} is unknown here")
        learner["importance_level"], learner["importance_mode"] = level, kind
    cap = fields.pop("vllm_importance_sampling_cap", None)  # deprecated; TRL lets it override clip_max
    has_max = "vllm_importance_sampling_clip_max" in fields
    clip_max = fields.pop("vllm_importance_sampling_clip_max", None)
    if cap is not None:
        clip_max = cap
    if cap is not None or has_max:
        learner["importance_cap"] = float("inf") if clip_max is None else clip_max
    clip_min = fields.pop("vllm_importance_sampling_clip_min", None)
    if clip_min is not None:
        learner["importance_cap_min"] = clip_min


def _trl_sampling(fields: dict[str, Any], learner: dict[str, Any]) -> None:
    if "min_p" in fields:
        learner["min_p"] = fields.pop("min_p") or 0.0
    if learner.get("top_k") == 0:
        learner["top_k"] = -1  # TRL's "off"


def _trl_scorer(fields: dict[str, Any]) -> dict[str, Any]:
    """Reward scaling and aggregation (the functions and their weights: ``trl_rewards``)."""
    scorer: dict[str, Any] = {}
    if "scale_rewards" in fields:
        value = fields.pop("scale_rewards")
        scorer["scale_rewards"] = {True: "group", False: "none"}.get(value, value)
    if "multi_objective_aggregation" in fields:
        scorer["reward_aggregation"] = fields.pop("multi_objective_aggregation")
    return scorer


def _trl_generator(fields: dict[str, Any], generator: dict[str, Any]) -> None:
    if "vllm_gpu_memory_utilization" in fields:
        generator["gpu_memory_utilization"] = fields.pop("vllm_gpu_memory_utilization")
