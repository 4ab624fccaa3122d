"""Where the learner's per-step metrics go: JSONL, TensorBoard, Prometheus gauges, and a progress bar.

Metric names are TRL's where TRL has the figure (``reward``, ``reward_std``, ``frac_reward_zero_std``,
``clip_ratio/low_mean``, ``completions/mean_length``, ``kl``, ``grad_norm``...), plus ``staleness/mean``,
``staleness/max``, ``sampling/importance_sampling_ratio/{min,mean,max}``, ``tokens_per_second`` and the
step time split into ``seconds/wait``, ``seconds/old_logprobs``, ``seconds/train``, ``seconds/sync``.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

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


class MetricsSink:
    def __init__(self, log_dir: Path, gauges: MetricsGauges, total_steps: int, progress: str) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / "metrics.jsonl"
        self._jsonl = self.path.open("a", encoding="utf-8")
        self._batches = (log_dir / "batches.jsonl").open("a", encoding="utf-8")
        self._drops = (log_dir / "dropped.jsonl").open("a", encoding="utf-8")
        self._tensorboard: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=str(log_dir / "tensorboard"))
        except ImportError as exc:
            log.warning("TensorBoard logging off: %s", exc)
        self.gauges = gauges
        enabled = progress == "on" or (progress == "auto" and sys.stderr.isatty())
        self.progress = StepProgress(total_steps, enabled)
        self.last: dict[str, float] = {}

    def write(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None and not math.isnan(float(v))}
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        self._jsonl.flush()
        if self._tensorboard is not None:
            for name, value in clean.items():
                self._tensorboard.add_scalar(name, value, step)
        self.gauges.update(clean | {"step": step})
        self.last = clean
        self.progress.update(step, clean)

    def write_batch(self, step: int, group_ids: list[str], policy_versions: list[int]) -> None:
        """Which groups (and sampled under which versions) made the batch of ``step``: an audit trail."""
        record = {"step": step, "group_ids": group_ids, "policy_versions": policy_versions}
        self._batches.write(json.dumps(record) + "\n")
        self._batches.flush()

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
        if self._tensorboard is not None:
            self._tensorboard.close()
