"""The prompt feeder: the learner owns the data, so it can bound how many groups are in flight.

Rows come from a local JSONL/Parquet file or directory (through Hugging Face ``datasets``) or a built-in
task. Each row becomes a chat prompt - system prompt, few-shot examples, the question, and optionally the
start of the assistant's answer - and a ``PromptTask`` with the reference columns. Each epoch visits the rows
in an order shuffled with ``shuffle_seed + epoch``; the position (epoch, index) is saved so a restarted
learner continues where it stopped.

Admission control (AReaL-style): the loop publishes tasks only while fewer than
``(max_staleness + 1) * groups_per_step`` groups are in flight, so few samples ever age past
``max_staleness``. :func:`admission_budget` is that rule.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.learner.tasks import BUILTIN_TASKS
from shared.config.learner import DataSettings
from shared.records import ChatMessage, DatasetPosition, PromptTask, SamplingSpec


class DataError(ValueError):
    """The configured data cannot be read or lacks a configured column."""


def admission_budget(in_flight: int, bound: int) -> int:
    """How many more groups may be admitted now: ``bound - in_flight``, never negative."""
    return max(0, bound - in_flight)


def replacement_cap_reached(skipped: int, cap: int | None, collected: int) -> bool:
    """Dynamic sampling's bound (verl ``max_num_gen_batches``, in groups): once a step has skipped more than
    ``cap`` zero-std groups while waiting for replacements, it trains on the ``collected`` groups it has
    (never on none)."""
    return cap is not None and skipped > cap and collected > 0


def load_rows(data: DataSettings) -> list[dict[str, Any]]:
    """All rows of the configured source, with the configured columns checked."""
    if data.source.startswith("builtin:"):
        name = data.source.removeprefix("builtin:")
        if name not in BUILTIN_TASKS:
            raise DataError(f"unknown built-in task {name!r}; available: {', '.join(BUILTIN_TASKS)}")
        rows = BUILTIN_TASKS[name](data.builtin_size, data.builtin_max_operand, data.shuffle_seed + 1234)
    else:
        rows = _read_files(Path(data.source), data.split)
    if not rows:
        raise DataError(f"{data.source} holds no rows")
    missing = [c for c in (data.prompt_column, data.answer_column, *data.extra_columns) if c not in rows[0]]
    if missing:
        raise DataError(
            f"{data.source} has no column {', '.join(missing)}; its columns are {', '.join(rows[0])}. "
            "Set data.prompt_column / data.answer_column / data.extra_columns"
        )
    return rows


def _read_files(path: Path, split: str) -> list[dict[str, Any]]:
    if not path.exists():
        raise DataError(f"data source {path} does not exist")
    files = (
        [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in {".jsonl", ".json", ".parquet"})
    )
    if split and path.is_dir():
        in_split = [f for f in files if split in f.name]
        files = in_split or files
    if not files:
        raise DataError(f"{path} holds no .jsonl/.json/.parquet files")
    kinds = {"parquet" if f.suffix == ".parquet" else "json" for f in files}
    if len(kinds) > 1:
        raise DataError(f"{path} mixes JSON and Parquet files; point data.source at one kind")
    from datasets import load_dataset

    dataset = load_dataset(kinds.pop(), data_files=[str(f) for f in files], split="train")
    return [dict(row) for row in dataset]


def build_prompt(question: str, data: DataSettings) -> tuple[ChatMessage, ...]:
    messages = []
    if data.system_prompt:
        messages.append(ChatMessage(role="system", content=data.system_prompt))
    messages.extend(data.examples)
    messages.append(ChatMessage(role="user", content=str(question)))
    if data.assistant_prefill:
        messages.append(ChatMessage(role="assistant", content=data.assistant_prefill))
    return tuple(messages)


class PromptFeeder:
    """Turns rows into ``PromptTask``s in a seeded order, epoch after epoch, from a saved position."""

    def __init__(
        self,
        rows: list[dict[str, Any]],
        data: DataSettings,
        sampling: SamplingSpec,
        group_size: int,
        position: DatasetPosition | None = None,
        *,
        prompt_length: Callable[[tuple[ChatMessage, ...]], int] | None = None,
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
        columns = {"answer": row[self.data.answer_column]}
        columns.update({name: row[name] for name in self.data.extra_columns})
        task = PromptTask(
            prompt=build_prompt(row[self.data.prompt_column], self.data),
            columns=columns,
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
