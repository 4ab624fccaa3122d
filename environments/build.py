"""The environment the settings name: a Python class and/or tool functions in this process
(``environments/python_env.py``), or an environment server over HTTP (``environments/client.py``)."""

from __future__ import annotations

import httpx

from environments.client import HttpEnvironment
from environments.python_env import python_environment
from environments.session import Environment
from shared.config.environment import EnvironmentSettings


def build_environment(settings: EnvironmentSettings) -> Environment:
    """The :class:`~environments.session.Environment` of ``[environment]``; ValueError naming the fix when its
    class or functions cannot be loaded or described."""
    if settings.url is not None:
        return HttpEnvironment(
            settings.url,
            httpx.AsyncClient(),
            owns_client=True,
            timeout_s=settings.timeout_s,
            retries=settings.retries,
            backoff_s=settings.backoff_s,
            concurrency=settings.concurrency,
            breaker_failures=settings.breaker_failures,
            breaker_reset_s=settings.breaker_reset_s,
            headers=settings.request_headers(),
        )
    return python_environment(
        settings.python,
        settings.tools,
        name=settings.label,
        concurrency=settings.concurrency,
        timeout_s=settings.timeout_s,
        breaker_failures=settings.breaker_failures,
        breaker_reset_s=settings.breaker_reset_s,
    )
