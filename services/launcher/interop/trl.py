"""TRL's side of ``asyncgrpo config from-trl``: the one table of every TRL option read, and the translation's order.

The file holds ``GRPOConfig`` fields (with the ``TrainingArguments`` it extends) and, as the ``trl grpo``
YAML does, TRL's ``ModelConfig`` (``model_name_or_path``, ``use_peft``, ``lora_*``) and script arguments
(``reward_funcs``, ``dataset_name``). Options the file leaves out take TRL's own defaults (read from the
installed TRL's dataclasses; without TRL, those of the TRL release the project pins, packaged in
``services/launcher/trl_defaults/``), never ours, so a translated run means what the TRL run meant; where it
cannot, the value is refused with the reason or listed as a difference with both values. Options that change
nothing learned (logging, the Hub, dataloader workers) are listed as "no effect here".

This module is the map (the README's TRL mapping table is its prose): fields copied as they are
(``TRL_DIRECT``), fields with no effect here and why (``TRL_NO_EFFECT``), every field read (``TRL_READ``, the
only ones given TRL's defaults), and :func:`from_trl`, which reads each once, in one pass:
``trl_algorithm`` for the objective, sampling and rewards, ``trl_trainer`` for the Trainer's steps, schedule,
checkpoints, precision, LoRA, data, evaluation and logging.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from services.launcher.explain import trl_batch
from services.launcher.interop.translation import Draft, Translation, fit_micro_batch, read_mapping
from services.launcher.interop.trl_algorithm import trl_algorithm, trl_differences
from services.launcher.interop.trl_trainer import trl_deployment, trl_steps, trl_trainer

# The TRL release the project pins (Makefile's bench-env); its defaults ship in services/launcher/trl_defaults/.
PINNED_TRL_VERSION = "1.16.0"
_PINNED_DEFAULTS = "trl_1_16_grpo_defaults.json"

# TRL GRPOConfig field -> our learner field, copied as they are.
TRL_DIRECT = {
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
_LOGGING = "logging only: metrics here go to metrics.jsonl every step, and to learner.report_to"
_HUB = "the Hugging Face Hub: nothing is pushed from here; checkpoints stay in learner.checkpoint_dir"
_LOADING = "how the Trainer loads batches, not which prompts: the learner reads the dataset itself"
_VLLM_SERVER = "TRL's connection to its vLLM server: generators here register themselves through Redis"
# Options that change nothing learned here, and why; listed in the output, never refused.
TRL_NO_EFFECT = {
    **dict.fromkeys(
        (
            "logging_strategy",
            "logging_first_step",
            "logging_nan_inf_filter",
            "logging_dir",
            "log_level",
            "log_level_replica",
            "log_on_each_node",
            "disable_tqdm",
            "log_unique_prompts",
            "wandb_log_unique_prompts",
            "log_multimodal",
            "include_num_input_tokens_seen",
            "skip_memory_metrics",
            "trackio_space_id",
        ),
        _LOGGING,
    ),
    **dict.fromkeys(
        (
            "push_to_hub",
            "hub_model_id",
            "hub_strategy",
            "hub_token",
            "hub_private_repo",
            "hub_always_push",
            "hub_revision",
            "log_completions_hub_repo",
        ),
        _HUB,
    ),
    **dict.fromkeys(
        (
            "dataloader_num_workers",
            "dataloader_pin_memory",
            "dataloader_persistent_workers",
            "dataloader_prefetch_factor",
            "dataset_streaming",
        ),
        _LOADING,
    ),
    **dict.fromkeys(
        ("vllm_server_host", "vllm_server_port", "vllm_server_base_url", "vllm_server_timeout", "vllm_group_port"),
        _VLLM_SERVER,
    ),
    "run_name": "the trackers' name for the run; learner.run_name here names the run's directory and continues "
    "a run of that name: output_dir's last part gives it, asyncgrpo run --run-name overrides",
    "overwrite_output_dir": "each run here has its own directory under learner.runs_dir",
    "save_only_model": "checkpoints here always hold the optimizer state (resuming needs it)",
    "save_on_each_node": "the learner's rank 0 writes every checkpoint",
    "per_device_eval_batch_size": "evaluation completions here are sampled by the generators",
    "eval_accumulation_steps": "evaluation completions here are sampled by the generators",
    "gradient_checkpointing_kwargs": "how activations are recomputed, not what is computed",
    "torch_empty_cache_steps": "memory housekeeping",
    "ignore_bias_buffers": "a DDP workaround of the trl script",
    "ds3_gather_for_generation": "DeepSpeed ZeRO-3 generation: generation here is vLLM's",
    "vllm_enable_sleep_mode": "vLLM memory housekeeping in TRL's colocated mode",
    "vllm_tensor_parallel_size": "a deployment choice: GPUs per generator replica are generator.tensor_parallel_size",
}
# Every GRPOConfig field the translation reads; a default is filled in for these only.
TRL_READ = (
    *TRL_DIRECT,
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


def from_trl(fields: dict[str, Any], defaults: dict[str, Any] | None = None) -> Translation:
    """Our TOML tables from TRL fields. ``defaults``: TRL's own defaults (:func:`installed_trl_defaults`),
    used for the fields the file leaves out; None leaves them at ours (and their differences unlisted)."""
    draft = Draft("TRL", given=set(fields))
    fields = _with_defaults(fields, defaults)
    staleness = _trl_batch_fields(fields, draft.learner)
    for theirs, ours_name in TRL_DIRECT.items():
        if theirs in fields:
            value = fields.pop(theirs)
            if value is not None:
                draft.learner[ours_name] = value
    steps_known = trl_steps(fields, draft)
    use_vllm = trl_algorithm(fields, draft)
    trl_deployment(fields, draft, use_vllm)
    trl_differences(draft, staleness, use_vllm, defaults_known=defaults is not None)
    trl_trainer(fields, draft, steps_known, LORA_FIELDS)
    trl_no_effect(fields, draft)
    fit_micro_batch(draft.learner, draft.notes)
    return draft.finish(fields, "dataset_name")


def trl_defaults(path: Path | None) -> tuple[dict[str, Any], str]:
    """GRPOConfig's defaults, from ``path``, else the installed TRL, else the pinned TRL's packaged ones, and
    where they came from (the TOML's header says it)."""
    if path is not None:
        return read_mapping(path), f"GRPOConfig defaults from {path}"
    defaults = installed_trl_defaults()
    if defaults is None:
        return pinned_trl_defaults(), (
            f"TRL {PINNED_TRL_VERSION}'s GRPOConfig defaults, packaged with asyncgrpo (TRL is not installed here; "
            "install it, or pass --trl-defaults FILE, to use another version's)"
        )
    import trl

    return defaults, f"the installed TRL {trl.__version__}'s GRPOConfig defaults"


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


def _with_defaults(fields: dict[str, Any], defaults: dict[str, Any] | None) -> dict[str, Any]:
    if defaults is None:
        return dict(fields)
    filled = {k: defaults[k] for k in TRL_READ if k in defaults and k not in fields}
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


def trl_no_effect(fields: dict[str, Any], draft: Draft) -> None:
    """Take out the options that change nothing learned here, listing those the file itself gives."""
    for name, why in TRL_NO_EFFECT.items():
        if name in fields:
            fields.pop(name)
            if name in draft.given:
                draft.ignore(name, why)
