"""``asyncgrpo config tables``: every setting as a markdown table, the README's "Settings" section.

Read from the settings classes themselves (name, environment variable, default, description), so the README
cannot drift from the code (``tests/unit/test_readme.py`` checks that it holds this output). A default
computed at start (a host name) is shown as its field declares: ``json_schema_extra={DEFAULT_TEXT: ...}``.
"""

from __future__ import annotations

import json

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from shared.config.base import COMMON_ENV, DEFAULT_TEXT
from shared.config.data import DataSettings
from shared.config.environment import EnvironmentSettings
from shared.config.generator import GeneratorSettings
from shared.config.launcher import LauncherSettings
from shared.config.learner import LearnerSettings
from shared.config.scorer import RewardSpec, ScorerSettings

# (class, environment prefix, TOML table), in the README's order.
TABLES: tuple[tuple[type[BaseModel], str, str], ...] = (
    (GeneratorSettings, "GENERATOR_", "generator"),
    (EnvironmentSettings, "GENERATOR_ENVIRONMENT__", "environment"),
    (ScorerSettings, "SCORER_", "scorer"),
    (LearnerSettings, "LEARNER_", "learner"),
    (DataSettings, "LEARNER_DATA__", "data"),
    (RewardSpec, "", "scorer.rewards (each entry)"),
    (LauncherSettings, "", "launcher"),
)
_LONGEST_DEFAULT = 48  # longer defaults (lists of modules) would stretch the table: the configs show them


def markdown_text(text: str) -> str:
    """``text`` for a markdown table cell: ``<name>`` outside code spans escaped, so that it is shown, not taken
    for an HTML tag (``runs/<name>/`` would lose ``<name>``); ``|`` escaped."""
    spans = text.split("`")
    spans[::2] = [span.replace("<", "&lt;") for span in spans[::2]]
    return "`".join(spans).replace("|", "\\|")


def default_text(field: FieldInfo) -> str:
    """How the table shows a field's default."""
    extra = field.json_schema_extra
    if isinstance(extra, dict) and DEFAULT_TEXT in extra:
        return str(extra[DEFAULT_TEXT])
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "its own table"
    text = json.dumps(value, default=str) if isinstance(value, list | dict) else str(value)
    return f"`{text}`" if len(text) <= _LONGEST_DEFAULT else "see configs/"


def settings_table(cls: type[BaseModel], prefix: str) -> str:
    """A markdown table of a settings class: TOML key, environment variable, default, meaning."""
    rows = ["| setting | environment | default | meaning |", "|---|---|---|---|"]
    for name, field in cls.model_fields.items():
        env = f"`{prefix}{name.upper()}`" if prefix else ""
        if name in COMMON_ENV and prefix:
            env += f" or `{COMMON_ENV[name]}`"
        rows.append(f"| `{name}` | {env} | {default_text(field)} | {markdown_text(field.description or '')} |")
    return "\n".join(rows)


def settings_tables() -> str:
    """Every table, each under its ``#### `[table]``` heading."""
    return "\n\n".join(f"#### `[{table}]`\n\n{settings_table(cls, prefix)}" for cls, prefix, table in TABLES)
