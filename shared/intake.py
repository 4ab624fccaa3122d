"""Reading a delivery into its record, or rejecting it to the dead-letter stream with the reason.

A record that can never be processed (undecodable, invalid, past a size bound of
:class:`~shared.config.bounds.EntryBoundsSettings`, a prompt too long) is not retried: it goes to the
dead-letter stream at once, through :class:`shared.redis_conn.RedisRetry` so a Redis blip does not
lose it. Every stream reader (generator, scorer, learner) does this the same way; the reason reads
``"<ErrorType>: <message>"``. The rejection itself, and its counterpart for failures that are not the entry's
(a release), are :mod:`shared.streams.outcomes`.
"""

from __future__ import annotations

from typing import TypeVar

from shared.codec import WireError, decode
from shared.config.bounds import EntryBoundsSettings
from shared.records import PromptTask, Rollout, ScoredGroup, WireModel
from shared.redis_conn import RedisRetry
from shared.streams import Delivery, StreamConsumer
from shared.streams.outcomes import reject

__all__ = ["EntryTooLarge", "bound_problem", "decode_or_reject", "reject"]

R = TypeVar("R", bound=WireModel)
_DEFAULT_BOUNDS = EntryBoundsSettings()


class EntryTooLarge(ValueError):
    """An entry past one of the bounds of :class:`~shared.config.bounds.EntryBoundsSettings`; the message names it."""


def bound_problem(record: WireModel, bounds: EntryBoundsSettings) -> str | None:
    """Which bound ``record`` breaks (its group size, a completion's or the prompt's tokens), or None."""
    if isinstance(record, ScoredGroup):
        record = record.rollout
    if isinstance(record, PromptTask):
        sizes, sequences = [("group_size", record.group_size)], []
    elif isinstance(record, Rollout):
        sizes = [("group", len(record.completions))]
        sequences = [("the prompt", len(record.prompt_token_ids))]
        for i, completion in enumerate(record.completions):
            sequences.append((f"completion {i}", len(completion.token_ids)))
            if completion.prompt_token_ids is not None:
                sequences.append((f"completion {i}'s prompt", len(completion.prompt_token_ids)))
    else:
        return None
    for name, size in sizes:
        if size > bounds.max_group_size:
            return f"{name} of {size} completions is over max_group_size ({bounds.max_group_size})"
    for name, tokens in sequences:
        if tokens > bounds.max_sequence_tokens:
            return f"{name} has {tokens} tokens, over max_sequence_tokens ({bounds.max_sequence_tokens})"
    return None


async def decode_or_reject(
    consumer: StreamConsumer,
    retry: RedisRetry,
    delivery: Delivery,
    record_type: type[R],
    what: str,
    bounds: EntryBoundsSettings = _DEFAULT_BOUNDS,
) -> R | None:
    """The delivery's record; None once one that does not decode, or breaks one of ``bounds`` (its size in
    bytes, before decoding; then :func:`bound_problem`), was dead-lettered (the caller counts it)."""
    size = len(delivery.payload)
    if size > bounds.max_entry_bytes:
        problem = f"the entry has {size} bytes, over max_entry_bytes ({bounds.max_entry_bytes})"
        await reject(consumer, retry, delivery, EntryTooLarge(problem), what)
        return None
    try:
        record = decode(delivery.payload, record_type)
    except WireError as exc:
        await reject(consumer, retry, delivery, exc, what)
        return None
    if broken := bound_problem(record, bounds):
        await reject(consumer, retry, delivery, EntryTooLarge(broken), what)
        return None
    return record
