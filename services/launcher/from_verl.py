"""``asyncgrpo config from-verl``: our TOML tables from a verl ``ppo_trainer.yaml``-style document.

Keys the document leaves out keep our defaults (verl's YAML defaults are not read). The README's verl
mapping table is the map; keys with no counterpart stay in the flattened document and are reported.
"""

from __future__ import annotations

from typing import Any

from services.launcher.translation import Translation, translation

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
    "trainer.total_training_steps": "max_steps",
    "actor_rollout_ref.model.path": "model",
}
_VERL_GENERATOR = {
    "actor_rollout_ref.rollout.gpu_memory_utilization": "gpu_memory_utilization",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "tensor_parallel_size",
}


def from_verl(document: dict[str, Any]) -> Translation:
    """Our TOML tables from a verl ppo_trainer.yaml-style document (keys it leaves out keep our defaults)."""
    flat: dict[str, Any] = {}
    _flatten("", document, flat)
    learner: dict[str, Any] = {}
    notes: list[str] = []
    _verl_batch(flat, learner)
    _verl_direct(flat, learner)
    _verl_objective(flat, learner, notes)
    _verl_kl(flat, learner)
    scorer = _verl_scorer(flat)
    generator = _verl_generator(flat)
    return translation(generator, scorer, learner, flat, notes)


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), inner, out)
    else:
        out[prefix] = value


def _verl_batch(flat: dict[str, Any], learner: dict[str, Any]) -> None:
    """Prompts per step and G; several mini-batches per rollout batch train on older samples: staleness."""
    train_batch = int(flat.pop("data.train_batch_size", 8))
    n = int(flat.pop("actor_rollout_ref.rollout.n", 8))
    mini = int(flat.pop(f"{_ACTOR}.ppo_mini_batch_size", train_batch) or train_batch)
    learner.update(groups_per_step=mini, group_size=n)
    if train_batch // mini > 1:
        learner["max_staleness"] = train_batch // mini - 1


def _verl_direct(flat: dict[str, Any], learner: dict[str, Any]) -> None:
    for theirs, ours in _VERL_DIRECT.items():
        if theirs in flat and flat[theirs] is not None:
            learner[ours] = flat.pop(theirs)
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


def _verl_generator(flat: dict[str, Any]) -> dict[str, Any]:
    return {ours: flat.pop(theirs) for theirs, ours in _VERL_GENERATOR.items() if theirs in flat}
