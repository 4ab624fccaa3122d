"""What ``config from-trl`` and ``config from-verl`` share: the result, the refusal, reading and writing files.

A translation is our TOML tables, the peer's options with no counterpart here (the command refuses them
unless ``--allow-unmapped``, then lists them at the top of the output) and notes on what changed meaning.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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


def translation(
    generator: dict[str, Any], scorer: dict[str, Any], learner: dict[str, Any], rest: Iterable[str], notes: list[str]
) -> Translation:
    """The non-empty tables (the generator loads the learner's initial model), the options nothing consumed
    (``rest``), sorted, and the notes."""
    if "model" in learner:
        generator["model"] = learner["model"]
    tables = {"generator": generator, "scorer": scorer, "learner": learner}
    return Translation({k: v for k, v in tables.items() if v}, sorted(rest), list(notes))


def read_mapping(path: Path) -> dict[str, Any]:
    """A JSON or YAML file of settings, as a mapping."""
    text = path.read_text()
    if path.suffix == ".json":
        return json.loads(text)
    import yaml

    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a mapping of settings")
    return data


def to_toml(result: Translation, source: Path, kind: str, defaults_from: str) -> str:
    """The tables as TOML, headed by where they came from, what was left out and the notes."""
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
