"""The push plan's decisions, exactly: transport per generator, duplicate GPUs, versions, dtype, ranks."""

from __future__ import annotations

import pytest

from shared.records import GeneratorRegistration, RuntimeVersions
from weight_sync.plan import (
    LearnerDevice,
    PushRefused,
    choose_transport,
    duplicate_gpus,
    plan_push,
    push_dtype,
    version_mismatches,
)
from weight_sync.sender import WeightPusher

V = RuntimeVersions(torch="2.13.0+cu130", nccl="2.29.1", vllm="0.32.0")
CPU = LearnerDevice("cpu", None, RuntimeVersions(torch="2.13.0+cpu", vllm="0.32.0"))
GPU_A = LearnerDevice("cuda", "uuid-a", V)


def gen(gid: str, *uuids: str, dtype=None, versions=V, device=None) -> GeneratorRegistration:
    return GeneratorRegistration(
        generator_id=gid,
        url=f"http://{gid}:8001",
        policy_version=0,
        engine_world_size=max(1, len(uuids)),
        device=device or ("cuda:0" if uuids else "cpu"),
        device_uuids=uuids,
        engine_dtype=dtype,
        versions=versions,
    )


def test_linear_weights_travel_transposed_only_when_every_generator_repacks_them():
    repacks = gen("a", versions=CPU.versions).model_copy(update={"transposed_linear": True})
    also = gen("b", versions=CPU.versions).model_copy(update={"transposed_linear": True})
    plain = gen("c", versions=CPU.versions)
    assert plan_push(CPU, [repacks, also]).transposed_linear
    assert plan_push(CPU, [repacks], shares_memory={"a"}).transposed_linear
    assert not plan_push(CPU, [repacks, plain]).transposed_linear  # one set of buckets serves them all
    assert not plan_push(CPU, []).transposed_linear
    assert not GeneratorRegistration.model_validate(plain.model_dump()).transposed_linear  # the default


def test_stacked_pieces_travel_joined_only_when_every_generator_stacks_them_the_same():
    stacks = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def repacking(gid: str, stacked) -> GeneratorRegistration:
        update = {"transposed_linear": True, "stacked_linear": stacked}
        return gen(gid, versions=CPU.versions).model_copy(update=update)

    assert plan_push(CPU, [repacking("a", stacks), repacking("b", stacks)]).stacked_linear == stacks
    other = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
    assert plan_push(CPU, [repacking("a", stacks), repacking("b", other)]).stacked_linear == {}
    plain = gen("c", versions=CPU.versions).model_copy(update={"stacked_linear": stacks})
    assert plan_push(CPU, [repacking("a", stacks), plain]).stacked_linear == {}  # nothing travels transposed
    assert GeneratorRegistration.model_validate(gen("d").model_dump()).stacked_linear == {}  # the default


def test_transport_follows_the_physical_device():
    assert choose_transport(CPU, gen("g", versions=CPU.versions)) == "gloo"
    assert choose_transport(GPU_A, gen("g", "uuid-a")) == "ipc"
    assert choose_transport(GPU_A, gen("g", "uuid-b")) == "nccl"
    assert choose_transport(GPU_A, gen("g", "uuid-b", "uuid-c")) == "nccl"


def test_cpu_generators_that_share_the_learners_memory_get_shm_and_no_rank():
    near, far = gen("near", versions=CPU.versions), gen("far", versions=CPU.versions)
    assert choose_transport(CPU, near, shares_memory=True) == "shm"
    assert choose_transport(CPU, far, shares_memory=False) == "gloo"
    plan = plan_push(CPU, [near, far], shares_memory={"near"})
    assert plan.transports == {"near": "shm", "far": "gloo"} and plan.shm == ["near"] and plan.ipc == []
    assert plan.ranks == {"far": 1} and plan.world_size == 2
    only_shm = plan_push(CPU, [near], shares_memory={"near"})
    assert only_shm.ranks == {} and only_shm.world_size == 1  # no process group at all
    # Sharing memory does not matter on GPUs: a CPU learner still refuses a GPU generator.
    with pytest.raises(PushRefused, match="learner pushes from the CPU"):
        choose_transport(CPU, gen("g", "uuid-a"), shares_memory=True)


@pytest.mark.parametrize(
    ("learner", "generator", "needle"),
    [
        (CPU, gen("g", "uuid-a"), "learner pushes from the CPU"),
        (GPU_A, gen("g"), "serves on the CPU"),
        (GPU_A, gen("g", device="cuda:0"), "did not publish its GPU's UUID"),
        (GPU_A, gen("g", "uuid-a", "uuid-b"), "1 of its 2 engine workers on the learner's GPU"),
    ],
)
def test_devices_that_cannot_be_joined_are_refused_by_name(learner, generator, needle):
    with pytest.raises(PushRefused, match=needle) as caught:
        choose_transport(learner, generator)
    assert caught.value.generator_ids == ["g"]


def test_duplicate_gpus_names_every_holder():
    assert duplicate_gpus({"learner": ["a"], "g1": ["b"], "g2": ["c", "d"]}) == {}
    assert duplicate_gpus({"learner": ["a"], "g1": ["b"], "g2": ["b"]}) == {"b": ["g1", "g2"]}
    assert duplicate_gpus({"g1": ["b", "b"]}) == {"b": ["g1", "g1"]}


def test_two_generators_on_one_gpu_are_refused_before_any_group_forms():
    with pytest.raises(PushRefused, match=r"two ranks on one physical GPU \(GPU uuid-b: g1, g2\)") as caught:
        plan_push(GPU_A, [gen("g1", "uuid-b"), gen("g2", "uuid-b"), gen("g3", "uuid-c")])
    assert caught.value.generator_ids == ["g1", "g2"]


def test_colocated_generator_takes_ipc_and_no_rank():
    plan = plan_push(GPU_A, [gen("local", "uuid-a"), gen("far", "uuid-b"), gen("tp", "uuid-c", "uuid-d")])
    assert plan.transports == {"local": "ipc", "far": "nccl", "tp": "nccl"}
    assert plan.ranks == {"far": 1, "tp": 2} and plan.world_size == 4
    assert plan.ipc == ["local"]


def test_cpu_plan_is_gloo_with_consecutive_ranks():
    plan = plan_push(CPU, [gen("a", versions=CPU.versions), gen("b", versions=CPU.versions)])
    assert plan.transports == {"a": "gloo", "b": "gloo"} and plan.ranks == {"a": 1, "b": 2}
    assert plan.world_size == 3 and plan.dtype is None


def test_version_mismatches_name_both_sides():
    other = RuntimeVersions(torch="2.11.0+cu128", nccl="2.27.3", vllm="0.11.0")
    assert version_mismatches(V, V, "nccl") == []
    assert version_mismatches(V, other, "nccl") == [
        "torch 2.13.0+cu130 (learner) vs 2.11.0+cu128 (generator)",
        "NCCL 2.29.1 (learner) vs 2.27.3 (generator)",
        "vLLM 0.32.0 (learner) vs 0.11.0 (generator)",
    ]
    # NCCL only matters where NCCL carries the push; a learner without vLLM compares what it has.
    same_torch = RuntimeVersions(torch=V.torch, nccl="2.27.3", vllm=V.vllm)
    assert version_mismatches(V, same_torch, "ipc") == []
    assert version_mismatches(RuntimeVersions(torch=V.torch), other, "ipc") == [
        "torch 2.13.0+cu130 (learner) vs 2.11.0+cu128 (generator)"
    ]


def test_a_generator_with_other_versions_is_refused_with_both_named():
    old = RuntimeVersions(torch="2.13.0+cpu", vllm="0.31.0")
    with pytest.raises(PushRefused) as caught:
        plan_push(CPU, [gen("ok", versions=CPU.versions), gen("old", versions=old)])
    assert caught.value.generator_ids == ["old"]
    assert "gloo weight group with generator old: vLLM 0.32.0 (learner) vs 0.31.0 (generator)" in str(caught.value)


def test_push_dtype_is_the_engines_and_must_agree():
    assert push_dtype([gen("a", dtype="bfloat16"), gen("b", dtype="bfloat16"), gen("c")]) == "bfloat16"
    assert push_dtype([gen("a")]) is None
    with pytest.raises(PushRefused, match="a: bfloat16, b: float32"):
        push_dtype([gen("a", dtype="bfloat16"), gen("b", dtype="float32")])


def test_runtime_records_round_trip_and_old_registrations_still_decode():
    from shared.codec import decode, encode
    from shared.records import LearnerRuntime

    runtime = LearnerRuntime(device="cuda:0", device_uuid="uuid-a", versions=V)
    assert decode(encode(runtime), LearnerRuntime) == runtime
    ranks = LearnerRuntime(
        device="cuda:0",
        device_uuid="uuid-a",
        rank_devices=("cuda:0", "cuda:1"),
        rank_device_uuids=("uuid-a", "uuid-c"),
    )
    assert decode(encode(ranks), LearnerRuntime) == ranks
    pusher = WeightPusher(bind_port=0, advertise_host="127.0.0.1", api_token="t")
    try:  # one process: its own device alone; under torchrun, every rank's in rank order
        assert pusher.runtime().rank_devices == ("cpu",) and pusher.runtime().rank_device_uuids == (None,)
        assert pusher.runtime([("cpu", None), ("cpu", None)]).rank_devices == ("cpu", "cpu")
    finally:
        pusher.close()
    registration = gen("g", "uuid-b", dtype="bfloat16")
    assert decode(encode(registration), GeneratorRegistration) == registration
    # A registration written before these fields existed: no UUIDs, no dtype, unknown versions.
    old = GeneratorRegistration(generator_id="g", url="http://g", policy_version=0)
    assert old.device_uuids == () and old.engine_dtype is None and old.versions.torch == ""
