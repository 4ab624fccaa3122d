"""Environment settings: ``[environment]`` (what the generator's trajectories talk to) and ``[env_server]`` (the
process ``python -m services.env_server`` serving a Python environment over HTTP).

An environment is one of three kinds (docs/concepts/multi-turn-design.md §2.3, §2.12):

- ``python = "mod:Class"``: a TRL ``environment_factory`` class run in the generator's process (``tools`` may add
  plain tool functions to its methods);
- ``tools = ["mod:fn", ...]`` alone: TRL's plain tool functions, no class;
- ``url = "http(s)://..."``: a server speaking ``asyncgrpo.env/v1`` (``environments/protocol.py``), called with
  the same retries, backoff, breaker and auth fields as an HTTP reward plugin (``shared/config/scorer.py``).
"""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from shared.config import endpoint
from shared.config.base import TOKEN_HOWTO, token_problem

ENV_SERVER_TOKEN_ENV = "ENV_SERVER_API_TOKEN"


def _import_path(value: str, what: str) -> str:
    module, _, attribute = value.partition(":")
    if not module or not attribute:
        raise ValueError(f"{what} is named 'module:name' (e.g. 'my_env:MyEnv'), got {value!r}")
    return value


class EnvironmentSettings(BaseModel):
    """``[environment]``: the environment of multi-turn tool use and the per-trajectory limits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    python: str | None = Field(
        None, description="A TRL environment_factory class, 'module:Class' (reset(**row), tool methods, get_reward)."
    )
    url: str | None = Field(None, description="An environment server's base URL (protocol asyncgrpo.env/v1).")
    tools: list[str] = Field(
        default_factory=list, description="Plain TRL tool functions, 'module:function' each (alone, or with python)."
    )
    max_turns: int = Field(
        8, ge=1, description="Assistant turns per trajectory at most (TRL's max_tool_calling_iterations)."
    )
    max_tool_response_tokens: int = Field(
        256, ge=1, description="A tool result's content is cut to this many tokens (before templating)."
    )
    tool_parser: str = Field(
        "hermes", min_length=1, description="How tool calls are parsed: a vLLM parser name, or 'transformers'."
    )
    chat_template: str = Field("", description="Path of a prefix-preserving chat template; '' keeps the tokenizer's.")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments of apply_chat_template (e.g. enable_thinking)."
    )
    timeout_s: endpoint.TimeoutS = 30.0
    retries: endpoint.Retries = 2
    backoff_s: endpoint.BackoffS = 0.2
    concurrency: endpoint.Concurrency = 16
    breaker_failures: endpoint.BreakerFailures = 5
    breaker_reset_s: endpoint.BreakerResetS = 30.0
    headers: endpoint.Headers = Field(default_factory=dict)
    bearer_token: endpoint.BearerToken = None
    bearer_token_env: endpoint.BearerTokenEnv = None

    @field_validator("python")
    @classmethod
    def _python_path(cls, value: str | None) -> str | None:
        return value if value is None else _import_path(value, "[environment] python")

    @field_validator("tools")
    @classmethod
    def _tool_paths(cls, values: list[str]) -> list[str]:
        for value in values:
            _import_path(value, "each of [environment] tools")
        repeated = sorted({value for value in values if values.count(value) > 1})
        if repeated:
            raise ValueError(f"[environment] tools repeats {', '.join(repeated)}; name each function once")
        return values

    @model_validator(mode="after")
    def _one_kind(self) -> EnvironmentSettings:
        if self.url is not None and (self.python or self.tools):
            raise ValueError(
                "[environment]: set url (an environment server) or python/tools (in-process), not both; to serve a "
                "Python environment over HTTP run python -m services.env_server --environment mod:Class"
            )
        if self.url is None and not self.python and not self.tools:
            raise ValueError(
                "[environment] names no environment: set python = 'module:Class', tools = ['module:function', ...] "
                "or url = 'http://host:port'"
            )
        if self.url is not None and urlsplit(self.url).scheme not in ("http", "https"):
            raise ValueError(f"[environment] url {self.url!r} must start with http:// or https://")
        self._check_auth()
        return self

    def _check_auth(self) -> None:
        problem = endpoint.auth_problem(
            self.url,
            self.headers,
            self.bearer_token,
            self.bearer_token_env,
            owner="[environment]",
            server="an environment server",
        )
        if problem is not None:
            raise ValueError(problem)

    @property
    def kind(self) -> Literal["python", "tools", "http"]:
        return "http" if self.url else "python" if self.python else "tools"

    @property
    def label(self) -> str:
        """What logs call the environment: the URL, 'mod:Class' or 'tools mod:fn,...'."""
        if self.url:
            return self.url
        return self.python or f"tools {','.join(self.tools)}"

    def start_problems(self) -> list[str]:
        """Checks of the generator's own environment, run when it starts."""
        return endpoint.token_env_problems(self.bearer_token_env, owner="[environment]", service="generator")

    def request_headers(self) -> dict[str, str]:
        """The headers to send to the environment server, secrets revealed (never log the result)."""
        return endpoint.request_headers(self.headers, self.bearer_token, self.bearer_token_env)


class EnvServerSettings(BaseModel):
    """``[env_server]``: the environment server process (``python -m services.env_server``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="Address to bind; 0.0.0.0 in a container the generator reaches.")
    port: int = Field(8010, ge=0, le=65535, description="HTTP port (0: any free one).")
    session_idle_ttl_s: float = Field(
        600.0,
        gt=0,
        description="A session with no request for this long is closed (what a SIGKILLed generator left open).",
    )
    api_token: SecretStr | None = Field(
        None, description=f"Bearer token every path but /health needs (${ENV_SERVER_TOKEN_ENV}; at least 32 chars)."
    )
    max_request_bytes: int = Field(
        4 << 20, ge=1024, description="Largest request body taken (413 past it): a dataset row or one turn's calls."
    )
    max_sessions: int = Field(
        1024,
        ge=1,
        description="Most sessions open at once: a create past it gets 429 (counted), so the server's memory is "
        "bounded whoever holds the token; at least the generators' prompts in flight times the group size.",
    )

    def start_problems(self) -> list[str]:
        """Why the server will not start (no token, a weak one), each naming the fix."""
        token = self.api_token.get_secret_value() if self.api_token is not None else ""
        if not token:
            return [f"${ENV_SERVER_TOKEN_ENV} is not set: the environment server needs a bearer token; {TOKEN_HOWTO}"]
        problem = token_problem(token, f"${ENV_SERVER_TOKEN_ENV}")
        return [problem] if problem else []
