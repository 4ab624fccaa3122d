"""Can the tool-use demo work? SmolLM2-135M-Instruct's starting figures on calculator tasks, with and without the
calculator tool (docs/concepts/multi-turn-design.md §3 step 19, §4 open question 5).

For each task (multi-digit arithmetic the model gets wrong mentally) and prompt variant, on ``--n`` held-out
problems:

* ``plain``: no tools, one turn, the answer inside ``<answer></answer>`` after one worked example (what the model
  can do alone; sampled by ``Engine.sample`` as the single-turn generator samples);
* ``tools-zero``: the calculator's schema in the system turn (``configs/templates/smollm2_tools.jinja``), a system
  prompt saying to call it, no example;
* ``tools-oneshot``: the same with one worked exchange in the prompt: the question, an assistant tool call, the
  tool's result, the assistant's ``<answer>``;
* ``tools-twoshot``: two worked exchanges through the tool (with one, the model copies the last assistant
  turn it saw, the direct answer, and almost never calls);
* ``tools-system``: the worked call written out in the system prompt, no exchange;
* ``tools-choice``: two worked exchanges: an easy question answered directly, then a hard one through the tool
  (the model is shown that calling is a choice).

Tool variants run through the generator's own ``TrajectoryRunner`` with ``configs/calculator_env.py`` and the
generator's ``Engine`` (vLLM in-process), exactly as ``[environment]`` would run them. Each variant is measured
greedily (one trajectory per problem, what the demo's held-out evaluation does) and sampled (G trajectories per
problem at the training temperature, what GRPO sees).

Columns: accuracy (the scorer's ``correctness``: the last assistant turn's ``<answer>``), lenient accuracy (the
last number of the last assistant turn), for the sampled trajectories also the share of mixed groups (some right,
some wrong: a learning signal), tool-call rate (trajectories with at least one call), right call (trajectories
where a calculator result equals the answer), parse failures (malformed or rejected calls per trajectory),
mean assistant turns, mean tokens after the prompt, prompt tokens, seconds.

    python bench/demo_tools.py [--n 40] [--group-size 4] [--tasks mul3x2,add4] [--variants plain,tools-oneshot]
                               [--model runs/demo-tools-.../checkpoints/step-40]  (a trained model's figures)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "configs"))  # calculator_env, as [environment] finds it beside the configuration

from bench.record import add_record_flag, record  # noqa: E402
from services.scorer.rewards.builtin import answers_equal, extract_answer  # noqa: E402
from shared.dataset.tasks import CALCULATOR_EXAMPLES, held_out_rows  # noqa: E402
from shared.records import ChatMessage, PromptTask, SamplingSpec  # noqa: E402
from shared.trajectory import ToolCall, ToolFunction  # noqa: E402

TEMPLATE = ROOT / "configs" / "templates" / "smollm2_tools.jinja"
CONFIG = ROOT / "configs" / "demo-tools-cpu.toml"
HELD_OUT_SEED = 20_251_125
PLAIN_SYSTEM = "Give only the final number inside <answer></answer>."
TOOLS_SYSTEM = (
    "You have a calculator. Call the calculate tool for any arithmetic, then give only the final number inside "
    "<answer></answer>."
)
CHOICE_SYSTEM = (
    "You have a calculator. Call the calculate tool when the arithmetic is hard, then give only the final number "
    "inside <answer></answer>."
)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclass(frozen=True)
class Task:
    """Two operands drawn from ``left`` and ``right`` (inclusive ranges), combined by ``symbol``."""

    name: str
    left: tuple[int, int]
    right: tuple[int, int]
    symbol: str  # "*" or "+"
    example: tuple[int, int]  # the worked example's operands
    second: tuple[int, int]  # a second worked example's (tools-twoshot)

    def question(self, a: int, b: int) -> str:
        return f"What is {a} times {b}?" if self.symbol == "*" else f"What is {a} + {b}?"

    def value(self, a: int, b: int) -> int:
        return a * b if self.symbol == "*" else a + b


TASKS = {
    t.name: t
    for t in (
        Task("mul3x2", (100, 999), (10, 99), "*", *CALCULATOR_EXAMPLES),  # the demo's builtin:calculator
        Task("mul2x2", (10, 99), (10, 99), "*", (47, 23), (86, 59)),
        Task("mul2x1", (10, 99), (2, 9), "*", (47, 6), (83, 7)),
        Task("add4", (1000, 9999), (1000, 9999), "+", (4178, 2936), (7351, 5684)),
        Task("add3", (100, 999), (100, 999), "+", (417, 286), (758, 649)),
    )
}
VARIANTS = ("plain", "tools-zero", "tools-oneshot", "tools-twoshot", "tools-system", "tools-choice")


def task_rows(task: Task, size: int, seed: int) -> list[dict[str, str]]:
    """``size`` distinct problems of ``task`` (``question``/``answer`` text, as the built-in tasks' rows), none of
    them a worked example's; the same seed gives the same rows. ``mul3x2`` is the demo's ``builtin:calculator``
    (its rows come from shared/dataset/tasks.py, as the demo's held-out evaluation draws them)."""
    if task.name == "mul3x2":
        return held_out_rows("calculator", size, task.left[1], seed)
    rng, seen = random.Random(seed), {task.question(*task.example), task.question(*task.second)}
    rows = []
    while len(rows) < size:
        a, b = rng.randint(*task.left), rng.randint(*task.right)
        if task.question(a, b) not in seen:
            seen.add(task.question(a, b))
            rows.append({"question": task.question(a, b), "answer": str(task.value(a, b))})
    return rows


def _message(role: str, content: str, **fields: Any) -> ChatMessage:
    return ChatMessage(role=role, content=content, **fields)


def tool_exchange(task: Task, a: int, b: int, call_id: str) -> list[ChatMessage]:
    """A worked example through the calculator: question, call, result, answer."""
    expression, value = f"{a} {task.symbol} {b}", str(task.value(a, b))
    call = ToolCall(id=call_id, function=ToolFunction(name="calculate", arguments={"expression": expression}))
    return [
        _message("user", task.question(a, b)),
        _message("assistant", "", tool_calls=(call,)),
        _message("tool", value, tool_call_id=call_id, name="calculate"),
        _message("assistant", f"<answer>{value}</answer>"),
    ]


def system_example(task: Task) -> str:
    """The tool-use instruction with a worked call written out in the system prompt itself."""
    a, b = task.example
    call = json.dumps({"name": "calculate", "arguments": {"expression": f"{a} {task.symbol} {b}"}})
    return (
        f"{TOOLS_SYSTEM} For example, to answer {task.question(a, b)!r} reply exactly:\n<tool_call>\n{call}\n"
        f"</tool_call>\nThe tool answers {task.value(a, b)}, and you reply <answer>{task.value(a, b)}</answer>."
    )


def direct_exchange(question: str, answer: int) -> list[ChatMessage]:
    return [_message("user", question), _message("assistant", f"<answer>{answer}</answer>")]


def prompt(task: Task, variant: str, question: str) -> tuple[ChatMessage, ...]:
    """The prompt messages of one problem under ``variant``."""
    a, b = task.example
    if variant == "plain":
        shots = [_message("system", PLAIN_SYSTEM), *direct_exchange(task.question(a, b), task.value(a, b))]
    elif variant == "tools-zero":
        shots = [_message("system", TOOLS_SYSTEM)]
    elif variant == "tools-oneshot":
        shots = [_message("system", TOOLS_SYSTEM), *tool_exchange(task, a, b, "call_0_0")]
    elif variant == "tools-twoshot":
        shots = [
            _message("system", TOOLS_SYSTEM),
            *tool_exchange(task, a, b, "call_0_0"),
            *tool_exchange(task, *task.second, "call_0_0"),
        ]
    elif variant == "tools-system":
        shots = [_message("system", system_example(task))]
    elif variant == "tools-choice":
        easy = direct_exchange("What is 3 + 4?", 7)
        shots = [_message("system", CHOICE_SYSTEM), *easy, *tool_exchange(task, a, b, "call_0_0")]
    else:
        raise ValueError(f"unknown prompt variant {variant!r}; known: {', '.join(VARIANTS)}")
    return (*shots, _message("user", question))


@dataclass(frozen=True)
class Outcome:
    """One completion or trajectory, graded."""

    correct: bool
    lenient: bool
    tool_calls: int = 0
    failed_calls: int = 0
    right_call: bool = False
    turns: int = 1
    tokens: int = 0
    text: str = ""  # what the model wrote (tool results included), for --show


def final_text(messages: list[dict[str, Any]]) -> str:
    assistants = [m for m in messages if m.get("role") == "assistant"]
    return (assistants[-1].get("content") or "") if assistants else ""


def grade(text: str, answer: str) -> tuple[bool, bool]:
    """(the scorer's correctness: the last ``<answer>``; lenient: the last number in the text)."""
    given = extract_answer(text)
    strict = given is not None and answers_equal(given, answer)
    numbers = _NUMBER.findall(text)
    lenient = bool(numbers) and answers_equal(numbers[-1].replace(",", ""), answer)
    return strict, lenient


def trajectory_outcome(completion: Any, answer: str) -> Outcome:
    """A tool variant's trajectory (a ``Completion`` with ``messages`` and ``trajectory``), graded."""
    messages = [m.model_dump(exclude_none=True) for m in completion.messages]
    strict, lenient = grade(final_text(messages), answer)
    info = completion.trajectory
    results = [m["content"].strip() for m in messages if m["role"] == "tool"]
    return Outcome(
        correct=strict,
        lenient=lenient,
        tool_calls=info.tool_calls,
        failed_calls=info.tool_errors,
        right_call=any(r == answer for r in results),
        turns=info.turns,
        tokens=len(completion.token_ids),
        text=completion.text,
    )


def summarise(groups: list[list[Outcome]]) -> dict[str, float]:
    """Means over every outcome, and the share of groups with both right and wrong answers."""
    every = [o for group in groups for o in group]
    count = len(every)

    def share(pick: Callable[[Outcome], float]) -> float:
        return sum(pick(o) for o in every) / count

    return {
        "accuracy": share(lambda o: o.correct),
        "lenient": share(lambda o: o.lenient),
        "mixed": sum(0 < sum(o.correct for o in g) < len(g) for g in groups) / len(groups),
        "tool_rate": share(lambda o: o.tool_calls > 0),
        "calls": share(lambda o: o.tool_calls),
        "right_call": share(lambda o: o.right_call),
        "parse_failures": share(lambda o: o.failed_calls),
        "turns": share(lambda o: o.turns),
        "tokens": share(lambda o: o.tokens),
    }


class Probe:
    """The engine, the calculator environment and the runner, started once for every task and variant."""

    def __init__(self, engine: Any, environment: Any, runner: Any, plain_render: Any) -> None:
        self.engine, self.environment, self.runner, self.plain_render = engine, environment, runner, plain_render

    @classmethod
    def start(cls, args: argparse.Namespace) -> Probe:
        from environments.python_env import python_environment
        from services.generator.engine import Engine
        from services.generator.trajectory.runner import TrajectoryRunner, TrajectorySettings
        from services.generator.trajectory.template import make_render
        from services.launcher.prepare_model import prepare_smollm2
        from shared.config.generator import GeneratorSettings

        model = args.model or str(prepare_smollm2())
        generator = GeneratorSettings.load(args.config, model=model, omp_cpus=args.cpus, max_num_seqs=args.max_num_seqs)
        engine = Engine.start(generator, model, policy_version=0)
        environment = python_environment("calculator_env:CalculatorEnv", [], name="calculator", concurrency=4)
        settings = TrajectorySettings(
            max_turns=args.max_turns,
            max_tool_response_tokens=32,
            max_model_len=generator.max_model_len,
            chat_template=TEMPLATE.read_text(encoding="utf-8"),
        )
        runner = TrajectoryRunner(engine, environment, settings)
        return cls(engine, environment, runner, make_render(engine.tokenizer, None, str(TEMPLATE)))

    def shutdown(self) -> None:
        self.engine.shutdown()

    async def plain(self, task: Task, rows: list[dict[str, str]], spec: SamplingSpec, g: int) -> list[list[Outcome]]:
        """One turn without tools, ``g`` completions per problem."""
        runs = []
        for row in rows:
            messages = [m.model_dump(exclude_none=True) for m in prompt(task, "plain", row["question"])]
            runs.append(self.engine.sample(self.plain_render(messages, True), spec, g))
        groups = await asyncio.gather(*runs)
        return [
            [Outcome(*grade(c.text, row["answer"]), tokens=len(c.token_ids), text=c.text) for c in group.completions]
            for row, group in zip(rows, groups, strict=True)
        ]

    async def tools(
        self, task: Task, variant: str, rows: list[dict[str, str]], spec: SamplingSpec, g: int
    ) -> list[list[Outcome]]:
        """``g`` trajectories per problem through the generator's runner and the calculator."""
        tasks = [
            PromptTask(
                prompt=prompt(task, variant, row["question"]),
                columns={"answer": row["answer"]},
                group_size=g,
                sampling=spec,
                policy_version=0,
            )
            for row in rows
        ]
        sampled = await asyncio.gather(*(self.runner.run(t) for t in tasks))
        return [
            [trajectory_outcome(c, row["answer"]) for c in result.completions]
            for row, result in zip(rows, sampled, strict=True)
        ]

    def prompt_tokens(self, task: Task, variant: str) -> int:
        messages = [m.model_dump(exclude_none=True) for m in prompt(task, variant, task.question(123, 45))]
        if variant == "plain":
            return len(self.plain_render(messages, True))
        toolkit = self.runner.toolkits.get(self.environment.tool_schemas())
        return len(toolkit.render(messages, True))


async def measure(probe: Probe, task: Task, variant: str, rows: list[dict[str, str]], args) -> dict[str, Any]:
    """Greedy (one per problem) and sampled (G per problem) figures of one task and variant."""
    started = time.perf_counter()
    greedy_spec = SamplingSpec(temperature=0.0, max_tokens=args.max_tokens)
    sampled_spec = SamplingSpec(temperature=args.temperature, max_tokens=args.max_tokens)
    if variant == "plain":
        greedy, sampled = await asyncio.gather(
            probe.plain(task, rows, greedy_spec, 1), probe.plain(task, rows, sampled_spec, args.group_size)
        )
    else:
        greedy, sampled = await asyncio.gather(
            probe.tools(task, variant, rows, greedy_spec, 1),
            probe.tools(task, variant, rows, sampled_spec, args.group_size),
        )
    return {
        "task": task.name,
        "variant": variant,
        "greedy": summarise(greedy),
        "sampled": summarise(sampled),
        "prompt_tokens": probe.prompt_tokens(task, variant),
        "seconds": time.perf_counter() - started,
        "examples": [_example(o) for o in sampled[: args.show]],
    }


def _example(group: list[Outcome]) -> str:
    """A group as R (right) or w (wrong) with its calls per trajectory, and its first trajectory's text."""
    marks = " ".join(f"{'R' if o.correct else 'w'}{o.tool_calls}" for o in group)
    return f"{marks}  {group[0].text[:240]!r}"


HEADER = (
    "task", "prompt", "greedy acc", "greedy lenient", "greedy tool rate", "sampled acc", "sampled lenient",
    "mixed groups", "sampled tool rate", "right call", "parse fail/traj", "turns", "tokens", "prompt tokens", "s",
)  # fmt: skip


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in results:
        g, s = r["greedy"], r["sampled"]
        shares = (g["accuracy"], g["lenient"], g["tool_rate"], s["accuracy"], s["lenient"], s["mixed"])
        cells = [r["task"], r["variant"], *(f"{x:.1%}" for x in shares)]
        cells += [f"{s['tool_rate']:.1%}", f"{s['right_call']:.1%}", f"{s['parse_failures']:.2f}"]
        cells += [f"{s['turns']:.2f}", f"{s['tokens']:.0f}", str(r["prompt_tokens"]), f"{r['seconds']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    started = time.perf_counter()
    probe = Probe.start(args)
    print(f"engine started in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    results = []
    try:
        for name in args.tasks:
            rows = task_rows(TASKS[name], args.n, HELD_OUT_SEED)
            for variant in args.variants:
                print(f"{name} / {variant} ...", file=sys.stderr)
                results.append(await measure(probe, TASKS[name], variant, rows, args))
                print(table(results[-1:]).splitlines()[-1], file=sys.stderr)
                for line in results[-1]["examples"]:
                    print(f"    group: {line}", file=sys.stderr)
    finally:
        probe.shutdown()
        del probe  # vLLM's finaliser, run at interpreter exit instead, fails noisily
        gc.collect()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(CONFIG), help="the generator's settings ([generator])")
    parser.add_argument("--model", default="", help="a model directory, e.g. a demo checkpoint (default: SmolLM2)")
    parser.add_argument("--n", type=int, default=40, help="held-out problems per task")
    parser.add_argument("--group-size", type=int, default=4, help="sampled trajectories per problem (G)")
    parser.add_argument("--temperature", type=float, default=1.0, help="the training temperature")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens after the prompt, every turn together")
    parser.add_argument("--max-turns", type=int, default=3, help="assistant turns per trajectory at most")
    parser.add_argument("--tasks", default="mul3x2,mul2x2,add4", help=f"from {', '.join(TASKS)}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"from {', '.join(VARIANTS)}")
    parser.add_argument("--cpus", default="0-1", help="cores for vLLM's threads (VLLM_CPU_OMP_THREADS_BIND)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="sequences vLLM batches (speed only)")
    parser.add_argument("--show", type=int, default=0, help="print this many sampled groups per variant (R/w, calls)")
    parser.add_argument("--json", help="also write the results to this file")
    add_record_flag(parser)
    args = parser.parse_args()
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [t for t in args.tasks if t not in TASKS] + [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown tasks or variants: {', '.join(unknown)}")
    started = time.perf_counter()
    results = asyncio.run(run(args))
    print(table(results))
    print(f"wall time {time.perf_counter() - started:.0f} s, n = {args.n} problems per task, G = {args.group_size}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.record:
        record_results(args, results)


def record_results(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    """One history row per task and prompt variant, its greedy and sampled figures flattened: a survey, no goal."""
    for row in results:
        figures = {f"{mode}_{k}": v for mode in ("greedy", "sampled") for k, v in row[mode].items()}
        figures |= {"prompt_tokens": row["prompt_tokens"], "seconds": row["seconds"]}
        one = argparse.Namespace(**{**vars(args), "tasks": row["task"], "variants": row["variant"]})
        record("demo_tools", figures, one, ratio=None, goal="")


if __name__ == "__main__":
    main()
