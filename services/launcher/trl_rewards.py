"""``config from-trl``, the reward functions: the ``trl grpo`` script's ``reward_funcs`` and ``reward_weights``
become ``[[scorer.rewards]]`` entries.

The script takes a name from its registry (``accuracy_reward``, ``reasoning_accuracy_reward``,
``think_format_reward``, ``get_soft_overlong_punishment``) or a dotted import path (``my_lib.rewards.fn``),
and passes every function TRL's signature, which our Python plugins take too: a path becomes
``function = "my_lib.rewards:fn"``, a registry function (or ``trl.rewards.<name>``) our copy of it,
``function = "shared.trl_rewards:<name>"``, which needs no TRL.
"""

from __future__ import annotations

from typing import Any

from services.launcher.translation import Draft, ours

_TRL_REGISTRY = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward")
# asyncgrpo's copies of TRL 1.16's trl.rewards functions (same names, signatures and results; no TRL needed).
_OURS_MODULE = "shared.trl_rewards"
# The trl grpo script's fixed arguments of get_soft_overlong_punishment (trl/scripts/grpo.py).
_OVERLONG_MAX_LEN, _OVERLONG_CACHE = 1280, 256


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
