"""The prompt feeder: the learner owns the data, so it can bound how many groups are in flight.

The rows are :mod:`shared.dataset.rows`' (the rows of ``train_split``, less those ``eval_fraction`` holds out
for evaluation, which are never fed). Each epoch visits the rows in an order shuffled with
``shuffle_seed + epoch``; the position (epoch, index) is saved so a restarted learner continues where it
stopped. How many tasks it hands out, and when, is admission control's (:mod:`services.learner.data.admission`).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from shared.config.learner import DataSettings
from shared.dataset.rows import DataError, Row, build_prompt, load_rows, prepare_rows
from shared.records import ChatMessage, DatasetPosition, PromptTask, SamplingSpec

__all__ = ["DataError", "PromptFeeder", "Row", "build_prompt", "load_rows", "prepare_rows"]


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
