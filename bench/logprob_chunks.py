"""Log-probability passes with whole logits vs chunked through the LM head (``logprob_chunk_tokens``).

Model: a Llama shape whose LM head dominates (``--vocab`` 32,000, hidden 256, 2 layers), random weights,
float32. Batch: ``--rows`` completions of ``--tokens`` / 4 to ``--tokens`` tokens (evenly spread, right-padded
to ``--tokens``) on a 64-token prompt. Each pass is the learner's (services/learner/logprobs/policy.py, padded forward):

* "training": log-probabilities and the entropy with its gradient, then backward;
* "no-grad": log-probabilities under ``torch.inference_mode`` (old logprobs, reference model).

Each configuration runs in its own processes (one thread): one pass for the peak resident memory it adds over
the loaded model, with glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_``) so that freed large tensors
leave the resident size instead of staying in the heap; then, in a plain process, CPU seconds per pass (median
after a warm-up pass), which other processes on the machine do not inflate. The last line is the ratio of the
training pass's peak, chunked over whole.

    python bench/logprob_chunks.py [--chunk 1024] [--vocab 32000] [--tokens 512] [--rows 8] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import add_record_flag, record, refuse_quick  # noqa: E402

_PROMPT = 64
_MMAP_THRESHOLD = "131072"  # bytes: larger allocations are mmap'd, and returned to the system when freed


def _batch(rows: int, tokens: int, vocab: int):
    import torch

    from services.learner.data.batch import TrainBatch

    ids = torch.randint(0, vocab, (rows, _PROMPT + tokens))
    lengths = torch.linspace(tokens // 4, tokens, rows).long()
    mask = (torch.arange(tokens)[None] < lengths[:, None]).long()
    return TrainBatch(
        input_ids=ids,
        attention_mask=torch.cat([torch.ones(rows, _PROMPT, dtype=torch.long), mask], dim=1),
        position_ids=torch.arange(_PROMPT + tokens).expand(rows, -1),
        completion_ids=ids[:, _PROMPT:],
        completion_mask=mask.float(),
        behaviour_logprobs=torch.zeros(rows, tokens),
        advantages=torch.zeros(rows),
        temperatures=torch.linspace(0.7, 1.2, rows),
        policy_versions=torch.zeros(rows, dtype=torch.long),
        group_index=torch.arange(rows),
        truncated=torch.zeros(rows, dtype=torch.bool),
    )


def _child(args: argparse.Namespace) -> None:
    """One configuration: prints {"peak_mb", "seconds"} as JSON."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.learner.logprobs.policy import completion_logprobs_and_entropy

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
    )
    model = LlamaForCausalLM(config)
    batch = _batch(args.rows, args.tokens, args.vocab)

    def one_pass() -> None:
        if args.kind == "training":
            model.zero_grad(set_to_none=True)
            logprobs, entropies = completion_logprobs_and_entropy(
                model, batch, share_prompts=False, entropy="grad", chunk_tokens=args.chunk
            )
            (logprobs.sum() + 0.01 * entropies.sum()).backward()
        else:
            with torch.inference_mode():
                completion_logprobs_and_entropy(
                    model, batch, share_prompts=False, entropy="none", chunk_tokens=args.chunk
                )

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds = []
    for _ in range(max(1, args.repeats)):
        started = time.process_time()
        one_pass()
        seconds.append(time.process_time() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # kB on Linux
    print(json.dumps({"peak_mb": peak / 1024, "seconds": statistics.median(seconds[1:] or seconds)}))


def _child_result(args: argparse.Namespace, kind: str, chunk: int, repeats: int, env: dict) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", "--kind", kind, "--chunk", str(chunk)]
    command += ["--vocab", str(args.vocab), "--tokens", str(args.tokens), "--rows", str(args.rows)]
    command += ["--repeats", str(repeats)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _run(args: argparse.Namespace, kind: str, chunk: int) -> tuple[float, float]:
    """(peak MB over the loaded model, CPU seconds per pass) of one configuration."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    memory = _child_result(args, kind, chunk, 1, {**env, "MALLOC_MMAP_THRESHOLD_": _MMAP_THRESHOLD})
    timing = _child_result(args, kind, chunk, args.repeats, env)
    return memory["peak_mb"], timing["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk", type=int, default=1024, help="logprob_chunk_tokens of the chunked runs")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=512, help="completion tokens per row")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=4, help="timed passes, the first a warm-up")
    parser.add_argument("--quick", action="store_true", help="a smoke test: small vocabulary and batch")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kind", choices=["training", "no-grad"], help=argparse.SUPPRESS)
    add_record_flag(parser)
    args = parser.parse_args()
    refuse_quick(args)
    if args.quick:
        args.vocab, args.tokens, args.rows, args.repeats, args.chunk = 4000, 64, 4, 2, 64
    if args.child:
        _child(args)
        return
    positions = args.rows * args.tokens
    real = int(_batch(args.rows, args.tokens, 2).completion_mask.sum())
    whole = positions * args.vocab * 4 / 2**20
    print(f"{positions} completion positions ({real} tokens) x vocabulary {args.vocab}: float32 logits {whole:.0f} MiB")
    print(f"{'pass':10s} {'logits':14s} {'peak MB':>8s} {'CPU s':>7s}")
    peaks = {}
    for kind in ("training", "no-grad"):
        for chunk in (0, args.chunk):
            peaks[kind, chunk], seconds = _run(args, kind, chunk)
            label = "whole" if chunk == 0 else f"chunks of {chunk}"
            print(f"{kind:10s} {label:14s} {peaks[kind, chunk]:8.0f} {seconds:7.2f}")
    ratio = peaks["training", args.chunk] / peaks["training", 0]
    print(f"ratio chunked/whole (training peak MB): {ratio:.2f}")
    if args.record:
        figures = {f"{kind}_{'whole' if c == 0 else 'chunked'}_peak_mb": mb for (kind, c), mb in peaks.items()}
        record("logprob_chunks", figures, args, ratio=ratio, goal="lower is better (no goal set)")


if __name__ == "__main__":
    main()
