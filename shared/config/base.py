"""Settings every service shares, and how one TOML file configures the whole pipeline.

Each service defines one subclass of :class:`ServiceSettings` with its own env prefix (``GENERATOR_``,
``SCORER_``, ``LEARNER_``) and TOML table. Values come from, highest first:

1. keyword arguments (tests, the launcher),
2. prefixed environment variables (``LEARNER_LR=1e-5``; nested fields with ``__``),
3. the shared unprefixed variables ``REDIS_URL``, ``STREAM_PREFIX``, ``LOG_LEVEL`` and ``API_TOKEN``,
4. the service's table in the TOML file named by ``ASYNCGRPO_CONFIG`` (or passed to :meth:`load`),
   plus any extra tables the class maps to fields (the learner reads ``[data]`` into ``data``),
5. the ``[common]`` table of that file,
6. defaults.
"""

from __future__ import annotations

import os
import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator
from pydantic.config import JsonDict
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from shared.redaction import redact

CONFIG_ENV = "ASYNCGRPO_CONFIG"
COMMON_TABLE = "common"
# Keys at the top of the file, outside any table, that every service having the field reads (under [common]).
TOP_LEVEL_KEYS = ("algorithm",)
# Unprefixed variables every service honours, so one `REDIS_URL=...` points the whole pipeline somewhere.
COMMON_ENV = {
    "redis_url": "REDIS_URL",
    "stream_prefix": "STREAM_PREFIX",
    "log_level": "LOG_LEVEL",
    "api_token": "API_TOKEN",
}

# A field whose default is computed (a host name, a secret) declares how the docs tables show it:
# ``Field(default_factory=..., json_schema_extra={DEFAULT_TEXT: "hostname-based"})``.
DEFAULT_TEXT = "default_text"
HOSTNAME_BASED: JsonDict = {DEFAULT_TEXT: "hostname-based"}

_config_path: ContextVar[Path | None] = ContextVar("asyncgrpo_config_path", default=None)

# Bearer tokens (API_TOKEN, a plugin's PLUGIN_TOKEN): at least this long, and never .env.example's placeholder.
# secrets.token_urlsafe(24) is 32 characters, 192 random bits; the launcher generates one of those.
MIN_TOKEN_CHARS = 32
PLACEHOLDER_PREFIX = "change-me"
TOKEN_HOWTO = 'generate one with: python -c "import secrets; print(secrets.token_urlsafe(32))"'

S = TypeVar("S", bound="ServiceSettings")


class ConfigFileError(ValueError):
    """The TOML configuration file is missing or malformed."""


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a TOML configuration file, with an error naming the file on failure."""
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigFileError(f"configuration file {path} does not exist (set {CONFIG_ENV} or --config)") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"configuration file {path} is not valid TOML: {exc}") from None


def config_path(path: str | Path | None = None) -> Path | None:
    """The configuration file: ``path``, else ``$ASYNCGRPO_CONFIG``, else None."""
    chosen = path or os.environ.get(CONFIG_ENV)
    return Path(chosen) if chosen else None


class _TomlTablesSource(PydanticBaseSettingsSource):
    """The service's TOML table over the ``[common]`` table (and extra tables mapped to fields)."""

    def __init__(self, settings_cls: type[ServiceSettings], path: Path | None) -> None:
        super().__init__(settings_cls)
        self._data: dict[str, Any] = {}
        if path is None:
            return
        document = read_config_file(path)
        fields = settings_cls.model_fields
        top = {k: document[k] for k in TOP_LEVEL_KEYS if k in document and k in fields}
        common = {**top, **{k: v for k, v in document.get(COMMON_TABLE, {}).items() if k in fields}}
        self._data = {**common, **document.get(settings_cls.toml_table, {})}
        for table, field_name in settings_cls.extra_toml_tables.items():
            if table in document:
                self._data[field_name] = document[table]

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._data)


class _CommonEnvSource(PydanticBaseSettingsSource):
    """``REDIS_URL``, ``STREAM_PREFIX`` and ``LOG_LEVEL`` without a service prefix."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        name = COMMON_ENV.get(field_name)
        return (os.environ.get(name) if name else None), field_name, False

    def __call__(self) -> dict[str, Any]:
        return {field: os.environ[var] for field, var in COMMON_ENV.items() if var in os.environ}


class ServiceSettings(BaseSettings):
    """Fields every service has. Subclasses set ``toml_table`` and an ``env_prefix``."""

    model_config = SettingsConfigDict(extra="forbid", validate_default=True, env_nested_delimiter="__")

    toml_table: ClassVar[str] = ""
    extra_toml_tables: ClassVar[dict[str, str]] = {}
    requires_api_token: ClassVar[bool] = False  # checked by start_problems (not to validate or explain a file)

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis to use: redis://[:password@]host:port/db, or rediss:// for TLS.",
    )
    stream_prefix: str = Field("grpo", min_length=1, description="Prefix of every Redis key this pipeline uses.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Logging level.")
    api_token: SecretStr = Field(
        SecretStr(""),
        description="Bearer token every control endpoint requires (and the learner sends to generators). "
        "Shared by all services through API_TOKEN.",
        json_schema_extra={DEFAULT_TEXT: "empty (required by the generator)"},
    )

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        scheme = urlsplit(value).scheme
        if scheme not in {"redis", "rediss", "unix"}:
            raise ValueError(f"redis_url must start with redis://, rediss:// or unix://, got {scheme or value!r}")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = config_path(_config_path.get())
        assert issubclass(settings_cls, ServiceSettings)
        return (
            init_settings,
            env_settings,
            _CommonEnvSource(settings_cls),
            _TomlTablesSource(settings_cls, path),
        )

    @classmethod
    def load(cls: type[S], config_file: str | Path | None = None, **overrides: Any) -> S:
        """Build settings from ``config_file`` (else ``$ASYNCGRPO_CONFIG``), the environment and overrides."""
        token = _config_path.set(Path(config_file) if config_file else None)
        try:
            return cls(**overrides)
        finally:
            _config_path.reset(token)

    def start_problems(self) -> list[str]:
        """What keeps this service from starting in this process's environment, one message each.

        Only the starting service runs these (from :func:`shared.config.pipeline.load_or_exit`): every
        service validates the whole file, and a check of the environment (a secret, a variable a plugin
        reads) would fail in another service's container for no reason."""
        token = self.api_token.get_secret_value()
        problems = []
        if not token and self.requires_api_token:
            problems.append(
                f"api_token is required: set API_TOKEN (control endpoints need a bearer token); {TOKEN_HOWTO}"
            )
        elif token and (problem := token_problem(token, "api_token (API_TOKEN)")):
            problems.append(problem)
        if is_placeholder(urlsplit(self.redis_url).password or ""):
            problems.append(
                "the Redis password in redis_url is the placeholder from .env.example: set REDIS_PASSWORD (letters "
                'and digits), e.g. python -c "import secrets; print(secrets.token_hex(24))"'
            )
        return problems

    def masked(self) -> dict[str, Any]:
        """The resolved settings as plain data, with passwords and tokens masked (safe to log)."""
        return _mask(self.model_dump(mode="json"), self)


def is_placeholder(secret: str) -> bool:
    """Whether ``secret`` is a ``change-me...`` placeholder (any case), as .env.example ships them."""
    return secret.strip().lower().startswith(PLACEHOLDER_PREFIX)


def token_problem(token: str, name: str) -> str | None:
    """Why the bearer token ``token`` (called ``name`` in the message) will not do, naming the fix; None when
    it will. The token itself is never quoted."""
    if is_placeholder(token):
        return f"{name} is still the placeholder 'change-me...' from .env.example; {TOKEN_HOWTO}"
    if len(token) < MIN_TOKEN_CHARS:
        return f"{name} has {len(token)} characters; a bearer token needs at least {MIN_TOKEN_CHARS}: {TOKEN_HOWTO}"
    return None


def mask_url(url: str) -> str:
    """``redis://:secret@host/0`` -> ``redis://:***@host/0``: :func:`shared.redaction.redact`, the one redaction."""
    return redact(url)


def _mask(data: Any, model: Any) -> Any:
    if isinstance(data, dict):
        out = {}
        for key, value in data.items():
            attribute = getattr(model, key, None) if model is not None else None
            if isinstance(attribute, SecretStr):
                out[key] = "***" if attribute.get_secret_value() else ""
            elif isinstance(value, str) and "://" in value:
                out[key] = mask_url(value)
            else:
                out[key] = _mask(value, attribute)
        return out
    if isinstance(data, list):
        items = model if isinstance(model, list | tuple) else [None] * len(data)
        return [_mask(v, m) for v, m in zip(data, items, strict=False)]
    return data
