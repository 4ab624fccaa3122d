"""``make demo``: SmolLM2-135M-Instruct learns to answer in ``<think>...</think><answer>...</answer>``.

Prepares the model (once, with the cache given), fills it into the demo configuration, runs generator, scorer
and learner as separate processes (Redis started if none answers) as the run ``demo-<time>`` (everything in
``runs/demo-<time>/``), then writes the reward curve as a PNG there and prints where the checkpoint is, how
long it took, and the goal: the mean reward of the last 5 steps at least 0.3 above
that of the first 5.
"""

from __future__ import annotations

import json
import logging
import time
import tomllib
from pathlib import Path

import tomli_w

from services.launcher.prepare_model import prepare_smollm2
from services.launcher.run import run
from shared.config.learner import LearnerSettings
from shared.runs import list_checkpoints

log = logging.getLogger(__name__)

MODEL_PLACEHOLDER = "@smollm2"
GOAL_GAIN = 0.3


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


def reward_curve(metrics: Path, png: Path) -> tuple[list[float], float, float]:
    """Plot reward per step; returns the rewards and the mean of the first and last 5 steps."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in records]
    rewards = [r.get("reward", float("nan")) for r in records]
    parts = (
        {
            k.split("/")[1]: [r.get(k, float("nan")) for r in records]
            for k in records[0]
            if k.startswith("rewards/") and k.endswith("/mean")
        }
        if records
        else {}
    )
    _plot(steps, rewards, parts, png)
    head, tail = rewards[:5], rewards[-5:]
    return rewards, sum(head) / max(len(head), 1), sum(tail) / max(len(tail), 1)


def _plot(steps: list[int], rewards: list[float], parts: dict[str, list[float]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5), dpi=110)
    axis.plot(steps, rewards, marker="o", linewidth=2, label="reward (combined)")
    for name, values in parts.items():
        axis.plot(steps, values, linestyle="--", alpha=0.7, label=f"{name}")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("mean reward")
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
    rewards, first, last = reward_curve(metrics, png)
    minutes = (time.monotonic() - started) / 60
    checkpoints = list_checkpoints(Path(learner.checkpoint_dir))
    print()
    print(f"steps trained      {len(rewards)} in {minutes:.1f} min (model preparation included)")
    print(f"reward, first 5    {first:.3f}")
    print(f"reward, last 5     {last:.3f}   (gain {last - first:+.3f}; goal >= +{GOAL_GAIN})")
    print(f"reward curve       {png}")
    print(f"checkpoint         {checkpoints[-1] if checkpoints else 'none'}")
    print(f"run directory      {learner.run_dir} (config.toml, metrics.jsonl, logs/)")
    return code
