"""Multi-turn vs single-turn sampling: does the generator keep the engine busy while trajectories wait on
their environment? (docs/concepts/multi-turn-design.md §3 step 18, goal >= 0.8.)

The same engine (the generator's ``Engine``, vLLM in this process, its threads pinned to the cores this
process may use) samples the same prompts three ways, P prompts in flight (P x G sequences), each prompt that
ends letting the next one start, as the generator's ``max_prompts_in_flight`` does (so the slowest group of a
batch does not idle the engine, a tail that multi-turn's variable lengths would otherwise exaggerate):

* single: one request with ``n = G`` per prompt (``Engine.sample``), as the generator samples single-turn;
* multi (python): G trajectories per prompt through ``TrajectoryRunner`` (one ``sample_turn`` request per
  turn), with ``tests/support/bench_envs.py::SleepEnv`` in this process, whose tool awaits 50 ms;
* multi (http): the same, the environment served by ``python -m services.env_server`` in its own process
  (real HTTP, bearer auth, exactly-once bookkeeping).

A model that has never seen a tool call does not write one, so the runner's parser is replaced by one that
reads every turn the model closes (its close token) as one call to ``echo``; ``max_turns = K`` caps the
trajectory, so it has K turns unless its token budget runs out first. The same sampled-token count per
sample: the multi-turn runs go first; the single-turn run then samples, for each prompt, exactly the mean
number of sampled tokens per sample of that prompt's two multi-turn groups (``min_tokens = max_tokens``: vLLM
holds back the end-of-text token until then), from the same prompt ids (sample 0's, tool schemas rendered in).
Context tokens (the template's tool messages and headers) are read by the engine but not counted: they are
part of the multi-turn overhead being measured.

Figures: sampled tokens / wall seconds of each run (a warm-up of both paths first). The last line is the
ratio multi/single of sampled tokens/s for each environment (goal >= 0.8 at 50 ms). ``--quick`` uses a tiny
random model whose output layer is tilted to close a turn every ~15 tokens (as the fidelity test does);
the default is SmolLM2-135M-Instruct (``prepare_smollm2``, what the demo uses) with the demo's tool template.

    python bench/multi_turn.py [--prompts 8] [--rounds 3] [--group 8] [--turns 4] [--max-tokens 256]
                               [--max-model-len 1024] [--step-s 0.05] [--block-size N] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import gc
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import add_record_flag, record, refuse_quick  # noqa: E402
from environments.build import build_environment  # noqa: E402
from services.generator.trajectory import runner as runner_module  # noqa: E402
from services.generator.trajectory.parsing import ParsedTurn  # noqa: E402
from services.generator.trajectory.runner import TrajectoryRunner, TrajectorySettings  # noqa: E402
from shared.config.environment import EnvironmentSettings  # noqa: E402
from shared.config.generator import GeneratorSettings  # noqa: E402
from shared.records import ChatMessage, PromptTask, SamplingSpec  # noqa: E402
from tests.support.bench_envs import STEP_LATENCY_ENV  # noqa: E402
from tests.support.processes import ServiceProcess, start_service, wait_http_ok  # noqa: E402
from tests.support.redis_server import free_port  # noqa: E402

ENVIRONMENT = "tests.support.bench_envs:SleepEnv"
TOKEN = "bench-token-0123456789abcdef0123456789"
TOOLS_TEMPLATE = ROOT / "configs" / "templates" / "smollm2_tools.jinja"
ECHO_CHARS = 20  # what a call echoes back: a short tool result, as a calculator's


@dataclass(frozen=True)
class Figures:
    """One run: sampled tokens (loss-mask tokens), wall seconds, and what the trajectories looked like."""

    mode: str
    seconds: float
    samples: int
    sampled_tokens: int
    context_tokens: int = 0  # template and tool tokens the engine read, not sampled
    turns: float = 1.0
    env_p50_s: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.sampled_tokens / self.seconds

    @property
    def per_sample(self) -> float:
        return self.sampled_tokens / self.samples


class EveryTurnCalls:
    """Stands in for ``ToolCallParser``: every turn the model closes is one call to ``echo`` with the turn's
    first characters (see the module docstring)."""

    def __init__(self, tokenizer, tools, kind="hermes") -> None:
        self.tokenizer = tokenizer

    def parse(self, token_ids, turn: int) -> ParsedTurn:
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=True)[:ECHO_CHARS]
        call = {"id": f"call_{turn}_0", "name": "echo", "arguments": {"text": text}}
        function = {"name": "echo", "arguments": call["arguments"]}
        message = {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": call["id"], "type": "function", "function": function}],
        }
        return ParsedTurn(message, (call,), (), False)


def core_ranges(cores: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``'0-2,5'`` (the form VLLM_CPU_OMP_THREADS_BIND reads)."""
    spans: list[list[int]] = []
    for core in sorted(cores):
        if spans and core == spans[-1][1] + 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


def machine() -> str:
    """CPU model, cores, date and commit, for the figures' provenance."""
    model = platform.processor() or "unknown CPU"
    with open("/proc/cpuinfo") as cpuinfo:
        names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    model = names[0] if names else model

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") + (" (working tree modified)" if git("status", "--porcelain") else "")
    cores = len(os.sched_getaffinity(0))
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"machine: {model}, {cores} of {os.cpu_count()} cores; {when}; commit {commit}"


def tasks(prompts: int, group: int, spec: SamplingSpec) -> list[PromptTask]:
    """``prompts`` distinct one-message prompts of G samples each."""
    questions = [f"Tell me, step by step, something interesting about the number {7 * i + 3}." for i in range(prompts)]
    return [
        PromptTask(prompt=(ChatMessage(role="user", content=q),), group_size=group, sampling=spec, policy_version=0)
        for q in questions
    ]


async def streamed(jobs: list[Callable[[], Awaitable[Any]]], in_flight: int) -> tuple[list[Any], float]:
    """Run ``jobs`` in order, at most ``in_flight`` at once (the generator's ``max_prompts_in_flight``): each
    one that ends lets the next start, so a slow group holds one slot, not the whole run. Results, seconds."""
    slots = asyncio.Semaphore(in_flight)

    async def one(job: Callable[[], Awaitable[Any]]) -> Any:
        async with slots:
            return await job()

    started = time.perf_counter()
    results = await asyncio.gather(*(one(job) for job in jobs))
    return results, time.perf_counter() - started


async def run_multi(
    engine, environment, settings: TrajectorySettings, work: list[PromptTask], in_flight: int, mode: str
) -> tuple[Figures, list[tuple[list[int], float]]]:
    """Every prompt's G trajectories; the figures and, per prompt, its ids (sample 0's) and the mean sampled
    tokens of its samples."""
    runner = TrajectoryRunner(engine, environment, settings)
    groups, seconds = await streamed([functools.partial(runner.run, task) for task in work], in_flight)
    completions = [c for g in groups for c in g.completions]
    sampled = sum(int(c.loss_mask.sum()) for c in completions)
    latencies = [float(x) for c in completions for x in c.trajectory.env_latency_s]
    figures = Figures(
        mode=mode,
        seconds=seconds,
        samples=len(completions),
        sampled_tokens=sampled,
        context_tokens=sum(len(c.token_ids) for c in completions) - sampled,
        turns=statistics.mean(c.trajectory.turns for c in completions),
        env_p50_s=statistics.median(latencies) if latencies else None,
    )
    per_prompt = [(g.prompt_token_ids, g.num_tokens / len(g.completions)) for g in groups]
    return figures, per_prompt


async def run_single(engine, work: list[tuple[list[int], int]], group: int, in_flight: int) -> Figures:
    """One ``n = G`` request per prompt (its ids, its sampled tokens per sample), every sample exactly that
    many sampled tokens long."""

    def request(prompt_ids: list[int], tokens: int) -> Callable[[], Awaitable[Any]]:
        spec = SamplingSpec(temperature=1.0, max_tokens=tokens, min_tokens=tokens)
        return functools.partial(engine.sample, prompt_ids, spec, group)

    groups, seconds = await streamed([request(ids, tokens) for ids, tokens in work], in_flight)
    completions = [c for g in groups for c in g.completions]
    return Figures("single", seconds, len(completions), sum(len(c.token_ids) for c in completions))


def start_env_server(step_s: float, concurrency: int) -> ServiceProcess:
    """``python -m services.env_server`` serving ``SleepEnv`` on a free port."""
    port = free_port()
    args = ["--environment", ENVIRONMENT, "--port", str(port), "--concurrency", str(concurrency)]
    env = {"ENV_SERVER_API_TOKEN": TOKEN, STEP_LATENCY_ENV: str(step_s), "LOG_LEVEL": "WARNING"}
    server = start_service("env-server", "services.env_server", env, args)
    server.port = port
    try:
        wait_http_ok(f"{server.url}/health", 60)
    except TimeoutError:
        server.stop()
        raise
    return server


def prepare_model(args: argparse.Namespace, scratch: Path) -> tuple[Path, str | None]:
    """The model's directory and its chat template's text (None: the tokenizer's own)."""
    if args.quick:
        from tests.support.tiny_model import build_turn_ending_llama  # torch: only the quick run needs it here

        return build_turn_ending_llama(scratch / "tiny"), None
    from services.launcher.prepare_model import prepare_smollm2

    return prepare_smollm2(), TOOLS_TEMPLATE.read_text()


def start_engine(args: argparse.Namespace, model: Path):
    """The generator's ``Engine`` on ``model``, its threads pinned to the cores this process may use."""
    from services.generator.engine import Engine

    cpus = core_ranges(sorted(os.sched_getaffinity(0)))
    sequences = args.prompts * args.group
    generator = GeneratorSettings(
        model=str(model),
        dtype="float32",
        max_model_len=args.max_model_len,
        max_num_seqs=sequences,
        omp_cpus=cpus,
        block_size=args.block_size,
    )
    blocks = "the generator's default" if args.block_size is None else args.block_size
    print(
        f"vLLM threads pinned to cores {cpus} (VLLM_CPU_OMP_THREADS_BIND); max_num_seqs {sequences}; "
        f"block size {blocks}"
    )
    return Engine.start(generator, str(model), policy_version=0)


async def measure(args: argparse.Namespace, model: Path, template: str | None, server: ServiceProcess) -> list[Figures]:
    """Warm up, then multi (python), multi (http), and single-turn with their sampled tokens per sample."""
    engine = start_engine(args, model)
    settings = TrajectorySettings(
        max_turns=args.turns, max_tool_response_tokens=32, max_model_len=args.max_model_len, chat_template=template
    )
    spec = SamplingSpec(temperature=1.0, max_tokens=args.max_tokens)
    calls = args.multi_prompts * args.group  # one environment call in flight per trajectory at most
    local = build_environment(EnvironmentSettings(python=ENVIRONMENT, concurrency=calls))
    remote = build_environment(EnvironmentSettings(url=server.url, bearer_token=TOKEN, concurrency=calls))
    try:
        _, warm = await run_multi(engine, local, settings, tasks(1, args.group, spec), 1, "warm-up")
        await run_single(engine, [(ids, max(1, round(mean))) for ids, mean in warm], args.group, 1)
        work = tasks(args.prompts * args.rounds, args.group, spec)
        python, by_prompt = await run_multi(engine, local, settings, work, args.multi_prompts, "multi (python)")
        progress(python)
        http, by_prompt_http = await run_multi(engine, remote, settings, work, args.multi_prompts, "multi (http)")
        progress(http)
        matched = [
            (ids, max(1, round((a + b) / 2))) for (ids, a), (_, b) in zip(by_prompt, by_prompt_http, strict=True)
        ]
        single = await run_single(engine, matched, args.group, args.prompts)
    finally:
        await local.aclose()
        await remote.aclose()
        engine.shutdown()
        del engine  # vLLM's finaliser, run at interpreter exit instead, fails noisily
        gc.collect()
    return [single, python, http]


def progress(figures: Figures) -> None:
    print(f"{figures.mode}: {figures.tokens_per_s:.1f} sampled tokens/s in {figures.seconds:.0f} s", file=sys.stderr)


def table(results: list[Figures]) -> str:
    header = "mode             samples  turns  sampled/sample  context/sample  env p50 ms  seconds  sampled tokens/s"
    lines = [header]
    for r in results:
        p50 = f"{r.env_p50_s * 1000:.1f}" if r.env_p50_s is not None else "-"
        context = r.context_tokens / r.samples
        lines.append(
            f"{r.mode:<16} {r.samples:>7} {r.turns:>6.2f} {r.per_sample:>15.1f} {context:>15.1f} {p50:>11} "
            f"{r.seconds:>8.1f} {r.tokens_per_s:>17.1f}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> None:
    print(machine())
    runner_module.ToolCallParser = EveryTurnCalls  # see the module docstring
    os.environ[STEP_LATENCY_ENV] = str(args.step_s)  # SleepEnv in this process reads it
    print(
        f"{args.prompts * args.rounds} prompts, G {args.group}, in flight {args.prompts} (single-turn) and "
        f"{args.multi_prompts} (multi-turn); {args.turns} turns and "
        f"{args.max_tokens} tokens after the prompt at most; environment step {args.step_s * 1000:.0f} ms"
    )
    server = start_env_server(args.step_s, args.multi_prompts * args.group)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-multi-turn-") as scratch:
            model, template = prepare_model(args, Path(scratch))
            shown = TOOLS_TEMPLATE.relative_to(ROOT) if template else "the tokenizer's own"
            print(f"model {model.name}, chat template {shown}")
            single, python, http = asyncio.run(measure(args, model, template, server))
    finally:
        server.stop()
    print(table([single, python, http]))
    print(
        f"ratio multi/single (tokens/s): python {python.tokens_per_s / single.tokens_per_s:.2f}, "
        f"http {http.tokens_per_s / single.tokens_per_s:.2f} (goal >= 0.8)"
    )
    if args.record:
        record_results(args, single, {"python": python, "http": http})


def record_results(args: argparse.Namespace, single: Figures, multi: dict[str, Figures]) -> None:
    """One history row per environment kind: its tokens/s against the single-turn run's."""
    for kind, figures in multi.items():
        numbers = {"single_tokens_per_s": single.tokens_per_s, "multi_tokens_per_s": figures.tokens_per_s}
        if figures.env_p50_s is not None:
            numbers["env_p50_s"] = figures.env_p50_s
        one = argparse.Namespace(**{**vars(args), "environment": kind})
        record("multi_turn", numbers, one, ratio=figures.tokens_per_s / single.tokens_per_s, goal=">= 0.8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=None, help="prompts in flight (8; --quick 4)")
    parser.add_argument("--rounds", type=int, default=None, help="prompts in all = rounds x prompts (3; --quick 2)")
    parser.add_argument(
        "--multi-prompts",
        type=int,
        default=None,
        help="prompts in flight in the multi-turn runs (--prompts; more hides the environment, Little's law)",
    )
    parser.add_argument("--group", type=int, default=8, help="G samples per prompt")
    parser.add_argument("--turns", type=int, default=None, help="max_turns K (4; --quick 3)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens after the prompt (256; --quick 96)")
    parser.add_argument("--max-model-len", type=int, default=None, help="engine context (1024; --quick 512)")
    parser.add_argument("--step-s", type=float, default=0.05, help="seconds each environment step takes")
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="the engine's KV-cache block size (default: the generator's, 32 on CPUs)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny random model, fewer prompts (CI smoke)")
    add_record_flag(parser)
    args = parser.parse_args(argv)
    refuse_quick(args)
    defaults = {
        "prompts": (8, 4),
        "turns": (4, 3),
        "max_tokens": (256, 96),
        "max_model_len": (1024, 512),
        "rounds": (3, 2),
    }
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.multi_prompts = args.multi_prompts or args.prompts
    return args


if __name__ == "__main__":
    main(parse_args())
