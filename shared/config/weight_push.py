"""The learner's weight-push settings: where generators reach its store, which of them it trusts with its token,
and the sizes and time limits of a push (``[learner]``, ``LEARNER_*``; the push itself is :mod:`weight_sync`).

A group of its own because it is one concern, read together by the learner's publisher
(:mod:`services.learner.weight_publisher`); :class:`~shared.config.learner.LearnerSettings` inherits it, so the
keys stay flat in ``[learner]``.
"""

from __future__ import annotations

import socket

from pydantic import BaseModel, Field, field_validator

from shared.allowed_hosts import LOOPBACK, HostAllowList
from shared.config.base import DEFAULT_TEXT, HOSTNAME_BASED


class WeightPushSettings(BaseModel):
    """The learner's store, the generators it pushes to, and each push's buckets and timeouts."""

    weight_sync_host: str = Field(
        default_factory=socket.gethostname,
        description="Address generators reach the learner's store at.",
        json_schema_extra=HOSTNAME_BASED,
    )
    weight_sync_port: int = Field(29500, ge=0, le=65535, description="Port of the learner's store (0: free).")
    weight_sync_bind: str = Field(
        "",
        description="Address the learner's store listens on; empty: weight_sync_host's (the interface generators "
        "reach). '0.0.0.0' listens on every interface.",
    )
    allowed_generator_hosts: list[str] = Field(
        default_factory=lambda: list(LOOPBACK),
        description="Generator URLs the learner sends its API token to: IP addresses, networks (CIDR) and host "
        "names; a generator registered at another host is refused and never contacted.",
        json_schema_extra={DEFAULT_TEXT: "127.0.0.1, ::1, localhost"},
    )
    weight_bucket_mb: int = Field(256, ge=1, description="Size of a weight-push bucket.")
    weight_push_timeout_s: float = Field(300.0, gt=0, description="Longest one weight push may take.")
    weight_join_timeout_s: float = Field(
        30.0, gt=0, description="Longest to wait for every generator to join a push's group."
    )
    weight_shm_dir: str = Field(
        "/dev/shm",
        description="CPU learner: shared-memory directory to push weights through to CPU generators that share "
        "it (same host and user; the others get gloo). Empty: gloo only.",
    )
    min_generators: int = Field(1, ge=0, description="Wait for this many live generators before training.")

    @field_validator("allowed_generator_hosts")
    @classmethod
    def _host_entries(cls, value: list[str]) -> list[str]:
        HostAllowList(value)  # each entry an address, a network or a name (the error names the entry)
        return value
