"""Experiment trackers the learner reports to besides ``metrics.jsonl`` (``learner.report_to``, TRL's name and
values): TensorBoard, Weights & Biases, trackio. Each gets every step's metrics at its step and the completion
tables (:mod:`services.learner.metrics.completions_log`).

A tracker asked for is never skipped in silence: W&B and trackio missing is a refusal to start naming the
install command (:func:`shared.config.learner.missing_trackers`). TensorBoard keeps its old rule: the learner's
torch brings it, and without it a warning says that its logging is off.

Resuming: the W&B run's id is the run's name, so a restarted run continues its W&B run; W&B keeps the first
values of the steps trained again after the checkpoint (it ignores steps below its last one, with a
warning). TensorBoard purges them; trackio resumes the run of the same name and appends.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from services.learner.metrics.completions_log import Row, cell_text, markdown_table, table_columns
from shared.config.learner import DEFAULT_REPORT_TO, LearnerSettings, ReportTo, missing_trackers
from shared.lifecycle import NotStarting

log = logging.getLogger(__name__)

DEFAULT_PROJECT = "asyncgrpo"
TENSORBOARD_DIR = "tensorboard"  # under the log directory
COMPLETIONS_KEY = "completions"  # the tables' name in every tracker (TRL's)


class Tracker(Protocol):
    """One destination of the learner's figures."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def log_completions(self, step: int, rows: Sequence[Row]) -> None: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class TrackingRun:
    """What the trackers are told about the run; the default reports to TensorBoard only."""

    report_to: tuple[ReportTo, ...] = DEFAULT_REPORT_TO
    name: str = ""
    project: str = DEFAULT_PROJECT
    entity: str | None = None
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: LearnerSettings, environ: Mapping[str, str] = os.environ) -> TrackingRun:
        """The run as the settings name it; the settings (secrets masked) are its config."""
        return cls(
            report_to=tuple(settings.report_to),
            name=settings.run_name,
            project=project_name(settings.tracking_project, environ),
            entity=settings.wandb_entity or None,
            config=settings.masked(),
        )


def project_name(configured: str, environ: Mapping[str, str]) -> str:
    """The tracker project: the setting, else ``WANDB_PROJECT`` (as TRL reads it), else ``asyncgrpo``."""
    return configured or environ.get("WANDB_PROJECT") or DEFAULT_PROJECT


def open_trackers(run: TrackingRun, log_dir: Path, resumed_step: int | None) -> list[Tracker]:
    """A tracker for each of ``run.report_to``; :class:`NotStarting` naming the install command when one's
    package is missing."""
    problems = missing_trackers(list(run.report_to))
    if problems:
        raise NotStarting("; ".join(problems))
    trackers: list[Tracker] = []
    for name in run.report_to:
        match name:
            case "tensorboard":
                tensorboard = TensorBoardTracker.open(log_dir / TENSORBOARD_DIR, resumed_step)
                if tensorboard is not None:
                    trackers.append(tensorboard)
            case "wandb":
                trackers.append(WandbTracker(run, log_dir))
            case "trackio":
                trackers.append(TrackioTracker(run))
    return trackers


def table_cells(rows: Sequence[Row]) -> tuple[list[str], list[list[Any]]]:
    """Columns and row-major cells of a completions table: text as text (a conversation one line per
    message), numbers as numbers, a missing reward as None."""
    columns = table_columns(rows)
    cells = [[_cell(row.get(column)) for column in columns] for row in rows]
    return columns, cells


def _cell(value: Any) -> Any:
    return value if value is None or isinstance(value, int | float) else cell_text(value)


class TensorBoardTracker:
    """Scalars per step; each completions table as Markdown text (TensorBoard's text tab)."""

    def __init__(self, writer: Any) -> None:
        self._writer = writer

    @classmethod
    def open(cls, directory: Path, resumed_step: int | None) -> TensorBoardTracker | None:
        """None without tensorboard (a warning says so); a resumed run purges the events after its checkpoint."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            log.warning("TensorBoard logging off: %s", exc)
            return None
        purge = None if resumed_step is None else resumed_step + 1
        return cls(SummaryWriter(log_dir=str(directory), purge_step=purge))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)

    def log_completions(self, step: int, rows: Sequence[Row]) -> None:
        self._writer.add_text(COMPLETIONS_KEY, markdown_table(rows), step)

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A W&B run named and identified by the run's name (resumed when it exists); its files go under
    ``WANDB_DIR``, else ``log_dir`` (``<log_dir>/wandb/``; with ``WANDB_MODE=offline`` they stay there)."""

    def __init__(self, run: TrackingRun, log_dir: Path) -> None:
        import wandb

        self._wandb = wandb
        self._run = wandb.init(
            project=run.project,
            entity=run.entity,
            name=run.name or None,
            id=run.name or None,
            config=dict(run.config),
            dir=os.environ.get("WANDB_DIR") or str(log_dir),
            resume="allow",
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def log_completions(self, step: int, rows: Sequence[Row]) -> None:
        columns, cells = table_cells(rows)
        self._run.log({COMPLETIONS_KEY: self._wandb.Table(columns=columns, data=cells)}, step=step)

    def close(self) -> None:
        self._run.finish()


class TrackioTracker:
    """A trackio run of the run's name (resumed when the project has it); trackio keeps its runs in its own
    directory (``TRACKIO_DIR``, by default under the Hugging Face cache)."""

    def __init__(self, run: TrackingRun) -> None:
        import trackio

        self._trackio = trackio
        trackio.init(project=run.project, name=run.name or None, config=dict(run.config), resume="allow")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._trackio.log(dict(metrics), step=step)

    def log_completions(self, step: int, rows: Sequence[Row]) -> None:
        import pandas  # trackio's own dependency; its Table takes column names only with a DataFrame

        columns, cells = table_cells(rows)
        table = self._trackio.Table(dataframe=pandas.DataFrame(cells, columns=columns))
        self._trackio.log({COMPLETIONS_KEY: table}, step=step)

    def close(self) -> None:
        self._trackio.finish()
