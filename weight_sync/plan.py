"""Decisions of a weight push, as pure functions: which transport reaches each generator, who may form an
NCCL group, whether versions agree, and which dtype the buckets carry.

* Transport: a learner on the CPU reaches CPU generators through shared memory when they share its
  shared-memory directory (same host: it sees their probe file, ``shared.shm``), else over gloo; on a GPU it
  reaches a generator on its own physical GPU over CUDA IPC (NCCL refuses two ranks on one GPU: "Duplicate
  GPU detected") and the others over NCCL. Devices are compared by their physical UUID, never by index
  (``CUDA_VISIBLE_DEVICES`` renumbers GPUs in every container).
* An NCCL group whose members share a GPU is refused before anyone joins it, instead of hanging.
* Members of a group run the same torch, NCCL and vLLM; a mismatch is refused with both sides named.
* Buckets carry the generators' engine dtype (the learner may hold float32 master weights while generators
  serve bf16): the cast happens once, while packing.

:mod:`weight_sync.sender` calls these; the CUDA-only code stays there and in the transport modules.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from shared.records import STORE_TRANSPORTS, DType, GeneratorRegistration, RuntimeVersions, Transport


class PushRefused(ValueError):
    """A push that must not start: the message says which generator and why, and how to fix it."""

    def __init__(self, message: str, generator_ids: Sequence[str]) -> None:
        super().__init__(message)
        self.generator_ids = list(generator_ids)


@dataclass(frozen=True)
class LearnerDevice:
    """Where the learner pushes from: ``kind`` "cpu" or "cuda", and the GPU's physical UUID on CUDA."""

    kind: str = "cpu"
    uuid: str | None = None
    versions: RuntimeVersions = field(default_factory=RuntimeVersions)


def choose_transport(
    learner: LearnerDevice, generator: GeneratorRegistration, shares_memory: bool = False
) -> Transport:
    """The transport for one generator: shm (both on CPU, ``shares_memory``: the learner sees the generator's
    shared-memory probe), gloo (both on CPU otherwise), ipc (the learner's own GPU), nccl (other GPUs).

    Raises PushRefused when the two cannot be joined: CPU and GPU mixed, a GPU generator without device
    UUIDs, or a tensor-parallel generator with some workers on the learner's GPU and some elsewhere.
    """
    gid = generator.generator_id
    on_gpu = bool(generator.device_uuids) or generator.device.startswith("cuda")
    if learner.kind == "cpu":
        if on_gpu:
            raise PushRefused(
                f"generator {gid} serves on {generator.device} but the learner pushes from the CPU; "
                "run the learner on a GPU (learner.device = 'cuda') or the generator on the CPU",
                [gid],
            )
        return "shm" if shares_memory else "gloo"
    if not on_gpu:
        raise PushRefused(
            f"generator {gid} serves on the CPU but the learner pushes from a GPU; both must be on GPUs or both on CPU",
            [gid],
        )
    if not generator.device_uuids:
        raise PushRefused(f"generator {gid} did not publish its GPU's UUID; upgrade it to this version", [gid])
    shared = [u for u in generator.device_uuids if u == learner.uuid]
    if not shared:
        return "nccl"
    if len(shared) == len(generator.device_uuids) == 1:
        return "ipc"
    raise PushRefused(
        f"generator {gid} has {len(shared)} of its {len(generator.device_uuids)} engine workers on the "
        f"learner's GPU {learner.uuid}; a tensor-parallel generator must be entirely on other GPUs",
        [gid],
    )


def duplicate_gpus(members: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """Physical GPUs that more than one member of one NCCL group sits on: ``uuid -> [member, ...]``.

    ``members`` maps a member's name (``"learner"``, a generator id) to the UUIDs of its ranks; a member
    whose own ranks repeat a GPU counts as a duplicate too.
    """
    holders: dict[str, list[str]] = {}
    for name, uuids in members.items():
        for uuid in uuids:
            holders.setdefault(uuid, []).append(name)
    return {uuid: names for uuid, names in holders.items() if len(names) > 1}


def check_nccl_group(learner: LearnerDevice, generators: Sequence[GeneratorRegistration]) -> None:
    """Refuse an NCCL group in which two ranks share a physical GPU (NCCL would fail at the first
    collective, or hang the ranks that already joined)."""
    members: dict[str, list[str]] = {"learner": [learner.uuid or ""]}
    for g in generators:
        members[g.generator_id] = list(g.device_uuids)
    clashes = duplicate_gpus(members)
    if clashes:
        detail = "; ".join(f"GPU {uuid}: {', '.join(names)}" for uuid, names in sorted(clashes.items()))
        offenders = sorted({n for names in clashes.values() for n in names if n != "learner"})
        raise PushRefused(
            f"refusing an NCCL weight group with two ranks on one physical GPU ({detail}); give every generator "
            "its own GPU (GPU leases), or put the generator on the learner's GPU alone (it then gets CUDA IPC)",
            offenders,
        )


def version_mismatches(learner: RuntimeVersions, generator: RuntimeVersions, transport: Transport) -> list[str]:
    """Differences that forbid a weight group, each as ``"<library> <learner's> (learner) vs <generator's>"``.

    torch must match on every transport (gloo's wire format, IPC handles); NCCL must match on NCCL; vLLM must
    match wherever both sides have it (its NCCL wrapper and the receiver's loading code).
    """
    found = []
    pairs: list[tuple[str, str | None, str | None]] = [("torch", learner.torch, generator.torch)]
    if transport == "nccl":
        pairs.append(("NCCL", learner.nccl, generator.nccl))
    if learner.vllm is not None and generator.vllm is not None:
        pairs.append(("vLLM", learner.vllm, generator.vllm))
    for library, ours, theirs in pairs:
        if ours != theirs:
            found.append(f"{library} {ours or 'unknown'} (learner) vs {theirs or 'unknown'} (generator)")
    return found


def check_versions(learner: RuntimeVersions, generator: GeneratorRegistration, transport: Transport) -> None:
    mismatches = version_mismatches(learner, generator.versions, transport)
    if mismatches:
        raise PushRefused(
            f"refusing to open a {transport} weight group with generator {generator.generator_id}: "
            f"{'; '.join(mismatches)}. Build the learner and the generators from the same image/lock",
            [generator.generator_id],
        )


def push_dtype(generators: Sequence[GeneratorRegistration]) -> DType | None:
    """The dtype every bucket of this push carries: the generators' engine dtype (None: leave each tensor's
    own dtype, for generators that do not say). One broadcast serves everyone, so they must agree."""
    dtypes = {g.engine_dtype for g in generators if g.engine_dtype is not None}
    if len(dtypes) > 1:
        by = ", ".join(f"{g.generator_id}: {g.engine_dtype}" for g in generators)
        raise PushRefused(
            f"generators serve different dtypes ({by}); one push carries one dtype: set the same generator.dtype",
            [g.generator_id for g in generators],
        )
    return dtypes.pop() if dtypes else None


@dataclass(frozen=True)
class PushPlan:
    """Who gets this push how: ``transports`` per generator id, the process-group members (gloo/NCCL) in
    rank order with their first rank, the group's size, the buckets' dtype, whether linear weights travel
    transposed (every generator of the push repacks them: ``GeneratorRegistration.transposed_linear``), and
    the stacked layers whose transposed pieces travel joined (every generator names the same ones)."""

    transports: dict[str, Transport]
    ranks: dict[str, int]
    world_size: int
    dtype: DType | None
    transposed_linear: bool = False
    stacked_linear: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def ipc(self) -> list[str]:
        return [gid for gid, t in self.transports.items() if t == "ipc"]

    @property
    def shm(self) -> list[str]:
        return [gid for gid, t in self.transports.items() if t == "shm"]


def group_members(plan: PushPlan) -> tuple[tuple[tuple[str, int], ...], int]:
    """What a kept process group must match to serve ``plan``: every member's first rank, and the group's
    size (a generator that joins or leaves, or one with more engine workers, changes it)."""
    return tuple(sorted(plan.ranks.items())), plan.world_size


def plan_push(
    learner: LearnerDevice, generators: Sequence[GeneratorRegistration], shares_memory: Collection[str] = ()
) -> PushPlan:
    """Transport, ranks and dtype of one push; raises PushRefused naming every generator that cannot join.
    ``shares_memory``: ids of the generators whose shared-memory probe the learner sees."""
    transports = {g.generator_id: choose_transport(learner, g, g.generator_id in shares_memory) for g in generators}
    for g in generators:
        check_versions(learner.versions, g, transports[g.generator_id])
    grouped = [g for g in generators if transports[g.generator_id] not in STORE_TRANSPORTS]
    if learner.kind == "cuda":
        check_nccl_group(learner, grouped)
    ranks, next_rank = {}, 1  # the learner is rank 0
    for g in grouped:
        ranks[g.generator_id] = next_rank
        next_rank += g.engine_world_size
    transposed = bool(generators) and all(g.transposed_linear for g in generators)
    stacked = generators[0].stacked_linear if transposed else {}
    if any(g.stacked_linear != stacked for g in generators):
        stacked = {}  # engines that stack differently get every piece on its own
    return PushPlan(transports, ranks, next_rank, push_dtype(generators), transposed, dict(stacked))
