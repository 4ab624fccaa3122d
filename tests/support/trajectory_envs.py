"""Environments for the trajectory runner's tests (tests/unit/test_trajectory.py), in TRL's
``environment_factory`` shape: ``reset(**row)``, public methods as tools, an optional ``get_reward``."""

from __future__ import annotations

import itertools
import time

_resets = itertools.count()


class AdderEnv:
    """Adds numbers; each reset says which try it is, so every sample of a prompt gets its own prompt."""

    def reset(self, **row) -> str:
        self.calls = 0
        return f" (try {next(_resets)})"

    def add(self, a: int, b: int) -> str:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return str(a + b)

    def echo(self, text: str) -> str:
        """Repeat a text.

        Args:
            text: The text to repeat.
        """
        self.calls += 1
        return text

    def fail(self, why: str) -> str:
        """Raise an error.

        Args:
            why: The error's message.
        """
        raise ValueError(why)

    def get_reward(self) -> float:
        return float(self.calls)


class StuckEnv:
    """A tool that never answers in time (the runner's environment fault)."""

    def reset(self, **row) -> None:
        return None

    def wait(self, seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "woke"
