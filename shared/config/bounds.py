"""How large a stream entry a service reads: one definition of the bounds every reader checks at decode.

Whoever can write to a stream decides the size of what the next service reads: a prompt task asking for a
group of 100,000 completions, a completion of 10 million tokens, an entry of hundreds of megabytes. Each
reader (the generator on prompts, the scorer on rollouts, the learner on scored groups) checks its entries
against these bounds before it works on them (:func:`shared.intake.decode_or_reject`), and dead-letters one past
them with the bound it broke. The same settings, with the same defaults, in ``[generator]``, ``[scorer]`` and
``[learner]``.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class EntryBoundsSettings(BaseModel):
    """The bounds on what one stream entry may hold (see the module docstring)."""

    max_group_size: int = Field(
        1024, ge=1, description="Most completions in one group (a prompt task's group_size, a rollout's group)."
    )
    max_sequence_tokens: int = Field(
        131_072,
        ge=1,
        description="Most tokens in one completion or multi-turn trajectory (every token after the prompt), and "
        "in a prompt: at least the model's context length.",
    )
    max_entry_bytes: int = Field(
        128 * 1024 * 1024, ge=1024, description="Most bytes of one encoded stream entry (its record's payload)."
    )
