"""Evaluation on held-out prompts: the generators complete them, the scorer scores them, the learner reports.

A round publishes ``eval_samples`` held-out prompts (the same ones every round: the first rows of
``eval_data``, or of the rows ``data.eval_split`` or ``data.eval_fraction`` hold out of the training source,
none of them a training row) as tasks marked with the learner's step (``PromptTask.eval_step``); the
generators sample them like any task (greedy by default: ``eval_temperature = 0``) and the scorer scores them
with the training reward functions, writing them to the evaluated stream instead of the training one. The
learner waits for the round (it trains nothing meanwhile, so every completion comes from the weights of that
step; ``eval/policy_version/{min,max}`` show it) and writes ``eval/*`` metrics for the step.

Rounds run before the first step (``eval_on_start``), every ``eval_every`` steps and after the last step.
A round that is not back within ``eval_timeout_s`` is reported with what came back (``eval/missing``); its
late groups, and those of a round a restarted learner left behind, are acknowledged and counted as orphans.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from services.learner.metrics.batch_metrics import trajectory_metrics
from shared.advantages import completion_metrics, reward_function_metrics
from shared.codec import encode
from shared.config.data import unsliced
from shared.config.learner import LearnerSettings
from shared.config.locations import locate, search_dirs
from shared.dataset.rows import Row, prepare_rows
from shared.dataset.sources import (
    DataError,
    overlap,
    read_eval_source,
    read_held_out,
    read_keyed,
    read_source,
)
from shared.intake import decode_or_reject
from shared.records import PromptTask, SamplingSpec, ScoredGroup
from shared.redis_conn import RedisRetry
from shared.streams import StreamConsumer, StreamProducer

log = logging.getLogger(__name__)

HELD_OUT = "held_out"


def eval_source(settings: LearnerSettings) -> str | None:
    """Where the held-out rows come from, in words for the log (None: no evaluation)."""
    data = settings.data
    if settings.eval_data is not None:
        return repr(settings.eval_data)
    if data.eval_split is not None:
        return f"split {data.eval_split!r} of {data.source!r}"
    if data.eval_fraction is not None:
        return f"the last {data.eval_fraction:g} of split {data.train_split!r} of {data.source!r}"
    return None


def load_eval_rows(settings: LearnerSettings) -> list[Row]:
    """The held-out rows of every round: the first ``eval_samples`` of ``eval_data``, or of the rows
    ``data.eval_split`` / ``data.eval_fraction`` hold out of ``data.source``, prepared by the ``[data]``
    table's prompt rules (system prompt, examples, prefill, column names)."""
    data = settings.data
    if settings.eval_data == HELD_OUT:
        raw = read_held_out(data, settings.eval_samples)
    elif settings.eval_data is not None:
        raw = read_eval_data(settings)
    else:
        raw = read_eval_source(data)
    return prepare_rows(raw[: settings.eval_samples], data)


def read_eval_data(settings: LearnerSettings) -> list[dict[str, Any]]:
    """The rows of ``eval_data``: its ``eval_split``, else the training split's name unsliced. Where it reads
    what ``data.source`` reads (:func:`may_share_rows`), its rows are keyed and compared with the training rows
    as :func:`read_eval_source` compares them: DataError when one is both."""
    data = settings.data
    split = settings.eval_split or unsliced(data.train_split)
    source = data.model_copy(update={"source": settings.eval_data, "train_split": split})
    if not may_share_rows(settings.eval_data, data.source):
        return read_source(source)
    evaluated = read_keyed(source, split, "train_split")
    training = read_keyed(data, data.train_split, "train_split")
    shared = overlap([key for key, _ in training], [key for key, _ in evaluated])
    if shared:
        chosen = f"learner.eval_split = {split!r}" if settings.eval_split else f"its split {split!r} (no eval_split)"
        raise DataError(
            f"learner.eval_data = {settings.eval_data!r} reads data.source, and {chosen} selects {shared} rows "
            f"that data.train_split = {data.train_split!r} also selects: held-out metrics would be on training "
            "prompts. Make them disjoint (e.g. data.train_split = 'train[:90%]' and learner.eval_split = "
            "'train[90%:]'), hold rows out with data.eval_fraction instead of eval_data, or set eval_data to "
            "a different file"
        )
    return [row for _, row in evaluated]


def may_share_rows(eval_data: str | list[str], source: str | list[str]) -> bool:
    """Whether ``eval_data`` may read rows ``source`` reads: both name one file, directory, dataset or built-in
    task (paths compared resolved), or one names a file or folder inside a directory the other names. Only
    then are rows compared by key (a dataset's keys are its split names, equal across datasets)."""
    return any(a == b or a in b.parents or b in a.parents for a in _resolved(eval_data) for b in _resolved(source))


def _resolved(source: str | list[str]) -> list[Path]:
    """Each path, dataset name or built-in task of ``source`` as an absolute path: a file or folder where the
    configuration's rule finds it (:mod:`shared.config.locations`), a name alike wherever it is written."""
    dirs = search_dirs()
    items = source if isinstance(source, list) else [source]
    return [locate(item, dirs) or Path(item).expanduser().resolve() for item in items]


def eval_sampling(training: SamplingSpec, temperature: float) -> SamplingSpec:
    """Evaluation's sampling: the training spec at ``eval_temperature`` (0: greedy, so no top-k/p/min-p), each
    completion ending where the model ends it (no ``min_tokens``)."""
    if temperature > 0:
        return training.model_copy(update={"temperature": temperature, "min_tokens": 0})
    return training.model_copy(update={"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "min_tokens": 0})


def eval_metrics(groups: Sequence[ScoredGroup], wanted: int, seconds: float) -> dict[str, float]:
    """``eval/*`` of one round: the mean combined reward and its spread over every completion, each reward
    function's mean, completion lengths, how many prompts came back of ``wanted``, the policy versions that
    sampled them, and the round's wall time. NaN rewards (an optional reward that failed) are left out."""
    metrics = {"eval/prompts": float(len(groups)), "eval/missing": float(wanted - len(groups)), "eval/seconds": seconds}
    if not groups:
        return metrics
    rewards = np.concatenate([g.rewards for g in groups]).astype(np.float64)
    present = rewards[~np.isnan(rewards)]
    metrics["eval/reward"] = float(present.mean()) if present.size else math.nan
    metrics["eval/reward_std"] = float(present.std(ddof=1)) if present.size > 1 else 0.0
    per_func = np.concatenate([g.rewards_per_func for g in groups]).astype(np.float64)
    for name, value in reward_function_metrics(groups[0].reward_names, per_func).items():
        if name.endswith("/mean"):
            metrics[f"eval/{name}"] = value
    completions = [c for g in groups for c in g.rollout.completions]
    lengths = [len(c.token_ids) for c in completions]
    truncated = [c.finish_reason == "length" for c in completions]
    for name in ("completions/mean_length", "completions/clipped_ratio"):
        metrics[f"eval/{name}"] = completion_metrics(lengths, truncated)[name]
    metrics["eval/policy_version/min"] = float(min(g.rollout.policy_version for g in groups))
    metrics["eval/policy_version/max"] = float(max(g.rollout.finished_policy_version for g in groups))
    tools = {name: value for name, value in trajectory_metrics(completions).items() if name.startswith("tools/")}
    metrics.update({f"eval/{name}": value for name, value in tools.items()})  # multi-turn: held-out tool use
    return metrics


@dataclass
class EvalRound:
    """One round's tasks, and what came back of them."""

    step: int
    pending: set[str]
    wanted: int
    started: float = field(default_factory=time.monotonic)
    groups: list[ScoredGroup] = field(default_factory=list)

    def receive(self, group: ScoredGroup) -> bool:
        """Keep ``group`` if it is one of this round's (once); False: not this round's."""
        if group.group_id not in self.pending:
            return False
        self.pending.discard(group.group_id)
        self.groups.append(group)
        return True


class Evaluator:
    """Runs rounds: publishes the held-out tasks to the prompts stream, reads their scored groups back."""

    def __init__(
        self,
        rows: list[Row],
        sampling: SamplingSpec,
        group_size: int,
        *,
        prompts: StreamProducer,
        consumer: StreamConsumer,
        timeout_s: float,
    ) -> None:
        if not rows:
            raise ValueError("an evaluation needs at least one held-out prompt")
        self.rows, self.sampling, self.group_size = rows, sampling, group_size
        self.prompts, self.consumer, self.timeout_s = prompts, consumer, timeout_s
        self.redis = RedisRetry()
        self.orphans = 0  # groups of no running round (late, or a restarted learner's): acknowledged, counted
        self.rejected = 0

    def tasks(self, step: int, policy_version: int) -> list[PromptTask]:
        return [
            PromptTask(
                prompt=row.prompt,
                columns=row.columns,
                group_size=self.group_size,
                sampling=self.sampling,
                policy_version=policy_version,
                eval_step=step,
            )
            for row in self.rows
        ]

    async def run(self, step: int, policy_version: int, stop: asyncio.Event) -> dict[str, float] | None:
        """One round for ``step``: its ``eval/*`` metrics once every group is back or the time is up; None
        when ``stop`` was set meanwhile."""
        tasks = self.tasks(step, policy_version)
        items = [(task.task_id, encode(task)) for task in tasks]
        await self.redis.run(lambda: self.prompts.add_many(items), "publishing held-out prompts")
        round_ = EvalRound(step, {task.task_id for task in tasks}, len(tasks))
        deadline = round_.started + self.timeout_s
        while round_.pending and time.monotonic() < deadline:
            if stop.is_set():
                return None
            await self._read(round_)
        seconds = time.monotonic() - round_.started
        if round_.pending:
            log.error(
                "evaluation at step %d: %d of %d prompts not back after %.0f s (eval_timeout_s); reported without them",
                step, len(round_.pending), round_.wanted, seconds,
            )  # fmt: skip
        return eval_metrics(round_.groups, round_.wanted, seconds)

    async def _read(self, round_: EvalRound) -> None:
        deliveries = await self.redis.run(
            lambda: self.consumer.read(count=len(round_.pending), block_ms=200), "reading evaluated groups"
        )
        for delivery in deliveries:
            group = await decode_or_reject(self.consumer, self.redis, delivery, ScoredGroup, "an evaluated group")
            if group is None:
                self.rejected += 1
                continue
            if not round_.receive(group):
                self.orphans += 1
                log.info("evaluated group %s belongs to no running evaluation: acknowledged", group.group_id)
            await self.redis.run(lambda delivery=delivery: self.consumer.commit(delivery), "acknowledging a group")
