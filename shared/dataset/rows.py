"""Dataset rows as the learner feeds them and the start-up check reads them: a prompt and the reward columns.

Rows come from :mod:`shared.dataset.sources` (files, ``save_to_disk`` directories, cached ``datasets``
names, built-in tasks). Each row becomes a :class:`Row`, following TRL's rules:

* the prompt: a list of ``{"role", "content"}`` messages is a conversation (the generator applies the chat
  template, and the reward functions get each completion as ``[{"role": "assistant", "content": ...}]``); a
  string is plain text (no chat template; completions are strings), unless ``system_prompt``, ``examples`` or
  ``assistant_prefill`` is set, which make it the user's turn of a conversation;
* the columns: every other column reaches the reward functions under its own name (TRL passes them all as
  keyword arguments), renamed only where ``rename_columns`` (or ``answer_column``) says; in verl's layout,
  ``reward_model.ground_truth`` is also passed as ``ground_truth``.

It lives in ``shared/`` because the learner (which feeds the rows) and the launcher's start-up check (which
reads the first rows to check the reward functions' columns) must prepare a row the same way.
"""

from __future__ import annotations

import datetime
import decimal
import math
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from shared.config.learner import DataSettings
from shared.dataset.sources import DataError, read_source
from shared.records import ChatMessage, column_problem


@dataclass(frozen=True)
class Row:
    """One prepared row: its prompt (text, or chat messages) and the columns the reward functions get."""

    prompt: str | tuple[ChatMessage, ...]
    columns: dict[str, Any]


def load_rows(data: DataSettings) -> list[Row]:
    """Every row of the configured source, prepared; a row that breaks the rules raises DataError naming it."""
    return prepare_rows(read_source(data), data)


def prepare_rows(raw: list[dict[str, Any]], data: DataSettings) -> list[Row]:
    """``raw`` rows (read from ``data.source``) prepared by ``data``'s rules."""
    if not raw:
        raise DataError(f"{data.source} holds no rows")
    prompt_column = resolve_prompt_column(data, raw[0])
    missing = [c for c in (*data.renames, *data.extra_columns) if _lookup(raw[0], c) is _MISSING]
    if missing:
        raise DataError(
            f"{data.source} has no column {', '.join(missing)}; its columns are {', '.join(raw[0])}. "
            "Set data.rename_columns / data.answer_column / data.extra_columns"
        )
    rows = []
    for index, row in enumerate(raw):
        try:
            rows.append(Row(build_prompt(row[prompt_column], data), reward_columns(row, prompt_column, data)))
        except (DataError, KeyError) as exc:
            raise DataError(f"{data.source}, row {index}: {exc}") from None
    return rows


def resolve_prompt_column(data: DataSettings, first: dict[str, Any]) -> str:
    """``prompt_column``, or by default TRL's ``prompt`` if the data has it, else ``question``."""
    if data.prompt_column is not None:
        candidates = [data.prompt_column]
    else:
        candidates = ["prompt", "question"]
    for name in candidates:
        if name in first:
            return name
    raise DataError(
        f"{data.source} has no column {' or '.join(candidates)} for the prompt; its columns are "
        f"{', '.join(first)}. Set data.prompt_column"
    )


_MISSING = object()


def _lookup(row: dict[str, Any], name: str) -> Any:
    """``row[name]``, where a dotted name reaches into nested columns; ``_MISSING`` when absent."""
    if name in row:
        return row[name]
    value: Any = row
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def reward_columns(row: dict[str, Any], prompt_column: str, data: DataSettings) -> dict[str, Any]:
    """The columns the reward functions get as keyword arguments: every column under its own name, as TRL
    passes them, except the prompt (they get it as ``prompts``) and TRL's ``completion``; renamed where
    ``rename_columns`` says; verl's ``reward_model.ground_truth`` also as ``ground_truth``."""
    renames = data.renames
    columns = {name: value for name, value in row.items() if name not in (prompt_column, "completion", *renames)}
    for old, new in renames.items():
        if new in columns:
            raise DataError(f"rename_columns gives {old!r} the name {new!r}, which another column has")
        columns[new] = _lookup(row, old)
    verl_truth = columns.get("reward_model")
    if isinstance(verl_truth, dict) and "ground_truth" in verl_truth and "ground_truth" not in columns:
        columns["ground_truth"] = verl_truth["ground_truth"]
    plain = {name: plain_value(value, name) for name, value in columns.items()}
    for name, value in plain.items():
        problem = column_problem(name, value)  # the check every PromptTask passes, made here at load
        if problem:
            raise DataError(problem)
    return plain


def plain_value(value: Any, column: str) -> Any:
    """A column value as JSON and msgpack carry it: dates as ISO text, NaN as None, tuples as lists."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return None if math.isnan(value) else value
    if isinstance(value, list | tuple):
        return [plain_value(v, column) for v in value]
    if isinstance(value, dict):
        return {str(k): plain_value(v, column) for k, v in value.items()}
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return float(value)
    raise DataError(f"column {column!r} holds a {type(value).__name__}, which cannot be sent to reward functions")


def build_prompt(value: Any, data: DataSettings) -> str | tuple[ChatMessage, ...]:
    """TRL's rule: a list of chat messages is a conversation (chat-templated by the generator); a string is
    plain text, unless a system prompt, examples or a prefill make it the user's turn of a conversation."""
    if isinstance(value, str):
        if not value:
            raise DataError("the prompt is empty")
        if not data.makes_conversations:
            return value
        return _frame((ChatMessage(role="user", content=value),), data)
    if isinstance(value, list | tuple) and value:
        return _frame(tuple(_message(m) for m in value), data)
    raise DataError(
        f"the prompt is {type(value).__name__} {str(value)[:60]!r}; a prompt is a string (standard format) or a "
        "list of {'role', 'content'} messages (conversational format)"
    )


def _message(value: Any) -> ChatMessage:
    if not isinstance(value, dict) or not {"role", "content"} <= set(value):
        raise DataError(f"a prompt message must be a dict with 'role' and 'content', got {str(value)[:80]!r}")
    extra = sorted(k for k, v in value.items() if k not in ("role", "content") and v is not None)
    if extra:
        raise DataError(f"prompt messages carry only role and content, this one also has {', '.join(extra)}")
    try:
        return ChatMessage(role=value["role"], content=value["content"])
    except ValidationError as exc:
        raise DataError(f"a prompt message is invalid: {exc.errors()[0]['msg']} ({str(value)[:80]!r})") from None


def _frame(messages: tuple[ChatMessage, ...], data: DataSettings) -> tuple[ChatMessage, ...]:
    """The system prompt (the row's own if it has one), the few-shot examples, the row's turns, the prefill."""
    if messages[0].role == "system":
        head, turns = messages[:1], messages[1:]
    else:
        head = (ChatMessage(role="system", content=data.system_prompt),) if data.system_prompt else ()
        turns = messages
    if not data.assistant_prefill:
        return (*head, *data.examples, *turns)
    if turns and turns[-1].role == "assistant":
        raise DataError("the prompt ends with an assistant message, and data.assistant_prefill adds another")
    return (*head, *data.examples, *turns, ChatMessage(role="assistant", content=data.assistant_prefill))
