"""The generator's I/O loop: prompts stream -> vLLM -> rollouts stream.

Keeps up to ``max_prompts_in_flight`` prompts sampling at once so the engine batches them. Each prompt's
entry is acknowledged in the same transaction that writes its ``Rollout`` (see :mod:`shared.streams`), so
a replica that dies leaves its prompts pending for another replica to claim. A prompt that can never be
served (undecodable, too long), or whose group the engine gave logprobs that cannot be trained on (NaN,
infinite or positive: :mod:`shared.finite`), goes to the dead-letter stream at once with the reason; one that
fails otherwise is retried by whichever replica claims it, up to ``max_deliveries``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from environments.session import EnvFault
from services.generator.engine import Engine, InvalidPromptError, NonFiniteOutput, SampledGroup
from services.generator.trajectory.runner import RolledBack, SampledTrajectories, TrajectoryRunner
from services.generator.trajectory.template import TemplateError
from shared.codec import encode
from shared.config.bounds import EntryBoundsSettings
from shared.intake import decode_or_reject
from shared.records import PromptTask, Rollout, RolloutTimings
from shared.redis_conn import RedisRetry
from shared.streams import Delivery, Output, StreamConsumer, StreamProducer
from shared.streams.outcomes import DeliveryOutcomes

log = logging.getLogger(__name__)

_TOKENS_WINDOW_S = 30.0


@dataclass
class GeneratorStats:
    prompts_done: int = 0
    completions_done: int = 0
    tokens_generated: int = 0
    failures: int = 0
    rejected: int = 0
    rolled_back: int = 0  # groups sampled while the weights went back to an older version: sampled again
    abandoned: int = 0  # multi-turn prompts given up after an environment fault: handed back, claimed at once
    nonfinite: int = 0  # groups whose logprobs could not be trained on (shared.finite): dead-lettered
    _recent: deque = field(default_factory=deque)  # (time, tokens) of recent groups

    def completed(self, completions: int, tokens: int) -> None:
        """One prompt's group written downstream."""
        self.prompts_done += 1
        self.completions_done += completions
        self.tokens_generated += tokens
        now = time.monotonic()
        self._recent.append((now, tokens))
        while self._recent and self._recent[0][0] < now - _TOKENS_WINDOW_S:
            self._recent.popleft()

    def tokens_per_second(self) -> float:
        if not self._recent:
            return 0.0
        span = max(time.monotonic() - self._recent[0][0], 1.0)
        return sum(tokens for _, tokens in self._recent) / span


class RolloutLoop:
    def __init__(
        self,
        engine: Engine,
        consumer: StreamConsumer,
        rollouts: StreamProducer,
        generator_id: str,
        max_in_flight: int,
        trajectories: TrajectoryRunner | None = None,
        bounds: EntryBoundsSettings | None = None,
    ) -> None:
        """``bounds``: the prompt tasks it takes (the generator's settings; None: the defaults)."""
        self.engine = engine
        self.consumer = consumer
        self.rollouts = rollouts
        self.generator_id = generator_id
        self.max_in_flight = max_in_flight
        self.trajectories = trajectories  # None: one completion per sample; else multi-turn with an environment
        self.bounds = bounds or EntryBoundsSettings()
        self.stats = GeneratorStats()
        self._tasks: set[asyncio.Task] = set()
        self.fatal: BaseException | None = None
        self.redis = RedisRetry()
        # A prompt the engine refuses, or whose group it gave logprobs that cannot be trained on, is the prompt's.
        own_faults = (InvalidPromptError, NonFiniteOutput)
        self.outcomes = DeliveryOutcomes(consumer, self.redis, "a prompt", rejects=own_faults)

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def accepting(self) -> bool:
        environment_ok = self.trajectories is None or self.trajectories.environment.accepting()
        return self.engine.weights_ok and not self.engine.paused_by_operator and environment_ok

    async def run(self, stop: asyncio.Event) -> None:
        """Read and sample until ``stop``; then let in-flight prompts finish."""
        while not stop.is_set() and self.fatal is None:
            room = self.max_in_flight - len(self._tasks)
            if room <= 0 or not self.accepting():
                await self._wait_for_room(stop)
                continue
            deliveries = await self.redis.run(
                lambda room=room: self.consumer.read(count=room, block_ms=500), "reading prompts"
            )
            for delivery in deliveries:
                task = asyncio.create_task(self._handle(delivery, time.time()))
                self._tasks.add(task)
                task.add_done_callback(self._finished)
        if self._tasks:
            log.info("finishing %d prompts in flight before stopping", len(self._tasks))
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.fatal is not None:
            raise self.fatal

    def _finished(self, task: asyncio.Task) -> None:
        """A prompt's task is done; a failure nobody handled is logged and counted (its prompt, released by
        :meth:`_handle`, is delivered again after ``claim_idle_ms``: the failure is not known to be the prompt's
        own, so its retries are spread out)."""
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        self.stats.failures += 1
        log.error("handling a prompt failed; it will be delivered again", exc_info=task.exception())

    async def _wait_for_room(self, stop: asyncio.Event) -> None:
        waiters = [asyncio.ensure_future(stop.wait()), *self._tasks]
        await asyncio.wait(waiters, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
        waiters[0].cancel()

    async def _handle(self, delivery: Delivery, received_at: float) -> None:
        """Sample and write one prompt's group. A failure nobody handled releases the prompt: held, it would
        be kept alive as in flight for good, never delivered again."""
        try:
            await self._handle_prompt(delivery, received_at)
        except Exception as exc:
            await self.outcomes.release(delivery, exc)
            raise

    async def _handle_prompt(self, delivery: Delivery, received_at: float) -> None:
        task = await decode_or_reject(self.consumer, self.redis, delivery, PromptTask, "a prompt", self.bounds)
        if task is None:
            self.stats.rejected += 1
            return
        try:
            group = await self._sample(task)
        except EnvFault as exc:
            self.stats.abandoned += 1
            log.warning("prompt %s abandoned, the environment failed: %s", delivery.record_id, exc)
            await self.outcomes.release(delivery, f"environment: {exc}", at_once=True)
            return
        except RolledBack as exc:
            await self._sample_again(delivery, str(exc))
            return
        except Exception as exc:
            await self._failed(delivery, exc)
            return
        if group.lowest_policy_version < group.policy_version:
            reason = f"the weights went back from version {group.policy_version} to {group.lowest_policy_version}"
            await self._sample_again(delivery, reason)
            return
        await self._commit(delivery, task, group, received_at)

    async def _failed(self, delivery: Delivery, exc: Exception) -> None:
        """Sampling failed: a dead engine or a chat template that cannot render stops the replica; otherwise the
        prompt is rejected when the failure is its own, else released to be retried."""
        if _engine_dead(exc) or isinstance(exc, TemplateError):
            self.fatal = exc
            log.critical("not sampling any more: %s", exc)
            return
        if await self.outcomes.settle(delivery, exc) == "released":
            self.stats.failures += 1
            log.error(
                "prompt %s failed (delivery %d); it will be retried",
                delivery.record_id,
                delivery.deliveries,
                exc_info=exc,
            )
        elif isinstance(exc, NonFiniteOutput):
            self.stats.nonfinite += 1
            log.error("prompt %s dead-lettered: %s", delivery.record_id, exc)
        else:
            self.stats.rejected += 1

    async def _sample(self, task: PromptTask) -> SampledGroup | SampledTrajectories:
        """The prompt's G samples: one completion each, or one trajectory each with an environment."""
        if self.trajectories is not None:
            return await self.trajectories.run(task)
        return await self.engine.sample(self.engine.tokenize(task.prompt), task.sampling, task.group_size)

    async def _sample_again(self, delivery: Delivery, reason: str) -> None:
        """The weights went back while the group was sampled (a restarted learner's reset push): no version
        describes its tokens, so the prompt is released and sampled again with the weights served now."""
        self.stats.rolled_back += 1
        log.warning("prompt %s: %s while it was sampled; it is sampled again", delivery.record_id, reason)
        await self.outcomes.release(delivery, reason, at_once=True)

    async def _commit(
        self, delivery: Delivery, task: PromptTask, group: SampledGroup | SampledTrajectories, received_at: float
    ) -> None:
        """Write the group's rollout and acknowledge its prompt in one transaction."""
        rollout = Rollout(
            group_id=task.task_id,
            task=task,
            prompt_token_ids=group.prompt_token_ids,
            completions=group.completions,
            policy_version=group.policy_version,
            finished_policy_version=group.finished_policy_version,
            generator_id=self.generator_id,
            timings=RolloutTimings(received_at=received_at, started_at=group.started_at, finished_at=group.finished_at),
        )
        output = Output(self.rollouts, rollout.group_id, encode(rollout))
        if await self.redis.run(lambda: self.consumer.commit(delivery, [output]), "writing a rollout"):
            self.stats.completed(len(group.completions), group.num_tokens)


def _engine_dead(exc: BaseException) -> bool:
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:  # pragma: no cover - vLLM always present in a generator
        return False
    return isinstance(exc, EngineDeadError)
