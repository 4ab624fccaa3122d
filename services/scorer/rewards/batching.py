"""Batched reward functions: one call over several groups, as TRL calls a reward once per generation batch.

TRL calls each reward function once over a step's whole generation batch (every prompt's G completions), so a
function may look across prompts (rank completions, normalise over the batch). The scorer receives groups one
by one, so a reward with ``batched = true`` gets a :class:`RewardBatcher`: a group that reaches it waits until
``max_groups`` groups are waiting (``scorer.groups_per_step``, else ``max_groups_in_flight``) or ``wait_s``
has passed since the first of them; then the function is called once, through its breaker, over all of them
(:func:`merge_batches`), and its values are split back per group (:func:`split_result`). The breaker and the
reward's figures count that one call. A failure is each group's failure, named with its own group id.

Only groups that can share one call are put together: the same kind (single- or multi-turn), the same column
names (so the call's keywords fit every row) and the same *lane* (training, or one evaluation round: TRL
scores its evaluation batches apart from training). ``trainer_state.global_step`` of a call is the newest of
its groups'. A scorer holds at most ``max_groups_in_flight`` groups and several scorers share a step's groups,
so a call covers the groups this scorer holds: the whole step's when one scorer receives them all.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from services.scorer.rewards.functions import RewardBatch, RewardFailure, RewardFunction, run_function

_Key = tuple[Hashable, bool, tuple[str, ...]]


@dataclass(frozen=True)
class _Waiting:
    """One group waiting for its share of a batched call, and where its answer goes."""

    batch: RewardBatch
    answer: asyncio.Future


class RewardBatcher:
    """Calls one batched reward function over up to ``max_groups`` groups at once (see the module docstring)."""

    def __init__(self, function: RewardFunction, max_groups: int, wait_s: float) -> None:
        if max_groups < 1 or wait_s < 0:
            raise ValueError(f"a batch needs max_groups >= 1 and wait_s >= 0, got {max_groups} and {wait_s}")
        self.function, self.max_groups, self.wait_s = function, max_groups, wait_s
        self._waiting: dict[_Key, list[_Waiting]] = {}
        self._timers: dict[_Key, asyncio.TimerHandle] = {}
        self._calls: set[asyncio.Task] = set()  # running calls, referenced so they are not collected

    async def run(self, batch: RewardBatch, lane: Hashable = None) -> list[float] | RewardFailure:
        """This group's G values (or the call's failure) from the next call over the groups waiting with it;
        ``lane``: groups of different lanes never share a call (None: training; an evaluation round's step)."""
        loop = asyncio.get_running_loop()
        key = (lane, batch.multi_turn, tuple(sorted(batch.columns)))
        waiting = self._waiting.setdefault(key, [])
        waiting.append(_Waiting(batch, loop.create_future()))
        answer = waiting[-1].answer
        if len(waiting) >= self.max_groups:
            self._flush(key)
        elif key not in self._timers:
            self._timers[key] = loop.call_later(self.wait_s, self._flush, key)
        return await answer

    def _flush(self, key: _Key) -> None:
        """Start one call over the groups waiting under ``key`` (those whose callers still wait)."""
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        entries = [entry for entry in self._waiting.pop(key, []) if not entry.answer.done()]
        if entries:
            task = asyncio.create_task(self._call(entries))
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)

    async def _call(self, entries: list[_Waiting]) -> None:
        batches = [entry.batch for entry in entries]
        try:
            result = await run_function(self.function, merge_batches(batches))
        except BaseException as exc:  # cancelled (run_function turns every other error into a failure)
            for entry in entries:
                if not entry.answer.done():
                    entry.answer.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for entry, share in zip(entries, split_result(result, batches), strict=True):
            if not entry.answer.done():  # a caller cancelled meanwhile wants no answer
                entry.answer.set_result(share)


def merge_batches(batches: Sequence[RewardBatch]) -> RewardBatch:
    """One batch of every group's completions in order (their columns joined name by name, group ids joined
    with ","), with the newest ``trainer_state``; every batch must have the first one's column names."""
    first = batches[0]
    names = set(first.columns)
    if any(set(batch.columns) != names for batch in batches):
        raise ValueError("batches with different column names cannot share one reward call")
    states = [batch.trainer_state for batch in batches if batch.trainer_state is not None]
    return RewardBatch(
        prompts=[prompt for batch in batches for prompt in batch.prompts],
        completions=[completion for batch in batches for completion in batch.completions],
        completion_ids=[ids for batch in batches for ids in batch.completion_ids],
        columns={name: [value for batch in batches for value in batch.columns[name]] for name in first.columns},
        group_id=",".join(batch.group_id for batch in batches),
        multi_turn=first.multi_turn,
        trainer_state=max(states, key=lambda state: state.global_step) if states else None,
    )


def split_result(
    result: list[float] | RewardFailure, batches: Sequence[RewardBatch]
) -> list[list[float] | RewardFailure]:
    """A merged call's answer per group: each group's slice of the values (in :func:`merge_batches`' order), or
    the failure under each group's own id."""
    if isinstance(result, RewardFailure):
        return [dataclasses.replace(result, group_id=batch.group_id) for batch in batches]
    if len(result) != sum(len(batch) for batch in batches):
        raise ValueError(f"{len(result)} values for {sum(len(batch) for batch in batches)} completions")
    shares: list[list[float] | RewardFailure] = []
    start = 0
    for batch in batches:
        shares.append(result[start : start + len(batch)])
        start += len(batch)
    return shares
