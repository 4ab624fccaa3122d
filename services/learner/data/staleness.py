"""Staleness: how many policy versions old a rollout is, and the rule that drops a group as too old.

A group sampled by policy version v is ``staleness = current - v`` versions old when the learner is at
``current``; it is trained while that is at most ``max_staleness`` (so the oldest trainable version is
:func:`min_fresh_version`) and dropped, and counted, otherwise. Admission control
(:mod:`services.learner.data.admission`) keeps few groups from ever getting that old.
"""

from __future__ import annotations


def staleness(current_version: int, rollout_version: int) -> int:
    """How many policy versions old a rollout is: current_version - rollout_version (never negative)."""
    if rollout_version > current_version:
        raise ValueError(f"rollout version {rollout_version} is newer than the learner's {current_version}")
    return current_version - rollout_version


def min_fresh_version(current_version: int, max_staleness: int) -> int:
    """The oldest policy version still trainable: groups sampled before it are dropped."""
    return current_version - max_staleness


def is_stale(current_version: int, rollout_version: int, max_staleness: int) -> bool:
    """True when a group is older than ``max_staleness`` versions and must be dropped (and counted)."""
    return staleness(current_version, rollout_version) > max_staleness
