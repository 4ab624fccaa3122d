"""verl's configuration files are Hydra's: what ``config from-verl`` does with a ``defaults:`` list and ``${...}``.

verl's ``ppo_trainer.yaml`` holds few values itself: a ``defaults:`` list composes the rest from config
groups (``actor@actor_rollout_ref.actor: dp_actor`` is ``actor/dp_actor.yaml`` placed at
``actor_rollout_ref.actor``), which themselves have defaults lists and ``${oc.select:...}`` interpolations.
Translating only the file's own values would quietly replace everything else with our defaults, so such a
file is refused unless the composed configuration is given (``--verl-defaults``: verl ships it as
``verl/trainer/config/_generated_ppo_trainer.yaml``, and ``--cfg job`` prints it for any Hydra config).
The file's own values then override the composed ones, as ``_self_`` last in the list does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# ${key}, ${.sibling} or ${oc.select:key,default} making up a whole value (which keeps the target's type).
_WHOLE = re.compile(r"^\$\{(?:oc\.select:)?\s*([A-Za-z0-9_.]+)\s*(?:,(.*))?\}$")
# ${key} inside a longer string ("checkpoints/${trainer.project_name}/...").
_EMBEDDED = re.compile(r"\$\{([A-Za-z0-9_.]+)\}")
_MAX_DEPTH = 8  # interpolations that lead to interpolations, followed this far


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
