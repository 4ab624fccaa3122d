"""Golden schema-v1 payloads: one record of every kind, encoded by the code that predates schema v2.

The files under ``tests/support/records_v1/`` were written by ``main()`` *before* records v2 existed
(docs/concepts/multi-turn-design.md §2.2), so they are what a v1 service puts on the wire. ``test_records_v2.py``
decodes them forever and checks that ``golden_records()``, encoded by today's code, still gives the same
bytes (a single-turn record stays v1 byte for byte).

Do not re-run this script after the v2 change: regenerating would make the goldens prove nothing. To add a
kind, encode it with a v1 build (a checkout before records v2) and commit the file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shared.records import (
    ChatMessage,
    CheckpointAnnouncement,
    Completion,
    CudaIpcTensor,
    CudaIpcWeights,
    DatasetPosition,
    GeneratorRegistration,
    LearnerRuntime,
    PromptTask,
    Rollout,
    RolloutTimings,
    RuntimeVersions,
    SamplingSpec,
    ScoredGroup,
    ShmBucket,
    ShmProbe,
    TensorSpec,
    WeightVersionAnnouncement,
    WireModel,
)

GOLDEN_DIR = Path(__file__).parent / "records_v1"
_T = 1_700_000_000.25  # fixed timestamps: the bytes must not depend on when this runs


def _task() -> PromptTask:
    return PromptTask(
        task_id="task-0001",
        prompt=(
            ChatMessage(role="system", content="Answer."),
            ChatMessage(role="user", content="What is 2+3?"),
            ChatMessage(role="assistant", content="Let me check."),
            ChatMessage(role="tool", content="5"),
        ),
        columns={"answer": "5", "difficulty": 2, "tags": ["math", "easy"]},
        group_size=2,
        sampling=SamplingSpec(temperature=0.7, top_p=0.9, max_tokens=16, stop=("</answer>",), seed=7),
        dataset_position=DatasetPosition(epoch=1, index=3),
        policy_version=4,
        eval_step=None,
        created_at=_T,
    )


def _rollout() -> Rollout:
    task = _task()
    completions = (
        Completion(
            text="<answer>5</answer>",
            token_ids=np.array([11, 22, 33, 2], dtype=np.int32),
            behaviour_logprobs=np.array([-0.5, -0.25, -1.0, -0.125], dtype=np.float32),
            finish_reason="stop",
            token_versions=np.array([4, 4, 5, 5], dtype=np.int32),
        ),
        Completion(
            text="<answer>6",
            token_ids=np.array([11, 23, 34], dtype=np.int32),
            behaviour_logprobs=np.array([-0.5, -2.0, -3.5], dtype=np.float32),
            finish_reason="length",
        ),
    )
    return Rollout(
        group_id=task.task_id,
        task=task,
        prompt_token_ids=np.arange(5, dtype=np.int32),
        completions=completions,
        policy_version=4,
        finished_policy_version=5,
        generator_id="gen-0",
        timings=RolloutTimings(received_at=_T, started_at=_T + 1, finished_at=_T + 2),
    )


def _scored() -> ScoredGroup:
    rewards_per_func = np.array([[1.0, 0.5], [0.0, np.nan]], dtype=np.float32)
    return ScoredGroup(
        rollout=_rollout(),
        reward_names=("accuracy", "format"),
        rewards_per_func=rewards_per_func,
        rewards=np.array([1.5, 0.0], dtype=np.float32),
        advantages=np.array([0.70710677, -0.70710677], dtype=np.float32),
        metrics={"reward": 0.75, "reward_std": 1.06},
        scorer_id="scorer-0",
        scored_at=_T + 3,
    )


def golden_records() -> dict[str, WireModel]:
    """One record of every kind, by file stem; every field fixed so its encoding is reproducible."""
    versions = RuntimeVersions(torch="2.9.0", nccl=None, vllm="0.32.0")
    return {
        "prompt_task": _task(),
        "prompt_task_text": PromptTask(
            task_id="task-0002", prompt="plain", group_size=1, policy_version=0, created_at=_T
        ),
        "rollout": _rollout(),
        "scored_group": _scored(),
        "generator_registration": GeneratorRegistration(
            generator_id="gen-0",
            url="http://127.0.0.1:8001",
            policy_version=3,
            versions=versions,
            shm_probe=ShmProbe(path="/dev/shm/probe", token="0123456789abcdef"),
            heartbeat_at=_T,
            started_at=_T,
        ),
        "learner_runtime": LearnerRuntime(
            versions=versions, started_at=_T, rank_devices=("cpu",), rank_device_uuids=(None,)
        ),
        "weight_version": WeightVersionAnnouncement(
            policy_version=4,
            layout=(TensorSpec(name="lm_head.weight", dtype="bfloat16", shape=(10, 4), bucket=0, transposed=True),),
            num_buckets=1,
            rendezvous="127.0.0.1:29500",
            namespace="push/4",
            ranks={"gen-0": 1},
            world_size=2,
            transports={"gen-0": "gloo"},
            created_at=_T,
        ),
        "cuda_ipc_weights": CudaIpcWeights(
            device_uuid="GPU-0",
            tensors=(
                CudaIpcTensor(
                    name="w",
                    dtype="float32",
                    shape=(2, 2),
                    nbytes=16,
                    tensor_offset=0,
                    storage_handle=b"\x00\x01handle",
                    storage_size_bytes=16,
                    storage_offset_bytes=0,
                    ref_counter_handle=b"ref",
                    ref_counter_offset=0,
                    event_handle=b"ev",
                    event_sync_required=True,
                ),
            ),
        ),
        "shm_bucket": ShmBucket(bucket=0, path="/dev/shm/bucket-0", nbytes=1024),
        "checkpoint": CheckpointAnnouncement(policy_version=4, step=8, path="/tmp/ckpt/step-8", created_at=_T),
    }


def main() -> None:
    from shared.codec import encode

    GOLDEN_DIR.mkdir(exist_ok=True)
    for stem, record in golden_records().items():
        (GOLDEN_DIR / f"{stem}.msgpack").write_bytes(encode(record))


if __name__ == "__main__":
    main()
