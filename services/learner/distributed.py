"""Several GPUs: the learner under ``torchrun`` with FSDP2.

``torchrun --standalone --nproc_per_node N -m services.learner --config FILE`` starts N ranks. Rank 0, the
leader, is the learner every single-process run has: Redis, HTTP, admission, weight pushes, checkpoints.
Every rank holds a shard of the parameters, gradients and AdamW state (``fully_shard`` on each decoder
layer, then on the root) and trains on its share of each batch:

* the leader sends each command to every rank (:class:`services.learner.ranks.RankChannel`), in the order it
  runs them: train this batch, gather the full weights (for a push or a checkpoint), save the optimizer's
  shards, stop;
* each rank takes its contiguous block of the batch's rows (:func:`split_rows`); the loss normalisers are
  the whole batch's (token count, number of sequences), so the gradient FSDP reduces is the gradient a
  single process computes on the whole batch;
* FSDP's collectives need every rank to run the same number of forward passes, so a rank with fewer rows
  pads with zero-weighted passes (:func:`micro_batch_plan`), and the forward is the padded one (the
  shared-prompt forward's pass count depends on where group boundaries fall).

Precision: the shards (master weights) and AdamW state stay float32; with a bf16 ``compute_dtype`` each unit
is gathered in bf16 and its gradients are reduce-scattered in float32 (FSDP2's ``MixedPrecisionPolicy``).

Followers (ranks > 0) open no port and no Redis connection: :func:`services.learner.ranks.follow` runs the
leader's commands until it says stop. LoRA is not supported across ranks (a clear error says so); a reference
model (beta > 0) is a full, frozen replica on every rank.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topology:
    """Where this process sits among the learner's ranks (one rank when not under torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def topology_from_env(env: Mapping[str, str] = os.environ) -> Topology:
    """The ranks torchrun describes in ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (none: one rank)."""
    world_size = int(env.get("WORLD_SIZE", "1"))
    if world_size < 1:
        raise ValueError(f"WORLD_SIZE is {world_size}")
    rank = int(env.get("RANK", "0"))
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK {rank} is outside WORLD_SIZE {world_size}")
    return Topology(rank=rank, world_size=world_size, local_rank=int(env.get("LOCAL_RANK", str(rank))))


def start(topology: Topology, device: str) -> str:
    """Join the learner's process group (NCCL on GPUs, gloo on CPU); returns this rank's device."""
    if not topology.distributed:
        return device
    if device.startswith("cuda"):
        device = f"cuda:{topology.local_rank}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    log.info("learner rank %d of %d on %s", topology.rank, topology.world_size, device)
    return device


def stop() -> None:
    """Leave the process group (the group object itself may live on: see ``exit_process``)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(status: int) -> NoReturn:
    """End a torchrun rank whose work is done, skipping interpreter finalization. FSDP's device mesh keeps the
    gloo group alive past ``destroy_process_group``, and its teardown during finalization can abort a finished
    rank ("terminate called without an active exception", SIGABRT), which torchrun reports as a failed run
    (seen once in CI after "learner rank 1 finished"). Every file the learner writes is closed by then; logs
    and stdio are flushed here."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError) as error:  # a closed or broken pipe: nothing left to say on it
            os.write(2, f"learner: could not flush {stream.name}: {error}\n".encode())
    os._exit(status)


def check_batch(completions_per_step: int, lora_rank: int, topology: Topology) -> None:
    """Refuse what the sharded learner cannot do, naming the fix."""
    if not topology.distributed:
        return
    if lora_rank:
        raise ValueError(
            f"lora_rank = {lora_rank} with {topology.world_size} learner ranks: LoRA is supported on one rank "
            "only; run without torchrun or set lora_rank = 0"
        )
    if completions_per_step < topology.world_size:
        raise ValueError(
            f"{completions_per_step} completions per step cannot be shared by {topology.world_size} ranks; "
            "raise groups_per_step or run fewer ranks"
        )


def mixed_precision_policy(param: torch.dtype, compute: torch.dtype):
    """FSDP2's policy: shards stay in ``param`` (the master weights), each unit is gathered and computes in
    ``compute``, and gradients are reduce-scattered in float32 (None when ``compute`` is not lower than
    ``param``: no casting, all in ``param``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from services.learner.hardware import Precision

    if not Precision(param=param, compute=compute).mixed:
        return None
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)


def shard_model(model: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """FSDP2: each decoder layer is one unit (gathered for its forward), the root holds the rest.

    With ``compute_dtype`` lower than the weights' dtype, units compute in it (:func:`mixed_precision_policy`).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no .model.layers to shard; FSDP2 needs decoder layers")
    from torch.distributed.device_mesh import init_device_mesh

    param = next(model.parameters()).dtype
    policy = mixed_precision_policy(param, compute_dtype or param) or MixedPrecisionPolicy()
    # FSDP's default mesh is on CUDA whenever CUDA is present, so gloo ranks on a GPU machine would each take
    # ``cuda:<local rank>``: the mesh follows the process group's backend instead.
    mesh = init_device_mesh(mesh_device_type(dist.get_backend()), (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def mesh_device_type(backend: str) -> str:
    """The device FSDP shards on for the learner's process group: NCCL ranks on their GPU, gloo on the CPU."""
    if backend == "nccl":
        return "cuda"
    if backend == "gloo":
        return "cpu"
    raise ValueError(f"the learner's process group uses {backend!r}; it is started with nccl or gloo")


def split_rows(batch_size: int, topology: Topology) -> slice:
    """This rank's contiguous block of rows: sizes differ by at most one, earlier ranks take the extra."""
    base, extra = divmod(batch_size, topology.world_size)
    start = topology.rank * base + min(topology.rank, extra)
    return slice(start, start + base + (1 if topology.rank < extra else 0))


def micro_batch_plan(batch_size: int, micro_batch_size: int, topology: Topology) -> list[slice | None]:
    """Row slices (of this rank's block) of each forward pass; None for a zero-weighted padding pass.

    Every rank gets the same number of passes: that of the largest block.
    """
    block = split_rows(batch_size, topology)
    rows = block.stop - block.start
    largest = -(-batch_size // topology.world_size)
    passes = -(-largest // micro_batch_size)
    plan: list[slice | None] = [slice(s, min(s + micro_batch_size, rows)) for s in range(0, rows, micro_batch_size)]
    return plan + [None] * (passes - len(plan))


def sum_across(values: dict[str, float]) -> dict[str, float]:
    """Sums of ``values`` over ranks (every rank passes the same keys)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    names = sorted(values)
    device = _collective_device()
    totals = torch.tensor([values[n] for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    return dict(zip(names, totals.tolist(), strict=True))


def gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


@contextmanager
def full_weights(model: torch.nn.Module) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The unsharded weights on the leader (on CPU), an empty list on the other ranks. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not state:
        yield []
        return
    # Parameters only, each once: a tied output layer is the embedding (as named_parameters lists them).
    yield [(name, state[name]) for name, _ in model.named_parameters()]


def save_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Every rank writes its optimizer shards under ``path`` (torch.distributed.checkpoint). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(path))


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Reads the shards :func:`save_optimizer` wrote (resharded when the rank count changed). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: the checkpoint was written by a single-rank learner; its optimizer state is "
            "in trainer.pt. Resume it on one rank, or start the sharded run from its model with resume = false"
        )
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(path))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
