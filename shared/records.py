"""Wire records: every value that crosses a process boundary, defined once.

Each record is a frozen pydantic model with ``extra="forbid"`` and a schema version. The comment above each
says who writes it and who reads it. Records are encoded by :mod:`shared.codec` (msgpack, arrays packed as
raw little-endian bytes); never pickled. A completion and its chat messages (with schema v2's tool calls and
trajectories) are defined in :mod:`shared.trajectory`.

Identity: a ``PromptTask``'s ``task_id`` is also the ``group_id`` of the ``Rollout`` and ``ScoredGroup``
made from it, so every stage can deduplicate a redelivered entry by the same id.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Annotated, Any, ClassVar, Final, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.arrays import Float32Array, Float32Matrix, Int32Array
from shared.columns import column_problem
from shared.finite import finite_problem, reward_problem
from shared.sampled_versions import trajectory_version
from shared.trajectory import ChatMessage, Completion, SinceV2, uses_v2

# The newest schema this build reads and writes. A record is written as the lowest version that carries it
# (``WireModel.wire_version``): v2 only where a v2 field (``shared.trajectory``) is set.
SCHEMA_VERSION: Final = 2
READABLE_VERSIONS: Final = (1, 2)


def new_id() -> str:
    """A fresh record id (32 hex characters)."""
    return uuid.uuid4().hex


def _now() -> float:
    return time.time()


class WireModel(BaseModel):
    """Base of every record: immutable, strict about unknown fields, versioned."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    kind: ClassVar[str] = ""
    # Not the record's version (the envelope's ``v``, from ``wire_version``, is): schema v1 wrote this field
    # inside nested records (a Rollout's task), so it stays, always 1, for v1 encodings to stay byte-identical.
    schema_version: Literal[1] = 1

    def wire_version(self) -> int:
        """The schema version this record is written as: 2 only when it sets a v2 field."""
        return 2 if uses_v2(self) else 1


class SamplingSpec(BaseModel):
    """Sampling parameters for one prompt's G completions (vLLM's names and meanings).

    ``top_k = -1`` and ``top_p = 1`` switch those filters off; ``seed`` is optional: set, the G completions are
    the same at every sampling of the same prompt under the same weights (vLLM seeds them ``seed`` to
    ``seed + G - 1``); None, vLLM draws them from its own generator.
    """

    # Non-finite numbers are refused in every form (a JSON literal is refused before this; "Infinity" as a
    # string, or a NaN in msgpack, here).
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    max_tokens: int = Field(256, ge=1)
    min_tokens: int = Field(0, ge=0)
    stop: tuple[str, ...] = ()
    seed: int | None = Field(None, ge=0, lt=2**63)  # vLLM takes a 64-bit seed

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("top_k = 0 is ambiguous; use -1 to disable top-k filtering")
        return value

    @model_validator(mode="after")
    def _min_below_max(self) -> SamplingSpec:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        return self


class DatasetPosition(BaseModel):
    """Where a prompt came from in the learner's feeder: epoch and index into that epoch's order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    epoch: int = Field(ge=0)
    index: int = Field(ge=0)


JsonValue = Any


# Learner (prompt feeder) -> generators, on the prompts stream.
class PromptTask(WireModel):
    kind: ClassVar[str] = "prompt_task"

    task_id: str = Field(default_factory=new_id, min_length=1)
    prompt: str | tuple[ChatMessage, ...]
    columns: dict[str, JsonValue] = Field(default_factory=dict)
    group_size: int = Field(ge=1)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    dataset_position: DatasetPosition | None = None
    policy_version: int = Field(ge=0)
    # The learner step whose evaluation this task is part of (held-out prompts: the scorer writes their
    # groups to the evaluated stream, never to training); None for a training prompt.
    eval_step: int | None = Field(None, ge=0)
    created_at: float = Field(default_factory=_now)

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: str | tuple[ChatMessage, ...]) -> str | tuple[ChatMessage, ...]:
        if not value:
            raise ValueError("prompt must not be empty")
        return value

    @field_validator("columns")
    @classmethod
    def _columns_reach_rewards(cls, columns: dict[str, JsonValue]) -> dict[str, JsonValue]:
        for name, value in columns.items():
            problem = column_problem(name, value)
            if problem:
                raise ValueError(problem)
        return columns


class RolloutTimings(BaseModel):
    """Wall-clock stamps (seconds since the epoch) of one prompt's trip through a generator."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    received_at: float
    started_at: float
    finished_at: float


# Generator -> scorers, on the rollouts stream.
class Rollout(WireModel):
    kind: ClassVar[str] = "rollout"

    group_id: str = Field(min_length=1)
    task: PromptTask
    prompt_token_ids: Int32Array
    completions: tuple[Completion, ...]
    policy_version: int = Field(ge=0, description="policy version when sampling started")
    # Policy version when the last completion finished: larger than policy_version when a weight update
    # landed while the group was being sampled (its tokens then come from both versions).
    finished_policy_version: int = Field(ge=0)
    generator_id: str
    timings: RolloutTimings

    @model_validator(mode="after")
    def _group_matches(self) -> Rollout:
        if len(self.completions) != self.task.group_size:
            raise ValueError(
                f"completions has {len(self.completions)} entries but the task's group_size is {self.task.group_size}"
            )
        if self.group_id != self.task.task_id:
            raise ValueError("group_id must equal task.task_id")
        if self.finished_policy_version < self.policy_version:
            raise ValueError("finished_policy_version must not be below policy_version")
        self._policy_version_bounds_tokens()
        return self

    def _policy_version_bounds_tokens(self) -> None:
        """Staleness reads ``policy_version``: it must be no newer than any sampled token's version."""
        for i, completion in enumerate(self.completions):
            oldest = trajectory_version(completion.token_versions, completion.loss_mask)
            if oldest is not None and self.policy_version > oldest:
                raise ValueError(
                    f"policy_version ({self.policy_version}) exceeds completion {i}'s oldest sampled token version "
                    f"({oldest}); policy_version must be the version when sampling started, at most every "
                    "sampled token's (shared.sampled_versions.trajectory_version)"
                )

    @property
    def group_size(self) -> int:
        return len(self.completions)


class AdvantageSpec(BaseModel):
    """How a group's advantages were normalised; the learner re-normalises over its batch when
    ``needs_batch`` (``scale_rewards="batch"`` and BNPO use statistics of the whole training batch)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    estimator: Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "bnpo"] = "grpo"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    eps: float = Field(1e-4, ge=0)
    std_unbiased: bool = True
    reward_min: float = 0.0
    reward_max: float = 1.0
    # GDPO (TRL multi_objective_aggregation): normalise each reward function in its group, then the weighted sum
    # over the batch; the weights travel so the learner can redo the batch step from rewards_per_func.
    reward_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    reward_weights: tuple[float, ...] = ()

    @property
    def needs_batch(self) -> bool:
        return (
            self.estimator in ("bnpo", "reinforce_pp", "reinforce_pp_baseline")
            or self.scale_rewards == "batch"
            or self.reward_aggregation == "normalize_then_sum"
        )


# Scorer -> learner, on the scored stream.
class ScoredGroup(WireModel):
    kind: ClassVar[str] = "scored_group"

    rollout: Rollout
    reward_names: tuple[str, ...]
    rewards_per_func: Float32Matrix = Field(description="[G, F]; NaN where a function gave None or failed")
    rewards: Float32Array = Field(description="[G] weighted combination; NaN where every function was NaN")
    advantages: Float32Array = Field(description="[G] group-relative advantages")
    advantage_spec: AdvantageSpec = Field(default_factory=AdvantageSpec)
    # Every non-NaN reward in the group agrees: no learning signal. With dynamic sampling (DAPO) on, the
    # scorer marks such groups ``dropped`` and the learner counts them instead of training on them.
    zero_std: bool = False
    dropped: bool = False
    metrics: dict[str, float] = Field(default_factory=dict)
    scorer_id: str = ""
    scored_at: float = Field(default_factory=_now)

    @model_validator(mode="after")
    def _shapes_agree(self) -> ScoredGroup:
        g, f = self.rollout.group_size, len(self.reward_names)
        if self.rewards_per_func.shape != (g, f):
            raise ValueError(f"rewards_per_func has shape {self.rewards_per_func.shape}, expected ({g}, {f})")
        for name in ("rewards", "advantages"):
            if getattr(self, name).shape != (g,):
                raise ValueError(f"{name} has shape {getattr(self, name).shape}, expected ({g},)")
        problem = (
            reward_problem(self.rewards_per_func, "rewards_per_func")
            or reward_problem(self.rewards, "rewards")
            or finite_problem(self.advantages, "advantages")
        )
        if problem:
            raise ValueError(f"{problem} (NaN only where a reward is None; a NaN reward gets advantage 0)")
        missing = np.isnan(self.rewards_per_func).all(axis=1)
        if not np.array_equal(np.isnan(self.rewards), missing):
            raise ValueError("rewards must be NaN exactly where every function's reward is NaN (None)")
        return self

    @property
    def group_id(self) -> str:
        return self.rollout.group_id


DType = Literal["float32", "float16", "bfloat16"]
_ITEM_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}


class RuntimeVersions(BaseModel):
    """Library versions of a process that joins weight pushes: members of one group must agree (NCCL does
    not promise that ranks of different versions can form a group; CUDA IPC handles are torch's format).
    ``None``: not installed (vLLM in a learner without it) or not applicable (NCCL on CPU)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    torch: str = ""
    nccl: str | None = None
    vllm: str | None = None


class ShmProbe(BaseModel):
    """Where a CPU generator's shared-memory probe file lies and the token it holds (see ``shared.shm``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str = Field(min_length=1)
    token: str = Field(min_length=16)


# Generator -> learner (and operators), under the replica's own registration key; refreshed with every heartbeat.
class GeneratorRegistration(WireModel, SinceV2):
    kind: ClassVar[str] = "generator_registration"
    V2_FIELDS: ClassVar[tuple[str, ...]] = ("stacked_linear",)

    generator_id: str = Field(min_length=1)
    url: str
    engine_world_size: int = Field(1, ge=1)
    policy_version: int = Field(ge=0)
    device: str = "cpu"
    # Physical GPU of each engine worker (``torch.cuda.get_device_properties(i).uuid``); empty on CPU. The
    # learner picks the transport from it (same GPU as its own: CUDA IPC) and refuses duplicate GPUs in NCCL.
    device_uuids: tuple[str, ...] = ()
    # The dtype the engine serves in; the learner casts pushed weights to it while packing. None: unknown.
    engine_dtype: DType | None = None
    versions: RuntimeVersions = Field(default_factory=RuntimeVersions)
    # A CPU replica's shared-memory probe (``shared.shm``): a learner that reads ``token`` at ``path`` shares
    # the directory with it and pushes through shared memory. None: no such directory (gloo only).
    shm_probe: ShmProbe | None = None
    # Whether the engine repacks its linear layers' weights into kernels of its own (vLLM-CPU's oneDNN
    # handles), which read a weight stored transposed (``[in, out]`` contiguous) about twice as fast: a
    # learner whose every receiver says so sends linear weights that way (``TensorSpec.transposed``).
    transposed_linear: bool = False
    # The engine's stacked linear layers: each fused module's name and the modules whose weights it stacks, in
    # order (vLLM's ``packed_modules_mapping``: ``qkv_proj`` -> ``q_proj, k_proj, v_proj``). A learner whose
    # every receiver names the same sends those transposed pieces joined (``TensorSpec.joined``).
    stacked_linear: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    heartbeat_at: float = Field(default_factory=_now)
    started_at: float = Field(default_factory=_now)


# Learner -> operators and generators, in the learner's state hash (field "runtime"), written at start.
class LearnerRuntime(WireModel):
    kind: ClassVar[str] = "learner_runtime"

    device: str = "cpu"
    device_uuid: str | None = None  # physical GPU the learner pushes from (rank 0's); None on CPU
    versions: RuntimeVersions = Field(default_factory=RuntimeVersions)
    started_at: float = Field(default_factory=_now)
    # Every learner rank's device and physical GPU (None on CPU), in rank order; one entry without torchrun.
    rank_devices: tuple[str, ...] = ()
    rank_device_uuids: tuple[str | None, ...] = ()


class TensorSpec(SinceV2):
    """One parameter in a weight push: its name in the model, dtype, shape, and the bucket it travels in.
    ``transposed``: the bucket holds a 2-D tensor's transpose (``[shape[1], shape[0]]``, contiguous)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    V2_FIELDS: ClassVar[tuple[str, ...]] = ("joined",)

    name: str
    dtype: DType
    shape: tuple[Annotated[int, Field(ge=0)], ...]
    bucket: int = Field(ge=0)
    transposed: bool = False
    # A transposed piece of a stacked engine layer (``k_proj`` after ``q_proj``): its columns continue the
    # ``[shape[1], ...]`` block the spec before it started, so the layer's pieces arrive joined, one view.
    joined: bool = False

    @model_validator(mode="after")
    def _transposed_is_2d(self) -> TensorSpec:
        if self.transposed and len(self.shape) != 2:
            raise ValueError(f"{self.name}: only a 2-D tensor travels transposed, not one of shape {self.shape}")
        if self.joined and not self.transposed:
            raise ValueError(f"{self.name}: only a transposed tensor is joined to the one before it")
        return self

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


Transport = Literal["gloo", "nccl", "ipc", "shm"]
# Transports without a process group: the learner publishes each bucket in the push's store.
STORE_TRANSPORTS: frozenset[str] = frozenset({"ipc", "shm"})


# Learner -> generators on the learner's own GPU, through the push's store (key ``ipc/weights``): every pushed
# tensor where it lies in the learner's GPU memory, nothing packed or copied on the learner's side. Each is a
# CUDA IPC handle to the tensor's bytes (the fields of ``torch.multiprocessing.reductions.reduce_tensor``'s
# answer for the tensor viewed as flat uint8, as bytes and ints, never pickled) with its name, dtype and shape.
# The receiver rebuilds them with ``rebuild_cuda_tensor``, copies them into its parameters (casting to the
# engine's dtype) and answers ``ipc/done/<generator>``; until then the learner leaves its weights alone.
class CudaIpcTensor(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    dtype: DType
    shape: tuple[Annotated[int, Field(ge=0)], ...]
    nbytes: int = Field(ge=0)
    tensor_offset: int = Field(ge=0)
    storage_handle: bytes
    storage_size_bytes: int = Field(ge=0)
    storage_offset_bytes: int = Field(ge=0)
    ref_counter_handle: bytes
    ref_counter_offset: int = Field(ge=0)
    event_handle: bytes
    event_sync_required: bool

    @model_validator(mode="after")
    def _bytes_match_shape(self) -> CudaIpcTensor:
        expected = math.prod(self.shape) * _ITEM_BYTES[self.dtype]
        if self.nbytes != expected:
            raise ValueError(f"{self.name}: {self.nbytes} bytes for {self.dtype} of shape {self.shape} ({expected})")
        return self


IPC_WEIGHTS_KEY: Final = "ipc/weights"
IPC_DONE_OK: Final = b"ok"  # a receiver's answer under ipc_done_key once it copied the weights, else its error


def ipc_done_key(generator_id: str) -> str:
    return f"ipc/done/{generator_id}"


class CudaIpcWeights(WireModel):
    kind: ClassVar[str] = "cuda_ipc_weights"

    device_uuid: str = Field(min_length=1)
    tensors: tuple[CudaIpcTensor, ...]


# Learner -> CPU generators that share its shared-memory directory, through the push's store (key
# ``shm/<bucket>``): the file one bucket is packed into; the receiver maps it and answers
# ``shm/<bucket>/done/<generator>`` once it has loaded it.
# Set by the learner in a push's store namespace when it gives up on sending (the value says why), so that
# IPC and shared-memory receivers waiting for a bucket's record stop at once.
PUSH_ABORT_KEY: Final = "abort"


class ShmBucket(WireModel):
    kind: ClassVar[str] = "shm_bucket"

    bucket: int = Field(ge=0)
    path: str = Field(min_length=1)
    nbytes: int = Field(ge=0)


# Learner -> generators: the body of POST /weights/update, and (without a channel) the "latest version" key.
class WeightVersionAnnouncement(WireModel):
    kind: ClassVar[str] = "weight_version"

    policy_version: int = Field(ge=0)
    layout: tuple[TensorSpec, ...] = ()
    num_buckets: int = Field(0, ge=0)
    # The push's process group: the learner's store (host:port), this push's namespace in it, the first
    # rank of each participating generator (its engine workers take the ranks after it) and the group size.
    rendezvous: str | None = None
    namespace: str = ""
    ranks: dict[str, Annotated[int, Field(ge=1)]] = Field(default_factory=dict)
    world_size: int = Field(1, ge=1)
    # A restarted learner pushes its checkpoint's (older) version: generators accept it instead of refusing.
    reset: bool = False
    # How each participating generator receives this push: "gloo" (CPU), "nccl" (another GPU), "ipc" (the
    # learner's own GPU: CUDA IPC handles of each bucket) or "shm" (a CPU generator on the learner's host: the
    # shared-memory file of each bucket); ipc and shm buckets are published in the store under the push's
    # namespace and such a generator has no rank. Empty: every generator in ``ranks``, over the learner's default.
    transports: dict[str, Transport] = Field(default_factory=dict)
    created_at: float = Field(default_factory=_now)

    @model_validator(mode="after")
    def _buckets_cover_layout(self) -> WeightVersionAnnouncement:
        used = {spec.bucket for spec in self.layout}
        if used and (max(used) >= self.num_buckets):
            raise ValueError(f"layout names bucket {max(used)} but num_buckets is {self.num_buckets}")
        if self.ranks and max(self.ranks.values()) >= self.world_size:
            raise ValueError(f"a rank is outside the group of {self.world_size}")
        if self.transports and set(self.ranks) - set(self.transports):
            raise ValueError("every generator with a rank needs an entry in transports")
        if any(self.transports[g] in STORE_TRANSPORTS for g in self.ranks if g in self.transports):
            raise ValueError("a generator that receives over CUDA IPC or shared memory joins no process group")
        return self

    def participates(self, generator_id: str) -> bool:
        """Whether this push is for ``generator_id`` (it has a rank, or receives over IPC or shared memory)."""
        return generator_id in self.ranks or generator_id in self.transports

    def transport_of(self, generator_id: str, default: Transport) -> Transport:
        return self.transports.get(generator_id, default)


# Learner -> generators that start late, in the "latest checkpoint" key.
class CheckpointAnnouncement(WireModel):
    kind: ClassVar[str] = "checkpoint"

    policy_version: int = Field(ge=0)
    step: int = Field(ge=0)
    path: str = Field(min_length=1, description="a directory transformers and vLLM load directly")
    created_at: float = Field(default_factory=_now)


RECORD_TYPES: tuple[type[WireModel], ...] = (
    PromptTask,
    Rollout,
    ScoredGroup,
    GeneratorRegistration,
    LearnerRuntime,
    WeightVersionAnnouncement,
    CudaIpcWeights,
    ShmBucket,
    CheckpointAnnouncement,
)
RECORDS_BY_KIND: dict[str, type[WireModel]] = {cls.kind: cls for cls in RECORD_TYPES}
