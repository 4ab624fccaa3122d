"""``asyncgrpo config explain | from-trl | from-verl``: the batch arithmetic, checked and translated.

Our vocabulary (README, "Batch arithmetic"): ``groups_per_step`` prompts per optimizer step, ``group_size``
(G) completions each, ``completions per step = groups_per_step * G``, ``micro_batch_size`` completions per
forward/backward, ``gradient accumulation = completions per step / micro_batch_size``, ``num_iterations``
optimizer steps per batch, ``sync_every`` steps per weight push, ``max_staleness``, and the admission bound
``(max_staleness + 1) * groups_per_step`` groups in flight.

TRL: ``generation_batch_size = per_device_train_batch_size * num_processes * steps_per_generation``
completions, ``/ num_generations`` distinct prompts; an optimizer step uses
``per_device_train_batch_size * num_processes * gradient_accumulation_steps`` of them.
verl: ``data.train_batch_size * rollout.n`` sequences per step; ``n_gpus / tensor_model_parallel_size``
rollout workers share the prompts; ``ppo_mini_batch_size`` (prompts) is multiplied by n, then divided by
the GPU count.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from shared.config.base import COMMON_ENV
from shared.config.generator import GeneratorSettings
from shared.config.launcher import LauncherSettings
from shared.config.learner import DataSettings, LearnerSettings
from shared.config.pipeline import PipelineConfig
from shared.config.scorer import RewardSpec, ScorerSettings

# Batch arithmetic of the other systems (pure) ---------------------------------------------------------------


@dataclass(frozen=True)
class TrlBatch:
    completions_per_generation: int
    prompts_per_generation: int
    completions_per_optimizer_step: int
    prompts_per_optimizer_step: int
    optimizer_steps_per_generation: int


def trl_batch(
    per_device_train_batch_size: int,
    num_generations: int,
    *,
    num_processes: int = 1,
    steps_per_generation: int | None = None,
    gradient_accumulation_steps: int = 1,
) -> TrlBatch:
    """TRL GRPOTrainer: what one generation block and one optimizer step hold."""
    steps = steps_per_generation or gradient_accumulation_steps
    generation = per_device_train_batch_size * num_processes * steps
    if generation % num_generations:
        raise ValueError(
            f"TRL needs generation_batch_size ({generation}) divisible by num_generations ({num_generations})"
        )
    per_step = per_device_train_batch_size * num_processes * gradient_accumulation_steps
    return TrlBatch(
        generation,
        generation // num_generations,
        per_step,
        per_step // num_generations,
        max(1, steps // gradient_accumulation_steps),
    )


@dataclass(frozen=True)
class VerlBatch:
    sequences_per_step: int
    rollout_workers: int
    prompts_per_rollout_worker: int
    mini_batch_sequences: int
    mini_batch_sequences_per_gpu: int
    optimizer_steps_per_rollout: int


def verl_batch(
    train_batch_size: int,
    rollout_n: int,
    n_gpus: int,
    *,
    tensor_model_parallel_size: int = 1,
    ppo_mini_batch_size: int | None = None,
) -> VerlBatch:
    """verl's ppo_trainer: sequences per step, rollout workers, and the normalised mini-batch."""
    workers = n_gpus // tensor_model_parallel_size
    mini = ppo_mini_batch_size or train_batch_size
    return VerlBatch(
        sequences_per_step=train_batch_size * rollout_n,
        rollout_workers=workers,
        prompts_per_rollout_worker=train_batch_size // workers,
        mini_batch_sequences=mini * rollout_n,
        mini_batch_sequences_per_gpu=mini * rollout_n // n_gpus,
        optimizer_steps_per_rollout=train_batch_size // mini,
    )


# Our configuration -----------------------------------------------------------------------------------------


def explain(pipeline: PipelineConfig) -> str:
    s = pipeline.learner
    completions = s.completions_per_step
    micro = completions // s.micro_batch_size
    tokens = completions * (s.max_prompt_length + s.max_completion_length)
    lines = [
        "One optimizer step",
        f"  prompts (groups_per_step)               {s.groups_per_step}",
        f"  completions per prompt (G)              {s.group_size}",
        f"  completions                             {completions}",
        f"  token upper bound                       {tokens}  ({completions} x (max_prompt_length "
        f"{s.max_prompt_length} + max_completion_length {s.max_completion_length}))",
        f"  completion tokens at most               {completions * s.max_completion_length}",
        f"  micro-batches (gradient accumulation)   {micro}  of {s.micro_batch_size} completions",
        f"  optimizer steps per batch               {s.num_iterations}  (num_iterations)",
        f"  optimizer steps per weight sync         {s.sync_every}",
        f"  groups admitted in flight at most       {s.admission_bound}  ((max_staleness {s.max_staleness} + 1) x "
        f"{s.groups_per_step})",
        f"  generator replicas here                 {pipeline.launcher.generators}",
        "",
        "The same run in TRL (GRPOConfig, one process)",
        f"  num_generations = {s.group_size}",
        f"  per_device_train_batch_size = {s.micro_batch_size}",
        f"  gradient_accumulation_steps = {micro}",
        f"  steps_per_generation = {micro}",
        f"  num_iterations = {s.num_iterations}",
        f"  max_completion_length = {s.max_completion_length}",
        f"  max_prompt_length = {s.max_prompt_length}",
        f"  learning_rate = {s.lr}",
        f"  beta = {s.beta}",
        f"  epsilon = {s.epsilon_low}, epsilon_high = {s.epsilon_high}",
        f'  loss_type = "{s.loss_type}"',
        f'  scale_rewards = "{pipeline.scorer.scale_rewards}"',
        f"  temperature = {s.temperature}",
        "  (TRL trains on-policy or within one generation block; our max_staleness has no TRL equivalent)",
        "",
        "The same run in verl (ppo_trainer.yaml, n_gpus_per_node = 1)",
        f"  data.train_batch_size = {s.groups_per_step}",
        f"  actor_rollout_ref.rollout.n = {s.group_size}",
        f"  actor_rollout_ref.actor.ppo_mini_batch_size = {s.groups_per_step}",
        f"  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = {s.micro_batch_size}",
        f"  actor_rollout_ref.actor.ppo_epochs = {s.num_iterations}",
        f"  actor_rollout_ref.actor.optim.lr = {s.lr}",
        f"  actor_rollout_ref.actor.clip_ratio_low = {s.epsilon_low}, clip_ratio_high = {s.epsilon_high}",
        f'  actor_rollout_ref.actor.loss_agg_mode = "{_VERL_AGG_FROM_OURS[s.loss_type]}"',
        f"  actor_rollout_ref.actor.use_kl_loss = {str(s.beta > 0).lower()}, kl_loss_coef = {s.beta}",
        f"  data.max_prompt_length = {s.max_prompt_length}, data.max_response_length = {s.max_completion_length}",
        f"  algorithm.norm_adv_by_std_in_grpo = {str(pipeline.scorer.scale_rewards != 'none').lower()}",
    ]
    return "\n".join(lines)


# Translation -----------------------------------------------------------------------------------------------

_TRL_LOSS = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
_CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
_VERL_AGG = {
    "token-mean": "dapo",
    "seq-mean-token-mean": "grpo",
    "seq-mean-token-sum-norm": "dr_grpo",
    "seq-mean-token-sum": "seq_sum",
}
_VERL_LOSS_FROM_AGG = {"dapo": "dapo", "grpo": "grpo", "dr_grpo": "dr_grpo", "seq_sum": "luspo"}
_VERL_AGG_FROM_OURS = {
    "dapo": "token-mean",
    "bnpo": "token-mean",
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "luspo": "seq-mean-token-sum",
    "seq_sum": "seq-mean-token-sum",
    "cispo": "token-mean",
    "sapo": "seq-mean-token-mean",
    "vespo": "token-mean",
    "geo_mean": "seq-mean-token-mean",
    "kl_cov": "token-mean",
}
_VERL_ESTIMATORS = {
    "grpo": "grpo",
    "rloo": "rloo",
    "reinforce_plus_plus": "reinforce_pp",
    "reinforce_plus_plus_baseline": "reinforce_pp_baseline",
}
# verl's kl_loss_type names (``kl_penalty_forward``); its "k3" is the clamped estimator, our low_var_kl.
_VERL_KL = {
    "kl": "k1",
    "k1": "k1",
    "abs": "abs",
    "mse": "k2",
    "k2": "k2",
    "low_var_kl": "low_var_kl",
    "k3": "low_var_kl",
}


class UnmappedError(ValueError):
    """Options with no counterpart here; the command fails naming them unless --allow-unmapped."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(
            "no counterpart here for: " + ", ".join(names) + " (remove them, or pass --allow-unmapped to translate "
            "the rest and list these at the top of the output)"
        )
        self.names = names


@dataclass(frozen=True)
class Translation:
    """Our TOML tables, the peer's options with no counterpart, and notes on what changed meaning."""

    tables: dict[str, Any]
    unmapped: list[str]
    notes: list[str]


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


def _read_mapping(path: Path) -> dict[str, Any]:
    text = path.read_text()
    if path.suffix == ".json":
        return json.loads(text)
    import yaml

    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a mapping of settings")
    return data


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


def _with_defaults(fields: dict[str, Any], defaults: dict[str, Any] | None) -> dict[str, Any]:
    if defaults is None:
        return dict(fields)
    filled = {k: defaults[k] for k in _TRL_READ if k in defaults and k not in fields}
    if filled.get("max_steps") is not None and filled["max_steps"] <= 0:
        del filled["max_steps"]  # TrainingArguments' -1 means "use num_train_epochs": no counterpart
    return {**filled, **fields}


def from_trl(fields: dict[str, Any], defaults: dict[str, Any] | None = None) -> Translation:
    """Our TOML tables from TRL GRPOConfig fields. ``defaults``: GRPOConfig's own defaults
    (:func:`installed_trl_defaults`), used for the fields the file leaves out; None leaves them at ours."""
    fields = _with_defaults(fields, defaults)
    learner: dict[str, Any] = {}
    scorer: dict[str, Any] = {}
    generator: dict[str, Any] = {}
    notes: list[str] = []
    _trl_batch_fields(fields, learner)
    for theirs, ours in _TRL_DIRECT.items():
        if theirs in fields:
            value = fields.pop(theirs)
            if value is not None:
                learner[ours] = value
    _trl_objective(fields, learner, notes)
    _trl_importance(fields, learner)
    if fields.get("bf16") is not None:  # TRL's bf16: autocast over float32 weights, as our compute_dtype
        learner["compute_dtype"] = "bfloat16" if fields.pop("bf16") else "float32"
    if "min_p" in fields:
        learner["min_p"] = fields.pop("min_p") or 0.0
    if learner.get("top_k") == 0:
        learner["top_k"] = -1  # TRL's "off"
    if "scale_rewards" in fields:
        value = fields.pop("scale_rewards")
        scorer["scale_rewards"] = {True: "group", False: "none"}.get(value, value)
    if "multi_objective_aggregation" in fields:
        scorer["reward_aggregation"] = fields.pop("multi_objective_aggregation")
    if "reward_weights" in fields:
        weights = fields.pop("reward_weights")
        if weights:
            scorer["rewards"] = [
                {"name": f"reward_{i}", "weight": w, "function": f"your_module:reward_{i}"}
                for i, w in enumerate(weights)
            ]
    if not fields.get("sync_ref_model", True):
        for name in ("sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps"):
            fields.pop(name, None)  # off: nothing to translate
    if "vllm_gpu_memory_utilization" in fields:
        generator["gpu_memory_utilization"] = fields.pop("vllm_gpu_memory_utilization")
    if fields.pop("use_vllm", None) is False:
        notes.append("use_vllm = false: generation here is always vLLM; importance correction as configured")
    if "model" in learner:
        generator["model"] = learner["model"]
    tables = {"generator": generator, "scorer": scorer, "learner": learner}
    return Translation({k: v for k, v in tables.items() if v}, sorted(fields), notes)


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
    if learner.get("delta") is not None and learner.get("loss_type", "grpo") not in _CLIPPED_LOSSES:
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


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), inner, out)
    else:
        out[prefix] = value


_ACTOR = "actor_rollout_ref.actor"
_VERL_DIRECT = {
    f"{_ACTOR}.ppo_micro_batch_size_per_gpu": "micro_batch_size",
    f"{_ACTOR}.ppo_epochs": "num_iterations",
    f"{_ACTOR}.optim.lr": "lr",
    f"{_ACTOR}.clip_ratio_low": "epsilon_low",
    f"{_ACTOR}.clip_ratio_high": "epsilon_high",
    f"{_ACTOR}.grad_clip": "max_grad_norm",
    f"{_ACTOR}.optim.weight_decay": "weight_decay",
    f"{_ACTOR}.tau_pos": "sapo_temperature_pos",
    f"{_ACTOR}.tau_neg": "sapo_temperature_neg",
    f"{_ACTOR}.policy_loss.kl_cov_ratio": "kl_cov_ratio",
    f"{_ACTOR}.policy_loss.ppo_kl_coef": "kl_cov_coef",
    f"{_ACTOR}.entropy_coeff": "entropy_coef",
    "actor_rollout_ref.rollout.temperature": "temperature",
    "actor_rollout_ref.rollout.top_p": "top_p",
    "actor_rollout_ref.rollout.top_k": "top_k",
    "data.max_prompt_length": "max_prompt_length",
    "data.max_response_length": "max_completion_length",
    "trainer.total_training_steps": "max_steps",
    "actor_rollout_ref.model.path": "model",
}


def from_verl(document: dict[str, Any]) -> Translation:
    """Our TOML tables from a verl ppo_trainer.yaml-style document (keys it leaves out keep our defaults)."""
    flat: dict[str, Any] = {}
    _flatten("", document, flat)
    take = flat.pop
    learner: dict[str, Any] = {}
    scorer: dict[str, Any] = {}
    generator: dict[str, Any] = {}
    notes: list[str] = []
    train_batch = int(take("data.train_batch_size", 8))
    n = int(take("actor_rollout_ref.rollout.n", 8))
    mini = int(take(f"{_ACTOR}.ppo_mini_batch_size", train_batch) or train_batch)
    learner.update(groups_per_step=mini, group_size=n)
    if train_batch // mini > 1:
        learner["max_staleness"] = train_batch // mini - 1
    for theirs, ours in _VERL_DIRECT.items():
        if theirs in flat and flat[theirs] is not None:
            learner[ours] = take(theirs)
    if f"{_ACTOR}.clip_ratio" in flat:
        ratio = take(f"{_ACTOR}.clip_ratio")
        learner.setdefault("epsilon_low", ratio)
        learner.setdefault("epsilon_high", ratio)
    _verl_objective(flat, learner, notes)
    _verl_kl(flat, learner)
    if not take("algorithm.norm_adv_by_std_in_grpo", True):
        scorer["scale_rewards"] = "none"
    estimator = flat.get("algorithm.adv_estimator", "grpo")
    if estimator in _VERL_ESTIMATORS:
        take("algorithm.adv_estimator", None)
        if _VERL_ESTIMATORS[estimator] != "grpo":
            scorer["estimator"] = _VERL_ESTIMATORS[estimator]
            scorer.pop("scale_rewards", None)  # verl's norm_adv_by_std_in_grpo applies to grpo only
    if "actor_rollout_ref.rollout.gpu_memory_utilization" in flat:
        generator["gpu_memory_utilization"] = take("actor_rollout_ref.rollout.gpu_memory_utilization")
    if "actor_rollout_ref.rollout.tensor_model_parallel_size" in flat:
        generator["tensor_parallel_size"] = take("actor_rollout_ref.rollout.tensor_model_parallel_size")
    if learner.get("top_k") == 0:
        learner["top_k"] = -1
    if "model" in learner:
        generator["model"] = learner["model"]
    tables = {"generator": generator, "scorer": scorer, "learner": learner}
    return Translation({k: v for k, v in tables.items() if v}, sorted(flat), notes)


def _verl_objective(flat: dict[str, Any], learner: dict[str, Any], notes: list[str]) -> None:
    """verl's loss_mode x loss_agg_mode -> loss_type (+ loss_aggregation); dual-clip c -> delta."""
    mode = flat.get(f"{_ACTOR}.policy_loss.loss_mode", "vanilla")
    agg_name = flat.get(f"{_ACTOR}.loss_agg_mode")
    if agg_name is not None and agg_name not in _VERL_AGG:
        return  # stays in flat: unmapped
    if mode not in ("vanilla", "gspo", "cispo", "sapo", "geo_mean", "kl_cov"):
        return  # clip_cov, gpg, ...: unmapped
    flat.pop(f"{_ACTOR}.policy_loss.loss_mode", None)
    flat.pop(f"{_ACTOR}.loss_agg_mode", None)
    agg = _VERL_AGG[agg_name or "token-mean"]
    if mode in ("vanilla", "gspo"):
        # verl's gspo and sapo aggregate seq-mean-token-mean whatever loss_agg_mode says; geo_mean its own way.
        learner["loss_type"] = "grpo" if mode == "gspo" else _VERL_LOSS_FROM_AGG[agg]
        if mode == "gspo":
            learner["ratio_level"] = "sequence"
    else:
        learner["loss_type"] = mode
        if mode in ("cispo", "kl_cov") and agg != "dapo":
            learner["loss_aggregation"] = agg
    low = learner.get("epsilon_low", 0.2)
    high = learner.get("epsilon_high", 0.2)
    if mode == "cispo":
        learner["cispo_clip_min"], learner["cispo_clip_max"] = 1 - low, 1 + high
    clip_c = flat.pop(f"{_ACTOR}.clip_ratio_c", None)
    if mode == "vanilla" and clip_c is not None:
        learner["delta"] = clip_c  # dual-clip: caps -A r at -A c for A < 0, exactly what delta does
    if mode in ("cispo", "sapo"):
        notes.append(f"verl's {mode} clamps log ratios to [-20, 20] first; here they are not clamped")


def _verl_kl(flat: dict[str, Any], learner: dict[str, Any]) -> None:
    use_kl = flat.pop(f"{_ACTOR}.use_kl_loss", False)
    coef = flat.pop(f"{_ACTOR}.kl_loss_coef", 0.0)
    learner["beta"] = float(coef) if use_kl else 0.0
    learner["kl_bias_correction"] = False  # verl has no such correction
    kind = flat.get(f"{_ACTOR}.kl_loss_type")
    if kind is None or kind in _VERL_KL:
        flat.pop(f"{_ACTOR}.kl_loss_type", None)
        learner["kl_estimator"] = _VERL_KL[kind or "low_var_kl"]
    # "k3+"-style straight-through estimators stay in flat: unmapped


def _to_toml(result: Translation, source: Path, kind: str, defaults_from: str) -> str:
    import tomli_w

    header = [
        f"# Translated from {kind} configuration {source} by `asyncgrpo config from-{kind.lower()}`.",
        f"# Options the file leaves out: {defaults_from}.",
    ]
    if result.unmapped:
        header.append("# Options with no counterpart here (not translated, --allow-unmapped):")
        header.extend(f"#   {name}" for name in result.unmapped)
    header.extend(f"# Note: {note}" for note in result.notes)
    return "\n".join(header) + "\n\n" + tomli_w.dumps(result.tables)


_COMPUTED_DEFAULTS = {"generator_id", "scorer_id", "gpu_host_key", "weight_sync_host"}


def _default_text(name: str, field) -> str:
    if name in _COMPUTED_DEFAULTS:
        return "hostname-based"
    if name == "api_token":
        return "empty (required by the generator)"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "its own table"
    text = json.dumps(value, default=str) if isinstance(value, list | dict) else str(value)
    return f"`{text}`" if len(text) <= 48 else "see configs/"


def settings_table(cls, prefix: str, table: str) -> str:
    """A markdown table of a settings class: TOML key, environment variable, default, meaning."""
    rows = ["| setting | environment | default | meaning |", "|---|---|---|---|"]
    for name, field in cls.model_fields.items():
        env = f"`{prefix}{name.upper()}`" if prefix else ""
        if name in COMMON_ENV and prefix:
            env += f" or `{COMMON_ENV[name]}`"
        rows.append(f"| `{name}` | {env} | {_default_text(name, field)} | {field.description or ''} |")
    return "\n".join(rows)


def settings_tables() -> str:
    tables = [
        (GeneratorSettings, "GENERATOR_", "generator"),
        (ScorerSettings, "SCORER_", "scorer"),
        (LearnerSettings, "LEARNER_", "learner"),
        (DataSettings, "LEARNER_DATA__", "data"),
        (RewardSpec, "", "scorer.rewards (each entry)"),
        (LauncherSettings, "", "launcher"),
    ]
    return "\n\n".join(f"#### `[{table}]`\n\n{settings_table(cls, prefix, table)}" for cls, prefix, table in tables)


def _translate(args) -> tuple[Translation, str, str]:
    data = _read_mapping(args.file)
    if args.config_command == "from-verl":
        return from_verl(data), "verl", "asyncgrpo's defaults (verl's YAML defaults are not read)"
    if args.trl_defaults is not None:
        defaults, source = _read_mapping(args.trl_defaults), f"GRPOConfig defaults from {args.trl_defaults}"
    else:
        defaults = installed_trl_defaults()
        if defaults is None:
            raise ValueError(
                "TRL is not importable here, so GRPOConfig's defaults for the options your file leaves out are "
                "unknown: install trl in this environment, or pass --trl-defaults FILE (a JSON of GRPOConfig's "
                "field defaults, e.g. dumped from dataclasses.fields(GRPOConfig) where TRL is installed)"
            )
        import trl

        source = f"the installed TRL {trl.__version__}'s GRPOConfig defaults"
    return from_trl(data, defaults), "TRL", source


def main(args) -> int:
    if args.config_command == "tables":
        print(settings_tables())
        return 0
    try:
        if args.config_command == "explain":
            print(explain(PipelineConfig.load(args.file)))
            return 0
        result, kind, defaults_from = _translate(args)
        if result.unmapped and not args.allow_unmapped:
            raise UnmappedError(result.unmapped)
        text = _to_toml(result, args.file, kind, defaults_from)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.output:
        args.output.write_text(text)
        print(f"wrote {args.output}; {len(result.unmapped)} option(s) had no counterpart (listed at its top)")
    else:
        print(text)
    return 0
