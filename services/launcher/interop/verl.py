"""verl's side of ``asyncgrpo config from-verl``: the one table of every verl key read, and the translation.

The document is a verl ``ppo_trainer.yaml``-style mapping. Keys it leaves out take verl's values from its
composed configuration when one is given (``defaults``: ``--verl-defaults``), else ours. Values that behave
differently here are listed with both values. This module is the map (the README's verl mapping table is its
prose): keys copied as they are (``VERL_DIRECT``, ``VERL_GENERATOR``), keys that change nothing learned here
and why (``VERL_NO_EFFECT``), and every key read (``VERL_READ``, the only ones filled from the composed
defaults); keys with no counterpart stay in the flattened document and are reported. ``verl_trainer`` holds
the trainer's side (steps, schedule, checkpoints, LoRA, rollout correction, data, validation, loggers).

verl's configuration files are Hydra's. Its ``ppo_trainer.yaml`` holds few values itself: a ``defaults:`` list
composes the rest from config groups (``actor@actor_rollout_ref.actor: dp_actor`` is ``actor/dp_actor.yaml``
placed at ``actor_rollout_ref.actor``), which themselves have defaults lists and ``${oc.select:...}``
interpolations. Translating only the file's own values would quietly replace everything else with our
defaults, so such a file is refused unless the composed configuration is given (verl ships it as
``verl/trainer/config/_generated_ppo_trainer.yaml``, and ``--cfg job`` prints it for any Hydra config). The
file's own values then override the composed ones, as ``_self_`` last in the list does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from services.launcher.interop.translation import Draft, Translation, fit_micro_batch, ours, staleness_difference
from services.launcher.interop.verl_trainer import (
    CORRECTION,
    MODEL,
    OPTIM,
    verl_checkpoints,
    verl_correction,
    verl_data,
    verl_lora,
    verl_monitoring,
    verl_optimizer,
    verl_steps,
)

# The keys verl_trainer reads.
VERL_TRAINER_READ = (
    "trainer.total_epochs",
    "trainer.total_training_steps",
    "trainer.save_freq",
    "trainer.max_actor_ckpt_to_keep",
    "trainer.default_local_dir",
    "trainer.resume_mode",
    f"{OPTIM}.betas",
    f"{OPTIM}.lr_scheduler_type",
    f"{OPTIM}.warmup_style",
    f"{OPTIM}.min_lr_ratio",
    f"{OPTIM}.num_cycles",
    f"{OPTIM}.lr_warmup_steps",
    f"{OPTIM}.lr_warmup_steps_ratio",
    f"{MODEL}.lora_rank",
    f"{MODEL}.lora_alpha",
    f"{MODEL}.target_modules",
    f"{CORRECTION}.rollout_is",
    f"{CORRECTION}.rollout_is_threshold",
    "data.filter_overlong_prompts",
    "data.truncation",
    "trainer.test_freq",
    "trainer.val_before_train",
)
_PLACEMENT = (
    "placement: GPUs here are given at deployment, LEARNER_GPUS and one per generator replica (README, GPU box)"
)
_NO_GRAD_BATCH = "how log-probabilities are batched, not their values (learner.no_grad_micro_batch_size here)"
_OFFLOAD = "where FSDP keeps weights and optimizer state, not their values"
# Keys that change nothing learned here, and why; listed in the output, never refused.
VERL_NO_EFFECT = {
    "trainer.n_gpus_per_node": _PLACEMENT,
    "trainer.nnodes": _PLACEMENT,
    "actor_rollout_ref.rollout.name": "the rollout engine: generators here run vLLM",
    f"{MODEL}.use_remove_padding": "padding-free kernels compute the same loss",
    "trainer.experiment_name": "the trackers' name for the run; learner.run_name here names the run's directory "
    "and continues a run of that name: trainer.default_local_dir's last part gives it, --run-name overrides",
    "trainer.log_val_generations": "logging only: learner.log_completions writes completion tables here",
    "trainer.default_hdfs_dir": "a copy of the checkpoints on HDFS: nothing is copied from here",
    "data.dataloader_num_workers": "how batches are loaded, not which prompts",
    "actor_rollout_ref.actor.fsdp_config.param_offload": _OFFLOAD,
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": _OFFLOAD,
    "actor_rollout_ref.ref.fsdp_config.param_offload": _OFFLOAD,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": _NO_GRAD_BATCH,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": _NO_GRAD_BATCH,
}

# verl's loss_agg_mode -> our aggregation, and the loss type that aggregates that way.
_VERL_AGG = {
    "token-mean": "dapo",
    "seq-mean-token-mean": "grpo",
    "seq-mean-token-sum-norm": "dr_grpo",
    "seq-mean-token-sum": "seq_sum",
}
_VERL_LOSS_FROM_AGG = {"dapo": "dapo", "grpo": "grpo", "dr_grpo": "dr_grpo", "seq_sum": "luspo"}
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
_VERL_LOSS_MODES = ("vanilla", "gspo", "cispo", "sapo", "geo_mean", "kl_cov")

_ACTOR = "actor_rollout_ref.actor"
# verl key (dotted) -> our learner field, copied as they are.
VERL_DIRECT = {
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
    "actor_rollout_ref.model.path": "model",
}
VERL_GENERATOR = {
    "actor_rollout_ref.rollout.gpu_memory_utilization": "gpu_memory_utilization",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "tensor_parallel_size",
}
# Every key the translation reads (filled from verl's composed defaults when they are given).
VERL_READ = frozenset(
    {
        *VERL_DIRECT,
        *VERL_GENERATOR,
        *VERL_TRAINER_READ,
        "data.train_batch_size",
        "actor_rollout_ref.rollout.n",
        f"{_ACTOR}.ppo_mini_batch_size",
        f"{_ACTOR}.clip_ratio",
        f"{_ACTOR}.clip_ratio_c",
        f"{_ACTOR}.policy_loss.loss_mode",
        f"{_ACTOR}.loss_agg_mode",
        f"{_ACTOR}.use_kl_loss",
        f"{_ACTOR}.kl_loss_coef",
        f"{_ACTOR}.kl_loss_type",
        "algorithm.norm_adv_by_std_in_grpo",
        "algorithm.adv_estimator",
    }
)

# ${key}, ${.sibling} or ${oc.select:key,default} making up a whole value (which keeps the target's type).
_WHOLE = re.compile(r"^\$\{(?:oc\.select:)?\s*([A-Za-z0-9_.]+)\s*(?:,(.*))?\}$")
# ${key} inside a longer string ("checkpoints/${trainer.project_name}/...").
_EMBEDDED = re.compile(r"\$\{([A-Za-z0-9_.]+)\}")
_MAX_DEPTH = 8  # interpolations that lead to interpolations, followed this far


def from_verl(document: dict[str, Any], defaults: dict[str, Any] | None = None) -> Translation:
    """Our TOML tables from a verl ppo_trainer.yaml-style document. ``defaults``: the composed verl
    configuration (``_generated_ppo_trainer.yaml``, or ``--cfg job``'s output) for the keys the document leaves
    out; None leaves them at ours, and refuses a Hydra ``defaults:`` document."""
    groups = composition(document)
    if groups and defaults is None:
        raise refusal(groups)
    flat = _verl_flat(own_values(document), defaults)
    draft = Draft("verl")
    theirs_staleness = _verl_batch(flat, draft.learner)
    _verl_direct(flat, draft.learner)
    _verl_objective(flat, draft.learner, draft.notes)
    _verl_kl(flat, draft.learner)
    draft.scorer.update(_verl_scorer(flat))
    draft.generator.update(_verl_generator(flat, draft.notes))
    steps_known = verl_steps(flat, draft)
    verl_optimizer(flat, draft, steps_known)
    verl_checkpoints(flat, draft, steps_known)
    verl_lora(flat, draft)
    verl_correction(flat, draft)
    verl_data(flat, draft)
    verl_monitoring(flat, draft)
    _verl_no_effect(flat, draft)
    staleness_difference(
        draft,
        theirs_staleness,
        f"each rollout batch is trained on, {theirs_staleness + 1} mini-batch(es), then the next is generated",
        f"set max_staleness = {theirs_staleness} for verl's on-policy batches; generation then waits for every step",
    )
    fit_micro_batch(draft.learner, draft.notes)
    return draft.finish(flat, "data.train_files")


def _verl_flat(document: dict[str, Any], defaults: dict[str, Any] | None) -> dict[str, Any]:
    """The document's dotted keys, with the keys it leaves out that the translation reads taken from
    ``defaults``, and the interpolations of those keys resolved."""
    flat: dict[str, Any] = {}
    _flatten("", document, flat)
    composed: dict[str, Any] = {}
    if defaults is not None:
        _flatten("", own_values(defaults), composed)
        fill = (VERL_READ - {"actor_rollout_ref.model.path"}) & set(composed)  # verl's placeholder model: not one
        flat = {**{k: composed[k] for k in fill if k not in flat}, **flat}
    resolve(flat, set(VERL_READ), {**composed, **flat})
    return flat


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), inner, out)
    else:
        out[prefix] = value


def _verl_batch(flat: dict[str, Any], learner: dict[str, Any]) -> int:
    """Prompts per step and G; several mini-batches per rollout batch train on older samples: staleness,
    which is returned (a key left out keeps our value)."""
    train_batch = int(flat.pop("data.train_batch_size", None) or ours(learner, "groups_per_step"))
    n = int(flat.pop("actor_rollout_ref.rollout.n", None) or ours(learner, "group_size"))
    mini = int(flat.pop(f"{_ACTOR}.ppo_mini_batch_size", None) or train_batch)
    learner.update(groups_per_step=mini, group_size=n)
    if train_batch // mini > 1:
        learner["max_staleness"] = train_batch // mini - 1
    return max(0, train_batch // mini - 1)


def _verl_direct(flat: dict[str, Any], learner: dict[str, Any]) -> None:
    for theirs, mine in VERL_DIRECT.items():
        value = flat.pop(theirs, None)  # null: verl's "unset", ours applies
        if value is not None:
            learner[mine] = value
    if f"{_ACTOR}.clip_ratio" in flat:
        ratio = flat.pop(f"{_ACTOR}.clip_ratio")
        learner.setdefault("epsilon_low", ratio)
        learner.setdefault("epsilon_high", ratio)
    if learner.get("top_k") == 0:
        learner["top_k"] = -1  # verl's "off"


def _verl_objective(flat: dict[str, Any], learner: dict[str, Any], notes: list[str]) -> None:
    """verl's loss_mode x loss_agg_mode -> loss_type (+ loss_aggregation); dual-clip c -> delta."""
    mode = flat.get(f"{_ACTOR}.policy_loss.loss_mode", "vanilla")
    agg_name = flat.get(f"{_ACTOR}.loss_agg_mode")
    if (agg_name is not None and agg_name not in _VERL_AGG) or mode not in _VERL_LOSS_MODES:
        return  # stays in flat: unmapped (clip_cov, gpg, ...)
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
    if mode == "cispo":
        low, high = learner.get("epsilon_low", 0.2), learner.get("epsilon_high", 0.2)
        learner["cispo_clip_min"], learner["cispo_clip_max"] = 1 - low, 1 + high
    clip_c = flat.pop(f"{_ACTOR}.clip_ratio_c", None)
    if mode == "vanilla" and clip_c is not None:
        learner["delta"] = clip_c  # dual-clip: caps -A r at -A c for A < 0, exactly what delta does
    if mode in ("cispo", "sapo"):
        notes.append(f"verl's {mode} clamps log ratios to [-20, 20] first; here they are not clamped")


def _verl_kl(flat: dict[str, Any], learner: dict[str, Any]) -> None:
    if flat.get("algorithm.use_kl_in_reward") is False:
        flat.pop("algorithm.use_kl_in_reward")  # off: nothing to translate (on: unmapped)
    use_kl = flat.pop(f"{_ACTOR}.use_kl_loss", False)
    coef = flat.pop(f"{_ACTOR}.kl_loss_coef", 0.0)
    learner["beta"] = float(coef) if use_kl else 0.0
    learner["kl_bias_correction"] = False  # verl has no such correction
    kind = flat.get(f"{_ACTOR}.kl_loss_type")
    if kind is None or kind in _VERL_KL:
        flat.pop(f"{_ACTOR}.kl_loss_type", None)
        learner["kl_estimator"] = _VERL_KL[kind or "low_var_kl"]
    # "k3+"-style straight-through estimators stay in flat: unmapped


def _verl_scorer(flat: dict[str, Any]) -> dict[str, Any]:
    scorer: dict[str, Any] = {}
    if not flat.pop("algorithm.norm_adv_by_std_in_grpo", True):
        scorer["scale_rewards"] = "none"
    estimator = flat.get("algorithm.adv_estimator", "grpo")
    if estimator in _VERL_ESTIMATORS:
        flat.pop("algorithm.adv_estimator", None)
        if _VERL_ESTIMATORS[estimator] != "grpo":
            scorer["estimator"] = _VERL_ESTIMATORS[estimator]
            scorer.pop("scale_rewards", None)  # verl's norm_adv_by_std_in_grpo applies to grpo only
    return scorer


def _verl_generator(flat: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    generator = {mine: flat.pop(theirs) for theirs, mine in VERL_GENERATOR.items() if theirs in flat}
    if generator.get("tensor_parallel_size", 1) > 1:
        generator["gpu_count"] = "auto"  # a replica over several GPUs leases them (README, GPU box)
        notes.append(
            "generator.gpu_count = 'auto': verl's hybrid engine shares every GPU between actor and rollout; "
            "here each generator replica leases its own tensor_parallel_size GPUs"
        )
    return generator


def _verl_no_effect(flat: dict[str, Any], draft: Draft) -> None:
    """Take out the keys that change nothing learned here, listing each."""
    for key, why in VERL_NO_EFFECT.items():
        if key in flat:
            flat.pop(key)
            draft.ignore(key, why)


class HydraDefaultsError(ValueError):
    """A Hydra ``defaults:`` file given without the configuration it composes to."""


def composition(document: Mapping[str, Any]) -> list[str]:
    """The config groups a document's ``defaults:`` list composes (``_self_`` left out); [] for none."""
    entries = document.get("defaults")
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise ValueError(f"defaults: {entries!r} is not a Hydra defaults list")
    return [_entry(entry) for entry in entries if entry != "_self_"]


def _entry(entry: Any) -> str:
    if isinstance(entry, Mapping):
        return ", ".join(f"{key}: {value}" for key, value in entry.items())
    return str(entry)


def own_values(document: Mapping[str, Any]) -> dict[str, Any]:
    """The document without Hydra's own keys (``defaults``, ``hydra``): the values ``_self_`` applies."""
    return {key: value for key, value in document.items() if key not in ("defaults", "hydra")}


def refusal(groups: list[str]) -> HydraDefaultsError:
    shown = "; ".join(groups[:4]) + ("; ..." if len(groups) > 4 else "")
    return HydraDefaultsError(
        f"this is a Hydra configuration whose defaults list ({shown}) composes most of its values from verl's "
        "config groups, which are not read here; translating its own values alone would put asyncgrpo's "
        "defaults where verl's are. Pass --verl-defaults FILE, the configuration it composes to (for verl's "
        "ppo_trainer.yaml that is verl/trainer/config/_generated_ppo_trainer.yaml; for your own, print it with "
        "`python -m verl.trainer.main_ppo --config-path DIR --config-name NAME --cfg job`), or translate "
        "that composed file itself"
    )


def resolve(flat: dict[str, Any], keys: set[str], lookup: Mapping[str, Any]) -> None:
    """Resolve the interpolations of ``keys`` in ``flat`` against ``lookup`` (dotted keys, composed values);
    one that cannot be resolved is refused with the key named."""
    for key in keys & set(flat):
        flat[key] = _resolved(key, flat[key], lookup, 0)


def _resolved(key: str, value: Any, lookup: Mapping[str, Any], depth: int) -> Any:
    if not isinstance(value, str) or "${" not in value:
        return value
    if depth > _MAX_DEPTH:
        raise ValueError(f"{key} = {value!r}: the interpolation does not end")
    whole = _WHOLE.match(value)
    if whole:
        target = _absolute(key, whole.group(1))
        if target in lookup:
            return _resolved(target, lookup[target], lookup, depth + 1)
        if whole.group(2) is not None:
            import yaml

            return yaml.safe_load(whole.group(2).strip())
        raise ValueError(f"{key} = {value!r}: {target} is not set in the configuration")
    text = _EMBEDDED.sub(
        lambda m: str(_resolved(m.group(1), lookup.get(m.group(1), m.group(0)), lookup, depth + 1)), value
    )
    if "${" in text:
        raise ValueError(f"{key} = {value!r}: only ${{key}} and ${{oc.select:key,default}} are resolved here")
    return text


def _absolute(key: str, target: str) -> str:
    """``.sibling`` is relative to the key's own node, as in OmegaConf."""
    if not target.startswith("."):
        return target
    node = key.rpartition(".")[0]
    return f"{node}.{target.lstrip('.')}" if node else target.lstrip(".")
