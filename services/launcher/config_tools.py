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

from pydantic import BaseModel, ValidationError

from services.generator.settings import GeneratorSettings
from services.launcher.supervisor import LauncherSettings
from services.learner.settings import DataSettings, LearnerSettings
from services.scorer.settings import RewardSpec, ScorerSettings
from shared.settings import COMMON_ENV, read_config_file

_PLACEHOLDER_TOKEN = "not-needed-to-explain"


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


@dataclass
class Pipeline:
    generator: GeneratorSettings
    scorer: ScorerSettings
    learner: LearnerSettings
    launcher: LauncherSettings


def load_pipeline(path: Path) -> Pipeline:
    """Every service's settings from one file (the environment still overrides); raises ValueError with
    each problem's field and how to fix it."""
    document = read_config_file(path)
    errors: list[str] = []
    loaded: dict[str, Any] = {}
    for name, cls in (("generator", GeneratorSettings), ("scorer", ScorerSettings), ("learner", LearnerSettings)):
        try:
            settings = cls.load(path)
        except ValidationError as exc:
            token_only = all("api_token" in str(e["msg"]) for e in exc.errors())
            if not token_only:
                errors.extend(_describe(name, exc))
                continue
            settings = cls.load(path, api_token=_PLACEHOLDER_TOKEN)
        loaded[name] = settings
    try:
        loaded["launcher"] = LauncherSettings(**document.get("launcher", {}))
    except ValidationError as exc:
        errors.extend(_describe("launcher", exc))
    if not errors:
        pipeline = Pipeline(**loaded)
        errors.extend(cross_check(pipeline))
        if not errors:
            return pipeline
    raise ValueError(f"{path} is not a valid configuration:\n  - " + "\n  - ".join(errors))


def _describe(section: str, exc: ValidationError) -> list[str]:
    out = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"])
        where = f"[{section}] {field}" if field else f"[{section}]"
        out.append(f"{where}: {error['msg'].removeprefix('Value error, ')}")
    return out


def cross_check(pipeline: Pipeline) -> list[str]:
    """Checks that span services."""
    learner, generator = pipeline.learner, pipeline.generator
    errors = []
    needed = learner.max_prompt_length + learner.max_completion_length
    if needed > generator.max_model_len:
        errors.append(
            f"[generator] max_model_len ({generator.max_model_len}) is below the learner's max_prompt_length + "
            f"max_completion_length ({needed}); raise it or lower those"
        )
    return errors


def explain(pipeline: Pipeline) -> str:
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

_TRL_LOSS = {"grpo": "grpo", "bnpo": "bnpo", "dr_grpo": "dr_grpo", "dapo": "dapo"}
_VERL_AGG = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}
_VERL_AGG_FROM_OURS = {
    "dapo": "token-mean",
    "bnpo": "token-mean",
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}


def _read_mapping(path: Path) -> dict[str, Any]:
    text = path.read_text()
    if path.suffix == ".json":
        return json.loads(text)
    import yaml

    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a mapping of settings")
    return data


def from_trl(fields: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Our TOML tables from TRL GRPOConfig fields; and the fields with no equivalent."""
    fields = dict(fields)
    learner: dict[str, Any] = {}
    scorer: dict[str, Any] = {}
    generator: dict[str, Any] = {}
    per_device = int(fields.pop("per_device_train_batch_size", 8))
    num_generations = int(fields.pop("num_generations", 8))
    num_processes = int(fields.pop("num_processes", 1))
    accumulation = int(fields.pop("gradient_accumulation_steps", 1))
    steps_per_generation = fields.pop("steps_per_generation", None)
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
    if batch.optimizer_steps_per_generation > 1:
        learner["max_staleness"] = batch.optimizer_steps_per_generation - 1
    direct = {
        "learning_rate": "lr",
        "beta": "beta",
        "epsilon_high": "epsilon_high",
        "delta": "delta",
        "num_iterations": "num_iterations",
        "max_completion_length": "max_completion_length",
        "max_prompt_length": "max_prompt_length",
        "temperature": "temperature",
        "top_p": "top_p",
        "top_k": "top_k",
        "max_steps": "max_steps",
        "warmup_steps": "warmup_steps",
        "weight_decay": "weight_decay",
        "max_grad_norm": "max_grad_norm",
        "seed": "seed",
        "adam_beta1": "adam_beta1",
        "adam_beta2": "adam_beta2",
        "model_name_or_path": "model",
    }
    for theirs, ours in direct.items():
        if theirs in fields and fields[theirs] is not None:
            learner[ours] = fields.pop(theirs)
    if "epsilon" in fields:
        learner["epsilon_low"] = fields.pop("epsilon")
        learner.setdefault("epsilon_high", learner["epsilon_low"])
    if "loss_type" in fields:
        learner["loss_type"] = _TRL_LOSS.get(fields.pop("loss_type"), "grpo")
    if "top_k" in learner and learner["top_k"] in (0, None):
        learner["top_k"] = -1
    if "scale_rewards" in fields:
        value = fields.pop("scale_rewards")
        scorer["scale_rewards"] = {True: "group", False: "none"}.get(value, value)
    if "reward_weights" in fields:
        weights = fields.pop("reward_weights")
        scorer["rewards"] = [
            {"name": f"reward_{i}", "weight": w, "function": "your_module:reward_{i}"}
            for i, w in enumerate(weights or [])
        ]
    if "vllm_importance_sampling_correction" in fields:
        learner["importance_correction"] = bool(fields.pop("vllm_importance_sampling_correction"))
    if "vllm_importance_sampling_cap" in fields:
        learner["importance_cap"] = fields.pop("vllm_importance_sampling_cap")
    if fields.get("bf16") is not None:  # TRL's bf16: autocast over float32 weights, as our compute_dtype
        learner["compute_dtype"] = "bfloat16" if fields.pop("bf16") else "float32"
    if "vllm_gpu_memory_utilization" in fields:
        generator["gpu_memory_utilization"] = fields.pop("vllm_gpu_memory_utilization")
    if "model" in learner:
        generator["model"] = learner["model"]
    tables = {"generator": generator, "scorer": scorer, "learner": learner}
    return {k: v for k, v in tables.items() if v}, sorted(fields)


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), inner, out)
    else:
        out[prefix] = value


def from_verl(document: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Our TOML tables from a verl ppo_trainer.yaml-style document; and the keys with no equivalent."""
    flat: dict[str, Any] = {}
    _flatten("", document, flat)
    take = flat.pop
    learner: dict[str, Any] = {}
    scorer: dict[str, Any] = {}
    generator: dict[str, Any] = {}
    train_batch = int(take("data.train_batch_size", 8))
    n = int(take("actor_rollout_ref.rollout.n", 8))
    mini = int(take("actor_rollout_ref.actor.ppo_mini_batch_size", train_batch) or train_batch)
    learner.update(groups_per_step=mini, group_size=n)
    if train_batch // mini > 1:
        learner["max_staleness"] = train_batch // mini - 1
    direct = {
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "micro_batch_size",
        "actor_rollout_ref.actor.ppo_epochs": "num_iterations",
        "actor_rollout_ref.actor.optim.lr": "lr",
        "actor_rollout_ref.actor.clip_ratio_low": "epsilon_low",
        "actor_rollout_ref.actor.clip_ratio_high": "epsilon_high",
        "actor_rollout_ref.actor.grad_clip": "max_grad_norm",
        "actor_rollout_ref.actor.optim.weight_decay": "weight_decay",
        "actor_rollout_ref.rollout.temperature": "temperature",
        "actor_rollout_ref.rollout.top_p": "top_p",
        "actor_rollout_ref.rollout.top_k": "top_k",
        "data.max_prompt_length": "max_prompt_length",
        "data.max_response_length": "max_completion_length",
        "trainer.total_training_steps": "max_steps",
        "actor_rollout_ref.model.path": "model",
    }
    for theirs, ours in direct.items():
        if theirs in flat and flat[theirs] is not None:
            learner[ours] = take(theirs)
    if "actor_rollout_ref.actor.clip_ratio" in flat:
        ratio = take("actor_rollout_ref.actor.clip_ratio")
        learner.setdefault("epsilon_low", ratio)
        learner.setdefault("epsilon_high", ratio)
    if "actor_rollout_ref.actor.loss_agg_mode" in flat:
        learner["loss_type"] = _VERL_AGG.get(take("actor_rollout_ref.actor.loss_agg_mode"), "grpo")
    use_kl = take("actor_rollout_ref.actor.use_kl_loss", False)
    coef = take("actor_rollout_ref.actor.kl_loss_coef", 0.0)
    learner["beta"] = float(coef) if use_kl else 0.0
    if not take("algorithm.norm_adv_by_std_in_grpo", True):
        scorer["scale_rewards"] = "none"
    estimator = take("algorithm.adv_estimator", "grpo")
    if estimator != "grpo":
        flat["algorithm.adv_estimator"] = estimator  # only GRPO-style estimators are ours
    if "actor_rollout_ref.rollout.gpu_memory_utilization" in flat:
        generator["gpu_memory_utilization"] = take("actor_rollout_ref.rollout.gpu_memory_utilization")
    if "actor_rollout_ref.rollout.tensor_model_parallel_size" in flat:
        generator["tensor_parallel_size"] = take("actor_rollout_ref.rollout.tensor_model_parallel_size")
    if learner.get("top_k") == 0:
        learner["top_k"] = -1
    if "model" in learner:
        generator["model"] = learner["model"]
    tables = {"generator": generator, "scorer": scorer, "learner": learner}
    return {k: v for k, v in tables.items() if v}, sorted(flat)


def _to_toml(tables: dict[str, Any], unmapped: list[str], source: Path, kind: str) -> str:
    import tomli_w

    header = [f"# Translated from {kind} configuration {source} by `asyncgrpo config from-{kind.lower()}`."]
    if unmapped:
        header.append("# Fields with no equivalent here (not translated):")
        header.extend(f"#   {name}" for name in unmapped)
    return "\n".join(header) + "\n\n" + tomli_w.dumps(tables)


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


def main(args) -> int:
    if args.config_command == "tables":
        print(settings_tables())
        return 0
    try:
        if args.config_command == "explain":
            print(explain(load_pipeline(args.file)))
            return 0
        data = _read_mapping(args.file)
        if args.config_command == "from-trl":
            tables, unmapped = from_trl(data)
            text = _to_toml(tables, unmapped, args.file, "TRL")
        else:
            tables, unmapped = from_verl(data)
            text = _to_toml(tables, unmapped, args.file, "verl")
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.output:
        args.output.write_text(text)
        print(f"wrote {args.output}; {len(unmapped)} field(s) had no equivalent (listed at its top)")
    else:
        print(text)
    return 0
