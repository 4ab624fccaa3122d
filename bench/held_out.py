"""Held-out evaluation for ``bench/vs_trl.py``: one judge for every system's final weights.

The final reward of a run is the mean reward of its trained model's greedy answers to ``--size`` held-out
problems of the demo's task: the same problems, system prompt, one-shot example, rewards and weights
(``bench/trl_side.py``'s :class:`JudgedReward`) and decoding (HF ``generate``, greedy, the demo's
``max_completion_length``) for every system, run here in the benchmark environment after the timed window. The
problems are drawn as the learner's ``eval_data = "held_out"`` draws them (another seed than the training
rows') and none is a training row of any seed that ``--exclude-seeds`` names (TRL trains on the rows of seed 0,
this pipeline on those of its run's seed).

Each model is asked as its system trained it (``--rendering``): ``continue`` (this pipeline, and TRL's
GRPOTrainer, which ``bench/trl_side.py`` gives our generator's prompts as text: the chat template continues the
assistant's ``<think>`` prefill) or ``no-prefill`` (TRL's asynchronous trainer, whose rollout worker takes
conversations only and opens a new assistant turn after the last message). The rewards judge the prefill plus
the answer where the prompt had one, as in training.

Prints one JSON line: ``reward`` (mean weighted reward), ``correct`` (share of correct answers), ``size``.

    python bench/held_out.py --model DIR [--rendering continue|no-prefill] [--size 200] [--exclude-seeds 0 1]
                             [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCH = 50
RENDERINGS = ("continue", "no-prefill")


def held_out_problems(demo: dict[str, Any], size: int, exclude_seeds: list[int]) -> list[dict[str, str]]:
    """``size`` problems of the demo's task, none of them a training row of any of ``exclude_seeds``."""
    from shared.dataset.tasks import HELD_OUT_SEED_OFFSET, held_out_rows, training_rows

    data = demo["data"]
    name = data["source"].removeprefix("builtin:")
    training_size, max_operand = data.get("builtin_size", 2000), data.get("builtin_max_operand", 50)
    training = [row for seed in exclude_seeds for row in training_rows(name, training_size, max_operand, seed)]
    # From read_held_out's stream for shuffle_seed 0 (seed HELD_OUT_SEED_OFFSET) whatever the runs' seeds, less
    # the training rows of every run judged.
    return held_out_rows(name, size, max_operand, HELD_OUT_SEED_OFFSET, exclude=training)


def prompt_text(tokenizer: Any, demo: dict[str, Any], question: str, rendering: str) -> str:
    """The prompt as the system that trained the model rendered it (see the module's docstring)."""
    from bench.trl_side import conversation
    from shared.chat import render_chat

    if rendering not in RENDERINGS:
        raise ValueError(f"rendering {rendering!r} is none of {', '.join(RENDERINGS)}")
    return render_chat(tokenizer, conversation(demo, question, prefill=rendering == "continue"), tokenize=False)


def evaluate(model_dir: str, size: int, exclude_seeds: list[int], threads: int, rendering: str) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.trl_side import JudgedReward, load_demo, reward_weights

    torch.set_num_threads(threads)
    demo = load_demo()
    problems = held_out_problems(demo, size, exclude_seeds)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = [prompt_text(tokenizer, demo, p["question"], rendering) for p in problems]
    completions: list[str] = []
    started = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(texts), BATCH):
            batch = tokenizer(texts[start : start + BATCH], return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(
                **batch,
                do_sample=False,
                max_new_tokens=demo["learner"]["max_completion_length"],
                pad_token_id=tokenizer.pad_token_id,
            )
            new = out[:, batch["input_ids"].shape[1] :]
            completions += tokenizer.batch_decode(new, skip_special_tokens=True)
    weights = reward_weights(demo)
    prefill = "" if rendering == "no-prefill" else demo["data"]["assistant_prefill"]
    judged = [[{"role": "assistant", "content": c}] for c in completions]
    answers = [p["answer"] for p in problems]
    per_function = {
        name: JudgedReward(name, prefill)(texts, judged, answer=answers) for name in weights
    }  # each a list of floats (None: could not judge, counted as 0)
    total = [sum(weights[name] * (per_function[name][i] or 0.0) for name in weights) for i in range(len(problems))]
    correct = [float((r or 0.0) > 0) for r in per_function["correctness"]]
    return {
        "reward": sum(total) / len(total),
        "correct": sum(correct) / len(correct),
        "size": float(len(problems)),
        "seconds": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rendering", choices=RENDERINGS, default="continue")
    parser.add_argument("--size", type=int, default=200)
    parser.add_argument("--exclude-seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(json.dumps(evaluate(args.model, args.size, args.exclude_seeds, args.threads, args.rendering)))


if __name__ == "__main__":
    main()
