"""The whole configuration file as one model, checked across services.

``asyncgrpo run``, ``asyncgrpo config explain`` and every service started with a file load it through
:meth:`PipelineConfig.load`, so a setting one service needs from another (the generator's context window
against the learner's prompt and completion lengths, one GPU's memory split between vLLM and the learner)
is refused before anything starts, with the fields named.

Three levels of checks, each run only where it means something:

* each table's own validators and :meth:`PipelineConfig.cross_service_problems`: the file, everywhere;
* :meth:`ServiceSettings.start_problems`: the starting service's own environment (a token, a variable a
  plugin reads), in that service only (:func:`load_or_exit`);
* :meth:`PipelineConfig.launch_problems`: what ``asyncgrpo run`` adds by starting every process on one
  machine from the ``[launcher]`` table, which other deployments ignore (:func:`launch_or_exit`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from shared.allowed_hosts import HostAllowList
from shared.config.base import ConfigFileError, ServiceSettings, config_path, read_config_file
from shared.config.generator import GeneratorSettings
from shared.config.launcher import LauncherSettings, model_placeholder_problem
from shared.config.learner import LearnerSettings
from shared.config.scorer import ScorerSettings
from shared.gpu_placement import memory_share_error

SECTIONS: dict[str, type[ServiceSettings]] = {
    "generator": GeneratorSettings,
    "scorer": ScorerSettings,
    "learner": LearnerSettings,
}
LAUNCHER = "launcher"

T = TypeVar("T")


class PipelineError(ValueError):
    """The configuration is invalid; ``problems`` lists each one as ``section.field: what to change``."""

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
        loaded, problems = _load_sections(source)
        if problems:
            raise PipelineError(source, problems)
        pipeline = cls(**loaded)
        problems = pipeline.cross_service_problems()
        if problems:
            raise PipelineError(source, problems)
        return pipeline

    def cross_service_problems(self) -> list[str]:
        """Checks that span services, each naming the fields on both sides."""
        problems = cross_problems(self.generator, self.learner)
        if self.generator.environment is None and any(r.name == "env_reward" for r in self.scorer.rewards):
            problems.append(
                "scorer reward 'env_reward' reads the environment's get_reward(), but there is no [environment] "
                "table: add one (python = 'module:Class' or url = ...) or remove the reward"
            )
        return problems

    def algorithm_notes(self) -> list[str]:
        """Combinations across the scorer and the learner that no paper runs: shown, never refused."""
        return algorithm_notes(self.scorer, self.learner)

    def launch_problems(self) -> list[str]:
        """What ``asyncgrpo run`` checks on top: the processes it starts from ``[launcher]`` must be able to run."""
        learner, launcher = self.learner, self.launcher
        problems = [model_placeholder_problem(table, getattr(self, table).model) for table in ("generator", "learner")]
        if learner.min_generators > launcher.generators:
            problems.append(
                f"learner.min_generators ({learner.min_generators}) exceeds launcher.generators "
                f"({launcher.generators}): the learner would wait for generators that never start; "
                "raise launcher.generators or lower learner.min_generators"
            )
        if not HostAllowList(learner.allowed_generator_hosts).allows("http://127.0.0.1"):
            problems.append(
                "learner.allowed_generator_hosts leaves out 127.0.0.1, where asyncgrpo run's generators register: "
                "the learner would refuse every one of them; add 127.0.0.1 (or remove the setting)"
            )
        return [problem for problem in problems if problem]


def _load_sections(source: Path | None) -> tuple[dict[str, Any], list[str]]:
    """Each table resolved on its own, and every problem of every table."""
    document = read_config_file(source) if source else {}
    loaded, problems = _load_service_tables(source, SECTIONS)
    try:
        loaded[LAUNCHER] = LauncherSettings(**document.get(LAUNCHER, {}))
    except ValidationError as exc:
        problems.extend(describe(LAUNCHER, exc))
    return loaded, problems


def _load_service_tables(source: Path | None, names: Iterable[str]) -> tuple[dict[str, Any], list[str]]:
    """The service tables ``names``, each resolved as its service resolves it, and every problem of each. The
    scorer comes last: it takes the learner's :data:`LEARNER_FIGURES` (:func:`_load_scorer`)."""
    loaded: dict[str, Any] = {}
    problems: list[str] = []
    for name in sorted(names, key=lambda name: name == "scorer"):
        try:
            if name == "scorer":
                loaded[name], conflicts = _load_scorer(source, loaded.get("learner"))
                problems.extend(conflicts)
            else:
                loaded[name] = SECTIONS[name].load(source)
        except ValidationError as exc:
            problems.extend(describe(name, exc))
    return loaded, problems


# The learner's settings the scorer needs too: max_steps (the rewards' trainer_state.max_steps) and
# groups_per_step (the groups one batched reward call covers). Configurations and from-trl/from-verl output set
# them in [learner], and the scorer runs as a process of its own reading the same file: it takes them here.
LEARNER_FIGURES = ("max_steps", "groups_per_step")


def _load_scorer(source: Path | None, learner: LearnerSettings | None) -> tuple[ScorerSettings, list[str]]:
    """The scorer's settings with each of :data:`LEARNER_FIGURES` that the learner sets (in ``[learner]``,
    ``[common]`` or ``LEARNER_*``) and the scorer does not; and one problem per figure both set, to different
    values. ``learner`` None (not in this file, or invalid): the scorer's own settings."""
    scorer = ScorerSettings.load(source)
    if learner is None:
        return scorer, []
    taken: dict[str, int] = {}
    problems: list[str] = []
    for name in LEARNER_FIGURES:
        if name not in learner.model_fields_set:
            continue
        own, learners = getattr(scorer, name), getattr(learner, name)
        if own is None:
            taken[name] = learners
        elif own != learners:
            problems.append(
                f"scorer.{name} ({own}, from [scorer], [common] or SCORER_{name.upper()}) differs from "
                f"learner.{name} ({learners}): the scorer's {name} is the learner's, as reward functions see it; "
                f"set {name} once, in [learner] (the scorer takes it from there) or in [common], and remove the other"
            )
    return (ScorerSettings.load(source, **taken) if taken else scorer), problems


def describe(section: str, exc: ValidationError) -> list[str]:
    """One ``[section] field: message`` line per pydantic error, without pydantic's boilerplate."""
    out = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"])
        where = f"{section}.{field}" if field else f"[{section}]"
        out.append(f"{where}: {error['msg'].removeprefix('Value error, ')}")
    return out


def cross_problems(generator: GeneratorSettings | None, learner: LearnerSettings | None) -> list[str]:
    """The checks between the generator's and the learner's tables (None: that table is not configured)."""
    problems = [_colocated_memory_problem(generator, learner)]
    if generator is not None and learner is not None:
        problems += [_context_problem(generator, learner), _tool_response_problem(generator, learner)]
        problems.append(_min_length_problem(generator, learner))
    return [problem for problem in problems if problem]


def algorithm_notes(scorer: ScorerSettings, learner: LearnerSettings) -> list[str]:
    """The pairs that span the scorer's advantage and the learner's objective, where they disagree."""
    notes = []
    if scorer.algorithm and learner.algorithm and scorer.algorithm != learner.algorithm:
        notes.append(
            f"scorer.algorithm ({scorer.algorithm!r}) and learner.algorithm ({learner.algorithm!r}) differ: set "
            "algorithm once, at the top of the file"
        )
    if learner.loss_type == "dr_grpo" and scorer.scale_rewards != "none":
        notes.append(
            f"learner.loss_type = 'dr_grpo' with scorer.scale_rewards = {scorer.scale_rewards!r}: Dr. GRPO leaves "
            "advantages unscaled by the std (scale_rewards = 'none', or algorithm = 'dr_grpo')"
        )
    if learner.loss_type == "dapo" and learner.epsilon_high <= learner.epsilon_low:
        notes.append(
            f"learner.loss_type = 'dapo' with epsilon_high ({learner.epsilon_high}) <= epsilon_low "
            f"({learner.epsilon_low}): DAPO clips higher (0.28; algorithm = 'dapo')"
        )
    return notes


def _tool_response_problem(generator: GeneratorSettings, learner: LearnerSettings) -> str | None:
    environment = generator.environment
    if environment is None or environment.max_tool_response_tokens < learner.max_completion_length:
        return None
    return (
        f"environment.max_tool_response_tokens ({environment.max_tool_response_tokens}) is not below "
        f"learner.max_completion_length ({learner.max_completion_length}), which counts every token after the "
        "prompt (sampled turns, tool results, the template's tokens): one tool result would leave no room for "
        "the answer; lower max_tool_response_tokens or raise max_completion_length"
    )


def _min_length_problem(generator: GeneratorSettings, learner: LearnerSettings) -> str | None:
    if generator.environment is None or not learner.min_completion_length:
        return None
    return (
        f"learner.min_completion_length ({learner.min_completion_length}) beside an [environment]: it would hold "
        "every turn open past the model's own turn end (vLLM's min_tokens masks the stop tokens too); set it to 0"
    )


def _context_problem(generator: GeneratorSettings, learner: LearnerSettings) -> str | None:
    needed = learner.max_prompt_length + learner.max_completion_length
    if needed <= generator.max_model_len:
        return None
    return (
        f"generator.max_model_len ({generator.max_model_len}) is below learner.max_prompt_length "
        f"({learner.max_prompt_length}) + learner.max_completion_length ({learner.max_completion_length}) "
        f"= {needed}; raise generator.max_model_len or lower those"
    )


def _colocated_memory_problem(generator: GeneratorSettings | None, learner: LearnerSettings | None) -> str | None:
    """One GPU (generator.colocated): vLLM's share and the learner's must fit it. A learner share left at its
    default (the whole GPU), or no learner table, is reported as not set."""
    if generator is None or not generator.colocated:
        return None
    set_share = learner is not None and "gpu_memory_share" in learner.model_fields_set
    share = learner.gpu_memory_share if learner is not None and set_share else None
    return memory_share_error(generator.gpu_memory_utilization, share)


def load_service(path: str | Path | None, service: str) -> ServiceSettings:
    """A starting service's settings. With a configuration file, every service table it has is validated, and
    the checks across them (a bad learner table stops the generator too); a file may leave out the tables of
    services deployed elsewhere. Without a file, only the service's own settings (its environment) are read."""
    source = config_path(path)
    if source is None:
        settings = SECTIONS[service].load(None)
        if isinstance(settings, GeneratorSettings) and settings.colocated:
            raise PipelineError(None, [_COLOCATED_NEEDS_FILE])
        return settings
    document = read_config_file(source)
    if all(name in document for name in SECTIONS):
        return getattr(PipelineConfig.load(source), service)
    return _load_present_tables(source, document, service)


def _load_present_tables(source: Path, document: dict[str, Any], service: str) -> ServiceSettings:
    """A file with only some services' tables: those tables and the service's own, and the checks between them."""
    present = [name for name in SECTIONS if name in document or name == service]
    loaded, problems = _load_service_tables(source, present)
    if not problems:
        problems = cross_problems(loaded.get("generator"), loaded.get("learner"))
    if problems:
        raise PipelineError(source, problems)
    return loaded[service]


_COLOCATED_NEEDS_FILE = (
    "generator.colocated: one GPU's memory split (generator.gpu_memory_utilization + learner.gpu_memory_share "
    "<= 1) is checked against the learner's table; start with the configuration file (--config or "
    "$ASYNCGRPO_CONFIG)"
)


def load_or_exit(path: str | Path | None, service: str) -> ServiceSettings:
    """:func:`load_service` and the service's own :meth:`~ServiceSettings.start_problems`, or every problem
    on stderr and exit status 2 (no traceback)."""
    settings = _or_exit(service, lambda: load_service(path, service))
    _exit_on(service, settings.start_problems())
    return settings


def launch_or_exit(path: str | Path) -> PipelineConfig:
    """``asyncgrpo run``'s check, before it starts anything: the whole file and
    :meth:`PipelineConfig.launch_problems`, or every problem on stderr and exit status 2."""
    pipeline = _or_exit(LAUNCHER, lambda: PipelineConfig.load(path))
    _exit_on(LAUNCHER, pipeline.launch_problems())
    return pipeline


def _or_exit(process: str, load: Callable[[], T]) -> T:
    try:
        return load()
    except (ConfigFileError, PipelineError) as exc:
        _fail(process, [str(exc)])
    except ValidationError as exc:
        _fail(process, ["invalid configuration:\n  - " + "\n  - ".join(describe(process, exc))])


def _exit_on(process: str, problems: list[str]) -> None:
    if problems:
        _fail(process, problems)


def _fail(process: str, problems: list[str]) -> NoReturn:
    """Each problem on stderr after the process's name, and exit status 2."""
    print("\n".join(f"{process}: {problem}" for problem in problems), file=sys.stderr)
    raise SystemExit(2)
