"""The settings every service with an HTTP server has, declared once: the bind address, the body limit, the docs.

The generator, the scorer and the learner inherit them, so ``GENERATOR_HOST``, ``[scorer] api_docs`` and the
rest keep their names; a service re-declares a field only where its number really differs, and says why in
its ``OVERRIDES`` (the architecture test refuses a field declared twice without it).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, Field


class HttpServerSettings(BaseModel):
    """Bind, limits and docs of a service's HTTP server (``/health``, ``/ready``, ``/metrics``, control)."""

    # Field -> why a subclass declares it again with another default (read by tests/unit/test_architecture.py).
    OVERRIDES: ClassVar[dict[str, str]] = {}

    host: str = Field("0.0.0.0", description="Address the HTTP server binds.")
    port: int = Field(0, ge=0, le=65535, description="HTTP port (0 picks a free one).")
    max_request_bytes: int = Field(
        64 << 10,
        ge=1024,
        description="Largest HTTP request body taken (413 past it). The scorer's and the learner's endpoints "
        "take no body (their one POST, /shutdown, has none): 64 KiB is ample, and bounds what a client can make "
        "them read.",
    )
    api_docs: bool = Field(
        False, description="Serve /docs, /redoc and /openapi.json (behind the API token, like every non-probe path)."
    )
