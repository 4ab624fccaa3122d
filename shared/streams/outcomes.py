"""How a stream reader ends a delivery it will not commit: **rejected** or **released** (AMQP's names for the
same two outcomes).

- *Rejected*: the entry can never be processed (it does not decode, breaks a bound, the engine or a reward
  refuses it as input). It goes to the dead-letter stream at once with the reason and is never retried.
- *Released*: the work failed for a reason outside the entry (a reward service down, Redis, a bug). The entry
  stays pending and is delivered again, after ``claim_idle_ms`` or, ``at_once``, at the next claim; after
  ``max_deliveries`` it is dead-lettered with the last reason.

The line between the two is what keeps an infrastructure failure from ever becoming training data or a lost
entry: only the error types a reader names as the entry's own fault (``rejects``) dead-letter an entry;
everything else releases it. The generator's and the scorer's loops end their deliveries here; the dead-letter
write goes through :class:`shared.redis_conn.RedisRetry`, so a Redis blip does not lose the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.redaction import redacted_error
from shared.redis_conn import RedisRetry
from shared.streams.consumer import StreamConsumer
from shared.streams.entries import Delivery

Outcome = Literal["rejected", "released"]


def failure_reason(error: BaseException | str) -> str:
    """A release's reason as the dead-letter stream keeps it: ``"<ErrorType>: <message>"``, or the text given."""
    return error if isinstance(error, str) else f"{type(error).__name__}: {error}"


async def reject(
    consumer: StreamConsumer, retry: RedisRetry, delivery: Delivery, error: Exception | str, what: str
) -> None:
    """Move ``delivery`` to the dead-letter stream with ``error`` as its reason (redacted: an error may quote a
    URL's password); ``what`` names the entry in the retry's log."""
    reason = error if isinstance(error, str) else redacted_error(error)
    await retry.run(lambda: consumer.dead_letter(delivery, reason), f"dead-lettering {what}")


@dataclass(frozen=True)
class DeliveryOutcomes:
    """One reader's rejects and releases: its consumer, its Redis retry, what its entries are (``"a prompt"``)
    and which error types are an entry's own fault."""

    consumer: StreamConsumer
    retry: RedisRetry
    what: str
    rejects: tuple[type[Exception], ...] = ()

    async def reject(self, delivery: Delivery, error: Exception | str) -> None:
        """Dead-letter ``delivery`` now, with ``error`` as the reason; it is never retried."""
        await reject(self.consumer, self.retry, delivery, error, self.what)

    async def release(self, delivery: Delivery, error: BaseException | str, *, at_once: bool = False) -> None:
        """Give ``delivery`` back to be delivered again (:meth:`StreamConsumer.release`), ``error`` its reason."""
        await self.consumer.release(delivery, failure_reason(error), at_once=at_once)

    async def settle(self, delivery: Delivery, error: Exception) -> Outcome:
        """Reject ``delivery`` when ``error`` is one of :attr:`rejects`, else release it (never the reverse: a
        failure not known to be the entry's keeps the entry)."""
        if isinstance(error, self.rejects):
            await self.reject(delivery, error)
            return "rejected"
        await self.release(delivery, error)
        return "released"
