"""The start-up check of ``asyncgrpo run`` and ``asyncgrpo config explain``: what would stop a service at its
start, found before Redis, the model or any process is started.

A configuration that loads can still fail seconds into a run, after vLLM has loaded the model:

* a Python reward function, environment class or tool that does not import (a misspelled name is answered
  with the closest names its module has: :mod:`services.scorer.rewards.imports`, the scorer's own check);
* a Python reward function with a parameter (no default) that is not a column of the dataset's rows: the
  first rows are read by the learner's reader and prepared by its rules (``rename_columns``,
  ``answer_column``, the prompt column taken out), and a missing column is reported with the scorer's message
  (:func:`~services.scorer.rewards.columns.missing_columns_message`).

Modules are looked up as the services look them up: on ``sys.path``, beside the configuration file, in the
working directory. The data is read only when a reward needs a column, so a run of built-in rewards starts as
fast as before.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.learner.data.feeder import prepare_rows
from services.learner.data.sources import DataError, read_source
from services.scorer.rewards.columns import missing_columns, missing_columns_message, required_columns
from services.scorer.rewards.imports import import_callable
from shared.config.base import CONFIG_ENV, ConfigFileError, config_path
from shared.config.data import DataSettings
from shared.config.environment import EnvironmentSettings
from shared.config.pipeline import PipelineConfig, PipelineError
from shared.config.scorer import RewardSpec

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
    with _modules_beside(source):
        functions, problems = _reward_functions(pipeline.scorer.rewards)
        problems += _environment_problems(pipeline.generator.environment)
    return problems + column_problems(functions, pipeline.learner.data)


@contextmanager
def _modules_beside(source: Path | None) -> Iterator[None]:
    """Modules are looked for beside ``source``, as the services (started with ``$ASYNCGRPO_CONFIG``) look."""
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


def column_problems(functions: Sequence[PythonReward], data: DataSettings) -> list[Problem]:
    """A problem for each reward function whose parameters without a default are not all columns of the
    dataset's first rows (read only when a function needs a column), or the reason the rows cannot be read."""
    if not any(required_columns(reward.function) for reward in functions):
        return []
    try:
        columns = first_row_columns(data)
    except DataError as exc:
        return [Problem("data", str(exc))]
    except Exception as exc:  # datasets' own errors, of many types (a malformed file, an unknown split)
        return [Problem("data.source", f"reading {data.source!r} failed: {type(exc).__name__}: {exc}")]
    problems = []
    for reward in functions:
        missing = missing_columns(reward.function, columns)
        if missing:
            problems.append(Problem(reward.setting, missing_columns_message(reward.name, missing, columns)))
    return problems


def first_row_columns(data: DataSettings) -> list[str]:
    """The columns the reward functions get with every one of the first rows, as the learner prepares them."""
    rows = prepare_rows(read_source(data)[:FIRST_ROWS], data)
    common = set(rows[0].columns).intersection(*(row.columns for row in rows[1:]))
    return sorted(common)
