"""The learner's I/O loop: admit prompts, assemble batches, train, push weights, checkpoint.

Per optimizer step:

1. **Admit** prompts while fewer than ``(max_staleness + 1) * groups_per_step`` groups are in flight
   (prompts not yet sampled + rollouts not yet scored + scored groups not yet read + read but not trained).
   Each task is added in one MULTI/EXEC with the feeder's new position, so a restart resumes exactly after
   the last admitted prompt.
2. **Assemble** ``groups_per_step`` groups from the scored stream. Groups older than ``max_staleness``
   versions, groups the scorer marked (zero-std, with dynamic sampling), and groups already trained before
   a restart are acknowledged and counted, not trained.
3. **Train** (in a worker thread, so heartbeats and HTTP keep running; admission runs in step 1, between
   batches: while a batch trains its groups still count as in flight).
4. **Push** weights every ``sync_every`` steps to every live generator.
5. **Checkpoint** every ``checkpoint_every`` steps; only then are the trained groups acknowledged, so a
   learner killed between checkpoints gets them back (its consumer name is stable) and trains them again
   from the checkpoint's weights - nothing lost, nothing trained twice on top of itself.

While it waits for groups, a live generator that missed the last push is pushed the weights again
(:mod:`services.learner.weight_publisher`).

The parts: admission (:mod:`services.learner.data.admission`), batch collection and the drop rules
(:mod:`services.learner.data.collector`), the weight push (:mod:`services.learner.weight_publisher`) and the
counts (:mod:`services.learner.metrics.counters`); this module runs them in order.

The loop ends in one of three ways, each said in the learner's last line (:class:`RunEnd`): ``max_steps``
trained, the data ran out (every epoch admitted and every group in flight came back), or a stop was requested
(a signal, ``/shutdown``). Ending any other way is an error (:class:`RunEndedEarly`), never a finished run; so
is a Redis that no longer holds what the learner wrote at its start (:class:`RedisStateLost`): a learner never
decides it is done from counts Redis lost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path
from typing import Literal

import httpx
import redis.asyncio as aioredis

from services.learner.checkpoint import LearnerState, save_checkpoint
from services.learner.data.admission import Admission, RedisStateLost
from services.learner.data.batch import collate
from services.learner.data.collector import BatchCollector
from services.learner.data.feeder import PromptFeeder
from services.learner.evaluation import Evaluator
from services.learner.metrics.batch_metrics import batch_metrics, finalize_advantages
from services.learner.metrics.completions_log import completion_rows, completions_due
from services.learner.metrics.counters import Counters
from services.learner.metrics.metric_sinks import MetricsSink
from services.learner.nonfinite import NonfiniteSteps, NonFiniteTraining
from services.learner.optimizer import NONFINITE_STEP
from services.learner.trainer import Trainer
from services.learner.weight_publisher import WeightPublisher
from shared.codec import encode
from shared.config.learner import LearnerSettings
from shared.keys import Keys
from shared.lifecycle import stop_reason
from shared.records import CheckpointAnnouncement, ScoredGroup
from shared.redis_conn import RedisRetry
from shared.registry import RegistryStats
from shared.streams import Delivery, StreamConsumer
from weight_sync.sender import WeightPusher

__all__ = ["LearnerLoop", "NonFiniteTraining", "RedisStateLost", "RunEnd", "RunEndedEarly"]

log = logging.getLogger(__name__)

EndReason = Literal["max_steps", "data_exhausted", "stopped"]


@dataclasses.dataclass(frozen=True)
class RunEnd:
    """How the learner loop ended: ``max_steps`` trained, the data ran out, or a stop (``cause``: what set
    it, "SIGTERM", ...). :meth:`describe` is the learner's last line."""

    reason: EndReason
    step: int
    max_steps: int
    cause: str = ""

    def describe(self) -> str:
        progress = f"step {self.step} of {self.max_steps}"
        match self.reason:
            case "max_steps":
                return f"learner finished: {progress}"
            case "data_exhausted":
                return f"learner finished: {progress}, the data ran out ({self.cause})"
            case "stopped":
                return f"learner stopped: {progress}, by {self.cause}"


class RunEndedEarly(RuntimeError):
    """The loop ended before ``max_steps`` with data left and no stop requested: an error, never a success."""


class WarmUp:
    """AdamW's state made on a worker thread (:meth:`OptimizerStep.make_state`) beside the wait for the first
    groups, so that the first step does not make it. Only on a fresh start: nothing is pushed before the first
    step then, so no push moves the parameters while it runs. Not on a distributed trainer."""

    def __init__(self) -> None:
        self._task: asyncio.Task[float] | None = None  # until the first step waits for it

    def start(self, trainer: Trainer) -> None:
        if trainer.topology.distributed:
            return

        def make_state() -> float:
            started = time.perf_counter()
            trainer.optimizer.make_state()
            seconds = time.perf_counter() - started
            log.info("warm-up: AdamW's state made in %.2f s while the first rollouts are sampled", seconds)
            return seconds

        self._task = asyncio.create_task(asyncio.to_thread(make_state))

    async def done(self) -> None:
        """Wait for the warm-up, if one runs; its error is the learner's."""
        if self._task is not None:
            task, self._task = self._task, None
            await task


class LearnerLoop:
    def __init__(
        self,
        *,
        settings: LearnerSettings,
        client: aioredis.Redis,
        keys: Keys,
        trainer: Trainer,
        tokenizer,
        feeder: PromptFeeder,
        consumer: StreamConsumer,
        pusher: WeightPusher,
        http: httpx.AsyncClient,
        sink: MetricsSink,
        state: LearnerState,
        evaluator: Evaluator | None = None,
        registry_stats: RegistryStats,
    ) -> None:
        self.settings, self.client, self.keys = settings, client, keys
        self.trainer, self.tokenizer, self.feeder = trainer, tokenizer, feeder
        self.consumer, self.pusher, self.sink = consumer, pusher, sink
        self.trained_ids = set(state.trained_group_ids)
        self.trained_order = list(state.trained_group_ids)
        self.counters = Counters.restore(state.counters)
        self.unacked: list[Delivery] = []  # trained, acknowledged at the next checkpoint
        self.redis = RedisRetry()
        self.running = False
        self.last_checkpoint: Path | None = None
        self.evaluator = evaluator
        self.nonfinite = NonfiniteSteps()  # optimizer steps in a row not applied (their numbers not finite)
        self.evaluated_step: int | None = None  # the step of the last evaluation
        self.warm_up = WarmUp()
        self.weights = WeightPublisher(
            settings=settings, client=client, keys=keys, trainer=trainer, pusher=pusher, http=http,
            counters=self.counters, redis=self.redis, registry_stats=registry_stats,
        )  # fmt: skip
        self.admission = Admission(
            settings=settings, client=client, keys=keys, feeder=feeder, counters=self.counters, redis=self.redis,
            version=lambda: self.policy_version,
        )  # fmt: skip
        self.collector = BatchCollector(
            settings=settings, consumer=consumer, admission=self.admission, feeder=feeder, counters=self.counters,
            sink=sink, redis=self.redis, trained=self.trained_ids, version=lambda: self.policy_version,
            while_waiting=self.weights.catch_up,
        )  # fmt: skip

    @property
    def policy_version(self) -> int:
        return self.trainer.step

    @property
    def in_flight(self) -> int:
        """Groups in flight at the last measurement (see :mod:`services.learner.data.admission`)."""
        return self.admission.in_flight

    def _train(self, groups: list[ScoredGroup]) -> list[dict[str, float]]:
        advantages = finalize_advantages(groups)
        batch = collate(groups, advantages, self._pad_id())
        return self.trainer.train(batch)

    async def checkpoint(self) -> None:
        state = LearnerState(
            step=self.trainer.step,
            policy_version=self.policy_version,
            feeder_epoch=self.feeder.position.epoch,
            feeder_index=self.feeder.position.index,
            trained_group_ids=self.trained_order,
            counters={k: float(v) for k, v in self.counters.as_dict().items()},
        )
        path = await asyncio.to_thread(
            save_checkpoint,
            Path(self.settings.checkpoint_dir),
            self.trainer,
            self.tokenizer,
            state,
            self.settings.keep_checkpoints,
        )
        if self.unacked:
            items = [(delivery, ()) for delivery in self.unacked]
            await self.redis.run(lambda: self.consumer.commit_many(items), "acknowledging trained groups")
            self.unacked = []
        announcement = CheckpointAnnouncement(
            policy_version=self.policy_version, step=self.trainer.step, path=str(path.resolve())
        )
        payload = encode(announcement)
        await self.redis.run(lambda: self.client.set(self.keys.checkpoint, payload), "announcing the checkpoint")
        self.last_checkpoint = path
        log.info("checkpoint %s (step %d)", path, self.trainer.step)

    async def run(self, stop: asyncio.Event, *, resumed: bool) -> RunEnd:
        """Train until ``max_steps``, the data runs out or ``stop``; then checkpoint what is not saved yet.
        Returns how it ended; raises :class:`RunEndedEarly` (after that checkpoint) when it ended otherwise."""
        await self.weights.wait_for_generators(stop)
        if resumed:
            await self.weights.push(reset=True)
        self.running = True
        if not resumed and self.settings.warm_up:
            self.warm_up.start(self.trainer)
        if self.trainer.step == 0 and self.settings.eval_on_start:
            await self.evaluate(stop)
        while self.trainer.step < self.settings.max_steps and not stop.is_set():
            if not await self.run_step(stop):
                break
        await self.warm_up.done()
        ended = self.ending(stop)
        if self.unacked or (self.trainer.step and self.last_checkpoint is None):
            await self.checkpoint()
        if ended is not None and self.evaluated_step != self.trainer.step and not stop.is_set():
            await self.evaluate(stop)  # after the last step
        self.running = False
        if ended is None:
            position = self.feeder.position
            raise RunEndedEarly(
                f"the learner loop ended at step {self.trainer.step} of {self.settings.max_steps} with no stop "
                f"requested and data left (epoch {position.epoch}, row {position.index}): the run is not finished"
            )
        return ended

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id

    def ending(self, stop: asyncio.Event) -> RunEnd | None:
        """Why the loop ended: ``max_steps`` trained, the data ran out, or a stop; None for no known reason."""
        step, max_steps = self.trainer.step, self.settings.max_steps
        if step >= max_steps:
            return RunEnd("max_steps", step, max_steps)
        if stop.is_set():
            return RunEnd("stopped", step, max_steps, stop_reason(stop))
        if self.collector.drained:
            fates = self.counters.group_fates()
            data = f"{self.feeder.data.epochs} epoch(s) of {len(self.feeder.rows)} rows; {fates}"
            log.warning("the data ran out at step %d of max_steps %d: %s", step, max_steps, data)
            return RunEnd("data_exhausted", step, max_steps, data)
        return None

    async def evaluate(self, stop: asyncio.Event) -> None:
        """An evaluation of the current weights (pushed first if the generators have older ones), written as
        ``eval/*`` for this step; nothing without ``eval_data``."""
        if self.evaluator is None:
            return
        if self.trainer.step and self.weights.pushed_version != self.policy_version:
            await self.weights.push()
        metrics = await self.evaluator.run(self.trainer.step, self.policy_version, stop)
        if metrics is None:
            return
        self.evaluated_step = self.trainer.step
        metrics["counters/eval_orphans"] = float(self.evaluator.orphans)
        self.sink.write_eval(self.trainer.step, metrics)

    async def run_step(self, stop: asyncio.Event) -> bool:
        """One batch: collect, train, push and checkpoint when due, write the metrics. False: nothing left."""
        started = time.perf_counter()
        collected = await self.collector.collect(stop)
        if collected is None:
            return False
        await self.warm_up.done()  # the first step's wait for the groups may end before the warm-up does
        waited = time.perf_counter() - started
        groups = [g for _, g in collected]
        metrics = self._batch_figures(groups)
        train_started = time.perf_counter()
        steps = await asyncio.to_thread(self._train, groups)
        skipped = sum(NONFINITE_STEP in step for step in steps)  # counted before a run of them raises
        self.counters.skipped_steps(skipped, len(groups) if skipped == len(steps) else 0)
        results = self.nonfinite.applied_of(steps, self.trainer.step, tuple(g.group_id for g in groups))
        train_wall = time.perf_counter() - train_started
        self._trained(collected, trained=bool(results))
        sync_seconds = await self._sync_and_checkpoint() if results else 0.0
        if results and self.settings.eval_every and self.trainer.step % self.settings.eval_every == 0:
            await self.evaluate(stop)
        seconds = {
            "seconds/wait": waited,
            "seconds/sync": sync_seconds,
            "seconds/train_wall": train_wall,
            "seconds/step": time.perf_counter() - started,
        }
        self._write_metrics(metrics, results, seconds)
        return True

    def _batch_figures(self, groups: list[ScoredGroup]) -> dict[str, float]:
        """The collected batch's figures; its completions and group ids written to the sink first."""
        if completions_due(self.trainer.step + 1, self.settings.num_iterations, self.settings.log_completions):
            rows = completion_rows(groups, self.settings.num_completions_to_log, self.tokenizer.decode)
            self.sink.write_completions(self.trainer.step + 1, rows)
        metrics = {**batch_metrics(groups, self.policy_version), **self.collector.dynamic_sampling}
        metrics["num_tokens"] = float(self.counters.tokens_seen(metrics.pop("input_tokens")))
        self.sink.write_batch(self.trainer.step + 1, groups)
        return metrics

    def _trained(self, collected: list[tuple[Delivery, ScoredGroup]], *, trained: bool) -> None:
        """Remember the groups just trained (``trained`` False: none of the batch's steps was applied, counted
        apart); they are acknowledged at the next checkpoint and never trained again."""
        for delivery, group in collected:
            self.trained_ids.add(group.group_id)
            self.trained_order.append(group.group_id)
            self.unacked.append(delivery)
        if trained:
            self.counters.trained(len(collected))

    async def _sync_and_checkpoint(self) -> float:
        """Push weights every ``sync_every`` steps, checkpoint every ``checkpoint_every`` and at the last
        step; returns the seconds the push took (0 without one)."""
        sync_seconds = 0.0
        if self.trainer.step % self.settings.sync_every == 0:
            sync_seconds = await self.weights.push()
        if self.trainer.step % self.settings.checkpoint_every == 0 or self.trainer.step >= self.settings.max_steps:
            await self.checkpoint()
        return sync_seconds

    def _write_metrics(
        self, metrics: dict[str, float], results: list[dict[str, float]], seconds: dict[str, float]
    ) -> None:
        """One record per optimizer step of the batch: the batch's figures, the step's, timings, counters."""
        for offset, result in enumerate(results):
            step = self.trainer.step - len(results) + offset + 1
            record = {
                **metrics,
                **result,
                **seconds,
                "policy_version": step,
                "groups_in_flight": self.in_flight,
                "tokens_per_second": metrics["completion_tokens"] / max(seconds["seconds/step"], 1e-9),
                "train_tokens_per_second": metrics["completion_tokens"] / max(result["seconds/train"], 1e-9),
            }
            record.update(self.counters.figures())
            record["stream/scored/recovered"] = self.consumer.stats.recovered
            self.sink.write(step, record)
