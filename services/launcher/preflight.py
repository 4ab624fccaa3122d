"""The start-up check of ``asyncgrpo run`` and ``asyncgrpo config explain``: what would stop a service at its
start, found before Redis, the model or any process is started.

A configuration that loads can still fail seconds into a run, after vLLM has loaded the model:

* a Python reward function, environment class or tool that does not import (a misspelled name is answered
  with the closest names its module has: :mod:`shared.reward_imports`, the scorer's own check);
* a Python reward function with a parameter (no default) that is not a column of the dataset's rows: the
  first rows are read by the learner's reader and prepared by its rules (``rename_columns``,
  ``answer_column``, the prompt column taken out), and a missing column is reported with the scorer's message
  (:func:`~shared.reward_columns.missing_columns_message`);
* a Python reward function without ``**kwargs`` that cannot take every keyword the scorer passes it (the first
  rows' columns, ``max_completion_length``, ...): every call would fail, so it is reported with the scorer's
  message (:func:`~shared.reward_columns.unaccepted_keywords_message`).

Modules and data files are looked up as the services look them up (:mod:`shared.config.locations`): beside
the configuration file, in the working directory, then (modules) on ``sys.path``. Only the first ``FIRST_ROWS``
rows are read (:func:`~shared.dataset.sources.read_source` with a limit), and only when a reward needs a
column or has no ``**kwargs``, so a run of built-in rewards starts as fast as before.

``asyncgrpo run`` and ``config explain`` run the check in a child process (:func:`isolated_preflight`): the user's
modules are imported there, so what they do at import (a reward model loaded onto the GPU, ``sys.path``
extended) ends with the check instead of staying in the launcher for the whole run.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.config.base import CONFIG_ENV, ConfigFileError, config_path
from shared.config.data import DataSettings
from shared.config.environment import EnvironmentSettings
from shared.config.pipeline import PipelineConfig, PipelineError
from shared.config.scorer import RewardSpec
from shared.dataset.rows import Row, prepare_rows
from shared.dataset.sources import DataError, read_source, split_problems
from shared.reward_columns import (
    missing_columns,
    missing_columns_message,
    passed_keywords,
    required_columns,
    takes_every_keyword,
    unaccepted_keywords,
    unaccepted_keywords_message,
)
from shared.reward_imports import import_callable

FIRST_ROWS = 8  # rows whose columns are checked: enough to see the dataset's columns, few to prepare


@dataclass(frozen=True)
class Problem:
    """One reason the run would fail at start: ``setting`` is where to look (``scorer.rewards[0]``,
    ``data.source``), ``message`` what is wrong and how to fix it."""

    setting: str
    message: str

    def __str__(self) -> str:
        return f"{self.setting}: {self.message}"


@dataclass(frozen=True)
class PythonReward:
    """A Python reward function that imports: where it is configured, its name, the function."""

    setting: str
    name: str
    function: Callable[..., Any]


def preflight(config: str | Path | PipelineConfig, *, config_file: str | Path | None = None) -> list[Problem]:
    """Every problem of the configuration ``config`` (a file, or one loaded from ``config_file``) that would stop
    a service at its start; [] when none. A file that does not load is one problem per invalid setting."""
    if isinstance(config, PipelineConfig):
        pipeline, source = config, config_path(config_file)
    else:
        source = Path(config)
        try:
            pipeline = PipelineConfig.load(source)
        except PipelineError as exc:
            return [Problem(str(source), problem) for problem in exc.problems]
        except ConfigFileError as exc:
            return [Problem("--config", str(exc))]
    multi_turn = pipeline.generator.environment is not None
    with _names_resolved_beside(source):
        functions, problems = _reward_functions(pipeline.scorer.rewards)
        problems += _environment_problems(pipeline.generator.environment)
        problems += [Problem("data", problem) for problem in split_problems(pipeline.learner.data, ("eval_split",))]
        return problems + column_problems(functions, pipeline.learner.data, multi_turn=multi_turn)


def isolated_preflight(config: str | Path) -> list[Problem]:
    """:func:`preflight` of the file ``config``, run in a child process (spawned: a fresh interpreter with none of
    the launcher's state) when it names user code (a Python reward, environment class or tool), so that the
    user's modules are imported there and never in the launcher; in this process when it names none (nothing is
    imported). A child that ends without an answer (a module that calls ``os._exit`` or crashes the interpreter
    at import) is one problem; any other exception of the check is raised here, as it would be in-process."""
    try:
        pipeline = PipelineConfig.load(Path(config))
    except (PipelineError, ConfigFileError):
        return preflight(config)  # the file's own problems, found without importing anything
    if not names_user_code(pipeline):
        return preflight(pipeline, config_file=config)
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as child:
        try:
            return child.submit(preflight, Path(config)).result()
        except BrokenProcessPool as exc:
            return [
                Problem(
                    "--config",
                    f"the start-up check of {config} ended without an answer ({exc}): a module it imports (a reward "
                    "function, environment class or tool) ended the process; import each one with python -c to see "
                    "which",
                )
            ]


def names_user_code(pipeline: PipelineConfig) -> bool:
    """Whether ``pipeline`` names a module of the user's: a Python reward function, environment class or tool."""
    environment = pipeline.generator.environment
    in_environment = environment is not None and bool(environment.python or environment.tools)
    return in_environment or any(spec.function is not None for spec in pipeline.scorer.rewards)


@contextmanager
def _names_resolved_beside(source: Path | None) -> Iterator[None]:
    """Modules and data files are looked for beside ``source``, as the services (started with
    ``$ASYNCGRPO_CONFIG``) look (:mod:`shared.config.locations`)."""
    before = os.environ.get(CONFIG_ENV)
    if source is not None:
        os.environ[CONFIG_ENV] = str(source)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CONFIG_ENV, None)
        else:
            os.environ[CONFIG_ENV] = before


def _reward_functions(specs: Sequence[RewardSpec]) -> tuple[list[PythonReward], list[Problem]]:
    """The Python reward functions that import, and a problem for each that does not."""
    functions, problems = [], []
    for index, spec in enumerate(specs):
        if spec.function is None:
            continue  # a built-in (its name is checked with the file) or an HTTP plugin (probed by the scorer)
        function, problem = import_callable(spec.function, "reward function")
        setting = f"scorer.rewards[{index}]"
        if function is None:
            problems.append(Problem(setting, problem or "does not import"))
        else:
            functions.append(PythonReward(setting, spec.name, function))
    return functions, problems


def _environment_problems(environment: EnvironmentSettings | None) -> list[Problem]:
    """A problem for the environment class and each tool function that does not import."""
    if environment is None:
        return []
    paths = [("environment.python", environment.python, "environment class")] if environment.python else []
    paths += [(f"environment.tools[{i}]", tool, "tool function") for i, tool in enumerate(environment.tools)]
    problems = []
    for setting, path, what in paths:
        _, problem = import_callable(path, what)
        if problem is not None:
            problems.append(Problem(setting, problem))
    return problems


def column_problems(
    functions: Sequence[PythonReward], data: DataSettings, *, multi_turn: bool = False
) -> list[Problem]:
    """A problem for each reward function whose parameters without a default are not all columns of the
    dataset's first rows, or that cannot take every keyword the scorer passes it with them (``multi_turn``: an
    environment runs, so ``env_reward`` too); or the reason the rows cannot be read. The rows are read only when
    a function needs a column or has no ``**kwargs``."""
    if all(takes_every_keyword(r.function) and not required_columns(r.function) for r in functions):
        return []
    try:
        rows = _first_rows(data)
    except DataError as exc:
        return [Problem("data", str(exc))]
    except Exception as exc:  # datasets' own errors, of many types (a malformed file, an unknown split)
        return [Problem("data.source", f"reading {data.source!r} failed: {type(exc).__name__}: {exc}")]
    common = _columns(rows, every=True)
    keywords = passed_keywords(_columns(rows, every=False), multi_turn=multi_turn)
    problems = []
    for reward in functions:
        unaccepted = unaccepted_keywords(reward.function, keywords)
        if unaccepted:
            message = unaccepted_keywords_message(reward.name, reward.function, unaccepted)
            problems.append(Problem(reward.setting, message))
        missing = missing_columns(reward.function, common)
        if missing:
            problems.append(Problem(reward.setting, missing_columns_message(reward.name, missing, common)))
    return problems


def first_row_columns(data: DataSettings) -> list[str]:
    """The columns the reward functions get with every one of the first rows, as the learner prepares them."""
    return _columns(_first_rows(data), every=True)


def _columns(rows: Sequence[Row], *, every: bool) -> list[str]:
    """The columns of ``every`` row (those a parameter may count on), else of any row (those passed somewhere)."""
    sets = [set(row.columns) for row in rows]
    return sorted(set.intersection(*sets) if every else set.union(*sets))


def _first_rows(data: DataSettings) -> list[Row]:
    """The first ``FIRST_ROWS`` training rows, read alone and prepared as the learner prepares them."""
    return prepare_rows(read_source(data, limit=FIRST_ROWS), data)
