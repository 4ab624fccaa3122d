"""The HTTP reward-plugin protocol ``asyncgrpo.reward/v1``: one request per group, one reward per item.

Scorer -> plugin: ``POST <url>`` with a :class:`RewardRequest`; plugin -> scorer: a :class:`RewardResponse`.
The scorer builds the request (``services/scorer``), the example plugin and ``--function`` plugins
(``services/reward_plugin``) read it. The JSON Schema of both, generated from these models by
:func:`json_schema`, is committed as ``shared/schemas/reward_v1.json`` (a test keeps the two equal) and
served by the example plugin at ``GET /schema``, so a plugin in any language can validate against it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shared.columns import RESERVED_COLUMNS, json_problem
from shared.config.base import CONFIG_ENV

PROTOCOL = "asyncgrpo.reward/v1"
SCHEMA_PATH = Path(__file__).parent / "schemas" / "reward_v1.json"
MAX_ITEMS = 4096  # a group is G completions; no sane G comes near this

# A JSON number, nothing else: not "1" (lax pydantic would read it), not true, not NaN or Infinity.
Reward = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class Message(BaseModel):
    """One chat turn, as the scorer sends it (the same fields as the dataset's chat messages)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str


NonEmptyMessages = Annotated[list[Message], Field(min_length=1)]  # a reward reads the last message
TokenId = Annotated[int, Field(ge=0, lt=2**31)]  # vocabulary ids travel as int32


class RewardItem(BaseModel):
    """One completion to judge, with what TRL would pass a reward function for it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt: str | NonEmptyMessages = Field(
        description="The prompt: a string for a text prompt, else the chat messages (system, user, ...)."
    )
    completion: str | NonEmptyMessages = Field(
        description="A string for a text prompt; for a chat prompt one assistant message whose content is "
        "the task's assistant prefill (if any) followed by the sampled text."
    )
    completion_ids: list[TokenId] = Field(description="The sampled token ids (the prefill is not included).")
    columns: dict[str, Any] = Field(
        description="The dataset row's other columns (e.g. answer), plus max_completion_length (an int); never "
        "one named after a reward-function argument.",
        json_schema_extra={"propertyNames": {"not": {"enum": list(RESERVED_COLUMNS)}}},
    )

    @field_validator("columns")
    @classmethod
    def _plain_columns(cls, columns: dict[str, Any]) -> dict[str, Any]:
        """No column takes a reward-function argument's name (a plugin would pass it instead of the real
        argument), and every value is plain JSON (finite numbers, string keys)."""
        reserved = sorted(set(columns) & set(RESERVED_COLUMNS))
        if reserved:
            raise ValueError(f"column {', '.join(reserved)} has the name of a reward-function argument")
        for name, value in columns.items():
            problem = json_problem(value)
            if problem:
                raise ValueError(f"column {name!r} holds {problem}, which JSON cannot carry")
        return columns


class RewardRequest(BaseModel):
    """Scorer -> plugin: every completion of one group, in order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    protocol: Literal["asyncgrpo.reward/v1"] = Field(description="The protocol version.")
    items: list[RewardItem] = Field(min_length=1, max_length=MAX_ITEMS)


class RewardResponse(BaseModel):
    """Plugin -> scorer: one reward per item, in order; ``null`` means "cannot judge" (NaN, not a failure)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rewards: list[Reward | None] = Field(description="One finite number or null per item, in order.")
    extra: dict[str, Any] = Field(
        default_factory=dict, description="Optional, free-form; the scorer accepts and ignores it."
    )


def json_schema() -> dict[str, Any]:
    """The protocol's JSON Schema (draft 2020-12): ``request`` and ``response`` under ``$defs``."""
    request = RewardRequest.model_json_schema(ref_template="#/$defs/{model}")
    response = RewardResponse.model_json_schema(ref_template="#/$defs/{model}")
    defs = {**request.pop("$defs", {}), **response.pop("$defs", {})}
    defs["RewardRequest"] = request
    defs["RewardResponse"] = response
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://asyncgrpo.dev/schemas/reward_v1.json",
        "title": PROTOCOL,
        "description": "Scorer -> plugin: POST a RewardRequest; plugin -> scorer: HTTP 200 with a RewardResponse.",
        "oneOf": [{"$ref": "#/$defs/RewardRequest"}, {"$ref": "#/$defs/RewardResponse"}],
        "$defs": dict(sorted(defs.items())),
    }


def schema_text() -> str:
    """:func:`json_schema` as the committed file's text."""
    return json.dumps(json_schema(), indent=2, sort_keys=False) + "\n"


if __name__ == "__main__":  # python -m shared.reward_protocol: rewrite the committed schema
    SCHEMA_PATH.write_text(schema_text())
    print(f"wrote {SCHEMA_PATH}")


def load_reward_function(path: str) -> Callable[..., Any]:
    """Import a reward function named ``module:function``; ValueError naming what is wrong when it cannot.
    The scorer's Python rewards and ``python -m services.reward_plugin --function`` both load theirs this way.

    The module is looked up on ``sys.path``, then beside the configuration file (``$ASYNCGRPO_CONFIG``), then
    in the working directory: a ``my_rewards.py`` next to the user's config imports wherever the services run."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"a reward function is named 'module:function', got {path!r}")
    directories = reward_module_directories()
    for directory in directories:
        if directory not in sys.path:
            sys.path.append(directory)  # appended: installed and project modules keep their precedence
    importlib.invalidate_caches()
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"cannot import reward function module {module_name!r}: {exc} (looked on sys.path, then in "
            f"{' and '.join(directories)}); put it beside the configuration file or on PYTHONPATH"
        ) from exc
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(f"{module_name!r} has no callable {attribute!r}")
    return function


def reward_module_directories() -> list[str]:
    """Where reward modules are looked for after ``sys.path``: the configuration file's directory, the
    working directory."""
    directories = []
    config = os.environ.get(CONFIG_ENV)
    if config:
        directories.append(str(Path(config).resolve().parent))
    directories.append(os.getcwd())
    return list(dict.fromkeys(directories))
