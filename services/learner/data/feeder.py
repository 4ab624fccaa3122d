"""The prompt feeder: the learner owns the data, so it can bound how many groups are in flight.

The rows are :mod:`shared.dataset.rows`' (the rows of ``train_split``, less those ``eval_fraction`` holds out
for evaluation, which are never fed). Each epoch visits the rows in an order shuffled with
``shuffle_seed + epoch``; the position (epoch, index) is saved so a restarted learner continues where it
stopped. How many tasks it hands out, and when, is admission control's (:mod:`services.learner.data.admission`).
With ``sampling_seed`` set, each task's sampling carries the seed of its position (:func:`prompt_seed`), so the
same prompt at the same place in two runs is sampled alike.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

from shared.config.learner import DataSettings
from shared.dataset.rows import DataError, Row, build_prompt, load_rows, prepare_rows
from shared.records import ChatMessage, DatasetPosition, PromptTask, SamplingSpec

__all__ = ["DataError", "PromptFeeder", "Row", "build_prompt", "load_rows", "prepare_rows", "prompt_seed"]

# vLLM seeds a group's G completions seed .. seed + G - 1 and takes seeds below 2**63: a prompt's seed stays below
# 2**62, so its group cannot pass that bound, and two prompts' ranges overlap only by a 62-bit hash collision.
_PROMPT_SEED_BITS = 62


def prompt_seed(sampling_seed: int | None, position: DatasetPosition) -> int | None:
    """The sampling seed of the prompt at ``position`` in a run seeded ``sampling_seed`` (None: unseeded). A hash,
    not ``seed + index``: neighbouring prompts, or runs one seed apart, share no completion's seed."""
    if sampling_seed is None:
        return None
    digest = hashlib.blake2b(f"{sampling_seed}:{position.epoch}:{position.index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - _PROMPT_SEED_BITS)


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
        sampling_seed: int | None = None,
    ) -> None:
        self.rows, self.data, self.sampling, self.group_size = rows, data, sampling, group_size
        self.sampling_seed = sampling_seed
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
        position = DatasetPosition(epoch=epoch, index=index)
        seed = prompt_seed(self.sampling_seed, position)
        task = PromptTask(
            prompt=row.prompt,
            columns=row.columns,
            group_size=self.group_size,
            sampling=self.sampling if seed is None else self.sampling.model_copy(update={"seed": seed}),
            dataset_position=position,
            policy_version=policy_version,
        )
        index += 1
        if index == len(self.rows):
            epoch, index = epoch + 1, 0
        self.position = DatasetPosition(epoch=epoch, index=index)
        return task
