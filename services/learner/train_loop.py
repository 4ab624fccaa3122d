"""The learner's I/O loop: admit prompts, assemble batches, train, push weights, checkpoint.

Per optimizer step:

1. **Admit** prompts while fewer than ``(max_staleness + 1) * groups_per_step`` groups are in flight
   (prompts not yet sampled + rollouts not yet scored + scored groups not yet read + read but not trained).
   Each task is added in one MULTI/EXEC with the feeder's new position, so a restart resumes exactly after
   the last admitted prompt.
2. **Assemble** ``groups_per_step`` groups from the scored stream. Groups older than ``max_staleness``
   versions, groups the scorer marked (zero-std, with dynamic sampling), and groups already trained before
   a restart are acknowledged and counted, not trained.
3. **Train** (in a worker thread, so admission, heartbeats and HTTP keep running).
4. **Push** weights every ``sync_every`` steps to every live generator.
5. **Checkpoint** every ``checkpoint_every`` steps; only then are the trained groups acknowledged, so a
   learner killed between checkpoints gets them back (its consumer name is stable) and trains them again
   from the checkpoint's weights - nothing lost, nothing trained twice on top of itself.

While it waits for groups, a live generator that missed the last push (its registration lapsed while Redis
was out of reach, it did not answer, its update failed, it restarted from an older checkpoint) is pushed the
weights again: with no group left to train, the learner would otherwise never push again, and everything that
generator samples could stay too stale to train.

The loop ends in one of three ways, each said in the learner's last line (:class:`RunEnd`): ``max_steps``
trained, the data ran out (every epoch admitted and every group in flight came back), or a stop was requested
(a signal, ``/shutdown``). Ending any other way is an error (:class:`RunEndedEarly`), never a finished run; so
is a Redis that no longer holds what the learner wrote at its start (:class:`RedisStateLost`): a learner never
decides it is done from counts Redis lost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Literal

import httpx
import redis.asyncio as aioredis
import torch
from redis.exceptions import ResponseError

from services.learner.batch import collate
from services.learner.batch_metrics import batch_metrics, finalize_advantages
from services.learner.checkpoint import LearnerState, save_checkpoint
from services.learner.completions_log import completion_rows, completions_due
from services.learner.evaluation import Evaluator
from services.learner.feeder import PromptFeeder, admission_budget, replacement_cap_reached
from services.learner.importance import is_stale
from services.learner.observability import MetricsSink
from services.learner.trainer import Trainer
from shared.codec import encode
from shared.config.learner import LearnerSettings
from shared.intake import decode_or_reject
from shared.keys import Keys
from shared.lifecycle import stop_reason
from shared.records import CheckpointAnnouncement, ScoredGroup, WeightVersionAnnouncement
from shared.redis_conn import RedisRetry
from shared.registry import live_generators
from shared.streams import Delivery, StreamConsumer, StreamProducer, group_backlog
from weight_sync.placement import own_parameters, place_parameters
from weight_sync.sender import PushReport, WeightPusher, WeightPushError

log = logging.getLogger(__name__)

FEEDER_POSITION = b"feeder_position"
RUNTIME = b"runtime"  # written into ``learner_state`` at start; its absence means Redis lost the run's state
# While it waits for groups, the learner looks this often for generators that missed the last push (one
# HGETALL); after pushing to them again it waits longer before the next look, so that a push that keeps failing
# is not retried in a tight loop.
_CATCH_UP_CHECK_S = 1.0
_CATCH_UP_RETRY_S = 10.0

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


class RedisStateLost(RuntimeError):
    """Redis no longer holds what the learner wrote at its start: it restarted without persistence (AOF or
    RDB), or it was flushed. The groups in flight are gone, and counting them in Redis would count none."""


DropReason = Literal["already_trained", "zero_std_dropped", "from_lost_versions", "stale_dropped"]


@dataclasses.dataclass
class Counters:
    """The run's counts of groups and weight pushes: checkpointed with the learner's state and written with
    every step's metrics as ``counters/<name>``. Changed only through the methods below."""

    groups_admitted: int = 0
    groups_trained: int = 0
    groups_stale_dropped: int = 0
    groups_zero_std_dropped: int = 0
    groups_from_lost_versions: int = 0
    groups_already_trained: int = 0
    groups_rejected: int = 0
    weight_pushes: int = 0
    weight_push_failures: int = 0
    input_tokens_seen: int = 0  # prompt + completion tokens of every trained completion (TRL's num_tokens)

    @classmethod
    def restore(cls, saved: Mapping[str, float]) -> Counters:
        """The counters a checkpoint saved (names this version does not know are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{name: int(value) for name, value in saved.items() if name in names})

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def admitted(self, groups: int) -> None:
        self.groups_admitted += groups

    def trained(self, groups: int) -> None:
        self.groups_trained += groups

    def tokens_seen(self, tokens: float) -> int:
        self.input_tokens_seen += int(tokens)
        return self.input_tokens_seen

    def rejected(self) -> None:
        self.groups_rejected += 1

    def dropped(self, reason: DropReason) -> None:
        match reason:
            case "already_trained":
                self.groups_already_trained += 1
            case "zero_std_dropped":
                self.groups_zero_std_dropped += 1
            case "from_lost_versions":
                self.groups_from_lost_versions += 1
            case "stale_dropped":
                self.groups_stale_dropped += 1

    def pushed(self, *, ok: bool) -> None:
        if ok:
            self.weight_pushes += 1
        else:
            self.weight_push_failures += 1


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
    ) -> None:
        self.settings, self.client, self.keys = settings, client, keys
        self.trainer, self.tokenizer, self.feeder = trainer, tokenizer, feeder
        self.consumer, self.pusher, self.http, self.sink = consumer, pusher, http, sink
        self.prompts = StreamProducer(client, keys.prompts)
        self.trained_ids = set(state.trained_group_ids)
        self.trained_order = list(state.trained_group_ids)
        self.counters = Counters.restore(state.counters)
        self.buffer: list[tuple[Delivery, ScoredGroup]] = []  # read, not yet trained
        self.unacked: list[Delivery] = []  # trained, acknowledged at the next checkpoint
        self.in_flight = 0
        self.redis = RedisRetry()
        self.running = False
        self.last_checkpoint: Path | None = None
        self.dynamic_sampling: dict[str, float] = {}  # the last collected batch's figures
        self.evaluator = evaluator
        self.pushed_version: int | None = None  # the version the generators were last given
        self.pushed_to: set[str] = set()  # the generators the last push reached
        self.next_catch_up = 0.0  # monotonic time before which missed generators are not pushed again
        self.drained = False  # every epoch admitted and every group in flight back (see collect)
        self.placed: list[torch.nn.Parameter] = []  # parameters living in the pusher's kept buffers
        self.evaluated_step: int | None = None  # the step of the last evaluation

    @property
    def policy_version(self) -> int:
        return self.trainer.step

    # Admission -----------------------------------------------------------------------------------------

    async def measure_in_flight(self) -> int:
        async def measure() -> int:
            await self.check_redis_state()
            prompts = await group_backlog(self.client, self.keys.prompts, Keys.GENERATORS)
            rollouts = await group_backlog(self.client, self.keys.rollouts, Keys.SCORERS)
            scored = await group_backlog(self.client, self.keys.scored, Keys.LEARNER, include_pending=False)
            return prompts + rollouts + scored

        self.in_flight = await self.redis.run(measure, "measuring groups in flight") + len(self.buffer)
        return self.in_flight

    async def check_redis_state(self) -> None:
        """Raise :class:`RedisStateLost` when Redis no longer holds the runtime record the learner wrote at
        its start: every stream, group and count it would read next is gone or starts from nothing."""
        if not await self.client.hexists(self.keys.learner_state, RUNTIME):
            raise RedisStateLost(
                f"Redis no longer holds the learner's state ({self.keys.learner_state!r} has no {RUNTIME.decode()!r}): "
                "it restarted without persistence or was flushed, and the groups in flight with it. Stopping at "
                f"step {self.trainer.step} of {self.settings.max_steps}; restart the learner to go on from its last "
                "checkpoint, and run Redis with appendonly yes so that a restart keeps the streams"
            )

    async def admit(self) -> int:
        """Publish tasks up to the admission bound; returns how many were admitted."""
        budget = admission_budget(await self.measure_in_flight(), self.settings.admission_bound)
        admitted = 0
        for _ in range(budget):
            before = self.feeder.position
            task = self.feeder.next_task(self.policy_version)
            if task is None:
                break
            try:
                await self.redis.run(lambda task=task: self._publish(task), "admitting a prompt")
            except BaseException:
                self.feeder.position = before  # not admitted: the next attempt starts from the same row
                raise
            admitted += 1
        self.counters.admitted(admitted)
        self.in_flight += admitted
        return admitted

    async def _publish(self, task) -> None:
        """The task and the feeder's position after it, in one transaction."""
        position = json.dumps(self.feeder.position.model_dump()).encode()
        async with self.client.pipeline(transaction=True) as pipe:
            self.prompts.queue(pipe, task.task_id, encode(task))
            pipe.hset(self.keys.learner_state, FEEDER_POSITION, position)
            await pipe.execute()

    # Batches -------------------------------------------------------------------------------------------

    def _drop_reason(self, group: ScoredGroup) -> DropReason | None:
        version = group.rollout.policy_version
        if group.group_id in self.trained_ids:
            return "already_trained"
        if group.dropped:
            return "zero_std_dropped"
        if version > self.policy_version:
            # Sampled by weights a crashed learner pushed after its last checkpoint: they no longer exist.
            return "from_lost_versions"
        if is_stale(self.policy_version, version, self.settings.max_staleness):
            return "stale_dropped"
        return None

    async def _accept(self, delivery: Delivery) -> None:
        group = await decode_or_reject(self.consumer, self.redis, delivery, ScoredGroup, "a group")
        if group is None:
            self.counters.rejected()
            return
        reason = self._drop_reason(group)
        if reason is None:
            self.buffer.append((delivery, group))
            return
        self.counters.dropped(reason)
        self.sink.write_drop(group.group_id, reason, group.rollout.policy_version, self.policy_version)
        await self.redis.run(lambda: self.consumer.commit(delivery), "acknowledging a dropped group")

    async def collect(self, stop: asyncio.Event) -> list[tuple[Delivery, ScoredGroup]] | None:
        """The next batch; a partial one when the data ran out, None when nothing is left or on stop."""
        wanted = self.settings.groups_per_step
        skipped_before = self.counters.groups_zero_std_dropped
        capped = False
        while len(self.buffer) < wanted and not stop.is_set():
            skipped = self.counters.groups_zero_std_dropped - skipped_before
            if replacement_cap_reached(skipped, self.settings.max_replacement_groups, len(self.buffer)):
                capped = True
                log.warning(
                    "dynamic sampling cap: %d zero-std groups skipped; training on %d", skipped, len(self.buffer)
                )
                break
            await self.admit()
            await self._read(wanted - len(self.buffer))
            await self.catch_up_generators()
            drained = self.feeder.exhausted and len(self.buffer) < wanted
            if drained and await self.measure_in_flight() == len(self.buffer):
                self.drained = True
                break
        if stop.is_set() or not self.buffer:
            return None
        self.dynamic_sampling = {
            "dynamic_sampling/skipped_groups": float(self.counters.groups_zero_std_dropped - skipped_before),
            "dynamic_sampling/capped": float(capped),
        }
        batch, self.buffer = self.buffer[:wanted], self.buffer[wanted:]
        return batch

    async def _read(self, count: int) -> None:
        """Read up to ``count`` scored groups: each is buffered for training, or dropped with its reason."""
        try:
            deliveries = await self.redis.run(lambda: self.consumer.read(count=count, block_ms=200), "reading groups")
        except ResponseError:  # NOGROUP: the learner's group may have gone with the rest of Redis's state
            await self.check_redis_state()
            raise
        for delivery in deliveries:
            await self._accept(delivery)

    def _train(self, groups: list[ScoredGroup]) -> list[dict[str, float]]:
        advantages = finalize_advantages(groups)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        batch = collate(groups, advantages, pad)
        return self.trainer.train(batch)

    # Weights and checkpoints ---------------------------------------------------------------------------

    async def push_weights(self, *, reset: bool = False, only: Collection[str] | None = None) -> float:
        """Push the current weights to every live generator (retried once); returns seconds spent. ``only``:
        to those of them alone (a catch-up, which announces no new version)."""
        started = time.perf_counter()
        failed: set[str] = set()
        for attempt in (1, 2):
            generators = await self.redis.run(lambda: live_generators(self.client, self.keys), "listing generators")
            generators = [
                g for g in generators if g.generator_id not in failed and (only is None or g.generator_id in only)
            ]  # the retry skips the failed ones
            try:
                try:
                    with self.trainer.full_weights() as named:
                        report = await self.pusher.push(
                            named, self.policy_version, generators, self.http, reset=reset,
                            linear=self.trainer.linear_weights,
                        )  # fmt: skip
                except BaseException:
                    if self.placed:  # a straggler may still read them where they lie
                        own_parameters(self.placed)
                        log.warning("the parameters left the weight push's buffers after a failed push")
                        self.placed = []
                    raise
                if self.trainer.pushes_parameters:  # the next push packs them by no copy
                    placed = place_parameters(self.trainer.model, self.pusher.weight_homes())
                    if placed and not self.placed:
                        mb = sum(p.numel() * p.element_size() for p in placed) / 1e6
                        log.info("%d parameters (%.0f MB) live in the weight push's buffers now", len(placed), mb)
                    self.placed = placed
                self.counters.pushed(ok=True)
                await self._pushed(report, catch_up=only is not None)
                break
            except WeightPushError as exc:
                self.counters.pushed(ok=False)
                failed.update(exc.failed)
                log.error("weight push attempt %d failed: %s", attempt, exc)
        self.next_catch_up = time.monotonic() + _CATCH_UP_CHECK_S
        return time.perf_counter() - started

    async def _pushed(self, report: PushReport, *, catch_up: bool) -> None:
        """Remember whom a push reached; a push to every generator also announces its version."""
        if catch_up:
            self.pushed_to |= set(report.generators)
            return
        announcement = encode(WeightVersionAnnouncement(policy_version=self.policy_version))
        await self.redis.run(lambda: self.client.set(self.keys.weights, announcement), "announcing weights")
        self.pushed_version, self.pushed_to = self.policy_version, set(report.generators)

    async def catch_up_generators(self) -> None:
        """Push the weights again when a live generator missed the last push and serves older weights (see
        the module docstring); looked for every ``_CATCH_UP_CHECK_S``, retried after ``_CATCH_UP_RETRY_S``."""
        if self.pushed_version is None or time.monotonic() < self.next_catch_up:
            return
        self.next_catch_up = time.monotonic() + _CATCH_UP_CHECK_S
        live = await self.redis.run(lambda: live_generators(self.client, self.keys), "listing generators")
        missed = {
            g.generator_id: g.policy_version
            for g in self.pusher.allowed(live)
            if g.generator_id not in self.pushed_to and g.policy_version < self.pushed_version
        }
        if missed:
            behind = ", ".join(f"{gid} (version {version})" for gid, version in sorted(missed.items()))
            log.warning(
                "generator(s) %s missed the push of version %d: pushing version %d to them while waiting for groups",
                behind, self.pushed_version, self.policy_version,
            )  # fmt: skip
            await self.push_weights(only=missed)
            self.next_catch_up = time.monotonic() + _CATCH_UP_RETRY_S

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

    # The loop ------------------------------------------------------------------------------------------

    async def wait_for_generators(self, stop: asyncio.Event) -> None:
        last_log = 0.0
        while not stop.is_set():
            live = await self.redis.run(lambda: live_generators(self.client, self.keys), "listing generators")
            live = self.pusher.allowed(live)  # one at a host it may not contact does not count
            if len(live) >= self.settings.min_generators:
                return
            if time.monotonic() - last_log > 10:
                log.info("waiting for generators: %d of %d live", len(live), self.settings.min_generators)
                last_log = time.monotonic()
            await asyncio.sleep(0.5)

    async def run(self, stop: asyncio.Event, *, resumed: bool) -> RunEnd:
        """Train until ``max_steps``, the data runs out or ``stop``; then checkpoint what is not saved yet.
        Returns how it ended; raises :class:`RunEndedEarly` (after that checkpoint) when it ended otherwise."""
        await self.wait_for_generators(stop)
        if resumed:
            await self.push_weights(reset=True)
        self.running = True
        if self.trainer.step == 0 and self.settings.eval_on_start:
            await self.evaluate(stop)
        while self.trainer.step < self.settings.max_steps and not stop.is_set():
            if not await self.run_step(stop):
                break
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

    def ending(self, stop: asyncio.Event) -> RunEnd | None:
        """Why the loop ended: ``max_steps`` trained, the data ran out, or a stop; None for no known reason."""
        step, max_steps = self.trainer.step, self.settings.max_steps
        if step >= max_steps:
            return RunEnd("max_steps", step, max_steps)
        if stop.is_set():
            return RunEnd("stopped", step, max_steps, stop_reason(stop))
        if self.drained:
            data = f"{self.feeder.data.epochs} epoch(s) of {len(self.feeder.rows)} rows; {self._group_fates()}"
            log.warning("the data ran out at step %d of max_steps %d: %s", step, max_steps, data)
            return RunEnd("data_exhausted", step, max_steps, data)
        return None

    def _group_fates(self) -> str:
        """What became of the admitted groups: "2000 admitted: 8 trained, 1992 stale_dropped"."""
        counts = self.counters.as_dict()
        fates = [f"{counts['groups_trained']} trained"] + [
            f"{n} {name.removeprefix('groups_')}"
            for name, n in counts.items()
            if n and name.startswith("groups_") and name not in ("groups_admitted", "groups_trained")
        ]
        return f"{counts['groups_admitted']} admitted: {', '.join(fates)}"

    async def evaluate(self, stop: asyncio.Event) -> None:
        """An evaluation of the current weights (pushed first if the generators have older ones), written as
        ``eval/*`` for this step; nothing without ``eval_data``."""
        if self.evaluator is None:
            return
        if self.trainer.step and self.pushed_version != self.policy_version:
            await self.push_weights()
        metrics = await self.evaluator.run(self.trainer.step, self.policy_version, stop)
        if metrics is None:
            return
        self.evaluated_step = self.trainer.step
        metrics["counters/eval_orphans"] = float(self.evaluator.orphans)
        self.sink.write_eval(self.trainer.step, metrics)

    async def run_step(self, stop: asyncio.Event) -> bool:
        """One batch: collect, train, push and checkpoint when due, write the metrics. False: nothing left."""
        started = time.perf_counter()
        collected = await self.collect(stop)
        if collected is None:
            return False
        waited = time.perf_counter() - started
        groups = [g for _, g in collected]
        if completions_due(self.trainer.step + 1, self.settings.num_iterations, self.settings.log_completions):
            rows = completion_rows(groups, self.settings.num_completions_to_log)
            self.sink.write_completions(self.trainer.step + 1, rows)
        metrics = {**batch_metrics(groups, self.policy_version), **self.dynamic_sampling}
        metrics["num_tokens"] = float(self.counters.tokens_seen(metrics.pop("input_tokens")))
        self.sink.write_batch(
            self.trainer.step + 1, [g.group_id for g in groups], [g.rollout.policy_version for g in groups]
        )
        train_started = time.perf_counter()
        results = await asyncio.to_thread(self._train, groups)
        train_wall = time.perf_counter() - train_started
        self._trained(collected)
        sync_seconds = await self._sync_and_checkpoint()
        if self.settings.eval_every and self.trainer.step % self.settings.eval_every == 0:
            await self.evaluate(stop)
        seconds = {
            "seconds/wait": waited,
            "seconds/sync": sync_seconds,
            "seconds/train_wall": train_wall,
            "seconds/step": time.perf_counter() - started,
        }
        self._write_metrics(metrics, results, seconds)
        return True

    def _trained(self, collected: list[tuple[Delivery, ScoredGroup]]) -> None:
        """Remember the groups just trained; they are acknowledged at the next checkpoint."""
        for delivery, group in collected:
            self.trained_ids.add(group.group_id)
            self.trained_order.append(group.group_id)
            self.unacked.append(delivery)
        self.counters.trained(len(collected))

    async def _sync_and_checkpoint(self) -> float:
        """Push weights every ``sync_every`` steps, checkpoint every ``checkpoint_every`` and at the last
        step; returns the seconds the push took (0 without one)."""
        sync_seconds = 0.0
        if self.trainer.step % self.settings.sync_every == 0:
            sync_seconds = await self.push_weights()
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
            record.update({f"counters/{k}": v for k, v in self.counters.as_dict().items()})
            self.sink.write(step, record)
