"""Generator service vs vLLM alone: what does the service cost on top of the engine it drives? (issue #37,
goal >= 0.9.)

The same prompts, G, sampling parameters and engine configuration, on the same cores, in one invocation:

1. **vllm**: vLLM's own ``LLM`` in this process, built with the arguments the generator's ``Engine`` gives
   ``AsyncLLM`` (dtype, context, KV cache, block size, ``max_num_seqs``, processed logprobs, eager), then one
   ``LLM.generate`` of every prompt as token ids, each with the ``SamplingParams`` the generator sends for it
   (``services.generator.engine.request_params``: ``n = G``, the sampled token's logprob, final output only).
   Timed around ``generate`` only, after a warm-up ``generate``; the engine is shut down before (2).
2. **service**: the real generator process (``python -m services.generator --config FILE``, base weights at
   policy version 0: no learner needed), its ``[generator]`` table written from the same settings. Once it
   says it is ready and a warm-up batch has gone through, every ``PromptTask`` is added to the prompts stream
   at once (one pipelined XADD) and the ``Rollout`` records are read back from the rollouts stream through a
   consumer group, decoded and acknowledged, as a scorer does. Timed from the first XADD to the last Rollout
   read.

Prompts: the CPU demo's (``configs/demo-cpu.toml``): its built-in arithmetic rows in the learner's feeder order,
framed by the demo's system prompt, worked example and assistant prefill, rendered with the model's chat
template by the generator's own tokenization; the Rollouts' prompt ids are checked against those given to
``LLM.generate``. Sampling: the demo learner's (``services.learner.startup.sampling_spec``: temperature 1.0,
top_p 1.0, its ``max_completion_length`` unless ``--max-tokens``), G = its ``group_size``. Engine: the demo's
``[generator]`` table (float32, ``max_model_len`` 1024, 2 GiB KV cache, ``max_num_seqs`` 64,
``max_prompts_in_flight`` 32), the generator's default block size (32 on CPUs) unless ``--block-size``.

This process and every process it starts (vLLM's engine core, the generator and its engine core) are pinned to
``--cpus`` (default: every core this process may use), and vLLM's threads are bound to them
(``VLLM_CPU_OMP_THREADS_BIND``). Figures: sampled tokens (the sum of every completion's token count) / seconds;
with ``--repeats R`` each side times R batches of other prompts (the same batches on both sides) and keeps its
fastest, which a machine shared with other work needs. Beside them, the CPU seconds per 1000 sampled tokens of
the front-end process (this one for vllm, the generator's for the service) and of its engine processes (its
descendants: vLLM's engine core and worker): what the service adds shows in its front-end's share. Other load
inflates both (the engine's up to 2-5x on a busy 2-core machine), so compare sides within one run. The last
line is the ratio service/vllm of sampled tokens/s (goal >= 0.9). ``--quick`` is a smoke test: the tiny
random Llama (``tests/support/tiny_model.py``, ``max_model_len`` 512), 4 prompts, 32 tokens.

    python bench/generator.py [--prompts 32] [--repeats 1] [--group 8] [--max-tokens N] [--warmup 2]
                              [--in-flight N] [--block-size N] [--cpus 0-1] [--quick] [--record]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import tomli_w  # noqa: E402

from bench.multi_turn import core_ranges, machine  # noqa: E402
from bench.record import add_record_flag, record, refuse_quick  # noqa: E402
from services.learner.data.feeder import PromptFeeder, load_rows  # noqa: E402
from shared.codec import decode, encode  # noqa: E402
from shared.config.generator import GeneratorSettings  # noqa: E402
from shared.config.learner import LearnerSettings  # noqa: E402
from shared.keys import Keys  # noqa: E402
from shared.records import PromptTask, Rollout  # noqa: E402
from shared.redis_conn import connect  # noqa: E402
from shared.streams import StreamConsumer, StreamProducer  # noqa: E402
from tests.support.processes import ServiceProcess, start_service  # noqa: E402
from tests.support.redis_server import free_port, use_or_start_redis  # noqa: E402

DEMO_CONFIG = ROOT / "configs" / "demo-cpu.toml"
TOKEN = "bench-token-0123456789abcdef0123456789"
GENERATOR_ID = "bench-generator"
ENGINE_START_S = 600
RUN_TIMEOUT_S = 3600
# The [generator] fields the bench passes on to the service; the same values build the vllm side's LLM.
SERVICE_FIELDS = frozenset(
    {
        "model",
        "dtype",
        "max_model_len",
        "kv_cache_gib",
        "max_num_seqs",
        "block_size",
        "max_prompts_in_flight",
        "enforce_eager",
        "omp_cpus",
        "claim_idle_ms",
        "max_rollout_backlog",
    }
)
QUICK_CONTEXT = 512  # the tiny model's position limit


@dataclass(frozen=True)
class Figures:
    """One side's timed batch: prompts (groups), completions, sampled tokens, wall seconds, and the CPU seconds
    its front-end process (this one for vllm, the generator for the service) and its engine processes (vLLM's
    engine core and worker, the front-end's descendants) spent meanwhile."""

    side: str
    groups: int
    completions: int
    sampled_tokens: int
    seconds: float
    front_cpu_s: float
    engine_cpu_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.sampled_tokens / self.seconds


@dataclass(frozen=True)
class Workload:
    """The warm-up prompts and the timed batches (distinct prompts each) as tasks, and each task's prompt token
    ids (the generator's rendering)."""

    warmup: list[PromptTask]
    batches: list[list[PromptTask]]
    prompt_ids: dict[str, list[int]]  # task_id -> ids

    def ids(self, tasks: list[PromptTask]) -> list[list[int]]:
        return [self.prompt_ids[t.task_id] for t in tasks]


class CpuClock:
    """CPU seconds (user + system) of one process and of its descendants, since the clock was made."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.start = self._read()

    def _read(self) -> tuple[float, float]:
        engine = 0.0
        for child in self.process.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                engine += sum(child.cpu_times()[:2])
        return sum(self.process.cpu_times()[:2]), engine

    def elapsed(self) -> tuple[float, float]:
        """(front-end, descendants) CPU seconds since the start."""
        front, engine = self._read()
        return front - self.start[0], engine - self.start[1]


def parse_cores(text: str) -> list[int]:
    """``'0-2,5'`` as ``[0, 1, 2, 5]``."""
    cores: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    if not cores:
        raise ValueError(f"--cpus {text!r} names no core; e.g. '0-1' or '0,2'")
    return sorted(cores)


def prepare_model(quick: bool, scratch: Path) -> Path:
    """SmolLM2-135M-Instruct (the demo's model), or with ``quick`` a tiny random Llama built in ``scratch``."""
    if quick:
        from tests.support.tiny_model import build_tiny_llama

        return build_tiny_llama(scratch / "tiny", seed=1, logit_scale=1.0, max_positions=QUICK_CONTEXT)
    from services.launcher.prepare_model import prepare_smollm2

    return prepare_smollm2()


def generator_settings(args: argparse.Namespace, model: Path) -> GeneratorSettings:
    """The demo's ``[generator]`` table on ``model``, with this run's cores, block size and in-flight limit."""
    overrides = {"model": str(model), "omp_cpus": core_ranges(args.cpus), "block_size": args.block_size}
    if args.in_flight is not None:
        overrides["max_prompts_in_flight"] = args.in_flight
    if args.quick:
        overrides["max_model_len"] = QUICK_CONTEXT
    return GeneratorSettings.load(DEMO_CONFIG, **overrides)


def demo_workload(args: argparse.Namespace, settings: GeneratorSettings) -> Workload:
    """The demo's first ``warmup + repeats x prompts`` tasks, in the learner feeder's order, and their prompt
    ids."""
    from transformers import AutoTokenizer

    from services.generator.engine import Engine
    from services.learner.startup import sampling_spec

    learner = LearnerSettings.load(DEMO_CONFIG, model=settings.model)
    spec = sampling_spec(learner)
    if args.max_tokens is not None:
        spec = spec.model_copy(update={"max_tokens": args.max_tokens})
    group = args.group or learner.group_size
    feeder = PromptFeeder(load_rows(learner.data), learner.data, spec, group)
    tasks = [feeder.next_task(policy_version=0) for _ in range(args.warmup + args.repeats * args.prompts)]
    # The generator's own rendering (chat template, prefill continued), without starting an engine.
    renderer = Engine(settings, None, AutoTokenizer.from_pretrained(settings.model), policy_version=0)
    ids = {t.task_id: renderer.tokenize(t.prompt) for t in tasks}
    timed = tasks[args.warmup :]
    batches = [timed[i : i + args.prompts] for i in range(0, len(timed), args.prompts)]
    return Workload(tasks[: args.warmup], batches, ids)


# vllm alone ----------------------------------------------------------------------------------------------


def start_llm(settings: GeneratorSettings):
    """vLLM's ``LLM`` with the engine arguments and environment ``Engine.start`` gives ``AsyncLLM``."""
    from vllm import LLM

    from services.generator.engine import WORKER_EXTENSION, engine_block_size, engine_dtype, vllm_on_cpu
    from weight_sync.receiver import WEIGHTS_IN_PLACE_ENV

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(settings.kv_cache_gib))))
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = settings.omp_cpus
    os.environ[WEIGHTS_IN_PLACE_ENV] = "1" if settings.cpu_weights_in_place else "0"
    return LLM(
        model=settings.model,
        dtype=engine_dtype(settings.dtype, vllm_on_cpu()),  # as Engine.start asks
        max_model_len=settings.max_model_len,
        logprobs_mode="processed_logprobs",
        enforce_eager=settings.enforce_eager,
        max_num_seqs=settings.max_num_seqs,
        block_size=engine_block_size(settings.block_size, vllm_on_cpu()),  # as Engine.start asks
        tensor_parallel_size=settings.tensor_parallel_size,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        worker_extension_cls=WORKER_EXTENSION,
    )


def generate(llm, settings: GeneratorSettings, tasks: list[PromptTask], prompt_ids: list[list[int]]) -> Figures:
    """One ``LLM.generate`` of every prompt with the generator's sampling parameters for it, timed."""
    from vllm.inputs import TokensPrompt

    from services.generator.engine import request_params

    params = [
        request_params(settings.max_model_len, ids, task.sampling, task.group_size)
        for task, ids in zip(tasks, prompt_ids, strict=True)
    ]
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids]
    clock = CpuClock(os.getpid())
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    cpu = clock.elapsed()
    completions = [c for output in outputs for c in output.outputs]
    expected = sum(t.group_size for t in tasks)
    if len(completions) != expected:
        raise RuntimeError(f"LLM.generate returned {len(completions)} completions, expected {expected}")
    return Figures("vllm", len(tasks), len(completions), sum(len(c.token_ids) for c in completions), seconds, *cpu)


def run_vllm(settings: GeneratorSettings, work: Workload) -> list[Figures]:
    """Warm up, then time one ``generate`` per batch; the engine is shut down on the way out."""
    llm = start_llm(settings)
    try:
        if work.warmup:
            generate(llm, settings, work.warmup, work.ids(work.warmup))
        return [generate(llm, settings, batch, work.ids(batch)) for batch in work.batches]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


# the service ---------------------------------------------------------------------------------------------


def start_generator(settings: GeneratorSettings, scratch: Path, redis_url: str, prefix: str) -> ServiceProcess:
    """``python -m services.generator`` on a ``[generator]`` table written from ``settings``, once ready."""
    table = {k: v for k, v in settings.model_dump(include=SERVICE_FIELDS).items() if v is not None}
    table |= {"port": free_port(), "generator_id": GENERATOR_ID}
    config = scratch / "generator.toml"
    config.write_text(tomli_w.dumps({"generator": table}))
    env = {"REDIS_URL": redis_url, "STREAM_PREFIX": prefix, "API_TOKEN": TOKEN, "LOG_LEVEL": "WARNING"}
    service = start_service("generator", "services.generator", env, ["--config", str(config)])
    try:
        service.wait_for_line("ready on port", ENGINE_START_S)
    except (TimeoutError, RuntimeError):
        service.kill()
        raise
    return service


async def feed_and_collect(
    client, keys: Keys, service: ServiceProcess, tasks: list[PromptTask], prompt_ids: dict[str, list[int]]
) -> Figures:
    """Add every task at once, read back every Rollout (decoded, acknowledged), timed; each rollout's prompt
    ids are checked against the ids the vllm side was given."""
    consumer = StreamConsumer(client, keys, keys.rollouts, "bench", "bench-0", batch_size=64, block_ms=1000)
    await consumer.start()
    payloads = [(t.task_id, encode(t)) for t in tasks]
    rollouts: dict[str, Rollout] = {}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    clock = CpuClock(service.process.pid)
    started = time.perf_counter()
    await StreamProducer(client, keys.prompts).add_many(payloads)
    while len(rollouts) < len(tasks):
        deliveries = await consumer.read()
        for delivery in deliveries:
            rollout = decode(delivery.payload, Rollout)
            rollouts[rollout.group_id] = rollout
        await consumer.commit_many([(d, ()) for d in deliveries])
        if not deliveries:
            stalled(service, len(rollouts), len(tasks), deadline)
    seconds = time.perf_counter() - started
    cpu = clock.elapsed()
    mismatched = [g for g, r in rollouts.items() if r.prompt_token_ids.tolist() != prompt_ids[g]]
    if mismatched:
        raise RuntimeError(f"{len(mismatched)} rollouts have other prompt ids than the vllm side was given")
    completions = [c for r in rollouts.values() for c in r.completions]
    sampled = sum(len(c.token_ids) for c in completions)
    return Figures("service", len(rollouts), len(completions), sampled, seconds, *cpu)


def stalled(service: ServiceProcess, done: int, expected: int, deadline: float) -> None:
    """Raise when no more rollouts can come: the generator ended, or the run took too long."""
    if service.process.poll() is not None:
        raise RuntimeError(f"the generator exited ({service.process.returncode}):\n{service.output()[-4000:]}")
    if time.monotonic() > deadline:
        raise TimeoutError(f"{done} of {expected} rollouts after {RUN_TIMEOUT_S} s:\n{service.output()[-4000:]}")


async def measure_service(service: ServiceProcess, redis_url: str, prefix: str, work: Workload) -> list[Figures]:
    """The warm-up tasks, then each timed batch, through the running generator."""
    client = await connect(redis_url)
    keys = Keys(prefix)
    try:
        if work.warmup:
            await feed_and_collect(client, keys, service, work.warmup, work.prompt_ids)
        return [await feed_and_collect(client, keys, service, batch, work.prompt_ids) for batch in work.batches]
    finally:
        await client.aclose()


async def delete_keys(redis_url: str, prefix: str) -> None:
    """Every key of this run's streams (after the generator stopped: it blocks reading one of them)."""
    client = await connect(redis_url)
    try:
        doomed = [key async for key in client.scan_iter(match=f"{prefix}:*", count=1000)]
        if doomed:
            await client.delete(*doomed)
    finally:
        await client.aclose()


def run_service(settings: GeneratorSettings, work: Workload, scratch: Path) -> list[Figures]:
    """Start the generator, time each batch through it, stop it (exit status 0 expected)."""
    redis_url, redis_server = use_or_start_redis()
    prefix = f"bench-generator-{uuid.uuid4().hex[:8]}"
    try:
        service = start_generator(settings, scratch, redis_url, prefix)
        try:
            figures = asyncio.run(measure_service(service, redis_url, prefix, work))
        finally:
            code = service.stop(120)
        if code != 0:
            raise RuntimeError(f"the generator exited with {code}:\n{service.output()[-4000:]}")
        return figures
    finally:
        asyncio.run(delete_keys(redis_url, prefix))
        if redis_server:
            redis_server.stop()


# report --------------------------------------------------------------------------------------------------


def table(results: list[Figures]) -> str:
    """One row per timed batch; CPU figures in seconds per 1000 sampled tokens."""
    lines = [
        "side     batch  groups  completions  sampled tokens  seconds  sampled tokens/s  "
        "front-end CPU s/1k tok  engine CPU s/1k tok"
    ]
    for index, r in enumerate(results):
        kilo = r.sampled_tokens / 1000
        lines.append(
            f"{r.side:<8} {index % (len(results) // 2) + 1:>5} {r.groups:>7} {r.completions:>12} "
            f"{r.sampled_tokens:>15} {r.seconds:>8.1f} {r.tokens_per_s:>17.1f} {r.front_cpu_s / kilo:>23.2f} "
            f"{r.engine_cpu_s / kilo:>20.2f}"
        )
    return "\n".join(lines)


def describe(settings: GeneratorSettings, work: Workload) -> str:
    from services.generator.engine import engine_dtype, vllm_on_cpu

    task = work.batches[0][0]
    spec = task.sampling
    blocks = "the generator's default (32 on CPUs)" if settings.block_size is None else str(settings.block_size)
    lengths = [len(ids) for ids in work.prompt_ids.values()]
    dtype = engine_dtype(settings.dtype, vllm_on_cpu())
    return (
        f"model {Path(settings.model).name}, {dtype} (dtype {settings.dtype}); {len(work.batches)} timed batch(es) of "
        f"{len(work.batches[0])} demo prompts ({min(lengths)}-{max(lengths)} tokens) after {len(work.warmup)} "
        f"warm-up, G {task.group_size}, temperature {spec.temperature}, top_p {spec.top_p}, max_tokens "
        f"{spec.max_tokens}; max_model_len {settings.max_model_len}, KV cache {settings.kv_cache_gib} GiB, block "
        f"size {blocks}, max_num_seqs {settings.max_num_seqs}, max_prompts_in_flight "
        f"{settings.max_prompts_in_flight}; cores {settings.omp_cpus} (both sides)"
    )


def best(results: list[Figures]) -> Figures:
    """The batch with the most sampled tokens/s (the one least slowed by whatever else ran)."""
    return max(results, key=lambda r: r.tokens_per_s)


def main(args: argparse.Namespace) -> None:
    os.sched_setaffinity(0, set(args.cpus))  # every process started from here on inherits it
    print(machine())
    with tempfile.TemporaryDirectory(prefix="bench-generator-") as scratch:
        model = prepare_model(args.quick, Path(scratch))
        settings = generator_settings(args, model)
        work = demo_workload(args, settings)
        print(describe(settings, work), flush=True)
        vllm = run_vllm(settings, work)
        print(f"vllm: {[round(r.tokens_per_s, 1) for r in vllm]} sampled tokens/s", file=sys.stderr)
        service = run_service(settings, work, Path(scratch))
        print(f"service: {[round(r.tokens_per_s, 1) for r in service]} sampled tokens/s", file=sys.stderr)
    print(table([*vllm, *service]))
    fastest = {"vllm": best(vllm), "service": best(service)}
    ratio = fastest["service"].tokens_per_s / fastest["vllm"].tokens_per_s
    print(f"best of {args.repeats}: " + ", ".join(f"{k} {v.tokens_per_s:.1f}" for k, v in fastest.items()))
    print(f"ratio service/vllm (tokens/s): {ratio:.2f} (goal >= 0.9)")
    if args.record:
        figures = {f"{side}_tokens_per_s": r.tokens_per_s for side, r in fastest.items()}
        record("generator", figures, args, ratio=ratio, goal=">= 0.9")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=None, help="timed prompts (32; --quick 4)")
    parser.add_argument("--group", type=int, default=None, help="G samples per prompt (the demo's group_size)")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="tokens per completion at most (the demo's; --quick 32)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="warm-up prompts before each side's timed batches")
    parser.add_argument(
        "--repeats", type=int, default=1, help="timed batches per side, other prompts each; the best is kept"
    )
    parser.add_argument(
        "--in-flight", type=int, default=None, help="the generator's max_prompts_in_flight (the demo's: 32)"
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="KV-cache block size of both sides (default: the generator's, 32 on CPUs)",
    )
    parser.add_argument(
        "--cpus", default=None, help="cores of both sides, e.g. '0-1' (default: all this process may use)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny random model, 4 prompts (smoke test)")
    add_record_flag(parser)
    args = parser.parse_args(argv)
    refuse_quick(args)
    args.cpus = parse_cores(args.cpus) if args.cpus else sorted(os.sched_getaffinity(0))
    if args.prompts is None:
        args.prompts = 4 if args.quick else 32
    if args.quick and args.max_tokens is None:
        args.max_tokens = 32
    return args


if __name__ == "__main__":
    main(parse_args())
