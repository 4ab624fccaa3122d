"""The settings every service that reads a Redis stream has, declared once: when a silent consumer's entries
are taken over, and how many deliveries an entry gets before it is dead-lettered.

The generator (prompts), the scorer (rollouts) and the learner (scored groups) inherit them, so
``GENERATOR_CLAIM_IDLE_MS``, ``[learner] max_deliveries`` and the rest keep their names; a service declares a
field again only where its number really differs, and says why in its ``OVERRIDES`` (the architecture test
refuses a field declared twice without it).

A live consumer refreshes its in-flight entries every third of ``claim_idle_ms``
(:meth:`shared.streams.StreamConsumer.run_keepalive`), however long it holds them; so ``claim_idle_ms`` is not
how long work may take, but how long a consumer may go without a keepalive before its entries are another's:
the trade between a dead consumer's work waiting and a stalled live one's work being done twice.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, Field


class StreamConsumerSettings(BaseModel):
    """Claiming and dead-lettering of a service's stream consumer (:mod:`shared.streams.consumer`)."""

    # Field -> why a subclass declares it again with another default (read by tests/unit/test_architecture.py).
    OVERRIDES: ClassVar[dict[str, str]] = {}

    claim_idle_ms: int = Field(
        30_000,
        ge=100,
        description="Entries pending this long without a keepalive (their consumer died or stalled) are taken "
        "over by another consumer of the group.",
    )
    max_deliveries: int = Field(
        3, ge=1, description="Deliveries of an entry (a consumer's restart re-reads count) before it is dead-lettered."
    )
