"""``config from-trl``, the algorithm's side: the objective and its clip range, the importance correction,
sampling, reward scaling, the reward functions, and what behaves differently from TRL there.

Each function takes the ``GRPOConfig`` fields it reads out of ``fields`` (the table of them is
:mod:`services.launcher.interop.trl`). The ``trl grpo`` script's ``reward_funcs`` are names from its registry
(``accuracy_reward``, ``reasoning_accuracy_reward``, ``think_format_reward``, ``get_soft_overlong_punishment``)
or dotted import paths (``my_lib.rewards.fn``), called with TRL's signature, which our Python plugins take too:
a path becomes ``function = "my_lib.rewards:fn"``, a registry function (or ``trl.rewards.<name>``) our copy of
it, ``function = "shared.trl_rewards:<name>"``, which needs no TRL.
"""

from __future__ import annotations

from typing import Any

from services.launcher.interop.translation import Draft, ours, staleness_difference
from shared.config.objective import CLIPPED_LOSSES, LOSS_TYPES

_TRL_LOSS = tuple(name for name in LOSS_TYPES if name not in ("geo_mean", "kl_cov"))  # verl's two are not TRL's
_TRL_REGISTRY = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward")
# asyncgrpo's copies of TRL 1.16's trl.rewards functions (same names, signatures and results; no TRL needed).
_OURS_MODULE = "shared.trl_rewards"
# The trl grpo script's fixed arguments of get_soft_overlong_punishment (trl/scripts/grpo.py).
_OVERLONG_MAX_LEN, _OVERLONG_CACHE = 1280, 256


def trl_algorithm(fields: dict[str, Any], draft: Draft) -> bool | None:
    """The objective, the importance correction, sampling, rewards and the generator's memory; returns
    use_vllm (whether TRL samples with vLLM, which decides what the differences say)."""
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
    return use_vllm


def trl_differences(draft: Draft, staleness: int, use_vllm: bool | None, *, defaults_known: bool) -> None:
    """What behaves differently from TRL in the algorithm: staleness, the importance correction, long prompts."""
    staleness_difference(
        draft,
        staleness,
        "on-policy: each generation block is trained on, then the next one is generated",
        "set max_staleness = 0 for TRL's on-policy batches; generation then waits for every step",
    )
    _importance_difference(draft, use_vllm)
    _prompt_length_difference(draft, defaults_known)


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


def trl_rewards(fields: dict[str, Any], draft: Draft) -> None:
    """reward_funcs (names or import paths) and reward_weights -> ``draft.scorer["rewards"]``."""
    names = fields.pop("reward_funcs", None)
    weights = fields.pop("reward_weights", None)
    if fields.get("reward_model_name_or_path") is None:
        fields.pop("reward_model_name_or_path", None)  # set: left in fields, reported as unmapped
    if isinstance(names, str):
        names = [names]
    if not names:
        _no_reward_names(weights, draft)
        return
    if weights and len(weights) != len(names):
        raise ValueError(
            f"reward_weights has {len(weights)} weight(s) for {len(names)} reward function(s); TRL needs one each"
        )
    entries = [_reward_entry(str(name), draft) for name in names]
    for entry, weight in zip(entries, weights or [1.0] * len(entries), strict=True):
        entry["weight"] = float(weight)
    _unique_names(entries)
    draft.scorer["rewards"] = entries


def _no_reward_names(weights: list[float] | None, draft: Draft) -> None:
    if weights:
        raise ValueError(
            f"reward_weights = {weights} but reward_funcs does not name the functions they weigh: add "
            "reward_funcs: [my_module.my_reward, ...] (import paths, as the trl grpo script takes them), or "
            "write [[scorer.rewards]] entries with function = 'module:function' yourself"
        )
    draft.differ(
        "reward_funcs",
        "none in this file (GRPOTrainer is given them in Python)",
        "the built-in 'correctness' (the scorer's default)",
        "name yours: reward_funcs: [my_module.my_reward], or [[scorer.rewards]] function = 'module:function'",
    )


def _reward_entry(name: str, draft: Draft) -> dict[str, Any]:
    ours_too = name.removeprefix("trl.rewards.")
    if ours_too in _TRL_REGISTRY:  # by the script's name, or its import path trl.rewards.<name>
        draft.notes.append(
            f"{ours_too} is TRL's (trl.rewards); {_OURS_MODULE}:{ours_too} gives its results without TRL installed"
        )
        return {"name": ours_too, "function": f"{_OURS_MODULE}:{ours_too}"}
    if name == "get_soft_overlong_punishment":
        length = ours(draft.learner, "max_completion_length")
        if length != _OVERLONG_MAX_LEN:
            draft.differ(
                "get_soft_overlong_punishment",
                f"max_completion_len = {_OVERLONG_MAX_LEN} (fixed by the trl grpo script)",
                f"max_completion_length = {length}",
                "the built-in overlong penalty measures against the learner's max_completion_length",
            )
        return {"name": "overlong", "params": {"buffer": _OVERLONG_CACHE}}
    module, _, function = name.rpartition(".")
    if not module:
        raise ValueError(
            f"reward function {name!r} is neither TRL's ({', '.join(_TRL_REGISTRY)}, get_soft_overlong_punishment) "
            "nor a dotted import path (my_module.my_reward)"
        )
    return {"name": function, "function": f"{module}:{function}"}


def _unique_names(entries: list[dict[str, Any]]) -> None:
    """Two functions of one name from different modules keep their full paths as names."""
    names = [entry["name"] for entry in entries]
    for entry in entries:
        if names.count(entry["name"]) > 1 and "function" in entry:
            entry["name"] = entry["function"].replace(":", ".")
