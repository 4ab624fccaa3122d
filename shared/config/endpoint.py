"""The fields and checks an HTTP endpoint's settings share: an HTTP reward plugin (``[[scorer.rewards]]``,
:class:`~shared.config.scorer.RewardSpec`) and an environment server (``[environment]``,
:class:`~shared.config.environment.EnvironmentSettings`) are called with the same retries, backoff, breaker and
auth. The same ``timeout_s`` and ``concurrency`` also bound in-process Python code (a reward function, an
environment's methods), which runs in worker threads (:mod:`shared.threads`).

The fields are annotated types (``retries: Retries = 2``) rather than a base class, so each model keeps its own
field order (the README's settings tables follow it) and its own defaults.
"""

from __future__ import annotations

import os
from typing import Annotated

from pydantic import Field, SecretStr

TimeoutS = Annotated[
    float,
    Field(
        gt=0,
        description="HTTP: seconds per attempt (then retried). Python: seconds per call, after which the call is "
        "abandoned as an outage (its thread runs on until the function returns).",
    ),
]
Retries = Annotated[
    int, Field(ge=0, description="HTTP: retries within a call after a transport error, timeout, 5xx, 408 or 429.")
]
BackoffS = Annotated[float, Field(ge=0, description="HTTP: first retry delay (doubles each time).")]
Concurrency = Annotated[
    int,
    Field(
        ge=1,
        description="HTTP: requests in flight at once. Python: worker threads for sync calls (a reward function; "
        "an environment's reset, tools and get_reward).",
    ),
]
BreakerFailures = Annotated[
    int,
    Field(
        ge=1,
        description="Consecutive failures (a reward's failed calls, an environment's faults) that open the breaker.",
    ),
]
BreakerResetS = Annotated[
    float, Field(gt=0, description="Seconds the breaker stays open before one trial is let through.")
]
Headers = Annotated[
    dict[str, SecretStr],
    Field(description="HTTP: headers sent with every request (values masked in logs)."),  # default: each field's
]
BearerToken = Annotated[
    SecretStr | None, Field(description="HTTP: sent as 'Authorization: Bearer <token>' (masked in logs).")
]
BearerTokenEnv = Annotated[
    str | None, Field(description="HTTP: environment variable holding the bearer token (read at start).")
]


def auth_problem(
    url: str | None,
    headers: dict[str, SecretStr],
    bearer_token: SecretStr | None,
    bearer_token_env: str | None,
    *,
    owner: str,
    server: str,
) -> str | None:
    """What is wrong with an endpoint's auth fields, or None. ``owner`` starts the message ("reward 'judge'");
    ``server`` says what headers are for ("HTTP plugins")."""
    if url is None and (headers or bearer_token or bearer_token_env):
        return f"{owner}: headers and bearer tokens are for {server} (set url)"
    if bearer_token is not None and bearer_token_env:
        return f"{owner}: set bearer_token or bearer_token_env, not both"
    has_token = bearer_token is not None or bearer_token_env
    if has_token and any(key.lower() == "authorization" for key in headers):
        return f"{owner}: an Authorization header and a bearer token; keep one"
    return None


def token_env_problems(bearer_token_env: str | None, *, owner: str, service: str) -> list[str]:
    """A start check of the service's own environment: the variable ``bearer_token_env`` names must be set."""
    if bearer_token_env and not os.environ.get(bearer_token_env):
        return [
            f"{owner}: bearer_token_env names {bearer_token_env!r}, which is not set (or empty) in the "
            f"{service}'s environment"
        ]
    return []


def request_headers(
    headers: dict[str, SecretStr], bearer_token: SecretStr | None, bearer_token_env: str | None
) -> dict[str, str]:
    """The headers to send, secrets revealed (never log the result): ``headers`` plus the bearer token, inline
    or read from the variable ``bearer_token_env`` (an empty or unset one sends none)."""
    revealed = {key: value.get_secret_value() for key, value in headers.items()}
    token = bearer_token.get_secret_value() if bearer_token is not None else None
    if bearer_token_env:
        token = os.environ.get(bearer_token_env) or None
    if token:
        revealed["Authorization"] = f"Bearer {token}"
    return revealed
