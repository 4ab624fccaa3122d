"""The whole configuration file as one model, checked across services.

``asyncgrpo run``, ``asyncgrpo config explain`` and every service at start load the file through
:meth:`PipelineConfig.load`, so a setting one service needs from another (the generator's context window
against the learner's prompt and completion lengths, one GPU's memory split between vLLM and the learner)
is refused before anything starts, with the fields named.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from shared.config.base import CONFIG_ENV, ConfigFileError, ServiceSettings, read_config_file
from shared.config.generator import GeneratorSettings
from shared.config.launcher import LauncherSettings
from shared.config.learner import LearnerSettings
from shared.config.scorer import ScorerSettings

SECTIONS: dict[str, type[ServiceSettings]] = {
    "generator": GeneratorSettings,
    "scorer": ScorerSettings,
    "learner": LearnerSettings,
}


class PipelineError(ValueError):
    """The configuration is invalid; ``problems`` lists each one as ``[table] field: what to change``."""

    def __init__(self, source: Path | None, problems: list[str]) -> None:
        where = str(source) if source else "the configuration"
        super().__init__(f"{where} is not a valid configuration:\n  - " + "\n  - ".join(problems))
        self.problems = problems


class PipelineConfig(BaseModel):
    """Every table of one configuration file, each resolved as its service resolves it (environment first)."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    generator: GeneratorSettings
    scorer: ScorerSettings
    learner: LearnerSettings
    launcher: LauncherSettings

    @classmethod
    def load(cls, path: str | Path | None = None) -> PipelineConfig:
        """The file at ``path`` (else ``$ASYNCGRPO_CONFIG``; none: defaults and the environment only).
        Raises :class:`PipelineError` naming every problem, or :class:`ConfigFileError` for the file itself."""
        source = config_path(path)
        document = read_config_file(source) if source else {}
        problems: list[str] = []
        loaded: dict[str, Any] = {}
        for name, settings_cls in SECTIONS.items():
            try:
                loaded[name] = settings_cls.load(source)
            except ValidationError as exc:
                problems.extend(describe(name, exc))
        try:
            loaded["launcher"] = LauncherSettings(**document.get("launcher", {}))
        except ValidationError as exc:
            problems.extend(describe("launcher", exc))
        if problems:
            raise PipelineError(source, problems)
        pipeline = cls(**loaded)
        problems = pipeline.cross_service_problems()
        if problems:
            raise PipelineError(source, problems)
        return pipeline

    def cross_service_problems(self) -> list[str]:
        """Checks that span services, each naming the fields on both sides."""
        problems = []
        learner, generator = self.learner, self.generator
        needed = learner.max_prompt_length + learner.max_completion_length
        if needed > generator.max_model_len:
            problems.append(
                f"generator.max_model_len ({generator.max_model_len}) is below learner.max_prompt_length "
                f"({learner.max_prompt_length}) + learner.max_completion_length ({learner.max_completion_length}) "
                f"= {needed}; raise generator.max_model_len or lower those"
            )
        return problems


def describe(section: str, exc: ValidationError) -> list[str]:
    """One ``[section] field: message`` line per pydantic error, without pydantic's boilerplate."""
    out = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"])
        where = f"{section}.{field}" if field else f"[{section}]"
        out.append(f"{where}: {error['msg'].removeprefix('Value error, ')}")
    return out


def config_path(path: str | Path | None) -> Path | None:
    """The configuration file: ``path``, else ``$ASYNCGRPO_CONFIG``, else None."""
    chosen = path or os.environ.get(CONFIG_ENV)
    return Path(chosen) if chosen else None


def load_service(path: str | Path | None, service: str) -> ServiceSettings:
    """A starting service's settings. With a configuration file, the whole file is validated across services
    first (a bad learner table stops the generator too); without one, only the service's own settings (its
    environment) are read."""
    source = config_path(path)
    if source is None:
        return SECTIONS[service].load(None)
    return getattr(PipelineConfig.load(source), service)


def load_or_exit(path: str | Path | None, service: str) -> ServiceSettings:
    """:func:`load_service`, or the problems on stderr and exit status 2 (no traceback)."""
    try:
        return load_service(path, service)
    except (ConfigFileError, PipelineError) as exc:
        print(f"{service}: {exc}", file=sys.stderr)
    except ValidationError as exc:
        print(f"{service}: invalid configuration:\n  - " + "\n  - ".join(describe(service, exc)), file=sys.stderr)
    raise SystemExit(2)
