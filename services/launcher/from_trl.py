"""``asyncgrpo config from-trl``: our TOML tables from TRL ``GRPOConfig`` fields.

Options the file leaves out take GRPOConfig's own defaults (read from the installed TRL's dataclass, or a
JSON of them), never ours, so a translated run means what the TRL run meant. The README's TRL mapping table
is the map; every option read is listed in ``_TRL_READ``.
"""

from __future__ import annotations

from typing import Any

from services.launcher.explain import trl_batch
from services.launcher.translation import Translation, translation
from shared.config.learner import CLIPPED_LOSSES

_TRL_LOSS = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")

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
    "max_steps": "max_steps",
    "warmup_steps": "warmup_steps",
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
)


def installed_trl_defaults() -> dict[str, Any] | None:
    """Field defaults of the installed TRL's ``GRPOConfig`` (read from the dataclass, never from memory);
    None when TRL is not importable here."""
    try:
        from trl import GRPOConfig
    except ImportError:
        return None
    import dataclasses

    out: dict[str, Any] = {}
    for field in dataclasses.fields(GRPOConfig):
        if field.default is not dataclasses.MISSING:
            out[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            out[field.name] = field.default_factory()
    return out


def from_trl(fields: dict[str, Any], defaults: dict[str, Any] | None = None) -> Translation:
    """Our TOML tables from TRL GRPOConfig fields. ``defaults``: GRPOConfig's own defaults
    (:func:`installed_trl_defaults`), used for the fields the file leaves out; None leaves them at ours."""
    fields = _with_defaults(fields, defaults)
    learner: dict[str, Any] = {}
    notes: list[str] = []
    _trl_batch_fields(fields, learner)
    for theirs, ours in _TRL_DIRECT.items():
        if theirs in fields:
            value = fields.pop(theirs)
            if value is not None:
                learner[ours] = value
    _trl_objective(fields, learner, notes)
    _trl_importance(fields, learner)
    _trl_precision_and_sampling(fields, learner)
    scorer = _trl_scorer(fields)
    if not fields.get("sync_ref_model", True):
        for name in ("sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps"):
            fields.pop(name, None)  # off: nothing to translate
    generator = _trl_generator(fields, notes)
    return translation(generator, scorer, learner, fields, notes)


def _with_defaults(fields: dict[str, Any], defaults: dict[str, Any] | None) -> dict[str, Any]:
    if defaults is None:
        return dict(fields)
    filled = {k: defaults[k] for k in _TRL_READ if k in defaults and k not in fields}
    if filled.get("max_steps") is not None and filled["max_steps"] <= 0:
        del filled["max_steps"]  # TrainingArguments' -1 means "use num_train_epochs": no counterpart
    return {**filled, **fields}


def _trl_batch_fields(fields: dict[str, Any], learner: dict[str, Any]) -> None:
    per_device = int(fields.pop("per_device_train_batch_size", 8))
    num_generations = int(fields.pop("num_generations", 8))
    num_processes = int(fields.pop("num_processes", 1))
    accumulation = int(fields.pop("gradient_accumulation_steps", 1))
    batch = trl_batch(
        per_device,
        num_generations,
        num_processes=num_processes,
        steps_per_generation=fields.pop("steps_per_generation", None),
        gradient_accumulation_steps=accumulation,
    )
    learner.update(
        group_size=num_generations, groups_per_step=batch.prompts_per_optimizer_step, micro_batch_size=per_device
    )
    if batch.optimizer_steps_per_generation > 1:
        learner["max_staleness"] = batch.optimizer_steps_per_generation - 1


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


def _trl_precision_and_sampling(fields: dict[str, Any], learner: dict[str, Any]) -> None:
    if fields.get("bf16") is not None:  # TRL's bf16: autocast over float32 weights, as our compute_dtype
        learner["compute_dtype"] = "bfloat16" if fields.pop("bf16") else "float32"
    if "min_p" in fields:
        learner["min_p"] = fields.pop("min_p") or 0.0
    if learner.get("top_k") == 0:
        learner["top_k"] = -1  # TRL's "off"


def _trl_scorer(fields: dict[str, Any]) -> dict[str, Any]:
    """Reward scaling, aggregation and weights; each weighted reward becomes a plugin for the user to name."""
    scorer: dict[str, Any] = {}
    if "scale_rewards" in fields:
        value = fields.pop("scale_rewards")
        scorer["scale_rewards"] = {True: "group", False: "none"}.get(value, value)
    if "multi_objective_aggregation" in fields:
        scorer["reward_aggregation"] = fields.pop("multi_objective_aggregation")
    weights = fields.pop("reward_weights", None)
    if weights:
        scorer["rewards"] = [
            {"name": f"reward_{i}", "weight": w, "function": f"your_module:reward_{i}"} for i, w in enumerate(weights)
        ]
    return scorer


def _trl_generator(fields: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    generator: dict[str, Any] = {}
    if "vllm_gpu_memory_utilization" in fields:
        generator["gpu_memory_utilization"] = fields.pop("vllm_gpu_memory_utilization")
    if fields.pop("use_vllm", None) is False:
        notes.append("use_vllm = false: generation here is always vLLM; importance correction as configured")
    return generator
