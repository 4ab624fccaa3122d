"""Async vs sync: the same run (model, data, steps) with and without overlap of generation and training.

Both modes run the whole pipeline through the launcher, the generator pinned to core 0 and the learner to
core 1 (so they can overlap at all on this 2-core machine), and everything else on core 0 too: the scorer, the
launcher and a Redis the bench starts (``--unpinned-rest``: the launcher unpinned, on the Redis at
``$REDIS_URL`` or the local default, as the earlier runs were):

* sync:  ``max_staleness = 0``: the learner admits one batch, waits for it, trains, pushes, admits the next;
  the generator idles while the learner trains and vice versa.
* async: ``max_staleness = 1``: the generator samples the next batch while the learner trains.

Seconds per step are taken from the learner's metrics (steps 2..N, so start-up is excluded; the last step's own
training and push count, the run's final checkpoint after them does not: the phases below leave it out too, and it
is no step's work; at 12 steps about 0.37 s of every step of a sync run on an AVX-512 BF16 EPYC). From the sync
run's phase times, T_gen = time the learner waited for a batch and T_train = its training + weight-push
time, the ideal speedup is (T_gen + T_train) / max(T_gen, T_train). The same phases measured side by side in
the async run (the learner's train + push beside a sampling generator; the generator's busy sampling time per
batch, the union of the groups' sampling intervals in ``batches.jsonl``, beside a training learner) give a
second ideal, sync s/step / max(both): the gap between the two ideals is what the phases lose to each other
(cores sharing caches and memory bandwidth, threads outside their core), the gap from the second to the
measured speedup is what the overlap itself costs. Both phases' work grows with the completion tokens, so both
runs sample every completion to the same length (``min_completion_length = max_completion_length``): each step
of either run samples and trains the same number of completion tokens (printed, and each phase's slowdown per
token beside it). The learning is not the demo's (a completion forced past its ``</answer>`` fails the
format reward): only the work per step is compared. Then ``bench/interference.py`` measures what the two
cores lose running at once (a cache-resident matmul, a copy through memory), printed beside what the phases
lost: the copy's loss is at most what the machine's shared memory bandwidth costs a memory-bound phase,
whatever runs it. The last line is measured / ideal from phases alone (goal >= 0.95).

``--in-flight-at-push keep`` keeps the KV of requests sampling when a push lands instead of recomputing them
(``generator.in_flight_at_push``); the bench prints how many pushes of each run landed while prompts were
sampling (from the generator's log: when the learner is the longer phase the generator has sampled the next
batch before the push, and the setting changes nothing).

    python bench/async_vs_sync.py [--model smollm2|tiny] [--steps 12] [--in-flight-at-push recompute|keep] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tomli_w  # noqa: E402

from bench import interference  # noqa: E402
from bench.record import add_record_flag, record, refuse_quick  # noqa: E402
from bench.vs_trl import phases_end, training_records  # noqa: E402
from shared.config.generator import GeneratorSettings  # noqa: E402
from tests.support.launcher import run_pipeline  # noqa: E402
from tests.support.redis_server import free_port, start_redis  # noqa: E402

# Every completion is sampled to this length (min = max tokens), so both runs do the same work each step: left
# to end where the model ends them, the two runs' completions drifted apart (867 vs 929 tokens a step in one
# pair of runs) as each policy learned its own way, and s/step compared different work.
COMPLETION_TOKENS = 64
# The generator (with the scorer, the launcher and the bench's Redis) on one core, the learner on the other.
GENERATOR_CORE, LEARNER_CORE = 0, 1


def _config(tmp: Path, model: Path, mode: str, steps: int, groups: int, context: int, in_flight: str) -> Path:
    document = {
        "launcher": {
            "redis_allow_no_auth": True,  # the bench's own Redis on loopback, or the one --unpinned-rest names
            "generators": 1,
            "generator_cpus": [str(GENERATOR_CORE)],
            "learner_cpus": str(LEARNER_CORE),
            "scorer_cpus": str(GENERATOR_CORE),
            "log_dir": str(tmp / "logs"),
            "first_generator_port": free_port(),
        },
        "generator": {
            "model": str(model),
            "dtype": "float32",
            "max_model_len": context,
            "kv_cache_gib": 2,
            "in_flight_at_push": in_flight,
        },
        "scorer": {"rewards": [{"name": "hard_format", "weight": 0.8}, {"name": "mark", "weight": 0.2}], "port": 0},
        "learner": {
            "model": str(model),
            "compute_dtype": "auto",
            "threads": 1,
            "group_size": 8,
            "groups_per_step": groups,
            "micro_batch_size": 8,
            "max_steps": steps,
            "max_staleness": 0 if mode == "sync" else 1,
            "max_completion_length": COMPLETION_TOKENS,
            "min_completion_length": COMPLETION_TOKENS,
            "max_prompt_length": 256,
            "lr": 1e-5,
            "loss_type": "dapo",
            "old_logprobs": "reuse",
            "checkpoint_every": 1000,
            "checkpoint_dir": str(tmp / "ckpt"),
            "log_dir": str(tmp / "logs"),
            "weight_sync_port": 0,
            "port": 0,
            "progress": "off",
        },
        "data": {
            "source": "builtin:arithmetic",
            "assistant_prefill": "<think>",
            "system_prompt": "Think inside <think></think>, then answer inside <answer></answer>.",
        },
    }
    path = tmp / f"{mode}.toml"
    path.write_text(tomli_w.dumps(document))
    return path


def seconds_per_step(records: Sequence[dict]) -> float:
    """Mean seconds per step over steps 2..N of a run's training records: from the end of step 1 to the end of
    step N's training and weight push, what followed them in step N (the run's final checkpoint) left out, and
    with it the last step's milliseconds of bookkeeping between its wait and its training."""
    if len(records) < 2:
        raise ValueError(f"seconds per step needs at least 2 training steps, got {len(records)}")
    end = phases_end(records[-1], ("seconds/wait", "seconds/train_wall", "seconds/sync"))
    return (end - records[0]["time"]) / (len(records) - 1)


def busy_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``(start, end)`` intervals: a generator sampling several groups at once
    is busy once, and idle between them not at all."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


# The generator's log line for each push it took (services/generator/weight_update.py::update_report).
_PUSH_LINE = re.compile(r"policy version \d+ loaded over .* (\d+) prompts in flight \((?:kept|recomputed)\)")


def prompts_in_flight_at_pushes(log: str) -> list[int]:
    """The prompts sampling when each push of a generator's log paused its engine, in order."""
    return [int(match.group(1)) for match in _PUSH_LINE.finditer(log)]


def sampling_per_batch(batches: Sequence[dict]) -> float:
    """The generator's busy seconds per trained batch (the first batch, sampled while the learner started, left
    out): the union of the batches' groups' sampling intervals over the number of batches."""
    later = batches[1:]
    spans = [iv for b in later for iv in zip(b["sampling_started_at"], b["sampling_finished_at"], strict=True)]
    return busy_seconds(spans) / len(later)


def phase_ideal(t_gen: float, t_train: float) -> float:
    """The speedup of perfect overlap over running the phases in turn: (T_gen + T_train) / max(T_gen, T_train)."""
    return (t_gen + t_train) / max(t_gen, t_train)


def run_mode(
    model: Path,
    mode: str,
    steps: int,
    groups: int,
    context: int,
    rest: tuple[dict[str, str] | None, str | None],
    in_flight: str,
) -> dict[str, float]:
    """One run; ``rest``: the launcher's environment and cores (None: this process's); ``in_flight``: the
    generator's ``in_flight_at_push``."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{mode}-") as scratch:
        tmp = Path(scratch)
        config = _config(tmp, model, mode, steps, groups, context, in_flight)
        result = run_pipeline(config, timeout_s=3600, env=rest[0], cpus=rest[1])
        if result.returncode != 0:
            logs = "".join(f"\n--- {log.name}\n{log.read_text()[-2000:]}" for log in (tmp / "logs").glob("*.log"))
            raise RuntimeError(f"{mode} run failed:\n{(result.stdout + result.stderr)[-3000:]}{logs}")
        lines = (tmp / "logs" / "metrics.jsonl").read_text().splitlines()
        records = training_records([json.loads(line) for line in lines])
        batches = [json.loads(line) for line in (tmp / "logs" / "batches.jsonl").read_text().splitlines()]
        in_flight = prompts_in_flight_at_pushes((tmp / "logs" / "generator-0.log").read_text(errors="replace"))
    if len(in_flight) < steps:  # every step pushes: a missing line is a changed log line, not zero pushes
        raise RuntimeError(f"{mode} run: {len(in_flight)} push lines in the generator's log for {steps} steps")
    later = records[1:]
    return {
        "seconds_per_step": seconds_per_step(records),
        "wait": statistics.mean(r["seconds/wait"] for r in later),
        "train": statistics.mean(r["seconds/train_wall"] + r["seconds/sync"] for r in later),
        "push": statistics.mean(r["seconds/sync"] for r in later),
        "sampling": sampling_per_batch(batches),
        "staleness": statistics.mean(r["staleness/mean"] for r in records),
        "tokens": statistics.mean(r["completion_tokens"] for r in later),
        "pushes": len(in_flight),
        "pushes_while_sampling": sum(1 for prompts in in_flight if prompts),
        "prompts_in_flight_at_pushes": statistics.mean(in_flight) if in_flight else 0.0,
    }


def main(args) -> None:
    usable = os.sched_getaffinity(0)
    if not {GENERATOR_CORE, LEARNER_CORE} <= usable:  # found now, not after both runs
        raise SystemExit(
            f"the bench pins the generator to core {GENERATOR_CORE} and the learner to core {LEARNER_CORE}; this "
            f"process may use cores {sorted(usable)} (run it without a taskset that leaves either out)"
        )
    if args.model == "tiny":
        from tests.support.tiny_model import build_tiny_llama

        model = build_tiny_llama(Path(tempfile.mkdtemp()) / "tiny", seed=1, hidden=256, layers=4, logit_scale=1.0)
        context = 512  # the tiny model's position limit
    else:
        from services.launcher.prepare_model import prepare_smollm2

        model = prepare_smollm2()
        context = 1024
    server = None
    rest: tuple[dict[str, str] | None, str | None] = (None, None)
    if not args.unpinned_rest:  # off the learner's core: its Redis, the launcher (the scorer is pinned by config)
        server = start_redis()
        if server.process is not None:
            os.sched_setaffinity(server.process.pid, {GENERATOR_CORE})
        rest = ({**os.environ, "REDIS_URL": server.url}, str(GENERATOR_CORE))
    try:
        sync = run_mode(model, "sync", args.steps, args.groups, context, rest, args.in_flight_at_push)
        asyn = run_mode(model, "async", args.steps, args.groups, context, rest, args.in_flight_at_push)
    finally:
        if server is not None:
            server.stop()
    # Alone: the sync run's phases, each running while the other side idles.
    t_gen, t_train = sync["wait"], sync["train"]
    ideal = phase_ideal(t_gen, t_train)
    # Side by side: the async run's phases, each beside the other; the generator's part of the wait is its
    # busy sampling time per batch (the rest, scoring and the streams, is taken as in the sync run).
    t_gen_beside = t_gen + asyn["sampling"] - sync["sampling"]
    t_train_beside = asyn["train"]
    ideal_beside = sync["seconds_per_step"] / max(t_gen_beside, t_train_beside)
    speedup = sync["seconds_per_step"] / asyn["seconds_per_step"]
    print(
        f"async vs sync: {args.model} model, {args.groups} groups x G=8 per step, {args.steps} steps, "
        "generator on core 0, learner on core 1, "
        + ("launcher and Redis unpinned" if args.unpinned_rest else "scorer, launcher and Redis on core 0")
        + f"; in-flight requests at a push: {args.in_flight_at_push}"
    )
    print(
        f"{'mode':<6} {'s/step':>7} {'wait s':>7} {'sampling s':>11} {'train+push s':>13} {'push s':>7} "
        f"{'staleness':>10} {'tokens/step':>12}"
    )
    for name, row in (("sync", sync), ("async", asyn)):
        print(
            f"{name:<6} {row['seconds_per_step']:>7.2f} {row['wait']:>7.2f} {row['sampling']:>11.2f} "
            f"{row['train']:>13.2f} {row['push']:>7.2f} {row['staleness']:>10.2f} {row['tokens']:>12.0f}"
        )
    print(f"phases alone (sync run): T_gen {t_gen:.2f} s, T_train {t_train:.2f} s -> ideal speedup {ideal:.2f}")
    print(
        f"phases side by side (async run): T_gen {t_gen_beside:.2f} s (sampling {sync['sampling']:.2f} -> "
        f"{asyn['sampling']:.2f}), T_train {t_train_beside:.2f} s ({t_train_beside / t_train:.2f}x alone) -> ideal "
        f"speedup {ideal_beside:.2f}"
    )
    print(
        f"measured speedup {speedup:.2f}: {speedup / ideal_beside:.2f} of the side-by-side ideal (what overlap "
        "itself costs); the rest is what each phase loses beside the other"
    )
    print(
        f"of the generator's {asyn['sampling'] - sync['sampling']:+.2f} s per batch beside the learner, up to "
        f"{asyn['push']:.2f} s is the pause for the step's weight push; pushes that landed while prompts were "
        f"sampling: async run {asyn['pushes_while_sampling']} of {asyn['pushes']} "
        f"({asyn['prompts_in_flight_at_pushes']:.1f} prompts in flight a push), sync run "
        f"{sync['pushes_while_sampling']} of {sync['pushes']} (the generator's log)"
    )
    # Both runs sample every completion to COMPLETION_TOKENS, so this is 1.00 unless a completion was cut short
    # (the context): then the times per completion token tell the slowdown apart from the work.
    tokens = asyn["tokens"] / sync["tokens"]
    print(
        f"per completion token (async run {asyn['tokens']:.0f} a step, sync {sync['tokens']:.0f}: {tokens:.2f}x): "
        f"sampling {asyn['sampling'] / sync['sampling'] / tokens:.2f}x, train + push "
        f"{t_train_beside / t_train / tokens:.2f}x their time alone"
    )
    # What the machine itself loses running both cores at once, measured on the cores the phases ran on.
    sharing = interference.measure([GENERATOR_CORE, LEARNER_CORE], seconds=0.5 if args.quick else 3.0)
    print(
        f"{interference.describe(sharing)}; the phases side by side kept {sync['sampling'] / asyn['sampling']:.2f} "
        f"(sampling) and {t_train / t_train_beside:.2f} (train + push) of their speed alone"
    )
    print(f"ratio measured/ideal: {speedup / ideal:.2f}  (goal >= 0.95, ideal from phases alone)")
    if args.record:
        figures = {"sync_s_per_step": sync["seconds_per_step"], "async_s_per_step": asyn["seconds_per_step"]}
        figures |= {"t_gen_s": t_gen, "t_train_s": t_train, "ideal_speedup": ideal, "speedup": speedup}
        figures |= {"t_gen_beside_s": t_gen_beside, "t_train_beside_s": t_train_beside}
        figures |= {"ideal_speedup_beside": ideal_beside, "push_s": sync["push"], "push_beside_s": asyn["push"]}
        figures |= {"completion_tokens_sync": sync["tokens"], "completion_tokens_async": asyn["tokens"]}
        figures |= {"pushes_async": asyn["pushes"], "pushes_while_sampling_async": asyn["pushes_while_sampling"]}
        figures |= {f"{kind}_together_over_alone": value for kind, value in sharing.items()}
        record("async_vs_sync", figures, args, ratio=speedup / ideal, goal=">= 0.95")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny model, 4 steps (smoke test)")
    parser.add_argument(
        "--unpinned-rest",
        action="store_true",
        help="leave the launcher unpinned and use the Redis at $REDIS_URL (else the local default) instead of "
        "one the bench starts on core 0",
    )
    parser.add_argument(
        "--in-flight-at-push",
        choices=["recompute", "keep"],
        default=GeneratorSettings.model_fields["in_flight_at_push"].default,
        help="what a push does to the requests sampling when it lands (generator.in_flight_at_push; default: its "
        "default); a sync run's pushes land while nothing samples",
    )
    add_record_flag(parser)
    arguments = parser.parse_args()
    refuse_quick(arguments)
    if arguments.quick:
        arguments.model, arguments.steps = "tiny", 4
    main(arguments)
