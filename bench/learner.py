"""Learner benchmark: our training step vs a bare transformers forward+backward loop on the same batch.

Model: SmolLM2-135M's architecture (30 layers, hidden 576, vocabulary 49,152) with random weights.
Precision: both loops run the learner's policy (services/learner/hardware.py): master weights and AdamW
state in ``--param-dtype`` (float32), forward and backward in ``--compute-dtype`` under autocast (auto: bf16
where the CPU computes in it, AMX / AVX512-BF16, else float32), so the speed ratio compares like with like.
Batch: ``--groups`` groups of G = ``--group-size`` completions (lengths 20-60) of a ``--prompt``-token prompt.

* "bare": one forward over each micro-batch's prompt + completion (right-padded), log-softmax of the
  completion tokens, a policy-gradient loss, backward, one AdamW step - the plain way to do it.
* "ours": ``Trainer.train`` - GRPO loss with clipping and importance weights, exact micro-batch
  accumulation, the group's prompt computed once and shared by its G completions.

Both in the same process, alternating, best of ``--repeats``; figures are completion tokens per second.
The last line is the ratio ours/bare (goal >= 0.9).

    python bench/learner.py [--threads 1] [--repeats 3] [--compute-dtype auto] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from services.learner.batch import TrainBatch, collate  # noqa: E402
from services.learner.hardware import Precision, compute_context, resolve_precision  # noqa: E402
from services.learner.trainer import Trainer  # noqa: E402
from shared.config.learner import LearnerSettings  # noqa: E402
from shared.records import Completion, PromptTask, Rollout, RolloutTimings, ScoredGroup  # noqa: E402

VOCAB = 49152


def smollm2_shaped(layers: int, dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    model.config.use_cache = False
    return model


def make_groups(groups: int, group_size: int, prompt_len: int) -> list[ScoredGroup]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(groups):
        task = PromptTask(prompt="x", group_size=group_size, policy_version=0)
        completions = []
        for _ in range(group_size):
            n = int(rng.integers(20, 61))
            completions.append(
                Completion(
                    text="",
                    token_ids=rng.integers(5, VOCAB, size=n).astype(np.int32),
                    behaviour_logprobs=np.full(n, -3.0, dtype=np.float32),
                    finish_reason="stop",
                )
            )
        rollout = Rollout(
            group_id=task.task_id,
            task=task,
            prompt_token_ids=rng.integers(5, VOCAB, size=prompt_len).astype(np.int32),
            completions=tuple(completions),
            policy_version=0,
            finished_policy_version=0,
            generator_id="bench",
            timings=RolloutTimings(received_at=0, started_at=0, finished_at=0),
        )
        rewards = rng.random(group_size).astype(np.float32)
        out.append(
            ScoredGroup(
                rollout=rollout,
                reward_names=("r",),
                rewards_per_func=rewards[:, None],
                rewards=rewards,
                advantages=(rewards - rewards.mean()).astype(np.float32),
            )
        )
    return out


def bare_step(model, optimizer, groups: list[ScoredGroup], micro_batch_size: int, precision: Precision) -> None:
    """The plain loop: right-padded prompt + completion, log-softmax, policy gradient, AdamW; the forward
    under the same autocast as ours."""
    rows = [
        (g.rollout.prompt_token_ids, c.token_ids, float(a))
        for g in groups
        for c, a in zip(g.rollout.completions, g.advantages, strict=True)
    ]
    optimizer.zero_grad(set_to_none=True)
    total_tokens = sum(len(c) for _, c, _ in rows)
    for start in range(0, len(rows), micro_batch_size):
        chunk = rows[start : start + micro_batch_size]
        length = max(len(p) + len(c) for p, c, _ in chunk)
        ids = torch.zeros((len(chunk), length), dtype=torch.long)
        attention = torch.zeros_like(ids)
        target_mask = torch.zeros((len(chunk), length - 1))
        advantages = torch.tensor([a for _, _, a in chunk])
        for row, (prompt, completion, _) in enumerate(chunk):
            sequence = np.concatenate([prompt, completion])
            ids[row, : len(sequence)] = torch.from_numpy(sequence.astype(np.int64))
            attention[row, : len(sequence)] = 1
            target_mask[row, len(prompt) - 1 : len(sequence) - 1] = 1
        with compute_context(precision, "cpu"):
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        loss = -(logprobs * target_mask * advantages[:, None]).sum() / total_tokens
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def main(args) -> None:
    torch.set_num_threads(args.threads)
    groups = make_groups(args.groups, args.group_size, args.prompt)
    tokens = sum(len(c.token_ids) for g in groups for c in g.rollout.completions)
    settings = LearnerSettings(
        model="(bench)",
        api_token="x",
        param_dtype=args.param_dtype,
        compute_dtype=args.compute_dtype,
        group_size=args.group_size,
        groups_per_step=args.groups,
        micro_batch_size=args.micro_batch_size,
        old_logprobs="reuse",
        loss_type="dapo",
        max_steps=1000,
    )
    batch: TrainBatch = collate(groups, [torch.from_numpy(g.advantages.copy()) for g in groups], pad_id=0)
    precision = resolve_precision(args.param_dtype, args.compute_dtype, "cpu")
    ours_model, bare_model = smollm2_shaped(args.layers, precision.param), smollm2_shaped(args.layers, precision.param)
    trainer = Trainer(ours_model, settings)
    assert trainer.precision == precision
    bare_optimizer = torch.optim.AdamW(bare_model.parameters(), lr=1e-6)
    best = {"bare": float("inf"), "ours": float("inf")}
    for _ in range(args.repeats):
        started = time.perf_counter()
        bare_step(bare_model, bare_optimizer, groups, args.micro_batch_size, precision)
        best["bare"] = min(best["bare"], time.perf_counter() - started)
        started = time.perf_counter()
        trainer.train(batch)
        best["ours"] = min(best["ours"], time.perf_counter() - started)
    print(
        f"learner: {args.groups} groups x G={args.group_size}, prompt {args.prompt} tokens, {tokens} completion "
        f"tokens, micro-batch {args.micro_batch_size}, {args.layers} layers, {precision.describe()}, "
        f"{args.threads} thread(s), best of {args.repeats}"
    )
    print(f"{'loop':<6} {'seconds':>8} {'tokens/s':>9}")
    for name in ("bare", "ours"):
        print(f"{name:<6} {best[name]:>8.2f} {tokens / best[name]:>9.1f}")
    print(f"ratio ours/bare (tokens/s): {best['bare'] / best['ours']:.2f}  (goal >= 0.90)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=110)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--compute-dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    parser.add_argument("--quick", action="store_true", help="2 layers, 2 groups, 1 repeat (smoke test)")
    arguments = parser.parse_args()
    if arguments.quick:
        arguments.layers, arguments.groups, arguments.repeats = 2, 2, 1
    main(arguments)
