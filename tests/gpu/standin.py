"""A receiver process for the GPU tests: the generator's ``WeightReceiverExtension`` around a plain torch
model standing in for vLLM's model runner (vLLM's CUDA build is not installed on the GPU test machine).

It runs the same receiving and loading code as a generator's engine worker; only the model differs.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import torch

from weight_sync.receiver import WeightReceiverExtension


def build_model(
    seed: int, hidden: int, layers: int, device: str, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """The same architecture on both sides; ``seed`` makes the weights differ; ``dtype`` is the engine's."""
    torch.manual_seed(seed)
    blocks = [torch.nn.Linear(hidden, hidden) for _ in range(layers)]
    return torch.nn.Sequential(torch.nn.Embedding(64, hidden), *blocks).to(device=device, dtype=dtype)


def digests(model: torch.nn.Module) -> dict[str, str]:
    """sha256 of every parameter's bytes (bitwise comparison across processes)."""
    out = {}
    for name, param in model.named_parameters():
        raw = param.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
        out[name] = hashlib.sha256(raw).hexdigest()
    return out


class _Runner:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def get_model(self) -> torch.nn.Module:
        return self.model


class StandInWorker(WeightReceiverExtension):
    """What vLLM's worker gives the extension: ``model_runner``, ``device``, ``rank``."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model_runner = _Runner(model)
        self.device = device
        self.rank = 0

    def _tensor_parallel_size(self) -> int:
        return 1

    def _engine_is_eager(self) -> bool:
        return True  # a plain torch model: no compiled graphs

    def _in_place_wanted(self) -> bool:
        return True  # generator.cpu_weights_in_place (used on the CPU only)

    def _hides_views(self) -> bool:
        return False  # plain torch layers: whatever they keep is a parameter the loader sees


def receive(
    conn: Any, device_name: str, seed: int, hidden: int, layers: int, shm_dir: str = "", dtype: str = "float32"
) -> None:
    """Process entry point: answer ``ready`` with the device's UUID (and a shared-memory probe in ``shm_dir``
    when given), then for every push message (the ``weight_channel_open`` arguments, layout, bucket count)
    join the push, answer ``opened`` with the seconds that took, receive it and answer with the result and
    the digests; ``"digests"`` asks for the digests alone; ``None`` ends it. ``dtype``: the engine's."""
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    worker = StandInWorker(build_model(seed, hidden, layers, device_name, getattr(torch, dtype)), device)
    uuid = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None
    probe = None
    if shm_dir:
        from pathlib import Path

        from shared.shm import make_probe

        probe_file, token = make_probe(Path(shm_dir))
        probe = {"path": str(probe_file.path), "token": token}
    conn.send({"ready": True, "uuid": uuid, "shm_probe": probe})
    while (push := conn.recv()) is not None:
        if push == "digests":
            conn.send({"digests": digests(worker.model_runner.get_model())})
            continue
        started = time.perf_counter()
        try:
            worker.weight_channel_open(*push["open"])
            conn.send({"opened": time.perf_counter() - started})
            result = worker.weight_channel_receive(push["layout"], push["num_buckets"])
            worker.weight_channel_close()
        except Exception as exc:
            conn.send({"error": f"{type(exc).__name__}: {exc}"})
            continue
        result["wall_seconds"] = time.perf_counter() - started
        conn.send({"result": result, "digests": digests(worker.model_runner.get_model())})
    conn.close()
