"""Learner benchmark: our training step vs a bare transformers forward+backward loop on the same batch.

Model (``--shape``, random weights): SmolLM2-135M's architecture (30 layers, hidden 576, vocabulary 49,152), or
Qwen2.5-0.5B's (24 layers, hidden 896, MLP 4,864, 14 heads / 2 KV heads, vocabulary 151,936, tied embeddings) or
Qwen2.5-1.5B's (28 layers, hidden 1,536, MLP 8,960, 12 heads / 2 KV heads, vocabulary 151,936, tied embeddings).
Precision: both loops run the learner's policy (services/learner/hardware.py): master weights and AdamW state
in ``--param-dtype`` (float32), forward and backward in ``--compute-dtype`` under autocast (auto: bf16 on CUDA
and where the CPU computes in it, AMX / AVX512-BF16, else float32), so the speed ratio compares like with like.
Batch (``--batch``): "cpu", ``--groups`` groups of G = ``--group-size`` completions of 20-60 tokens on a
``--prompt``-token prompt; "gpu", the issue's GPU batch: 8 groups x G = 8, prompt 256, completions uniform in
128-1024 tokens, micro-batch 8.

* "bare": one forward over each micro-batch's prompt + completion (right-padded), log-softmax of the
  completion tokens, a policy-gradient loss, backward, one AdamW step - the plain way to do it. With
  ``--bare-head-chunk N`` (the default on cuda: 8192) the LM head, log-softmax and loss run N token positions
  at a time, each chunk's backward at once into the final hidden states (the plain way to keep a 151,936-word
  vocabulary's logits out of memory; nothing computed twice).
* "ours": ``Trainer.train`` - GRPO loss with clipping and importance weights, exact micro-batch accumulation,
  with the learner's defaults for the device (``share_prompts``, ``max_tokens_per_micro_batch``: packed
  micro-batches) unless ``--share-prompts`` / ``--max-tokens-per-micro-batch`` say otherwise; with
  ``--gradient-checkpointing``, each decoder layer's activations recomputed in the backward
  (``gradient_checkpointing``: lower peak memory, about one more forward).

Both in the same process, alternating, best of ``--repeats``. Printed per loop: seconds, completion tokens/s,
model TFLOP/s and MFU against the device's dense bf16 peak (model FLOPs: 6 x non-embedding parameters x the
batch's prompt + completion tokens, plus causal attention, 6 x layers x hidden x L^2 per sequence of L tokens:
the work of one unshared forward + backward), and peak memory (CUDA: torch.cuda.max_memory_allocated; CPU: the
process's resident set, sampled every 10 ms, above its level before the loop, after glibc's malloc_trim; glibc's
malloc set as the CPU learner sets it, ``services/learner/host_memory.py``). Then
the recompute pass (the no-grad old-logprob pass of ``old_logprobs = "recompute"``) as a share of our training
step, and last the ratio ours/bare (goal >= 0.9).
With ``--profile DIR``, one more step of each loop runs under ``torch.profiler`` (:mod:`bench.profiling`):
its ops by device and host time, the device's busy time and the host's waits for it, in ``DIR/bare.txt`` and
``DIR/ours.txt``.

    python bench/learner.py [--device cpu|cuda] [--shape smollm2|qwen2.5-0.5b|qwen2.5-1.5b] [--batch cpu|gpu]
        [--threads 1] [--repeats 3] [--compute-dtype auto] [--max-tokens-per-micro-batch auto|0|N]
        [--share-prompts auto|on|off] [--gradient-checkpointing] [--profile DIR] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from bench.profiling import profile_step  # noqa: E402
from bench.record import add_record_flag, record, refuse_quick  # noqa: E402
from services.learner.data.batch import TrainBatch, collate  # noqa: E402
from services.learner.hardware import Precision, compute_context, resolve_precision  # noqa: E402
from services.learner.host_memory import keep_freed_memory  # noqa: E402
from services.learner.logprobs.packing import attention_implementation  # noqa: E402
from services.learner.model import checkpoint_layers  # noqa: E402
from services.learner.trainer import Trainer  # noqa: E402
from shared.config.learner import LearnerSettings  # noqa: E402
from shared.records import Completion, PromptTask, Rollout, RolloutTimings, ScoredGroup  # noqa: E402


def _config(shape: str, layers: int | None) -> PretrainedConfig:
    """The transformers config of ``shape`` (random weights), with ``layers`` layers when given."""
    if shape == "smollm2":
        config: PretrainedConfig = LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        )
    else:
        big = shape == "qwen2.5-1.5b"
        config = Qwen2Config(
            vocab_size=151936,
            hidden_size=1536 if big else 896,
            intermediate_size=8960 if big else 4864,
            num_hidden_layers=28 if big else 24,
            num_attention_heads=12 if big else 14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        )
    if layers:
        config.num_hidden_layers = layers
    config.use_cache = False
    return config


def build_model(config: PretrainedConfig, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A random-weight model of ``config``, with the learner's attention (flash-attn on CUDA when installed)."""
    torch.manual_seed(0)
    implementation = attention_implementation(device) or "sdpa"
    config._attn_implementation = implementation
    cls = LlamaForCausalLM if isinstance(config, LlamaConfig) else Qwen2ForCausalLM
    return cls(config).to(device=device, dtype=dtype)


@dataclass(frozen=True)
class BatchShape:
    groups: int
    group_size: int
    prompt: int
    completion_min: int
    completion_max: int
    micro_batch_size: int


GPU_BATCH = BatchShape(groups=8, group_size=8, prompt=256, completion_min=128, completion_max=1024, micro_batch_size=8)


def make_groups(shape: BatchShape, vocab: int) -> list[ScoredGroup]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(shape.groups):
        task = PromptTask(prompt="x", group_size=shape.group_size, policy_version=0)
        completions = []
        for _ in range(shape.group_size):
            n = int(rng.integers(shape.completion_min, shape.completion_max + 1))
            completions.append(
                Completion(
                    text="",
                    token_ids=rng.integers(5, vocab, size=n).astype(np.int32),
                    behaviour_logprobs=np.full(n, -3.0, dtype=np.float32),
                    finish_reason="stop",
                )
            )
        rollout = Rollout(
            group_id=task.task_id,
            task=task,
            prompt_token_ids=rng.integers(5, vocab, size=shape.prompt).astype(np.int32),
            completions=tuple(completions),
            policy_version=0,
            finished_policy_version=0,
            generator_id="bench",
            timings=RolloutTimings(received_at=0, started_at=0, finished_at=0),
        )
        rewards = rng.random(shape.group_size).astype(np.float32)
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


def bare_step(
    model,
    optimizer,
    groups: list[ScoredGroup],
    micro_batch_size: int,
    precision: Precision,
    device: str,
    head_chunk_tokens: int = 0,
) -> None:
    """The plain loop: right-padded prompt + completion, log-softmax, policy gradient, AdamW; the forward
    under the same autocast as ours. ``head_chunk_tokens`` > 0: the LM head in chunks of that many token
    positions (see ``_chunked_head_backward``), 0: full logits at once."""
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
        ids, attention = ids.to(device), attention.to(device)
        target_mask, advantages = target_mask.to(device), advantages.to(device)
        if head_chunk_tokens:
            _chunked_head_backward(
                model, ids, attention, target_mask, advantages, total_tokens, precision, device, head_chunk_tokens
            )
            continue
        with compute_context(precision, device):
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        loss = -(logprobs * target_mask * advantages[:, None]).sum() / total_tokens
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def _chunked_head_backward(
    model, ids, attention, target_mask, advantages, total_tokens: int, precision: Precision, device: str, chunk: int
) -> None:
    """The plain way to keep a large vocabulary's logits out of memory: the body's forward once, then the LM head,
    log-softmax and loss over ``chunk`` positions at a time, each chunk's backward run at once into the final
    hidden states' gradient (its logits freed before the next chunk), and last the body's backward from that
    gradient. Nothing is computed twice."""
    with compute_context(precision, device):
        hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state[:, :-1]
    detached = hidden.detach().requires_grad_(True)
    head = model.get_output_embeddings()
    targets = ids[:, 1:]
    weights = target_mask * advantages[:, None]
    positions = max(1, chunk // ids.shape[0])
    for start in range(0, detached.shape[1], positions):
        piece = slice(start, start + positions)
        with compute_context(precision, device):
            logits = head(detached[:, piece]).float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, piece].unsqueeze(-1)).squeeze(-1)
        (-(logprobs * weights[:, piece]).sum() / total_tokens).backward()
    hidden.backward(detached.grad)


# Dense bf16 peaks (TFLOP/s) from the vendors' data sheets, matched against torch.cuda.get_device_name().
BF16_PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0}


def bf16_peak_tflops(device: str) -> tuple[str, float | None]:
    """The device's name and its dense bf16 peak (None: unknown; for CPUs this benchmark knows none)."""
    if device != "cuda":
        return "CPU", None
    name = torch.cuda.get_device_name()
    for key, peak in BF16_PEAK_TFLOPS.items():  # "H100 PCIe" is tried before "H100"
        if all(part in name for part in key.split()):
            return name, peak
    return name, None


def model_flops(config: PretrainedConfig, model: torch.nn.Module, groups: list[ScoredGroup]) -> float:
    """Forward + backward FLOPs of the batch's sequences, each computed once without padding or sharing."""
    embedding = model.get_input_embeddings().weight.numel()
    dense = sum(p.numel() for p in model.parameters()) - embedding
    if config.tie_word_embeddings:
        dense += embedding  # the tied LM head multiplies too
    lengths = [len(g.rollout.prompt_token_ids) + len(c.token_ids) for g in groups for c in g.rollout.completions]
    attention = sum(6 * config.num_hidden_layers * config.hidden_size * n * n for n in lengths)
    return 6.0 * dense * sum(lengths) + attention


def _return_freed_memory() -> None:
    """glibc keeps freed heap pages; malloc_trim hands them back, so one loop's leftovers do not hide the next
    loop's growth."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakMemory:
    """Peak memory of a block: CUDA's allocator peak, or the CPU process's RSS sampled every 10 ms, above the
    level before the block."""

    def __init__(self, device: str):
        self.device = device
        self.peak = 0
        self._stop = threading.Event()

    @staticmethod
    def _rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

    def _sample(self, base: int) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._rss() - base)

    def __enter__(self) -> PeakMemory:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            _return_freed_memory()
            self._thread = threading.Thread(target=self._sample, args=(self._rss(),), daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._base
        else:
            self._stop.set()
            self._thread.join()


def _release(device: str) -> None:
    """Give back what the last loop's model, optimizer and activations held."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    else:
        _return_freed_memory()


def _timed(device: str, step) -> tuple[float, int]:
    """Seconds and peak memory of ``step()``."""
    with PeakMemory(device) as memory:
        started = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    return seconds, memory.peak


def _settings(args, shape: BatchShape, old_logprobs: str) -> LearnerSettings:
    longest = shape.prompt + shape.completion_max
    return LearnerSettings(
        model="(bench)",
        api_token="x",
        device=args.device,
        param_dtype=args.param_dtype,
        compute_dtype=args.compute_dtype,
        group_size=shape.group_size,
        groups_per_step=shape.groups,
        micro_batch_size=shape.micro_batch_size,
        max_prompt_length=shape.prompt,
        max_completion_length=shape.completion_max,
        model_context=longest,
        max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
        share_prompts=args.share_prompts,
        gradient_checkpointing=args.gradient_checkpointing,
        old_logprobs=old_logprobs,
        loss_type="dapo",
        max_steps=1000,
    )


def _batch_shape(args) -> BatchShape:
    if args.batch == "gpu":
        return GPU_BATCH
    return BatchShape(args.groups, args.group_size, args.prompt, 20, 60, args.micro_batch_size)


def _best_bare(args, config, shape: BatchShape, groups: list[ScoredGroup], precision: Precision) -> tuple[float, int]:
    """The bare loop's best (seconds, peak memory) of ``args.repeats`` steps, on a model of its own."""
    model = build_model(config, precision.param, args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def step() -> None:
        bare_step(model, optimizer, groups, shape.micro_batch_size, precision, args.device, args.bare_head_chunk)

    best = min(_timed(args.device, step) for _ in range(args.repeats))
    if args.profile:
        print(profile_step("bare", args.device, step, args.profile))
    return best


def main(args) -> None:
    torch.set_num_threads(args.threads)
    if args.device == "cpu":  # as the learner service runs (keep_freed_memory; figures before 2026-11-27 had not)
        keep_freed_memory()
    shape = _batch_shape(args)
    config = _config(args.shape, args.layers)
    groups = make_groups(shape, config.vocab_size)
    tokens = sum(len(c.token_ids) for g in groups for c in g.rollout.completions)
    settings = _settings(args, shape, "reuse")
    batch: TrainBatch = collate(groups, [torch.from_numpy(g.advantages.copy()) for g in groups], pad_id=0)
    precision = resolve_precision(args.param_dtype, args.compute_dtype, args.device)
    best = {"bare": (float("inf"), 0), "ours": (float("inf"), 0)}
    # One loop at a time, each with its own model and optimizer state: on a GPU, two 1.5B models with their
    # AdamW states and the bare loop's activations do not fit in 80 GB together.
    best["bare"] = _best_bare(args, config, shape, groups, precision)
    _release(args.device)
    ours_model = build_model(config, precision.param, args.device)
    if settings.gradient_checkpointing:  # as load_policy does
        checkpoint_layers(ours_model)
    trainer = Trainer(ours_model, settings)
    recompute = Trainer(ours_model, _settings(args, shape, "recompute"))  # only its no-grad pass runs
    assert trainer.optimizer.precision == precision
    old_logprobs = float("inf")
    for _ in range(args.repeats):
        best["ours"] = min(best["ours"], _timed(args.device, lambda: trainer.train(batch)))
        old_logprobs = min(old_logprobs, recompute.prepare(batch.to(trainer.device)).seconds_old_logprobs)
    if args.profile:
        print(profile_step("ours", args.device, lambda: trainer.train(batch), args.profile))
    report(args, shape, config, ours_model, groups, tokens, trainer, precision, best, old_logprobs)


def report(args, shape, config, model, groups, tokens, trainer, precision, best, old_logprobs) -> None:
    name, peak = bf16_peak_tflops(args.device)
    flops = model_flops(config, model, groups)
    memory = "torch.cuda.max_memory_allocated" if args.device == "cuda" else "process RSS sampled every 10 ms"
    print(
        f"learner: {args.shape} ({config.num_hidden_layers} layers), {shape.groups} groups x G={shape.group_size}, "
        f"prompt {shape.prompt} tokens, {tokens} completion tokens ({shape.completion_min}-{shape.completion_max} "
        f"each), micro-batch {shape.micro_batch_size}, {precision.describe()}, {args.device}, "
        f"{args.threads} thread(s), best of {args.repeats}"
    )
    head = f"in chunks of {args.bare_head_chunk} positions" if args.bare_head_chunk else "full logits at once"
    print(f"bare: LM head {head}")
    print(
        f"ours: share_prompts={trainer.planner.share_prompts}, packed={trainer.planner.packed}, "
        f"gradient_checkpointing={args.gradient_checkpointing} "
        f"(token budget {trainer.planner.token_budget}); device {name}, dense bf16 peak "
        f"{'unknown' if peak is None else f'{peak:.0f} TFLOP/s'}; model FLOPs per step {flops / 1e12:.3f} T"
    )
    print(f"{'loop':<6} {'seconds':>8} {'tokens/s':>9} {'TFLOP/s':>8} {'MFU':>7} {'peak MiB':>9}  ({memory})")
    for loop in ("bare", "ours"):
        seconds, peak_bytes = best[loop]
        achieved = flops / seconds / 1e12
        mfu = "n/a" if peak is None else f"{100 * achieved / peak:.1f}%"
        print(
            f"{loop:<6} {seconds:>8.2f} {tokens / seconds:>9.1f} {achieved:>8.4f} {mfu:>7} {peak_bytes / 2**20:>9.0f}"
        )
    print(
        f"recompute pass (no-grad old logprobs): {old_logprobs:.2f} s = "
        f"{old_logprobs / best['ours'][0]:.2f} of our training step"
    )
    print(f"ratio ours/bare (tokens/s): {best['bare'][0] / best['ours'][0]:.2f}  (goal >= 0.90)")
    if args.record:
        speeds = {f"{loop}_tokens_per_s": tokens / best[loop][0] for loop in ("bare", "ours")}
        figures = {**speeds, "old_logprobs_s": old_logprobs}
        batch = _batch_shape(args)  # the GPU batch replaces the batch options: record what ran
        measured = argparse.Namespace(
            **{
                **vars(args),
                **{k: getattr(batch, k) for k in ("groups", "group_size", "prompt", "micro_batch_size")},
            }
        )
        record("learner", figures, measured, ratio=best["bare"][0] / best["ours"][0], goal=">= 0.90")


def _token_budget(value: str) -> int | str:
    return value if value == "auto" else int(value)


def _head_chunk(value: str) -> int | str:
    if value == "auto":
        return value
    if int(value) < 0:
        raise argparse.ArgumentTypeError(f"--bare-head-chunk must be >= 0 or auto, got {value}")
    return int(value)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shape", choices=["smollm2", "qwen2.5-0.5b", "qwen2.5-1.5b"], default="smollm2")
    parser.add_argument("--batch", choices=["cpu", "gpu"], default="cpu", help="gpu: the issue's GPU batch")
    parser.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=110)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--compute-dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    parser.add_argument("--max-tokens-per-micro-batch", type=_token_budget, default="auto")
    parser.add_argument("--share-prompts", choices=["auto", "on", "off"], default="auto")
    parser.add_argument(
        "--gradient-checkpointing", action="store_true", help="ours: recompute each layer's activations in the backward"
    )
    parser.add_argument(
        "--bare-head-chunk",
        type=_head_chunk,
        default="auto",
        help="the bare loop's LM head in chunks of this many token positions; 0: full logits at once; "
        "auto: 8192 on cuda (a 151,936-word vocabulary's full float32 logits of the GPU batch do not fit), 0 on cpu",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="after the timed steps, one more step of each loop under torch.profiler: tables in this directory",
    )
    parser.add_argument("--quick", action="store_true", help="2 layers, 2 groups, 1 repeat (smoke test)")
    add_record_flag(parser)
    arguments = parser.parse_args()
    refuse_quick(arguments)
    if arguments.bare_head_chunk == "auto":
        arguments.bare_head_chunk = 8192 if arguments.device == "cuda" else 0
    if arguments.quick:
        arguments.layers, arguments.groups, arguments.repeats = 2, 2, 1
    main(arguments)
