"""``make demo``: SmolLM2-135M-Instruct gets better at word problems (``<think>...</think><answer>...</answer>``).

Runs the demo configuration as ``asyncgrpo run`` runs any file (the model prepared once, with the cache given;
generator, scorer and learner as separate processes; Redis started if none answers) as the run ``demo-<time>``
(everything in ``runs/demo-<time>/``, the configuration's copy included), then draws the reward curve and the
held-out accuracy as a PNG there and prints where the checkpoint is, how long it took, and the goals: held-out
greedy accuracy (the learner's evaluation before the first step and after the last) up by at least 0.15, and
the training correctness of the last 10 steps at least 0.15 above that of the first 10. A missed goal is
printed and the demo exits 1.

``make demo-tools`` (``demo --tools``, configs/demo-tools-cpu.toml): the same model learns to call a calculator
(configs/calculator_env.py) for multi-digit products. Its goals: held-out greedy accuracy up by at least 0.15,
and the tool-call frequency (calls per trajectory) up: on the held-out evaluation where it records
``eval/tools/call_frequency``, else the training figure's mean over the last 10 steps against the first 10.
The PNG has both curves.

``--quick`` (``make demo DEMO_ARGS=--quick``, what ``make test`` runs) takes the same path on a few steps and
a few held-out problems (:func:`quick_overrides`), and reports the goals without checking them.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.launcher.run import run
from services.launcher.run_config import Overrides
from shared.config.learner import LearnerSettings
from shared.runs import list_checkpoints

log = logging.getLogger(__name__)

CORRECTNESS = "correctness"  # the reward function whose mean is the share of correct answers
EVAL_ACCURACY = f"eval/rewards/{CORRECTNESS}/mean"
GOAL_EVAL_GAIN = 0.15  # held-out greedy accuracy, last evaluation minus the first
GOAL_TRAIN_GAIN = 0.15  # training correctness, mean of the last WINDOW steps minus that of the first
WINDOW = 10
TOOL_CALLS = "tools/call_frequency"  # calls per trajectory (training batches; eval/ when the evaluation has it)
EVAL_TOOL_CALLS = f"eval/{TOOL_CALLS}"
DEMO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"  # the repository's, from any working directory
QUICK_STEPS = 2  # --quick: enough for a weight push and a second batch under the new policy
QUICK_EVAL_SAMPLES = 8  # --quick: held-out problems per evaluation (the full demo's are 50-100)


def demo_config(tools: bool) -> Path:
    """The demo's configuration file: configs/demo-tools-cpu.toml (``tools``) or configs/demo-cpu.toml."""
    return DEMO_CONFIGS / ("demo-tools-cpu.toml" if tools else "demo-cpu.toml")


def quick_overrides(tools: bool) -> Overrides:
    """``--quick``: the demo's own path (the run's copy, the start-up check, every service, the held-out
    evaluation before the first step and after the last, the PNG) on budgets a smoke run can afford."""
    learner = {"max_steps": QUICK_STEPS, "eval_samples": QUICK_EVAL_SAMPLES, "checkpoint_every": QUICK_STEPS}
    if tools:
        learner["eval_every"] = QUICK_STEPS
    return {"learner": learner}


@dataclass(frozen=True)
class DemoResult:
    """What a demo run learned: training correctness per step, held-out greedy accuracy before and after."""

    steps: list[int]
    rewards: list[float]
    parts: dict[str, list[float]]  # each reward function's mean per step
    evaluations: dict[int, float]  # step -> held-out accuracy (eval correctness mean)
    tool_calls: list[float] = field(default_factory=list)  # training calls per trajectory, per step (NaN: none)
    eval_tool_calls: dict[int, float] = field(default_factory=dict)  # step -> held-out calls per trajectory

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

    def tool_gain(self) -> tuple[float, float, str]:
        """Tool-call frequency before and after, and where it comes from: the first and last held-out
        evaluations where they record it, else the mean of the first and of the last ``WINDOW`` training steps."""
        if len(self.eval_tool_calls) >= 2:
            ordered = sorted(self.eval_tool_calls)
            return self.eval_tool_calls[ordered[0]], self.eval_tool_calls[ordered[-1]], "held-out"
        return _mean(self.tool_calls[:WINDOW]), _mean(self.tool_calls[-WINDOW:]), "training"

    def missed_goals(self, tools: bool = False) -> list[str]:
        """The goals this run missed, each with its numbers; empty when every goal was met. ``tools``: the
        tool-use demo's goals (held-out accuracy and tool-call frequency up) instead of the single-turn one's."""
        missed = []
        before, after = self.eval_gain()
        if len(self.evaluations) < 2 or not after >= before + GOAL_EVAL_GAIN:
            missed.append(f"held-out accuracy {before:.3f} -> {after:.3f}: the goal is a gain of +{GOAL_EVAL_GAIN}")
        if tools:
            return missed + self._missed_tool_goal()
        first, last = self.train_gain()
        if len(self.correctness) < 2 * WINDOW or not last >= first + GOAL_TRAIN_GAIN:
            missed.append(
                f"training correctness, first {WINDOW} steps {first:.3f}, last {WINDOW} {last:.3f}: the goal is a "
                f"gain of +{GOAL_TRAIN_GAIN} (over at least {2 * WINDOW} steps)"
            )
        return missed

    def _missed_tool_goal(self) -> list[str]:
        first, last, source = self.tool_gain()
        enough = source == "held-out" or len(self.tool_calls) >= 2 * WINDOW
        if enough and last > first:
            return []
        over = f" (training figures over at least {2 * WINDOW} steps)" if source == "training" else ""
        return [
            f"tool-call frequency ({source}) {first:.3f} -> {last:.3f} calls per trajectory: the goal is a rise{over}"
        ]


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
        tool_calls=[r.get(TOOL_CALLS, math.nan) for r in training],
        eval_tool_calls={r["step"]: r[EVAL_TOOL_CALLS] for r in records if EVAL_TOOL_CALLS in r},
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


def plot_tools(result: DemoResult, png: Path) -> None:
    """The tool-use demo's two curves: held-out accuracy (and training correctness) on the left, tool-call
    frequency (training, and held-out where recorded) on the right, both over optimizer steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=110)
    left.plot(result.steps, result.correctness, linestyle="--", alpha=0.7, label="correct (training samples)")
    _points(left, result.evaluations, "held-out accuracy (greedy)", percent=True)
    left.set_ylim(-0.02, 1.02)
    left.set_ylabel("share correct")
    right.plot(result.steps, result.tool_calls, marker="o", linewidth=2, label="calls per trajectory (training)")
    _points(right, result.eval_tool_calls, "calls per trajectory (held-out, greedy)", percent=False)
    right.set_ylim(bottom=-0.02)
    right.set_ylabel("tool calls per trajectory")
    for axis in (left, right):
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_xlabel("optimizer step")
        axis.grid(alpha=0.3)
        axis.legend(loc="lower right")
    figure.suptitle("asyncgrpo tool-use demo: SmolLM2-135M-Instruct learns a calculator on 2 CPU cores")
    figure.tight_layout()
    figure.savefig(png)
    plt.close(figure)


def _points(axis, values: dict[int, float], label: str, *, percent: bool) -> None:
    if not values:
        return
    steps = sorted(values)
    ys = [values[s] for s in steps]
    axis.plot(steps, ys, marker="s", markersize=8, color="black", label=label)
    for step, value in zip(steps, ys, strict=True):
        text = f"{value:.0%}" if percent else f"{value:.2f}"
        axis.annotate(text, (step, value), textcoords="offset points", xytext=(6, 6))


def run_demo(config: Path, cache: Path | None, tools: bool = False, quick: bool = False) -> int:
    """Prepare the model, run the demo configuration, report its curves; returns the run's exit code (1 when a
    goal was missed). ``tools``: the tool-use demo's report and goals; ``quick``: :func:`quick_overrides`, and
    the goals are reported but not checked (a handful of steps teaches nothing)."""
    started = time.monotonic()
    run_name = time.strftime(f"demo{'-tools' if tools else ''}{'-quick' if quick else ''}-%Y%m%d-%H%M%S")
    overrides = quick_overrides(tools) if quick else None
    code, _ = run(config, run_name=run_name, overrides=overrides, cache=cache)
    learner = LearnerSettings.load(config, run_name=run_name)  # where the run wrote (overrides change none of it)
    metrics = Path(learner.log_dir) / "metrics.jsonl"
    if not metrics.exists() or not metrics.read_text().strip():
        print(f"no training steps were recorded; see the logs in {learner.run_dir / 'logs'}")
        return code or 1
    result = read_result(metrics)
    png = learner.run_dir / ("tool_curve.png" if tools else "reward_curve.png")
    (plot_tools if tools else plot)(result, png)
    minutes = (time.monotonic() - started) / 60
    print()
    print(f"steps trained            {len(result.steps)} in {minutes:.1f} min (model preparation included)")
    before, after = result.eval_gain()
    print(
        f"held-out accuracy        {before:.3f} -> {after:.3f}  (gain {after - before:+.3f}; goal >= +{GOAL_EVAL_GAIN})"
    )
    _report_lines(result, tools)
    print(f"{'curves' if tools else 'reward curve':<25}{png}")
    checkpoints = list_checkpoints(Path(learner.checkpoint_dir))
    print(f"checkpoint               {checkpoints[-1] if checkpoints else 'none'}")
    print(f"run directory            {learner.run_dir} (config.toml, metrics.jsonl, logs/)")
    missed = result.missed_goals(tools)
    for goal in missed:
        print(f"{'goal not checked (--quick)' if quick else 'GOAL MISSED'}: {goal}")
    return code or (1 if missed and not quick else 0)


def _report_lines(result: DemoResult, tools: bool) -> None:
    first, last = result.train_gain()
    print(f"training correctness     first {WINDOW} steps {first:.3f}, last {WINDOW} {last:.3f}  "
          f"(gain {last - first:+.3f}{'' if tools else f'; goal >= +{GOAL_TRAIN_GAIN}'})")  # fmt: skip
    if not tools:
        return
    before, after, source = result.tool_gain()
    where = "first and last evaluation" if source == "held-out" else f"first and last {WINDOW} training steps"
    print(f"tool calls/trajectory    {before:.3f} -> {after:.3f}  ({source}: {where}; goal: a rise)")
    if source == "held-out":
        train_first, train_last = _mean(result.tool_calls[:WINDOW]), _mean(result.tool_calls[-WINDOW:])
        print(
            f"                         training, first and last {WINDOW} steps: {train_first:.3f} -> {train_last:.3f}"
        )
