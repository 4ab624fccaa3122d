"""``asyncgrpo config from-verl``: our TOML tables from a verl ``ppo_trainer.yaml``-style document.

Keys the document leaves out take verl's values from its composed configuration when one is given
(``defaults``: ``--verl-defaults``), else ours; a Hydra ``defaults:`` file without it is refused
(``verl_hydra``). Values that behave differently here are listed with both values. The README's verl
mapping table is the map; keys that change nothing learned here (``VERL_NO_EFFECT``) are listed as such, and
keys with no counterpart stay in the flattened document and are reported.
"""

from __future__ import annotations

from typing import Any

from services.launcher.translation import Draft, Translation, fit_micro_batch, ours, staleness_difference
from services.launcher.verl_hydra import composition, own_values, refusal, resolve
from services.launcher.verl_training import (
    VERL_TRAINING_READ,
    verl_checkpoints,
    verl_correction,
    verl_data,
    verl_lora,
    verl_monitoring,
    verl_no_effect,
    verl_optimizer,
    verl_steps,
)

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
    "actor_rollout_ref.model.path": "model",
}
_VERL_GENERATOR = {
    "actor_rollout_ref.rollout.gpu_memory_utilization": "gpu_memory_utilization",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "tensor_parallel_size",
}
# Every key the translation reads (filled from verl's composed defaults when they are given).
_VERL_READ = frozenset(
    {
        *_VERL_DIRECT,
        *_VERL_GENERATOR,
        *VERL_TRAINING_READ,
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
    verl_no_effect(flat, draft)
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
        fill = (_VERL_READ - {"actor_rollout_ref.model.path"}) & set(composed)  # verl's placeholder model: not one
        flat = {**{k: composed[k] for k in fill if k not in flat}, **flat}
    resolve(flat, set(_VERL_READ), {**composed, **flat})
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
    for theirs, mine in _VERL_DIRECT.items():
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
    generator = {mine: flat.pop(theirs) for theirs, mine in _VERL_GENERATOR.items() if theirs in flat}
    if generator.get("tensor_parallel_size", 1) > 1:
        generator["gpu_count"] = "auto"  # a replica over several GPUs leases them (README, GPU box)
        notes.append(
            "generator.gpu_count = 'auto': verl's hybrid engine shares every GPU between actor and rollout; "
            "here each generator replica leases its own tensor_parallel_size GPUs"
        )
    return generator
