"""The prompt feeder: the learner owns the data, so it can bound how many groups are in flight.

Rows come from :mod:`services.learner.data.sources` (files, ``save_to_disk`` directories, cached ``datasets``
names, built-in tasks): the rows of ``train_split``, less those ``eval_fraction`` holds out for evaluation,
which are never fed. Each row becomes a :class:`Row`, following TRL's rules:

* the prompt: a list of ``{"role", "content"}`` messages is a conversation (the generator applies the chat
  template, and the reward functions get each completion as ``[{"role": "assistant", "content": ...}]``); a
  string is plain text (no chat template; completions are strings), unless ``system_prompt``, ``examples`` or
  ``assistant_prefill`` is set, which make it the user's turn of a conversation;
* the columns: every other column reaches the reward functions under its own name (TRL passes them all as
  keyword arguments), renamed only where ``rename_columns`` (or ``answer_column``) says; in verl's layout,
  ``reward_model.ground_truth`` is also passed as ``ground_truth``.

Each epoch visits the rows in an order shuffled with ``shuffle_seed + epoch``; the position (epoch, index) is
saved so a restarted learner continues where it stopped. How many tasks it hands out, and when, is admission
control's (:mod:`services.learner.data.admission`).
"""

from __future__ import annotations

import datetime
import decimal
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from services.learner.data.sources import DataError, read_source
from shared.config.learner import DataSettings
from shared.records import ChatMessage, DatasetPosition, PromptTask, SamplingSpec, column_problem

__all__ = ["DataError", "PromptFeeder", "Row", "build_prompt", "load_rows", "prepare_rows"]


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


class PromptFeeder:
    """Turns rows into ``PromptTask``s in a seeded order, epoch after epoch, from a saved position."""

    def __init__(
        self,
        rows: list[Row],
        data: DataSettings,
        sampling: SamplingSpec,
        group_size: int,
        position: DatasetPosition | None = None,
        *,
        prompt_length: Callable[[str | tuple[ChatMessage, ...]], int] | None = None,
        max_prompt_length: int | None = None,
    ) -> None:
        self.rows, self.data, self.sampling, self.group_size = rows, data, sampling, group_size
        self.position = position or DatasetPosition(epoch=0, index=0)
        self.prompt_length, self.max_prompt_length = prompt_length, max_prompt_length
        self._order_epoch = -1
        self._order: list[int] = []

    def _order_for(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            self._order = list(range(len(self.rows)))
            random.Random(self.data.shuffle_seed + epoch).shuffle(self._order)
            self._order_epoch = epoch
        return self._order

    @property
    def exhausted(self) -> bool:
        return self.data.epochs > 0 and self.position.epoch >= self.data.epochs

    def next_task(self, policy_version: int) -> PromptTask | None:
        """The next task (prompts over ``max_prompt_length`` tokens are skipped); None once every epoch is
        done."""
        while not self.exhausted:
            task = self._task_at_position(policy_version)
            if self.prompt_length is None or self.max_prompt_length is None:
                return task
            if self.prompt_length(task.prompt) <= self.max_prompt_length:
                return task
        return None

    def _task_at_position(self, policy_version: int) -> PromptTask:
        epoch, index = self.position.epoch, self.position.index
        row = self.rows[self._order_for(epoch)[index]]
        task = PromptTask(
            prompt=row.prompt,
            columns=row.columns,
            group_size=self.group_size,
            sampling=self.sampling,
            dataset_position=DatasetPosition(epoch=epoch, index=index),
            policy_version=policy_version,
        )
        index += 1
        if index == len(self.rows):
            epoch, index = epoch + 1, 0
        self.position = DatasetPosition(epoch=epoch, index=index)
        return task
