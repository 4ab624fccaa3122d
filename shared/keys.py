"""Names of every Redis key and stream the services share, under one prefix.

One place so that a reader can see the whole Redis layout at once, and so that two pipelines can share one
Redis by using different prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str = "grpo"

    # Streams (who writes -> who reads).
    @property
    def prompts(self) -> str:  # learner feeder -> generators (PromptTask)
        return f"{self.prefix}:prompts"

    @property
    def rollouts(self) -> str:  # generators -> scorers (Rollout)
        return f"{self.prefix}:rollouts"

    @property
    def scored(self) -> str:  # scorers -> learner (ScoredGroup)
        return f"{self.prefix}:scored"

    @property
    def evaluated(self) -> str:  # scorers -> learner: scored groups of held-out prompts (evaluation only)
        return f"{self.prefix}:evaluated"

    @property
    def dead_letter(self) -> str:  # any consumer -> operators: entries that could not be processed
        return f"{self.prefix}:dead"

    # Consumer groups.
    GENERATORS = "generators"
    SCORERS = "scorers"
    LEARNER = "learner"

    # Control keys.
    @property
    def registrations(self) -> str:  # list: registration key names in filing order (generators -> learner)
        return f"{self.prefix}:registrations"

    def registration(self, secret: str) -> str:  # string with a TTL: one replica's GeneratorRegistration
        # The name holds the replica's secret: whoever cannot read the index cannot name it (shared.registry).
        return f"{self.prefix}:registration:{secret}"

    @property
    def weights(self) -> str:  # string: the latest WeightVersionAnnouncement (learner writes)
        return f"{self.prefix}:weights:latest"

    @property
    def checkpoint(
        self,
    ) -> str:  # string: the latest CheckpointAnnouncement (late-joining generators read it)
        return f"{self.prefix}:checkpoint:latest"

    def gpu_lease(self, host: str, index: int) -> str:  # string with a TTL: which replica holds a GPU
        return f"{self.prefix}:gpu:{host}:{index}"

    def applied(self, stream: str, group: str, record_id: str) -> str:  # string with a TTL: already applied
        # Per stream and group: the same record id travels through every stream (a task's id is its group's).
        return f"{stream}:applied:{group}:{record_id}"

    @property
    def learner_state(self) -> str:  # hash: the learner's step, policy version, groups in flight
        return f"{self.prefix}:learner"
