"""The scorer's I/O loop: rollouts stream -> reward functions -> scored stream.

Scores up to ``max_groups_in_flight`` rollouts at once (HTTP plugins are I/O bound). Each rollout's entry
is acknowledged in the transaction that writes its ``ScoredGroup``; a scorer that dies leaves its rollouts
pending for another scorer to claim.

Failures of *required* rewards never become NaN. The group is held: it stays pending (kept fresh by the
consumer's keepalive, so no other scorer takes it), and only its failed required rewards are called again
after a backoff (``retry_backoff_s`` doubling to ``retry_backoff_max_s``; while the reward's breaker is
open, exactly when it lets a trial through; any change of the breaker wakes the groups waiting on it). A
group still failing after ``max_reward_wait_s`` is dead-lettered with the reason. While a required
reward's breaker is open the loop takes no new rollouts, so the rollouts backlog fills and the generators
stop at their backlog bound; when it is half-open and nothing is in flight, one rollout is taken as the
trial. Optional rewards that fail are NaN for that group. Rollouts of held-out prompts (``task.eval_step``
set) are scored by the same functions and written to the evaluated stream, without advantages, never to
training. On shutdown held groups are left pending (unacknowledged) for the next scorer. A required
reward's *bug* (an exception from a Python function that is not an outage, see
:mod:`services.scorer.rewards.functions`) is not waited out: its group is released for after the fix and the
loop stops, raising :class:`RewardBugError` (the scorer exits 1). A group that a reward cannot even be given
(:class:`RewardInputError`, e.g. a column an HTTP plugin's JSON request cannot carry) is a bad record: it is
dead-lettered at once with the reason, like an undecodable rollout, whether that reward is required or not,
and no breaker counts it. A reward with ``batched = true`` is called once over several groups
(:mod:`services.scorer.rewards.batching`); every other reward once per group.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from pydantic import ValidationError

from services.scorer.holding import HoldPolicy, Released
from services.scorer.rewards.batching import RewardBatcher
from services.scorer.rewards.functions import (
    RewardBatch,
    RewardBugError,
    RewardFailure,
    RewardFunction,
    RewardInputError,
    intake_state,
    run_function,
)
from services.scorer.scoring import evaluated_group, reward_batch, scored_group
from shared.codec import encode
from shared.config.bounds import EntryBoundsSettings
from shared.config.scorer import ScorerSettings
from shared.intake import decode_or_reject
from shared.records import AdvantageSpec, Rollout, ScoredGroup
from shared.redis_conn import RedisRetry
from shared.streams import Delivery, Output, StreamConsumer, StreamProducer
from shared.streams.outcomes import DeliveryOutcomes
from shared.telemetry import CallbackCollector

log = logging.getLogger(__name__)

_IDLE_POLL_S = 0.2  # how often a paused loop looks at the breakers again


@dataclass
class ScorerStats:
    groups_scored: int = 0
    groups_evaluated: int = 0  # held-out prompts scored for the learner's evaluation
    groups_zero_std: int = 0
    groups_dropped: int = 0
    groups_dead_lettered: int = 0  # a required reward failed for max_reward_wait_s
    groups_held: int = 0  # now waiting for a required reward (a gauge)
    group_retries: int = 0  # retries of held groups' required rewards
    failures: int = 0
    rejected: int = 0  # bad records: undecodable or invalid, or a reward could not be given the group
    groups_nonfinite: int = 0  # rewards or advantages not finite (shared.finite): dead-lettered
    last_metrics: dict[str, float] = field(default_factory=dict)

    def scored(self, group: ScoredGroup) -> None:
        """One group written downstream (a training group's figures become the last ones)."""
        if group.rollout.task.eval_step is not None:
            self.groups_evaluated += 1
            return
        self.groups_scored += 1
        self.groups_zero_std += group.zero_std
        self.groups_dropped += group.dropped
        self.last_metrics = group.metrics

    def counters(self) -> dict[str, float]:
        return {
            "scorer/groups": self.groups_scored,
            "scorer/groups_evaluated": self.groups_evaluated,
            "scorer/groups_zero_std": self.groups_zero_std,
            "scorer/groups_dropped": self.groups_dropped,
            "scorer/groups_dead_lettered": self.groups_dead_lettered,
            "scorer/group_retries": self.group_retries,
            "scorer/failures": self.failures,
            "scorer/rejected": self.rejected,
            "scorer/groups_nonfinite": self.groups_nonfinite,
        }


class ScoringLoop:
    def __init__(
        self,
        consumer: StreamConsumer,
        scored: StreamProducer,
        functions: Sequence[RewardFunction],
        weights: Sequence[float],
        spec: AdvantageSpec,
        *,
        evaluated: StreamProducer | None = None,
        drop_zero_std: bool,
        max_in_flight: int,
        max_reward_wait_s: float = 1800.0,
        retry_backoff_s: float = 1.0,
        retry_backoff_max_s: float = 30.0,
        batch_groups: int | None = None,
        batch_wait_s: float = 0.0,
        max_steps: int | None = None,
        bounds: EntryBoundsSettings | None = None,
    ) -> None:
        """``batch_groups`` (None: ``max_in_flight``) and ``batch_wait_s``: a batched reward's most groups per
        call and longest wait for them; ``max_steps``: the learner's, for the rewards' ``trainer_state``;
        ``bounds``: the rollouts it takes (None: the defaults)."""
        self.consumer, self.scored, self.evaluated = consumer, scored, evaluated
        self.functions, self.weights = list(functions), list(weights)
        self.names = [f.name for f in self.functions]
        self.spec, self.drop_zero_std = spec, drop_zero_std
        self.max_in_flight = max_in_flight
        self.hold = HoldPolicy(max_reward_wait_s, retry_backoff_s, retry_backoff_max_s)
        self.stats = ScorerStats()
        self._tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()
        self.redis = RedisRetry()
        # A rollout no reward can be given (a column a plugin's request cannot carry) is the rollout's fault.
        self.outcomes = DeliveryOutcomes(consumer, self.redis, "a rollout", rejects=(RewardInputError,))
        self.bug: RewardBugError | None = None  # set when a required reward's bug stops the loop
        self.max_steps, self.bounds = max_steps, bounds or EntryBoundsSettings()
        groups = batch_groups or max_in_flight
        self.batchers = {
            index: RewardBatcher(function, groups, batch_wait_s)
            for index, function in enumerate(self.functions)
            if function.batched
        }

    @classmethod
    def from_settings(
        cls,
        consumer: StreamConsumer,
        scored: StreamProducer,
        functions: Sequence[RewardFunction],
        settings: ScorerSettings,
        evaluated: StreamProducer | None = None,
    ) -> ScoringLoop:
        return cls(
            consumer,
            scored,
            functions,
            [r.weight for r in settings.rewards],
            settings.advantage_spec,
            evaluated=evaluated,
            drop_zero_std=settings.drop_zero_std_groups,
            max_in_flight=settings.max_groups_in_flight,
            max_reward_wait_s=settings.max_reward_wait_s,
            retry_backoff_s=settings.retry_backoff_s,
            retry_backoff_max_s=settings.retry_backoff_max_s,
            batch_groups=settings.batch_groups,
            batch_wait_s=settings.reward_batch_wait_s,
            max_steps=settings.max_steps,
            bounds=settings,
        )

    def not_ready_reason(self) -> str:
        """Why the scorer takes no (or only trial) rollouts now; empty when it takes them freely."""
        state, reasons = intake_state(self.functions)
        return "" if state == "closed" else "; ".join(reasons)

    def intake_summary(self) -> str:
        """``ready: rewards a, b`` or ``paused until a trial call succeeds: <why>: rewards a, b``."""
        paused = self.not_ready_reason()
        state = f"paused until a trial call succeeds: {paused}" if paused else "ready"
        return f"{state}: rewards {', '.join(self.names)}"

    def _room(self) -> int:
        state, _ = intake_state(self.functions)
        if state == "open":
            return 0
        if state == "half_open":
            return 0 if self._tasks else 1  # one rollout is the trial
        return self.max_in_flight - len(self._tasks)

    async def run(self, stop: asyncio.Event) -> None:
        self._stop = stop
        while not stop.is_set():
            room = self._room()
            if room <= 0:
                await self._idle()
                continue
            deliveries = await self.redis.run(
                lambda room=room: self.consumer.read(count=room, block_ms=500), "reading rollouts"
            )
            for delivery in deliveries:
                task = asyncio.create_task(self.handle(delivery))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.bug is not None:
            raise self.bug

    async def _idle(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=_IDLE_POLL_S, return_when=asyncio.FIRST_COMPLETED)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=_IDLE_POLL_S)

    async def handle(self, delivery: Delivery) -> None:
        rollout = await decode_or_reject(self.consumer, self.redis, delivery, Rollout, "a rollout", self.bounds)
        if rollout is None:
            self.stats.rejected += 1
            return
        try:
            outcome = await self.score_rewards(rollout)
            if isinstance(outcome, str):
                await self._dead_letter(delivery, outcome)
            else:
                await self._commit(delivery, rollout, outcome)
        except Released:
            await self.outcomes.release(delivery, "the scorer stopped while a required reward was failing")
        except RewardBugError as exc:
            await self.outcomes.release(delivery, str(exc))
            self.bug = self.bug or exc
            self._stop.set()
        except Exception as exc:
            await self._failed(delivery, exc)

    async def _failed(self, delivery: Delivery, exc: Exception) -> None:
        """Scoring failed: a rollout no reward can be given is rejected; any other failure releases it."""
        if await self.outcomes.settle(delivery, exc) == "rejected":
            self.stats.rejected += 1
            return
        self.stats.failures += 1
        log.error("scoring group %s failed; it will be retried", delivery.record_id, exc_info=exc)

    async def score_rewards(self, rollout: Rollout) -> np.ndarray | str:
        """Rewards [G, F] once every required reward has answered, or the reason to dead-letter the group;
        RewardInputError when a reward cannot be given the group at all (a bad record)."""
        batch = reward_batch(rollout, self.max_steps)
        per_func = np.full((len(batch), len(self.functions)), np.nan, dtype=np.float32)
        todo = list(range(len(self.functions)))
        started = time.monotonic()
        held = False
        try:
            for attempt in itertools.count():
                results = await asyncio.gather(*(self._call(i, batch, rollout.task.eval_step) for i in todo))
                bad = [r for r in results if isinstance(r, RewardFailure) and r.bad_input]
                if bad:
                    raise RewardInputError(str(bad[0]))
                failed: list[tuple[int, RewardFailure]] = []
                for index, result in zip(todo, results, strict=True):
                    if not isinstance(result, RewardFailure):
                        per_func[:, index] = result
                    elif self.functions[index].required:
                        failed.append((index, result))
                if not failed:
                    return per_func
                bugs = [failure for _, failure in failed if failure.bug]
                if bugs:
                    raise RewardBugError(bugs[0])
                todo = [index for index, _ in failed]
                waited = time.monotonic() - started
                failures = [failure for _, failure in failed]
                if waited >= self.hold.max_wait_s:
                    return self.hold.give_up_reason(failures, waited)
                if not held:
                    held = True
                    self.stats.groups_held += 1
                self.stats.group_retries += 1
                breakers = [b for b in (self.functions[index].breaker for index in todo) if b is not None]
                remaining_s = self.hold.max_wait_s - waited
                await self.hold.wait(rollout.group_id, attempt, failures, breakers, remaining_s, self._stop)
        finally:
            if held:
                self.stats.groups_held -= 1
        raise AssertionError("unreachable")  # pragma: no cover

    async def _call(self, index: int, batch: RewardBatch, lane: int | None) -> list[float] | RewardFailure:
        """Reward ``index`` on one group: through its batcher when it is batched (``lane``: the evaluation
        round, None for training), else on its own."""
        batcher = self.batchers.get(index)
        if batcher is not None:
            return await batcher.run(batch, lane)
        return await run_function(self.functions[index], batch)

    async def _dead_letter(self, delivery: Delivery, reason: str) -> None:
        log.error("group %s dead-lettered: %s", delivery.record_id, reason)
        await self.outcomes.reject(delivery, reason)
        self.stats.groups_dead_lettered += 1

    async def _commit(self, delivery: Delivery, rollout: Rollout, per_func: np.ndarray) -> None:
        try:
            output = self._output(rollout, per_func)
        except ValidationError as exc:  # the rewards or advantages it makes cannot be trained on (shared.finite)
            self.stats.groups_nonfinite += 1
            problem = exc.errors()[0]["msg"]
            log.error("group %s dead-lettered: its scored group is invalid: %s", delivery.record_id, problem)
            await self.outcomes.reject(delivery, ValueError(problem))
            return
        group = output.record
        committed = await self.redis.run(
            lambda: self.consumer.commit(delivery, [output.entry]), "writing a scored group"
        )
        if committed:
            self.stats.scored(group)

    def _output(self, rollout: Rollout, per_func: np.ndarray) -> _Scored:
        """The group to write and where: a training group to the scored stream, a held-out one to the
        evaluated stream (a scorer started without one refuses it: it is an error, not training data)."""
        scorer_id = self.consumer.consumer
        if rollout.task.eval_step is None:
            group = scored_group(
                rollout,
                self.names,
                self.weights,
                per_func,
                self.spec,
                drop_zero_std=self.drop_zero_std,
                scorer_id=scorer_id,
            )
            return _Scored(group, Output(self.scored, group.group_id, encode(group)))
        if self.evaluated is None:
            raise RuntimeError("an evaluation rollout reached a scorer that has no evaluated stream")
        group = evaluated_group(rollout, self.names, self.weights, per_func, scorer_id=scorer_id)
        return _Scored(group, Output(self.evaluated, group.group_id, encode(group)))


def scorer_collector(loop: ScoringLoop) -> CallbackCollector:
    """The scorer's Prometheus figures, read at scrape time; ``rewards/<function>/<figure>`` are exported
    as ``asyncgrpo_rewards_<figure>{function="<function>"}``."""

    def counters() -> dict[str, float]:
        stream = loop.consumer.stats
        out = loop.stats.counters() | {
            "stream/rollouts/claimed": stream.claimed,
            "stream/rollouts/recovered": stream.recovered,
            "stream/rollouts/dead_lettered": stream.dead_lettered,
            "stream/rollouts/duplicates": stream.duplicates,
        }
        for function in loop.functions:
            out.update(function.stats.as_metrics(function.name))
        return out

    def gauges() -> dict[str, float]:
        out = {k: v for k, v in loop.stats.last_metrics.items() if v == v}  # last group's figures, NaN left out
        out["scorer/groups_held"] = loop.stats.groups_held
        out["scorer/intake_paused"] = float(bool(loop.not_ready_reason()))
        for function in loop.functions:
            if function.breaker is not None:
                out[f"rewards/{function.name}/breaker_open"] = float(function.breaker.state != "closed")
            if function.threads is not None:  # a Python plugin's threads still running abandoned calls
                out[f"rewards/{function.name}/hung_threads"] = function.threads.hung
        return out

    return CallbackCollector(counters, gauges)


@dataclass(frozen=True)
class _Scored:
    record: ScoredGroup
    entry: Output
