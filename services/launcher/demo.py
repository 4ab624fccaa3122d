"""``make demo``: SmolLM2-135M-Instruct gets better at word problems (``<think>...</think><answer>...</answer>``).

Prepares the model (once, with the cache given), fills it into the demo configuration, runs generator, scorer
and learner as separate processes (Redis started if none answers) as the run ``demo-<time>`` (everything in
``runs/demo-<time>/``), then draws the reward curve and the held-out accuracy as a PNG there and prints where
the checkpoint is, how long it took, and the goals: held-out greedy accuracy (the learner's evaluation before
the first step and after the last) up by at least 0.15, and the training correctness of the last 10 steps at
least 0.15 above that of the first 10. A missed goal is printed and the demo exits 1.
"""

from __future__ import annotations

import json
import logging
import math
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from services.launcher.prepare_model import prepare_smollm2
from services.launcher.run import run
from shared.config.learner import LearnerSettings
from shared.runs import list_checkpoints

log = logging.getLogger(__name__)

MODEL_PLACEHOLDER = "@smollm2"
CORRECTNESS = "correctness"  # the reward function whose mean is the share of correct answers
EVAL_ACCURACY = f"eval/rewards/{CORRECTNESS}/mean"
GOAL_EVAL_GAIN = 0.15  # held-out greedy accuracy, last evaluation minus the first
GOAL_TRAIN_GAIN = 0.15  # training correctness, mean of the last WINDOW steps minus that of the first
WINDOW = 10


def _materialise(config: Path, model: Path, run_name: str) -> tuple[Path, LearnerSettings]:
    """The demo config with the model path and the run's name filled in, written into the run directory;
    and the learner's settings as the run will resolve them (where its checkpoints and metrics go)."""
    document = tomllib.loads(config.read_text())
    for table in ("generator", "learner"):
        if document.get(table, {}).get("model") == MODEL_PLACEHOLDER:
            document[table]["model"] = str(model)
    document.setdefault("learner", {})["run_name"] = run_name
    run_dir = Path(document["learner"].get("runs_dir", "runs")) / run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.toml"
    path.write_text(tomli_w.dumps(document))
    return path, LearnerSettings.load(path, run_name=run_name)


@dataclass(frozen=True)
class DemoResult:
    """What a demo run learned: training correctness per step, held-out greedy accuracy before and after."""

    steps: list[int]
    rewards: list[float]
    parts: dict[str, list[float]]  # each reward function's mean per step
    evaluations: dict[int, float]  # step -> held-out accuracy (eval correctness mean)

    @property
    def correctness(self) -> list[float]:
        return self.parts.get(CORRECTNESS, [])

    def train_gain(self) -> tuple[float, float]:
        """Mean training correctness of the first and of the last ``WINDOW`` steps."""
        values = self.correctness
        return _mean(values[:WINDOW]), _mean(values[-WINDOW:])

    def eval_gain(self) -> tuple[float, float]:
        """Held-out accuracy at the first evaluation (step 0) and at the last."""
        if not self.evaluations:
            return math.nan, math.nan
        ordered = sorted(self.evaluations)
        return self.evaluations[ordered[0]], self.evaluations[ordered[-1]]

    def missed_goals(self) -> list[str]:
        """The goals this run missed, each with its numbers; empty when every goal was met."""
        missed = []
        before, after = self.eval_gain()
        if len(self.evaluations) < 2 or not after >= before + GOAL_EVAL_GAIN:
            missed.append(f"held-out accuracy {before:.3f} -> {after:.3f}: the goal is a gain of +{GOAL_EVAL_GAIN}")
        first, last = self.train_gain()
        if len(self.correctness) < 2 * WINDOW or not last >= first + GOAL_TRAIN_GAIN:
            missed.append(
                f"training correctness, first {WINDOW} steps {first:.3f}, last {WINDOW} {last:.3f}: the goal is a "
                f"gain of +{GOAL_TRAIN_GAIN} (over at least {2 * WINDOW} steps)"
            )
        return missed


def _mean(values: list[float]) -> float:
    present = [v for v in values if not math.isnan(v)]
    return sum(present) / len(present) if present else math.nan


def read_result(metrics: Path) -> DemoResult:
    """The run's training records (one per step) and evaluation records (``eval/*``) from metrics.jsonl."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    training = [r for r in records if "reward" in r]
    names = sorted({k.split("/")[1] for r in training for k in r if k.startswith("rewards/") and k.endswith("/mean")})
    return DemoResult(
        steps=[r["step"] for r in training],
        rewards=[r["reward"] for r in training],
        parts={name: [r.get(f"rewards/{name}/mean", math.nan) for r in training] for name in names},
        evaluations={r["step"]: r[EVAL_ACCURACY] for r in records if EVAL_ACCURACY in r},
    )


def plot(result: DemoResult, png: Path) -> None:
    """The reward and its parts per step, and the held-out accuracy of each evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5), dpi=110)
    axis.plot(result.steps, result.rewards, marker="o", linewidth=2, label="reward (combined)")
    for name, values in result.parts.items():
        axis.plot(result.steps, values, linestyle="--", alpha=0.7, label=f"{name} (training samples)")
    if result.evaluations:
        steps = sorted(result.evaluations)
        values = [result.evaluations[s] for s in steps]
        axis.plot(steps, values, marker="s", markersize=8, color="black", label="held-out accuracy (greedy)")
        for step, value in zip(steps, values, strict=True):
            axis.annotate(f"{value:.0%}", (step, value), textcoords="offset points", xytext=(6, 6))
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("mean reward / accuracy")
    axis.set_ylim(-0.02, 1.02)
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right")
    axis.set_title("asyncgrpo demo: SmolLM2-135M-Instruct on 2 CPU cores")
    figure.tight_layout()
    figure.savefig(png)
    plt.close(figure)


def run_demo(config: Path, cache: Path | None) -> int:
    """Prepare the model, run the demo configuration, report the reward curve; returns the run's exit code."""
    started = time.monotonic()
    model = prepare_smollm2(cache)
    run_config, learner = _materialise(config, model, time.strftime("demo-%Y%m%d-%H%M%S"))
    code, _ = run(run_config, run_name=learner.run_name)
    metrics = Path(learner.log_dir) / "metrics.jsonl"
    if not metrics.exists() or not metrics.read_text().strip():
        print(f"no training steps were recorded; see the logs in {learner.run_dir / 'logs'}")
        return code or 1
    png = learner.run_dir / "reward_curve.png"
    result = read_result(metrics)
    plot(result, png)
    minutes = (time.monotonic() - started) / 60
    checkpoints = list_checkpoints(Path(learner.checkpoint_dir))
    before, after = result.eval_gain()
    first, last = result.train_gain()
    print()
    print(f"steps trained            {len(result.steps)} in {minutes:.1f} min (model preparation included)")
    print(
        f"held-out accuracy        {before:.3f} -> {after:.3f}  (gain {after - before:+.3f}; goal >= +{GOAL_EVAL_GAIN})"
    )
    print(f"training correctness     first {WINDOW} steps {first:.3f}, last {WINDOW} {last:.3f}  "
          f"(gain {last - first:+.3f}; goal >= +{GOAL_TRAIN_GAIN})")  # fmt: skip
    print(f"reward curve             {png}")
    print(f"checkpoint               {checkpoints[-1] if checkpoints else 'none'}")
    print(f"run directory            {learner.run_dir} (config.toml, metrics.jsonl, logs/)")
    missed = result.missed_goals()
    for goal in missed:
        print(f"GOAL MISSED: {goal}")
    return code or (1 if missed else 0)
