"""Receives new policy weights inside vLLM's worker process (a vLLM ``worker_extension_cls``).

The learner (rank 0) sends the weights over the transport its announcement names for this generator
(:mod:`weight_sync.plan` chooses it); each transport's receiving half lives beside its sending half:

* ``gloo`` / ``nccl`` (:mod:`weight_sync.collective`): a process group of its own (gloo's kept from push to
  push while the learner offers it again; NCCL's made for each push), buckets broadcast from rank 0; the next
  bucket is received while this one loads.
* ``ipc`` (:mod:`weight_sync.transport_ipc`): no group and no buckets; the learner's tensors are opened
  where they lie on this GPU and copied into the parameters.
* ``shm`` (:mod:`weight_sync.transport_shm`): no group either; each bucket is loaded straight from the
  shared-memory file the learner packed it into. The learner packs the next push into the same files, so
  nothing of the engine may keep pointing into them: tensors are copied into parameters, a CPU linear
  layer's kernel handle packs its own copy, and a layer that would keep the mapped weight itself gets a
  private copy (see :class:`~weight_sync.direct_load.DirectLoader`'s ``borrowed``).

Buckets and the layout are :mod:`weight_sync.protocol`'s; the load paths (direct, in place, layerwise) are
:mod:`weight_sync.direct_load`'s. Methods are called through ``AsyncLLM.collective_rpc`` by
:mod:`services.generator.engine`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from shared.records import PUSH_ABORT_KEY, TensorSpec
from weight_sync.collective import (
    KeptGroup,
    form_group,
    join_store,
    member_group,
    posting_schedule,
    receive_bucket,
    release_in_background,
)
from weight_sync.direct_load import (
    DirectLoader,
    DirectLoadUnavailable,
    StackScratch,
    describe_targets,
    layerwise_reload,
    plan_direct_load,
)
from weight_sync.protocol import (
    KeptLayout,
    bucket_byte_sizes,
    cuda_uuid,
    layout_key,
    nccl_version,
    specs_by_bucket,
    unpack_bucket,
    vllm_version,
)
from weight_sync.transport_ipc import IpcReceiver
from weight_sync.transport_shm import ShmReceiver

log = logging.getLogger(__name__)

WEIGHTS_IN_PLACE_ENV = "ASYNCGRPO_CPU_WEIGHTS_IN_PLACE"  # "1": generator.cpu_weights_in_place
RECORD_WAIT_SLICE = timedelta(seconds=1)  # a receiver's store timeout over IPC and shared memory


class _PublishedBucket:
    """A bucket the learner publishes in the store when it is packed: ``result()`` waits for that."""

    def __init__(self, fetch: Callable[[], torch.Tensor]) -> None:
        self.fetch = fetch

    def result(self) -> torch.Tensor:
        return self.fetch()


class _EnginePolicy:
    """What the engine's worker decides about loading, from its device, settings and platform (a mixin of
    :class:`WeightReceiverExtension`; the stand-in in tests/gpu overrides the engine-specific answers)."""

    device: torch.device
    vllm_config: Any
    model_runner: Any
    _weight_transport: str = ""

    def _tensor_parallel_size(self) -> int:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_world_size()

    def _repacks_linear(self) -> bool:
        """Whether this engine repacks linear weights into oneDNN handles, which it makes about twice as fast
        from a transposed weight: a CPU engine, unless it is set to compute on views of gloo receive buffers
        (``generator.cpu_weights_in_place`` with an eager engine; decided once, at registration, so such a
        replica gets untransposed weights over shared memory too) or uses zentorch (AMD Zen: its own packing)."""
        if self.device.type != "cpu" or self._hides_views():
            return False
        return not (self._in_place_wanted() and self._engine_is_eager())

    def _stacked_linear(self) -> dict[str, tuple[str, ...]]:
        """The model's stacked linear layers (vLLM's ``packed_modules_mapping``: ``qkv_proj`` -> its pieces)."""
        packed = getattr(type(self.model_runner.get_model()), "packed_modules_mapping", {}) or {}
        return {fused: tuple(pieces) for fused, pieces in packed.items()}

    def _engine_is_eager(self) -> bool:
        """Whether the engine runs its model eagerly (no torch.compile graphs holding on to parameters)."""
        return bool(self.vllm_config.model_config.enforce_eager)

    def _in_place_wanted(self) -> bool:
        """``generator.cpu_weights_in_place``, handed to the engine's workers by the generator's process."""
        return os.environ.get(WEIGHTS_IN_PLACE_ENV, "0") == "1"

    def _hides_views(self) -> bool:
        """Whether a CPU linear layer may keep a view of its weight where the loader cannot see it: vLLM's
        zentorch kernels (AMD Zen CPUs) capture the weight in a closure."""
        from vllm.platforms import current_platform

        return bool(getattr(current_platform, "is_zen_cpu", lambda: False)())

    def _kept_buffers(self) -> bool:
        """Whether gloo receives into buffers kept from push to push (on the CPU: no new 64 MB buffers to
        fault in every time)."""
        return self.device.type == "cpu" and self._weight_transport == "gloo"

    def _aliasing(self) -> bool:
        """Whether parameters become views of the receive buffers (see :class:`DirectLoader`): when asked
        for, on the CPU over gloo, with an eager engine. On a GPU, CUDA graphs keep parameter pointers and IPC
        buffers belong to the learner, so weights are copied there (at device speed)."""
        return self._kept_buffers() and self._engine_is_eager() and self._in_place_wanted()

    def _borrowing(self) -> bool:
        """Whether buckets are read where the learner packed them, memory it writes the next push into."""
        return self._weight_transport == "shm"

    def _deferring(self) -> bool:
        """Whether a CPU engine's linear layers get their kernel handles after the push has returned, in the
        engine's first step (:class:`~weight_sync.direct_load.PendingHandle`): over gloo into kept buffers,
        which only the next push overwrites; with an eager engine (no compiled graph holding on to a layer's
        kernel). The learner then waits for the bytes to arrive, not for oneDNN to reorder them. Not over
        shared memory: the learner writes the next push into the memory the weights would be read from while
        the engine samples."""
        return self._kept_buffers() and self._engine_is_eager() and not self._aliasing()


class WeightReceiverExtension(_EnginePolicy):
    """Mixed into vLLM's worker: ``self.model_runner``, ``self.device`` and ``self.vllm_config`` exist."""

    # Given by vLLM's worker (declared here for type checkers; the stand-in in tests/gpu sets them too).
    device: torch.device
    model_runner: Any
    vllm_config: Any

    _weight_group: Any = None
    _gloo: KeptGroup | None = None  # the gloo group, kept after a push it received whole (see weight_channel_close)
    _received = False  # this push's buckets all arrived: its group's sockets hold nothing unread
    _weight_store: Any = None
    _weight_receiver_id: str = ""
    _direct_plan: Any = None  # (layout key, plan, targets) of the last push, or (layout key, reason)
    _receive_buffers: Any = None  # (layout key, [bucket buffer, ...]): gloo receives into these, push after push
    _shm: ShmReceiver | None = None  # the learner's shared-memory segments, mapped push after push
    _ipc: IpcReceiver | None = None  # the learner's tensors opened over CUDA IPC, kept while it resends them
    _weight_timeout_s: float = 300.0
    _layout: KeptLayout | None = None  # the last layout received, read
    _stack_scratch: StackScratch | None = None  # kept push to push on the CPU (see StackScratch)
    _joins: dict[str, StackScratch] | None = None  # where deferring pushes join stacked layers (see _deferring)

    def weight_runtime(self) -> dict[str, Any]:
        """This worker's device UUID, engine dtype and library versions (for the generator's registration), and
        the glibc malloc settings it started with (for the generator's log)."""
        return {
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
            "device_uuid": cuda_uuid(self.device),
            "transposed_linear": self._repacks_linear(),
            "stacked_linear": self._stacked_linear() if self._repacks_linear() else {},
            "dtype": str(self.vllm_config.model_config.dtype).removeprefix("torch."),
            "torch": str(torch.__version__),
            "nccl": nccl_version(self.device),
            "vllm": vllm_version(),
        }

    def weight_channel_open(
        self,
        host: str,
        port: int,
        prefix: str,
        first_rank: int,
        world_size: int,
        join_timeout_s: float,
        timeout_s: float,
        transport: str = "",
        receiver_id: str = "",
    ) -> None:
        """Join the learner's push. Over gloo/NCCL engine worker k of this replica takes rank
        ``first_rank + k`` and gives up after ``join_timeout_s`` if a member never arrives; over IPC and
        shared memory it only connects to the store the learner publishes its records in."""
        self.weight_channel_close()
        transport = transport or ("nccl" if self.device.type == "cuda" else "gloo")
        if transport != "ipc" and self._ipc is not None:  # the learner's memory kept open for IPC is let go
            self._ipc.forget()
        if transport != "gloo" and self._gloo is not None:
            self._gloo.retire()
            self._gloo = None
        self._weight_store = join_store(host, port, prefix, timedelta(seconds=join_timeout_s))
        self._weight_transport, self._weight_receiver_id = transport, receiver_id
        self._weight_timeout_s = timeout_s
        worker_rank = int(getattr(self, "rank", 0))
        if transport == "shm" and worker_rank != 0:
            raise RuntimeError("shared-memory pushes reach CPU engines, which run one worker")
        rank, timeout = first_rank + worker_rank, timedelta(seconds=timeout_s)
        if transport in ("ipc", "shm"):  # reads wait for the learner's records in slices (see _published)
            self._weight_store.set_timeout(RECORD_WAIT_SLICE)
        elif transport == "gloo":
            members = (f"{host}:{port}", rank, world_size)
            kept, self._gloo = self._gloo, None  # member_group reuses it or tears it down
            self._gloo = member_group(self._weight_store, prefix, kept, members, rank, world_size, timeout)
            self._weight_group = self._gloo.group
        else:
            self._weight_group = form_group(self._weight_store, rank, world_size, self.device, timeout)

    def _direct_loader(self, model: torch.nn.Module, specs: Sequence[TensorSpec]) -> DirectLoader | None:
        """A direct loader for this layout, or None (the reason logged once per layout)."""
        key = tuple((spec.name, tuple(spec.shape)) for spec in specs)
        if self._direct_plan is None or self._direct_plan[0] != key:
            try:
                targets = describe_targets(model, self._tensor_parallel_size())
                plan = plan_direct_load(dict(key), targets)
                self._direct_plan = (key, plan, targets)
            except DirectLoadUnavailable as exc:
                log.warning("loading pushed weights layerwise: %s", exc)
                self._direct_plan = (key, str(exc))
        if len(self._direct_plan) == 2:
            return None
        if self._stack_scratch is None and self.device.type == "cpu":
            self._stack_scratch = StackScratch()
        return DirectLoader(
            model,
            self._direct_plan[1],
            self._direct_plan[2],
            alias=self._aliasing(),
            borrowed=self._borrowing(),
            scratch=self._stack_scratch,
            defer=self._joins is not None,
            joins=self._joins,
        )

    def _buffers_for(self, specs: Sequence[TensorSpec], sizes: list[int], keep: bool) -> list[torch.Tensor] | None:
        """The buffers gloo receives this push's buckets into: the last push's when ``keep`` and the layout is
        the same (parameters aliasing them take the new weights as they arrive), new ones when it changed;
        None (a fresh buffer per bucket) when ``keep`` is off."""
        if not keep:
            self._receive_buffers = None
            return None
        key = layout_key(specs)
        if self._receive_buffers is None or self._receive_buffers[0] != key:
            # The old buffers live on in the parameters aliasing them until this push rebinds those.
            self._receive_buffers = (key, [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes])
        return self._receive_buffers[1]

    def weight_channel_receive(self, layout: list[dict[str, Any]], num_buckets: int) -> dict[str, float]:
        """Receive every bucket and load it into the model; returns bytes and seconds spent waiting for data
        and loading. The next bucket is received while this one loads (gloo in the background)."""
        if self._weight_store is None:
            raise RuntimeError("weight_channel_open must be called before weight_channel_receive")
        model = self.model_runner.get_model()
        if self._layout is None:
            self._layout = KeptLayout()
        specs = self._layout.read(layout)
        self._joins = (self._joins if self._joins is not None else {}) if self._deferring() else None
        if self._weight_transport == "ipc":
            return self._receive_ipc(model, specs)
        sizes = bucket_byte_sizes(specs, num_buckets)
        direct = self._direct_loader(model, specs)
        buffers = self._buffers_for(specs, sizes, keep=direct is not None and self._kept_buffers())
        # Loading straight from shared memory needs a loader that copies whatever a layer would keep of it.
        private = self._borrowing() and (direct is None or self._hides_views())
        by_bucket = specs_by_bucket(specs, num_buckets)
        start = time.perf_counter()
        try:
            if direct is not None:
                waiting, loading = self._receive_buckets(by_bucket, sizes, direct.add_all, buffers, private)
                mark = time.perf_counter()
                direct.finish()
                loading += time.perf_counter() - mark
            else:
                waiting, loading = layerwise_reload(
                    model, self.vllm_config, lambda load: self._receive_buckets(by_bucket, sizes, load, private=private)
                )
        finally:  # also after a failed push: the learner makes new segments after one
            if self._shm is not None:
                self._shm.forget_unused()
        self._received = True
        return {
            "bytes": float(sum(sizes)),
            "seconds": time.perf_counter() - start,
            "receive_wait_seconds": waiting,
            "load_seconds": loading,
            "deferred_handles": float(len(direct.deferred) if direct is not None else 0),
            "joined_pieces": float(sum(spec.joined for spec in specs)),
            "direct": float(direct is not None),
            "aliased_bytes": float(direct.aliased_bytes if direct is not None else 0),
            "copied_borrowed_bytes": float(direct.copied_borrowed_bytes if direct is not None else 0),
        }

    def _receive_ipc(self, model: torch.nn.Module, specs: list[TensorSpec]) -> dict[str, float]:
        if self._ipc is None:
            self._ipc = IpcReceiver(self.device)

        def layerwise(pairs: list[tuple[str, torch.Tensor]]) -> None:
            layerwise_reload(model, self.vllm_config, lambda load: (0.0, _timed(lambda: load(pairs))))

        return self._ipc.receive(
            self._weight_store,
            self._weight_receiver_id,
            specs,
            self._published,
            lambda: self._direct_loader(model, specs),
            layerwise,
        )

    def _receive_buckets(self, by_bucket, sizes, load, buffers=None, private: bool = False) -> tuple[float, float]:
        """Receive bucket after bucket (into ``buffers`` when given: every bucket is started at once, see
        :func:`posting_schedule`), handing each bucket's ``(name, tensor)`` pairs to ``load`` (from a private
        copy of the bucket when ``private``)."""
        waiting = loading = 0.0
        first, after = posting_schedule(len(sizes), len(sizes) if buffers is not None else 1)

        def post(index: int) -> Any:
            return self._post_receive(index, sizes[index], None if buffers is None else buffers[index])

        pending = {index: post(index) for index in first}
        for index, specs in enumerate(by_bucket):
            mark = time.perf_counter()
            buffer = pending.pop(index).result()
            waiting += time.perf_counter() - mark
            pending.update((later, post(later)) for later in after[index])
            mark = time.perf_counter()
            load(unpack_bucket(buffer.clone() if private else buffer, specs))
            if self._weight_transport == "shm":
                ShmReceiver.release(self._weight_store, index, self._weight_receiver_id)
            loading += time.perf_counter() - mark
        return waiting, loading

    def _post_receive(self, index: int, nbytes: int, buffer: torch.Tensor | None = None) -> Any:
        """Start receiving one bucket (into ``buffer``, else a new one): gloo does it in the background, NCCL
        at once, shared memory when the learner has packed it."""
        if self._weight_transport == "shm":
            if self._shm is None:
                self._shm = ShmReceiver()
            shm = self._shm
            return _PublishedBucket(lambda: shm.bucket(self._published, index, nbytes))
        return receive_bucket(self._weight_group, nbytes, self.device, buffer)

    def _published(self, key: str) -> bytes:
        """The record the learner publishes under ``key`` once the bucket is ready (IPC, shared memory)."""
        return published_record(self._weight_store, key, self._weight_timeout_s)

    def weight_channel_close(self) -> None:
        """Leave the push's process group: a gloo group that received the whole push is kept for the next one
        (the learner offers it again while its members stay); any other group is torn down in the background,
        after the update is done (one cut short may have left bytes unread in its sockets)."""
        if self._weight_store is None:  # no push open: closed already
            return
        if self._gloo is not None and not self._received:
            self._weight_group = None
            self._gloo.retire()
            self._gloo = None
        if self._weight_group is not None and self._gloo is None:  # NCCL's: one per push
            retired, self._weight_group = [self._weight_group], None
            release_in_background(retired, "weight-group-release")
        self._weight_group = None
        self._received = False
        self._weight_store = None
        self._weight_transport = ""

    def weight_fingerprint(self) -> dict[str, float]:
        """Sum of every parameter (float64), for tests and operators to compare weights across replicas."""
        model = self.model_runner.get_model()
        return {name: float(param.detach().double().sum()) for name, param in model.named_parameters()}


def published_record(store: Any, key: str, timeout_s: float) -> bytes:
    """The record the learner publishes in ``store`` under ``key`` once a bucket is ready (IPC, shared memory).
    A read waits for its key in slices of the store's timeout (:data:`RECORD_WAIT_SLICE`, set when the push
    opened; one request, where a wait and then a read took two), so that a push the learner gave up on (it sets
    ``abort``, with the reason) ends here at once instead of after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return store.get(key)
        except torch.distributed.DistStoreError:
            if store.check([PUSH_ABORT_KEY]):
                reason = store.get(PUSH_ABORT_KEY).decode(errors="replace")
                raise RuntimeError(f"the learner gave up on this push: {reason}") from None
            if time.monotonic() > deadline:
                raise


def _timed(step: Callable[[], Any]) -> float:
    mark = time.perf_counter()
    step()
    return time.perf_counter() - mark
