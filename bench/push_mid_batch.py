"""A weight push that lands mid-batch: what it costs the batch, by ``generator.in_flight_at_push``.

The generator's ``Engine`` (vLLM, this process's cores) samples batches of the CPU demo's prompts
(``bench/generator.py``'s workload: the demo's rows, framing, G and sampling, every completion ``--max-tokens``
long: min = max tokens), distinct prompts each. Three kinds of batch, in rotation:

* **none**: no push;
* **recompute**: half way through the batch (half the calibration batch's seconds) the engine takes a push the
  way ``Engine.update_weights`` does, less the transfer: pause (requests kept), then ``_take_version``, which
  preempts the requests in flight and recomputes them (vLLM's ``reset_prefix_cache(reset_running_requests=True)``),
  takes a new prefix-cache salt and resumes;
* **keep**: the same push with ``in_flight_at_push = "keep"``: nothing is recomputed.

A push that finds fewer prompts sampling than the batch has measures nothing: it is printed and the batch run again with
the push at half the time (four tries, then the bench stops). The order of the three kinds rotates from round to
round.
The weights do not change (the transfer and loading are ``bench/weight_push.py``'s), so what differs is the
recompute alone. Every batch starts under a new salt, so none reads the prompts' blocks a batch before it left in
the prefix cache (as the first batch after any push). Figures: each kind's median batch seconds over
``--rounds``; the last line is the ratio of the push's batches to the batches without one (no goal: how much
``keep`` spares). ``--quick``: the tiny random Llama, 2 prompts x G 4 x 32 tokens, one round (a smoke test).

    python bench/push_mid_batch.py [--prompts 2] [--max-tokens 64] [--rounds 4] [--cpus 0] [--quick] [--record]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.generator import Workload, demo_workload, generator_settings, parse_cores, prepare_model  # noqa: E402
from bench.multi_turn import machine  # noqa: E402
from bench.record import add_record_flag, record, refuse_quick  # noqa: E402
from services.generator.weight_update import Phases  # noqa: E402
from shared.records import PromptTask  # noqa: E402

KINDS = ("none", "recompute", "keep")


async def batch(engine, work: Workload, tasks: list[PromptTask], push: str, push_at_s: float) -> tuple[float, int]:
    """One batch's wall seconds and the prompts in flight at its push (0 without one); ``push``: none, recompute
    or keep."""
    engine.loads.add(engine.policy_version)  # a new salt: no block of an earlier batch is read
    started = time.perf_counter()
    sampling = [
        asyncio.create_task(
            engine.sample(ids, t.sampling.model_copy(update={"min_tokens": t.sampling.max_tokens}), t.group_size)
        )
        for t, ids in zip(tasks, work.ids(tasks), strict=True)
    ]
    in_flight = 0
    if push != "none":
        await asyncio.sleep(push_at_s)
        engine.settings = engine.settings.model_copy(update={"in_flight_at_push": push})
        await engine._pause_scheduler()  # Engine.update_weights's steps, less the transfer
        in_flight = engine.active_requests
        await engine._take_version(engine.policy_version + 1, Phases())
    groups = await asyncio.gather(*sampling)
    seconds = time.perf_counter() - started
    expected = sum(t.group_size * t.sampling.max_tokens for t in tasks)
    if sum(g.num_tokens for g in groups) != expected:
        raise RuntimeError(f"a batch sampled {sum(g.num_tokens for g in groups)} tokens, expected {expected}")
    return seconds, in_flight


async def measure(
    settings, model: Path, work: Workload, rounds: int
) -> tuple[float, dict[str, list[float]], list[int]]:
    """Start the engine; the calibration batch's seconds, each kind's batch seconds, the prompts in flight at each
    push. The engine is shut down in this event loop, the one its client runs in."""
    from services.generator.engine import Engine

    engine = Engine.start(settings, str(model), policy_version=0)
    try:
        return await _measure(engine, work, rounds)
    finally:
        engine.shutdown()
        await asyncio.sleep(0)  # its cancelled output tasks end


async def _measure(engine, work: Workload, rounds: int) -> tuple[float, dict[str, list[float]], list[int]]:
    await batch(engine, work, work.warmup, "none", 0.0)
    batches = iter(work.batches)
    calibration, _ = await batch(engine, work, next(batches), "none", 0.0)
    seconds: dict[str, list[float]] = {kind: [] for kind in KINDS}
    in_flight: list[int] = []
    for round_ in range(rounds):
        for kind in KINDS[round_ % 3 :] + KINDS[: round_ % 3]:  # each kind after each other in turn
            tasks = next(batches)
            took, prompts = await mid_batch(engine, work, tasks, kind, calibration / 2)
            seconds[kind].append(took)
            if kind != "none":
                in_flight.append(prompts)
    return calibration, seconds, in_flight


async def mid_batch(engine, work: Workload, tasks: list[PromptTask], kind: str, push_at_s: float, tries: int = 4):
    """``batch`` with its push landing while every prompt samples: a push that found fewer (the batch, or part of
    it, ended first: it measures nothing) is printed and the batch run again with the push at half the time. The
    smoke test's tiny batches last about half a second, and on a loaded core this process can wake later than
    half of that."""
    for _ in range(tries):
        took, prompts = await batch(engine, work, tasks, kind, push_at_s)
        if kind == "none" or prompts == len(tasks):
            return took, prompts
        print(f"the {kind} push at {push_at_s:.2f} s found {prompts} of {len(tasks)} prompts sampling: again at half")
        push_at_s /= 2
    raise RuntimeError(f"{tries} {kind} pushes found fewer than the batch's {len(tasks)} prompts sampling")


def main(args: argparse.Namespace) -> None:
    os.sched_setaffinity(0, set(args.cpus))  # vLLM's engine core and worker inherit it
    print(machine())
    with tempfile.TemporaryDirectory(prefix="bench-push-mid-batch-") as scratch:
        model = prepare_model(args.quick, Path(scratch))
        settings = generator_settings(args, model)
        work = demo_workload(args, settings)
        calibration, seconds, in_flight = asyncio.run(measure(settings, model, work, args.rounds))
        gc.collect()  # vLLM's client, shut down, goes now rather than at the interpreter's exit
    group = work.warmup[0].group_size
    print(
        f"push mid-batch: {'tiny' if args.quick else 'smollm2'}, {settings.dtype}, {args.prompts} prompts x G "
        f"{group} x {args.max_tokens} tokens a batch, cores {args.cpus}; the push (weights unchanged) at "
        f"{calibration / 2:.2f} s, half a batch; prompts in flight at the pushes: {in_flight}"
    )
    print(f"{'kind':<10} {'median s':>9} {'min s':>7}  all")
    medians = {kind: statistics.median(values) for kind, values in seconds.items()}
    for kind, values in seconds.items():
        print(f"{kind:<10} {medians[kind]:>9.2f} {min(values):>7.2f}  {[round(v, 2) for v in values]}")
    ratios = {kind: medians[kind] / medians["none"] for kind in ("recompute", "keep")}
    print(
        "ratio with a push/without (batch s): "
        + ", ".join(f"{kind} {ratio:.2f}" for kind, ratio in ratios.items())
        + " (no goal: what keep spares)"
    )
    if args.record:
        figures = {f"{kind}_batch_s": median for kind, median in medians.items()}
        figures |= {f"{kind}_over_none": ratio for kind, ratio in ratios.items()}
        record("push_mid_batch", figures, args, ratio=None, goal="")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=2, help="prompts a batch (each G completions)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per completion (64; --quick 32)")
    parser.add_argument("--rounds", type=int, default=4, help="batches of each kind, in rotation")
    parser.add_argument("--cpus", default="0", help="cores of this process and the engine's, e.g. '0' or '0-1'")
    parser.add_argument("--quick", action="store_true", help="tiny random model, one round (smoke test)")
    add_record_flag(parser)
    args = parser.parse_args(argv)
    refuse_quick(args)
    args.cpus = parse_cores(args.cpus)
    if args.max_tokens is None:
        args.max_tokens = 32 if args.quick else 64
    if args.quick:
        args.rounds = 1
    # What bench/generator.py's workload helpers read: the demo's G (4 with --quick), one warm-up prompt, one
    # calibration batch and a batch per kind and round.
    args.group, args.warmup, args.in_flight, args.block_size = (4 if args.quick else None), 1, None, None
    args.repeats = 1 + args.rounds * len(KINDS)
    return args


if __name__ == "__main__":
    main(parse_args())
