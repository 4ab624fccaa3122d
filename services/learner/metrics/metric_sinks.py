"""Where the learner's per-step metrics go: JSONL, the trackers of ``report_to`` (TensorBoard by default; W&B,
trackio), Prometheus gauges, and a progress bar; and the completion tables of ``log_completions``.

Metric names and meanings are TRL's where TRL has the figure (``reward``, ``reward_std``, ``frac_reward_zero_std``,
``clip_ratio/low_mean``, ``clip_ratio/low_min``, ``clip_ratio/high_max``, ``completions/mean_length``,
``completions/mean_terminated_length``, ``num_tokens`` (cumulative), ``entropy``, ``kl``, ``grad_norm``,
``sampling/importance_sampling_ratio/{min,mean,max}``, ``sampling/sampling_logp_difference/{mean,max}``...),
plus ``staleness/mean``, ``staleness/max``, ``tokens_per_second`` and the step time split into ``seconds/wait``,
``seconds/old_logprobs``, ``seconds/train``, ``seconds/sync``. On Prometheus a reward function's name is a
``function`` label (:func:`shared.telemetry.split_labels`).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path

from services.learner.metrics.completions_log import Row, jsonl_records
from services.learner.metrics.trackers import TENSORBOARD_DIR, TrackingRun, open_trackers
from shared.records import ScoredGroup
from shared.telemetry import MetricsGauges

log = logging.getLogger(__name__)


class StepProgress:
    """A rich progress bar in a terminal; one log line per step otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self._progress = None
        self._task = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]GRPO[/]"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[line]}"),
                refresh_per_second=2,
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("steps", total=total, line="waiting for the first batch")

    def update(self, step: int, metrics: dict[str, float]) -> None:
        line = (
            f"reward {metrics.get('reward', math.nan):.3f}  staleness {metrics.get('staleness/mean', 0):.2f}  "
            f"{metrics.get('tokens_per_second', 0):.0f} tok/s  step {metrics.get('seconds/step', 0):.1f}s"
        )
        if self._progress is not None:
            self._progress.update(self._task, completed=step, line=line)
        else:
            log.info("step %d/%d  %s", step, self.total, line)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


# The learner's files in its log directory (the run directory by default).
METRICS_FILE, BATCHES_FILE, DROPS_FILE = "metrics.jsonl", "batches.jsonl", "dropped.jsonl"
COMPLETIONS_FILE = "completions.jsonl"


class MetricsSink:
    """One run's metrics. ``resumed_step``: the step of the checkpoint the run continues from (its records
    after that step are dropped: they are trained again); None: a new run, whose files start empty (an earlier
    run's, in an explicit ``log_dir`` both share, are renamed aside, never appended to). ``tracking``: the
    trackers besides the files (TensorBoard by default)."""

    def __init__(
        self,
        log_dir: Path,
        gauges: MetricsGauges,
        total_steps: int,
        progress: str,
        resumed_step: int | None = None,
        tracking: TrackingRun | None = None,
    ) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        if resumed_step is None:
            set_aside(log_dir, (METRICS_FILE, BATCHES_FILE, DROPS_FILE, COMPLETIONS_FILE, TENSORBOARD_DIR))
        else:
            keep_steps_up_to(log_dir / METRICS_FILE, resumed_step)
            keep_steps_up_to(log_dir / COMPLETIONS_FILE, resumed_step)
        self.path = log_dir / METRICS_FILE
        self._jsonl = self.path.open("a", encoding="utf-8")
        self._batches = (log_dir / BATCHES_FILE).open("a", encoding="utf-8")
        self._drops = (log_dir / DROPS_FILE).open("a", encoding="utf-8")
        self._completions = (log_dir / COMPLETIONS_FILE).open("a", encoding="utf-8")
        self._trackers = open_trackers(tracking or TrackingRun(), log_dir, resumed_step)
        self.gauges = gauges
        enabled = progress == "on" or (progress == "auto" and sys.stderr.isatty())
        self.progress = StepProgress(total_steps, enabled)
        self.last: dict[str, float] = {}

    def write(self, step: int, metrics: dict[str, float]) -> None:
        clean = self._record(step, metrics)
        self.gauges.update(clean | {"step": step})
        self.last = clean
        self.progress.update(step, clean)

    def _record(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """``metrics`` without NaN, as a metrics-file line for ``step`` and to every tracker; returns them."""
        clean = {k: float(v) for k, v in metrics.items() if v is not None and not math.isnan(float(v))}
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        self._jsonl.flush()
        for tracker in self._trackers:
            tracker.log(step, clean)
        return clean

    def write_eval(self, step: int, metrics: dict[str, float]) -> None:
        """An evaluation's ``eval/*`` figures: a record of their own for ``step`` in the metrics file (beside
        the step's training record), the trackers and Prometheus, and a log line."""
        clean = self._record(step, metrics)
        self.gauges.update(clean)
        rewards = "  ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in clean.items() if "reward" in k)
        log.info("evaluation at step %d: %s (%d prompts in %.1f s)", step, rewards, clean.get("eval/prompts", 0),
                 clean.get("eval/seconds", 0))  # fmt: skip

    def write_batch(self, step: int, groups: list[ScoredGroup]) -> None:
        """Which groups made the batch of ``step``, sampled under which versions and when (the generator's wall
        clock: when it started and finished each group's samples, as benches time a run from its first
        generation request): an audit trail."""
        record = {
            "step": step,
            "group_ids": [g.group_id for g in groups],
            "policy_versions": [g.rollout.policy_version for g in groups],
            "sampling_started_at": [g.rollout.timings.started_at for g in groups],
            "sampling_finished_at": [g.rollout.timings.finished_at for g in groups],
        }
        self._batches.write(json.dumps(record) + "\n")
        self._batches.flush()

    def write_completions(self, step: int, rows: list[Row]) -> None:
        """A table of sampled completions and their rewards (:mod:`services.learner.metrics.completions_log`), one
        ``completions.jsonl`` line per completion and one table per tracker."""
        if not rows:
            return
        self._completions.write(jsonl_records(step, rows))
        self._completions.flush()
        for tracker in self._trackers:
            tracker.log_completions(step, rows)

    def write_drop(self, group_id: str, reason: str, group_version: int, learner_version: int) -> None:
        """A group acknowledged without training, and why (stale, zero std, already trained...)."""
        record = {
            "time": time.time(),
            "group_id": group_id,
            "reason": reason,
            "group_version": group_version,
            "learner_version": learner_version,
        }
        self._drops.write(json.dumps(record) + "\n")
        self._drops.flush()

    def close(self) -> None:
        self.progress.close()
        self._jsonl.close()
        self._batches.close()
        self._drops.close()
        self._completions.close()
        for tracker in self._trackers:
            tracker.close()


def set_aside(directory: Path, names: tuple[str, ...]) -> None:
    """Rename an earlier run's files in ``directory`` to ``<name>.<time>`` so a new run starts them empty."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for name in names:
        path = directory / name
        if path.exists():
            aside = path.with_name(f"{name}.{stamp}")
            path.rename(aside)
            log.warning("%s is an earlier run's (this run starts afresh): renamed it %s", path, aside.name)


def keep_steps_up_to(path: Path, step: int) -> None:
    """Drop the records of steps after ``step`` (and a line cut short by a kill) from a JSONL metrics file."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line + "\n")
    staging = path.with_name(path.name + ".tmp")
    staging.write_text("".join(kept), encoding="utf-8")
    staging.replace(path)
