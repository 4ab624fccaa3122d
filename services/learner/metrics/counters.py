"""The run's counts of groups and weight pushes: what became of every admitted group, and of every push.

Checkpointed with the learner's state (so a resumed run goes on counting) and written with every step's
metrics as ``counters/<name>``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

DropReason = Literal["already_trained", "zero_std_dropped", "from_lost_versions", "stale_dropped"]


@dataclasses.dataclass
class Counters:
    """The run's counts of groups and weight pushes: checkpointed with the learner's state and written with
    every step's metrics as ``counters/<name>``. Changed only through the methods below."""

    groups_admitted: int = 0
    groups_trained: int = 0
    groups_stale_dropped: int = 0
    groups_zero_std_dropped: int = 0
    groups_from_lost_versions: int = 0
    groups_already_trained: int = 0
    groups_rejected: int = 0
    groups_nonfinite: int = 0  # groups of a batch none of whose optimizer steps was applied (not finite)
    weight_pushes: int = 0
    weight_push_failures: int = 0
    input_tokens_seen: int = 0  # prompt + completion tokens of every trained completion (TRL's num_tokens)
    nonfinite_steps: int = 0  # optimizer steps not applied: their loss or gradient norm was not finite

    @classmethod
    def restore(cls, saved: Mapping[str, float]) -> Counters:
        """The counters a checkpoint saved (names this version does not know are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{name: int(value) for name, value in saved.items() if name in names})

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def figures(self) -> dict[str, float]:
        """The counts as a step record writes them: ``counters/<name>``, and ``train/nonfinite_steps``."""
        counts = self.as_dict()
        nonfinite = counts.pop("nonfinite_steps")
        return {**{f"counters/{name}": float(n) for name, n in counts.items()}, "train/nonfinite_steps": nonfinite}

    def skipped_steps(self, steps: int, groups: int) -> None:
        """``steps`` optimizer steps not applied; ``groups``: the batch's, when none of its steps was."""
        self.nonfinite_steps += steps
        self.groups_nonfinite += groups

    def admitted(self, groups: int) -> None:
        self.groups_admitted += groups

    def trained(self, groups: int) -> None:
        self.groups_trained += groups

    def tokens_seen(self, tokens: float) -> int:
        self.input_tokens_seen += int(tokens)
        return self.input_tokens_seen

    def rejected(self) -> None:
        self.groups_rejected += 1

    def dropped(self, reason: DropReason) -> None:
        match reason:
            case "already_trained":
                self.groups_already_trained += 1
            case "zero_std_dropped":
                self.groups_zero_std_dropped += 1
            case "from_lost_versions":
                self.groups_from_lost_versions += 1
            case "stale_dropped":
                self.groups_stale_dropped += 1

    def pushed(self, *, ok: bool) -> None:
        if ok:
            self.weight_pushes += 1
        else:
            self.weight_push_failures += 1

    def fates(self) -> dict[str, int]:
        """The admitted groups by what became of them: {"trained": 8, "stale_dropped": 1992, ...}, every fate."""
        return {
            name.removeprefix("groups_"): n
            for name, n in self.as_dict().items()
            if name.startswith("groups_") and name != "groups_admitted"
        }

    def group_fates(self) -> str:
        """What became of the admitted groups: "2000 admitted: 8 trained, 1992 stale_dropped"."""
        fates = self.fates()
        trained = fates.pop("trained")
        shown = [f"{trained} trained"] + [f"{n} {name}" for name, n in fates.items() if n]
        return f"{self.groups_admitted} admitted: {', '.join(shown)}"
