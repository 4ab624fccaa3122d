"""Which GPUs of a host a generator replica may lease, and the one-GPU memory split: pure placement arithmetic
(the leases themselves, Redis keys with a TTL, are :mod:`services.generator.gpu_lease`).

Placement on a host where every replica sees every GPU (``docker compose up --scale generator=N``, or
several processes on one machine):

* the learner's GPUs are an explicit list of indices (``LEARNER_GPUS``, default ``0``), which compose hands
  to the learner as ``CUDA_VISIBLE_DEVICES`` and to every generator as ``generator.learner_gpus``;
* generators lease one GPU each (``tensor_parallel_size`` for a sharded engine) from the other indices,
  in index order, through Redis keys in one lease namespace (``generator.gpu_host_key``) that every
  replica on the host shares;
* colocated (one-GPU) mode: the generator leases the learner's own GPUs instead of the others, and
  vLLM's ``generator.gpu_memory_utilization`` plus the learner's ``learner.gpu_memory_share`` must not
  exceed the whole GPU.

Indices are in PCI bus order (``CUDA_DEVICE_ORDER=PCI_BUS_ID``), the order ``nvidia-smi`` and NVML list.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class PlacementError(ValueError):
    """A GPU layout that cannot work (the message names the setting to change)."""


def parse_gpu_list(text: str) -> tuple[int, ...]:
    """``"0,1"`` -> ``(0, 1)``; ``""`` -> ``()``. The ``CUDA_VISIBLE_DEVICES`` syntax, indices only."""
    indices: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit():
            raise PlacementError(f"GPU list {text!r}: {part!r} is not a GPU index (write e.g. '0' or '6,7')")
        index = int(part)
        if index in indices:
            raise PlacementError(f"GPU list {text!r} names GPU {index} twice")
        indices.append(index)
    return tuple(indices)


def leasable_gpus(gpu_count: int, learner_gpus: Sequence[int], colocated: bool) -> tuple[int, ...]:
    """The indices generators on a host of ``gpu_count`` GPUs may lease, in the order they take them."""
    if gpu_count < 1:
        raise PlacementError(f"gpu_count is {gpu_count}: a host to lease GPUs on has at least one")
    outside = [i for i in learner_gpus if i >= gpu_count]
    if outside:
        raise PlacementError(
            f"learner GPUs {list(learner_gpus)} name {outside}, but this host has {gpu_count} GPUs "
            f"(indices 0..{gpu_count - 1}); fix LEARNER_GPUS (generator.learner_gpus)"
        )
    if colocated:
        if not learner_gpus:
            raise PlacementError("colocated mode shares the learner's GPU: set LEARNER_GPUS (e.g. 0)")
        return tuple(sorted(learner_gpus))
    free = tuple(i for i in range(gpu_count) if i not in learner_gpus)
    if not free:
        raise PlacementError(
            f"all {gpu_count} GPUs are the learner's ({list(learner_gpus)}), none is left for a generator: "
            "give the learner fewer (LEARNER_GPUS) or share its GPU (deploy/one-gpu.yml, generator.colocated)"
        )
    return free


def first_free(candidates: Sequence[int], held: Mapping[int, str], needed: int) -> tuple[int, ...] | None:
    """The first ``needed`` candidates nobody holds (``held``: index -> holder), or None if too few are free."""
    free = [i for i in candidates if i not in held]
    return tuple(free[:needed]) if len(free) >= needed else None


def no_free_gpu_message(
    namespace: str,
    candidates: Sequence[int],
    held: Mapping[int, str],
    needed: int,
    learner_gpus: Sequence[int],
    colocated: bool = False,
) -> str:
    """Why a replica cannot start, and what to change (in colocated mode the replicas share the learner's GPU,
    and the command carries the one-GPU override)."""
    holders = ", ".join(f"GPU {i}: {held[i]}" for i in candidates if i in held) or "none"
    most = len(candidates) // needed
    if colocated:
        whose = f"(shared with the learner: colocated mode), held by {holders}"
        command = f"docker compose -f docker-compose.yml -f deploy/one-gpu.yml up --scale generator={most}"
        other = "share more GPUs with the learner (LEARNER_GPUS)"
    else:
        whose = f"(the learner's {list(learner_gpus)} are never leased), held by {holders}"
        command = f"docker compose up --scale generator={most}"
        other = "give the learner fewer GPUs (LEARNER_GPUS)"
    return (
        f"no free GPU in lease namespace {namespace!r}: {needed} needed of GPUs {list(candidates)} {whose}. "
        f"At most {most} generator replica(s) fit: scale down ({command}), {other}, or wait for a dead "
        "replica's lease to expire (generator.heartbeat_ttl_s)"
    )


def plan(gpu_count: int, learner_gpus: Sequence[int], replicas: int, colocated: bool = False) -> dict[int, str]:
    """What each GPU of the host runs when ``replicas`` one-GPU generators start one after another.

    Returns index -> ``"learner"``, ``"generator-<n>"``, ``"learner+generator-<n>"`` or ``"idle"``;
    raises :class:`PlacementError` when a replica would find no free GPU."""
    candidates = leasable_gpus(gpu_count, learner_gpus, colocated)
    held: dict[int, str] = {}
    for replica in range(1, replicas + 1):
        taken = first_free(candidates, held, 1)
        if taken is None:
            raise PlacementError(no_free_gpu_message("plan", candidates, held, 1, learner_gpus, colocated))
        held[taken[0]] = f"generator-{replica}"
    roles = {}
    for index in range(gpu_count):
        parts = (["learner"] if index in learner_gpus else []) + ([held[index]] if index in held else [])
        roles[index] = "+".join(parts) or "idle"
    return roles


def memory_share_error(gpu_memory_utilization: float, learner_share: float | None) -> str | None:
    """Colocated mode: the message saying why vLLM's and the learner's shares of one GPU do not fit, or None
    (``learner_share`` None: not set). :class:`shared.config.pipeline.PipelineConfig` checks it with the file."""
    if learner_share is None:
        return (
            "colocated mode: the learner's share of the GPU is not set (read from LEARNER_GPU_MEMORY_SHARE, else "
            "the [learner] table of $ASYNCGRPO_CONFIG); set learner.gpu_memory_share to at most "
            f"{1 - gpu_memory_utilization:.2f}, the part generator.gpu_memory_utilization "
            f"({gpu_memory_utilization}) leaves"
        )
    if gpu_memory_utilization + learner_share > 1.0:
        return (
            f"colocated mode: generator.gpu_memory_utilization ({gpu_memory_utilization}) + "
            f"learner.gpu_memory_share ({learner_share}) = {gpu_memory_utilization + learner_share:.2f} exceeds "
            "the whole GPU (1.0); lower either (GENERATOR_GPU_MEMORY_UTILIZATION, LEARNER_GPU_MEMORY_SHARE)"
        )
    return None
