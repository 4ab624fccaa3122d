"""Environments for ``bench/multi_turn.py``, in TRL's ``environment_factory`` shape: a tool that answers after a
fixed latency, awaited on the event loop (``asyncio.sleep``), so what the bench measures is how well the
generator hides environment latency, not how fast a tool computes."""

from __future__ import annotations

import asyncio
import os

STEP_LATENCY_ENV = "BENCH_ENV_STEP_S"  # the env server's process reads its latency from here
DEFAULT_STEP_S = 0.05


class SleepEnv:
    """One tool, ``echo``, that answers after ``$BENCH_ENV_STEP_S`` seconds (50 ms by default); no reset
    observation, so every sample of a prompt shares its prompt ids, and no reward."""

    def __init__(self) -> None:
        self.step_s = float(os.environ.get(STEP_LATENCY_ENV, DEFAULT_STEP_S))

    def reset(self, **row) -> None:
        return None

    async def echo(self, text: str) -> str:
        """Repeat a text, slowly.

        Args:
            text: The text to repeat.
        """
        await asyncio.sleep(self.step_s)
        return text
