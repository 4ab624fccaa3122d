"""Which built-in task can the CPU demo's model partly do? SmolLM2-135M-Instruct's base accuracy per task.

For each candidate (a built-in task of ``shared/dataset/tasks.py`` at one ``max_operand``) and prompt
variant, on ``--n`` held-out problems (drawn from another seed than the demo's training rows, and unlike
them where the task has enough distinct questions):

* greedy: one completion per problem at temperature 0;
* sampled: G completions per problem at the demo's temperature (``[learner]`` group_size, temperature,
  max_completion_length of ``--config``), as the generator samples a group.

Prompts are built as the learner builds them (``feeder.build_prompt``: system prompt, one few-shot exchange,
the question, the assistant prefill) and tokenized and sampled by the generator's own ``Engine`` (vLLM,
``n = G`` with output kind FINAL_ONLY, no per-request seed). Completions are graded as the scorer grades them
(the prefill put back in front) with the built-in ``correctness`` and ``hard_format`` rewards.

Prompt variants: ``think`` is the demo's (its system prompt and prefill, ``<think>...</think><answer>...
</answer>``) with a worked example of the candidate's own task; ``answer`` asks for the number only,
``<answer>N</answer>``, prefilled with ``<answer>`` (its hard_format is 0 by construction).

Columns: greedy accuracy, sampled accuracy (mean over all G x n completions), mixed: the share of groups
with both correct and wrong completions (those that give GRPO a signal on correctness), hard_format over
the sampled completions, parsed: the share of sampled completions with an answer the scorer can read,
unseen: the share of the held-out questions not among the demo's training rows, seconds for the pair.

    python bench/demo_tasks.py [--n 200] [--candidates sums-9,compare-99] [--variants think,answer]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import add_record_flag, record  # noqa: E402
from services.learner.data.feeder import build_prompt  # noqa: E402
from services.scorer.rewards.builtin import correctness, extract_answer, hard_format  # noqa: E402
from shared.config.data import DataSettings  # noqa: E402
from shared.config.learner import LearnerSettings  # noqa: E402
from shared.dataset.tasks import held_out_rows, training_rows  # noqa: E402
from shared.records import ChatMessage, SamplingSpec  # noqa: E402

ANSWER_ONLY_SYSTEM = "Give only the final number inside <answer></answer>."
HELD_OUT_SEED = 20_250_901


@dataclass(frozen=True)
class Candidate:
    task: str
    max_operand: int
    example: str  # a question of this task, for the one few-shot exchange
    working: str  # what goes inside <think></think> for it
    answer: int

    @property
    def name(self) -> str:
        return f"{self.task}-{self.max_operand}"


_WORD_PROBLEM = ("Ava has 3 cards and finds 4 more. How many cards does Ava have now?", "3 + 4 = 7", 7)
CANDIDATES = {
    c.name: c
    for c in (
        Candidate("arithmetic", 50, *_WORD_PROBLEM),
        Candidate("arithmetic", 20, *_WORD_PROBLEM),
        Candidate("arithmetic", 9, *_WORD_PROBLEM),
        Candidate("sums", 9, "What is 3 + 4?", "3 + 4 = 7", 7),
        Candidate("sums", 20, "What is 13 + 4?", "13 + 4 = 17", 17),
        Candidate("products", 9, "What is 3 times 4?", "3 x 4 = 12", 12),
        Candidate("compare", 99, "Which number is larger, 23 or 61?", "61 is more than 23", 61),
        Candidate("count_items", 9, "How many items are in this list: cup, moon, pen?", "cup 1, moon 2, pen 3", 3),
        Candidate("count_letters", 10, 'How many letters are in the word "lamp"?', "l 1, a 2, m 3, p 4", 4),
    )
}
VARIANTS = ("think", "answer")


def prompt_settings(candidate: Candidate, variant: str, demo: DataSettings) -> DataSettings:
    """The [data] prompt settings for one candidate and variant (the demo's system prompt and prefill for
    ``think``), with a few-shot exchange of the candidate's own task."""
    if variant == "think":
        system, prefill = demo.system_prompt, demo.assistant_prefill
        reply = f"<think>{candidate.working}</think><answer>{candidate.answer}</answer>"
    elif variant == "answer":
        system, prefill = ANSWER_ONLY_SYSTEM, "<answer>"
        reply = f"<answer>{candidate.answer}</answer>"
    else:
        raise ValueError(f"unknown prompt variant {variant!r}; known: {', '.join(VARIANTS)}")
    examples = [ChatMessage(role="user", content=candidate.example), ChatMessage(role="assistant", content=reply)]
    return demo.model_copy(update={"system_prompt": system, "examples": examples, "assistant_prefill": prefill})


def grade(texts: list[str], prefill: str, answer: str) -> tuple[list[float], list[float], list[bool]]:
    """Correctness, hard_format and 'an answer was found' per completion, judged as the scorer judges them."""
    completions = [[{"role": "assistant", "content": prefill + text}] for text in texts]
    prompts = [None] * len(texts)
    correct = correctness(prompts, completions, answer=[answer] * len(texts))
    formatted = hard_format(prompts, completions)
    parsed = [extract_answer(prefill + text) is not None for text in texts]
    return [float(c or 0.0) for c in correct], [float(f or 0.0) for f in formatted], parsed


async def measure(engine, rows, data: DataSettings, learner: LearnerSettings, show: int) -> dict:
    """Greedy and sampled figures for one candidate and variant."""
    started = time.perf_counter()
    prompts = [engine.tokenize(build_prompt(row["question"], data)) for row in rows]
    greedy_spec = SamplingSpec(temperature=0.0, max_tokens=learner.max_completion_length)
    sampled_spec = SamplingSpec(
        temperature=learner.temperature,
        top_p=learner.top_p,
        top_k=learner.top_k,
        min_p=learner.min_p,
        repetition_penalty=learner.repetition_penalty,
        max_tokens=learner.max_completion_length,
    )
    greedy_runs = [engine.sample(ids, greedy_spec, 1) for ids in prompts]
    sampled_runs = [engine.sample(ids, sampled_spec, learner.group_size) for ids in prompts]
    done = await asyncio.gather(*greedy_runs, *sampled_runs)  # one queue, so the engine batches fully
    greedy, sampled = done[: len(rows)], done[len(rows) :]
    greedy_correct, sampled_correct, formatted, parsed, mixed = 0.0, 0.0, 0.0, 0, 0
    for index, (row, one, group) in enumerate(zip(rows, greedy, sampled, strict=True)):
        greedy_correct += grade([one.completions[0].text], data.assistant_prefill, row["answer"])[0][0]
        texts = [c.text for c in group.completions]
        correct, format_ok, found = grade(texts, data.assistant_prefill, row["answer"])
        sampled_correct += sum(correct)
        formatted += sum(format_ok)
        parsed += sum(found)
        mixed += 0 < sum(correct) < len(correct)
        if index < show:
            print(f"    Q: {row['question']}  (answer {row['answer']})", file=sys.stderr)
            print(f"    greedy: {data.assistant_prefill + one.completions[0].text!r}", file=sys.stderr)
            print(f"    sample: {data.assistant_prefill + texts[0]!r}", file=sys.stderr)
    samples = len(rows) * learner.group_size
    return {
        "greedy": greedy_correct / len(rows),
        "sampled": sampled_correct / samples,
        "mixed": mixed / len(rows),
        "hard_format": formatted / samples,
        "parsed": parsed / samples,
        "seconds": time.perf_counter() - started,
    }


def _table(results: list[dict]) -> str:
    header = ("task", "prompt", "greedy acc", "sampled acc", "mixed groups", "hard_format", "parsed", "unseen", "s")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        figures = (r["greedy"], r["sampled"], r["mixed"], r["hard_format"], r["parsed"], r["unseen"])
        cells = [r["candidate"], r["variant"], *(f"{x:.1%}" for x in figures), f"{r['seconds']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> list[dict]:
    from services.generator.engine import Engine
    from services.launcher.prepare_model import prepare_smollm2
    from shared.config.generator import GeneratorSettings

    model = str(prepare_smollm2())
    learner = LearnerSettings.load(args.config, model=model)
    generator = GeneratorSettings.load(args.config, model=model, omp_cpus=args.cpus, max_num_seqs=args.max_num_seqs)
    started = time.perf_counter()
    engine = Engine.start(generator, model, policy_version=0)
    print(f"engine started in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    results = []
    try:
        for name in args.candidates:
            candidate = CANDIDATES[name]
            training = training_rows(
                candidate.task, learner.data.builtin_size, candidate.max_operand, learner.data.shuffle_seed
            )
            rows = held_out_rows(candidate.task, args.n, candidate.max_operand, HELD_OUT_SEED, training)
            seen = {row["question"] for row in training}
            unseen = sum(row["question"] not in seen for row in rows) / len(rows)
            for variant in args.variants:
                print(f"{name} / {variant} ...", file=sys.stderr)
                data = prompt_settings(candidate, variant, learner.data)
                figures = await measure(engine, rows, data, learner, args.show)
                results.append({"candidate": name, "variant": variant, "unseen": unseen, **figures})
                print(_table(results[-1:]).splitlines()[-1], file=sys.stderr)
    finally:
        engine.shutdown()
        del engine  # vLLM's finaliser, run at interpreter exit instead, fails noisily
        gc.collect()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo-cpu.toml"))
    parser.add_argument("--n", type=int, default=200, help="held-out problems per candidate")
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help=f"from {', '.join(CANDIDATES)}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"from {', '.join(VARIANTS)}")
    parser.add_argument("--cpus", default="0-1", help="cores for vLLM's threads (VLLM_CPU_OMP_THREADS_BIND)")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="sequences vLLM batches (speed only)")
    parser.add_argument("--show", type=int, default=0, help="print this many completions per candidate")
    parser.add_argument("--json", help="also write the results to this file")
    add_record_flag(parser)
    args = parser.parse_args()
    args.candidates = [c for c in args.candidates.split(",") if c]
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [c for c in args.candidates if c not in CANDIDATES] + [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown candidates or variants: {', '.join(unknown)}")
    started = time.perf_counter()
    results = asyncio.run(run(args))
    print(_table(results))
    print(f"wall time {time.perf_counter() - started:.0f} s, n = {args.n} problems per candidate")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.record:
        for row in results:  # one history row per candidate and prompt variant: a survey, no goal
            one = argparse.Namespace(**{**vars(args), "candidates": row["candidate"], "variants": row["variant"]})
            figures = {k: v for k, v in row.items() if k not in ("candidate", "variant")}
            record("demo_tasks", figures, one, ratio=None, goal="")


if __name__ == "__main__":
    main()
