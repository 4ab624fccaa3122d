"""Can this vLLM build run vLLM's own RL weight-transfer API (``vllm.distributed.weight_transfer``)?

    python tools/probe_weight_transfer.py [--keep DIR]

Prints one line per check and exits 1 when the custom-engine path fails; the checks that are expected to fail on
a CPU build (CUDA IPC, NCCL) print the error they raise and do not change the exit status. What it starts: two
tiny random Llamas written to a temporary directory, and one ``AsyncLLM`` serving the first (float32, eager).

1. The trainer-side engines that vLLM ships (``ipc``, ``nccl``) from a process without CUDA.
2. A custom engine registered with ``WeightTransferEngineFactory.register_engine`` inside vLLM's worker process
   (the worker imports this module as its ``worker_extension_cls``, which registers it) and a custom trainer
   engine registered with ``WeightTransferTrainerFactory.register_engine``: the trainer engine writes the second
   model's weights into one shared-memory file and drives ``init_weight_transfer_engine``,
   ``start_weight_update``, ``update_weights`` and ``finish_weight_update(weight_version)`` through a
   ``VLLMWeightSyncClient`` around the ``AsyncLLM``; the worker engine maps the file and loads it with vLLM's
   layerwise reload. The check: greedy tokens after the push equal transformers' greedy tokens of the second
   model, ``get_weight_version`` is the pushed one and the completion's ``weight_versions`` name it.
3. A second push (the first model back) through the base class's ``update_weights``, which calls
   ``torch.accelerator.synchronize()`` after every chunk: a CPU-only torch raises there, and vLLM-CPU's worker
   replaces it by a no-op (``cpu_model_runner._set_torch_accelerator_to_noop``); the first push skips it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer import (
    ModuleSource,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    WeightTransferInitInfo,
    WeightTransferInitRequest,
    WeightTransferUpdateInfo,
    WeightTransferUpdateRequest,
)

BACKEND = "probe_shm"
_ALIGN = 64  # bytes: every tensor of the file starts aligned, so a view of it is too
_PROMPT = [5, 17, 29, 41, 8]
_NEW_TOKENS = 12


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """Worker side: whether ``update_weights`` skips the base class's ``torch.accelerator.synchronize()``."""

    skip_accelerator_sync: bool = True


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    """One chunk: the file, and each tensor's name, dtype, shape and byte offset in it."""

    path: str
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    offsets: list[int]


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """Receives a chunk by mapping its file and loading the views with vLLM's layerwise reload."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        self.skip_accelerator_sync = init_info.skip_accelerator_sync

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        if not self.skip_accelerator_sync:
            super().update_weights(update_info)
            return
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        size = os.path.getsize(update_info.path)
        flat = torch.from_file(update_info.path, shared=False, size=size, dtype=torch.uint8)
        pairs = []
        for name, dtype_name, shape, offset in zip(
            update_info.names, update_info.dtype_names, update_info.shapes, update_info.offsets, strict=True
        ):
            dtype = getattr(torch, dtype_name)
            numel = torch.Size(shape).numel()
            nbytes = numel * dtype.itemsize
            pairs.append((name, flat[offset : offset + nbytes].view(dtype).reshape(shape)))
        self.model.load_weights(weights=iter(pairs))

    def shutdown(self) -> None:
        pass


@dataclass
class ShmTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND
    directory: str = "/dev/shm"
    skip_accelerator_sync: bool = True


class ShmTrainerWeightTransferEngine(TrainerWeightTransferEngine[ShmTrainerInitInfo]):
    """Writes every tensor of the source into one file, then drives the round trip through the client."""

    init_info_cls = ShmTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: ShmTrainerInitInfo, *, client: Any, source: WeightSource | None = None):
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.path = str(Path(init_info.directory) / f"probe-weights-{os.getpid()}")
        if engine.is_sender:
            client.init_weight_transfer_engine({"skip_accelerator_sync": init_info.skip_accelerator_sync})
        return engine

    def send_weights(self, weight_version: str | None = None) -> None:
        assert self.source is not None
        meta = self.source.metadata()
        offsets, end = [], 0
        for m in meta:
            offsets.append(end)
            end += -(-torch.Size(m.shape).numel() * m.dtype.itemsize // _ALIGN) * _ALIGN
        flat = torch.from_file(self.path, shared=True, size=end, dtype=torch.uint8)
        for (_, tensor), offset in zip(self.source, offsets, strict=True):
            raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
            flat[offset : offset + raw.numel()].copy_(raw)
        info = ShmUpdateInfo(
            path=self.path,
            names=[m.name for m in meta],
            dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
            shapes=[list(m.shape) for m in meta],
            offsets=offsets,
        )
        self.client.start_weight_update()
        self.client.update_weights(asdict(info))
        self.client.finish_weight_update(weight_version)

    def shutdown(self) -> None:
        Path(self.path).unlink(missing_ok=True)


def register() -> None:
    """Register both halves under ``BACKEND`` (each process has registries of its own; twice is harmless)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, ShmWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, ShmTrainerWeightTransferEngine)


register()  # at import: vLLM's worker process imports this module as its worker extension


class ProbeWorkerExtension:
    """Nothing but the import that registers the engine in the worker."""


class AsyncLLMClient:
    """``VLLMWeightSyncClient`` for a trainer engine on a thread beside the loop that runs the ``AsyncLLM``."""

    def __init__(self, llm: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.llm, self.loop = llm, loop

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=300)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._run(self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self._run(self.llm.start_weight_update())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._run(self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run(self.llm.finish_weight_update(weight_version))


class Report:
    def __init__(self) -> None:
        self.failed: list[str] = []

    def check(self, name: str, step: Callable[[], str], *, required: bool = True) -> Any:
        try:
            detail = step()
        except Exception as exc:  # the point of a probe: say what raised, go on
            frames = traceback.extract_tb(exc.__traceback__)
            where = next((f for f in reversed(frames) if "/vllm/" in f.filename), frames[-1])  # vLLM's line
            mark = "FAIL" if required else "no  "
            print(f"{mark} {name}: {type(exc).__name__}: {exc} ({where.filename}:{where.lineno})")
            if required:
                self.failed.append(name)
            return None
        print(f"ok   {name}: {detail}")
        return detail


def trainer_side_checks(report: Report, model: torch.nn.Module) -> None:
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    source = ModuleSource(model)

    def ipc() -> str:
        WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo(rank=0), client=None, source=source)
        return "made"

    def nccl() -> str:
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

        # PyNcclCommunicator (both halves of 'nccl', 'sparse_nccl', 'nccl_m2n') loads this; where it cannot,
        # the communicator is made disabled, and the broadcasts then fail.
        NCCLLibrary(None)
        return "loaded"

    report.check("trainer engine 'ipc' on this host (expected to fail without CUDA)", ipc, required=False)
    report.check("the NCCL library behind 'nccl' (expected to fail without CUDA)", nccl, required=False)


async def greedy(llm: Any, tag: str) -> tuple[list[int], Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=_NEW_TOKENS, ignore_eos=True)
    final = None
    async for output in llm.generate(TokensPrompt(prompt_token_ids=_PROMPT), params, request_id=tag):
        final = output
    completion = final.outputs[0]
    return list(completion.token_ids), getattr(completion, "weight_versions", None)


def hf_greedy(path: Path) -> list[int]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = model.generate(
        torch.tensor([_PROMPT]), max_new_tokens=_NEW_TOKENS, do_sample=False, min_new_tokens=_NEW_TOKENS
    )
    return out[0, len(_PROMPT) :].tolist()


_EXTENSION = "tools.probe_weight_transfer.ProbeWorkerExtension"  # imported by vLLM's worker: registers the engine


async def engine_checks(report: Report, first: Path, second: Path) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=str(first),
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        max_num_seqs=4,
        worker_extension_cls=_EXTENSION,
        weight_transfer_config={"backend": BACKEND},
    )
    engines: list[Any] = []
    report.check(
        f"AsyncLLM with weight_transfer_config backend {BACKEND!r}",
        lambda: engines.append(AsyncLLM.from_engine_args(args)) or "started",
    )
    if not engines:
        return
    llm = engines.pop()
    try:
        before, _ = await greedy(llm, "before")
        expected = hf_greedy(first)
        report.check(f"greedy before any push equals transformers on {first.name}", lambda: _same(before, expected))
        client = AsyncLLMClient(llm, asyncio.get_running_loop())
        # The first push skips the base class's accelerator synchronization, the second runs it.
        for version, path, skip in (("1", second, True), ("2", first, False)):
            if not await push_round(report, llm, client, version, path, skip):
                break
    finally:
        llm.shutdown()


async def push_round(report: Report, llm: Any, client: AsyncLLMClient, version: str, path: Path, skip: bool) -> bool:
    """Push the model at ``path`` as ``version`` with sampling paused, then check what the engine serves."""
    from transformers import LlamaForCausalLM

    trained = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    sync = "skipped" if skip else "the base class's, in vLLM-CPU's worker"

    def push() -> str:
        init = ShmTrainerInitInfo(rank=0, skip_accelerator_sync=skip)
        engine = WeightTransferTrainerFactory.trainer_init(init, client=client, source=ModuleSource(trained))
        try:
            engine.send_weights(version)
        finally:
            engine.shutdown()
        return f"pushed {len(list(trained.parameters()))} tensors of {path.name} as version {version}"

    await llm.pause_generation(mode="keep", clear_cache=True)  # layerwise reload leaves no layer usable meanwhile
    try:
        pushed = await asyncio.to_thread(report.check, f"custom engine push {version} (sync {sync})", push)
    finally:
        await llm.resume_generation()
    if not pushed:
        return False
    after, spans = await greedy(llm, f"after-{version}")
    expected = hf_greedy(path)
    current = await llm.get_weight_version()
    report.check(f"greedy after push {version} equals transformers on {path.name}", lambda: _same(after, expected))
    report.check(f"get_weight_version after push {version}", lambda: _equal(current, version))
    report.check(f"completion weight_versions after push {version}", lambda: _spans(spans, version))
    return True


def _same(got: list[int], want: list[int]) -> str:
    if got != want:
        raise AssertionError(f"engine {got} != transformers {want}")
    return f"{len(got)} tokens equal"


def _equal(got: str, want: str) -> str:
    if got != want:
        raise AssertionError(f"{got!r} != {want!r}")
    return repr(got)


def _spans(spans: Any, version: str) -> str:
    if not spans or any(s.version != version for s in spans):
        raise AssertionError(f"spans {spans!r} do not all name version {version}")
    return repr(spans)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="write the two tiny models here instead of a temporary directory")
    options = parser.parse_args()
    # The project's packages are beside tools/: this process needs them, and so does vLLM's spawned worker, which
    # imports this module as its extension.
    root = str(Path(__file__).resolve().parent.parent)
    sys.path.insert(0, root)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm

    from tests.support.tiny_model import build_tiny_llama

    print(f"vllm {vllm.__version__}, torch {torch.__version__}, accelerator {torch.accelerator.current_accelerator()}")
    report = Report()
    with tempfile.TemporaryDirectory() as scratch:
        root = options.keep or Path(scratch)
        first, second = build_tiny_llama(root / "a", seed=0), build_tiny_llama(root / "b", seed=1)
        from transformers import LlamaForCausalLM

        trainer_side_checks(report, LlamaForCausalLM.from_pretrained(second, dtype=torch.float32))
        asyncio.run(engine_checks(report, first, second))
        gc.collect()  # the engine's last references go now, not in AsyncLLM.__del__ at interpreter exit
    print("custom-engine path: " + ("FAILED: " + ", ".join(report.failed) if report.failed else "works"))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
