"""Reading a delivery into its record, or rejecting it to the dead-letter stream with the reason.

A record that can never be processed (undecodable, invalid, a prompt too long) is not retried: it goes to
the dead-letter stream at once, through :class:`shared.redis_conn.RedisRetry` so a Redis blip does not
lose it. Every stream reader (generator, scorer, learner) does this the same way; the reason reads
``"<ErrorType>: <message>"``.
"""

from __future__ import annotations

from typing import TypeVar

from shared.codec import WireError, decode
from shared.records import WireModel
from shared.redaction import redacted_error
from shared.redis_conn import RedisRetry
from shared.streams import Delivery, StreamConsumer

R = TypeVar("R", bound=WireModel)


async def reject(consumer: StreamConsumer, retry: RedisRetry, delivery: Delivery, error: Exception, what: str) -> None:
    """Move ``delivery`` to the dead-letter stream with ``error`` as its reason (``what``: for the logs)."""
    reason = redacted_error(error)
    await retry.run(lambda: consumer.dead_letter(delivery, reason), f"dead-lettering {what}")


async def decode_or_reject(
    consumer: StreamConsumer, retry: RedisRetry, delivery: Delivery, record_type: type[R], what: str
) -> R | None:
    """The delivery's record; None once an undecodable one was dead-lettered (the caller counts it)."""
    try:
        return decode(delivery.payload, record_type)
    except WireError as exc:
        await reject(consumer, retry, delivery, exc, what)
        return None
