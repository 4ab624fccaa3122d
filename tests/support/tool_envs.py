"""Environments for the tests, in TRL's documented shapes (written by us): an ``environment_factory`` class
(``IncrementEnv``, as in TRL's docs: ``reset``, a tool method, ``get_reward``) and plain tool functions.

Module-level counters and events let a test see what ran, and in which instance."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from typing import Any

calls: Counter = Counter()  # what ran, by name
release = threading.Event()  # ends every hang (set by the test when it is over)


class IncrementEnv:
    """A counter per trajectory. ``reset`` returns an observation when the row asks for one (``greet``)."""

    instances = 0

    def __init__(self) -> None:
        type(self).instances += 1
        self.serial = type(self).instances
        self.counter = 0

    def reset(self, **kwargs: Any) -> str | None:
        calls["reset"] += 1
        self.counter = int(kwargs.get("start", 0))
        return f"The counter starts at {self.counter}." if kwargs.get("greet") else None

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        calls["increment"] += 1
        self.counter += step
        return self.counter

    async def double(self) -> str:
        """
        Double the counter (an async tool).

        Returns:
            The doubled counter value, as text.
        """
        await asyncio.sleep(0)
        self.counter *= 2
        return str(self.counter)

    def divide(self, by: int) -> float:
        """
        Divide the counter (raises on zero: a tool error the model reads).

        Args:
            by: The divisor.
        """
        self.counter = self.counter / by
        return self.counter

    def hang(self, seconds: float) -> str:
        """
        Block the thread (until the test releases it, at most `seconds`).

        Args:
            seconds: The longest wait.
        """
        release.wait(seconds)
        return "woke"

    def whoami(self) -> int:
        """
        Which instance serves this trajectory.

        Returns:
            The instance's serial number.
        """
        return self.serial

    def get_reward(self) -> float:
        return float(self.counter)


class AsyncRewardEnv:
    """``get_reward`` is a coroutine; ``reset`` returns an observation."""

    def reset(self, **kwargs: Any) -> str:
        self.prompt = kwargs["prompt"]
        return "Ready."

    def echo(self, text: str) -> str:
        """
        Echo the text back.

        Args:
            text: What to echo.
        """
        return text

    async def get_reward(self) -> float | None:
        await asyncio.sleep(0)
        return 0.5


class BrokenResetEnv:
    def reset(self, **kwargs: Any) -> None:
        raise RuntimeError("the sandbox did not start")

    def noop(self) -> str:
        """
        Do nothing.
        """
        return ""


class BadRewardEnv(IncrementEnv):
    def get_reward(self) -> float:
        return float("nan")


def add(a: int, b: int) -> int:
    """
    Add two integers (a plain sync tool function).

    Args:
        a: The first.
        b: The second.
    """
    calls["add"] += 1
    return a + b


async def slow_upper(text: str, seconds: float = 0.0) -> str:
    """
    Upper-case the text after a pause (a plain async tool function).

    Args:
        text: What to upper-case.
        seconds: How long to wait first.
    """
    await asyncio.sleep(seconds)
    return text.upper()


def sleepy(seconds: float) -> str:
    """
    Sleep in the thread, then answer.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "slept"
