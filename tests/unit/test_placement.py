"""GPU placement arithmetic: what each GPU runs on 1, 2, 4 and 8 GPUs with learners of 1, 2 and 4 GPUs, the
refusals and their fixes, and the one-GPU memory split."""

from __future__ import annotations

import pytest

from shared.config.generator import GeneratorSettings
from shared.gpu_placement import (
    PlacementError,
    first_free,
    leasable_gpus,
    memory_share_error,
    no_free_gpu_message,
    parse_gpu_list,
    plan,
)


def test_parse_gpu_list():
    assert parse_gpu_list("") == ()
    assert parse_gpu_list("0") == (0,)
    assert parse_gpu_list("6,7") == (6, 7)
    assert parse_gpu_list(" 1 , 3 ,") == (1, 3)
    with pytest.raises(PlacementError, match="not a GPU index"):
        parse_gpu_list("0-3")  # CUDA_VISIBLE_DEVICES has no ranges
    with pytest.raises(PlacementError, match="twice"):
        parse_gpu_list("1,1")


@pytest.mark.parametrize(
    ("gpus", "learner", "replicas", "expected"),
    [
        (2, (0,), 1, {0: "learner", 1: "generator-1"}),
        (4, (0,), 3, {0: "learner", 1: "generator-1", 2: "generator-2", 3: "generator-3"}),
        (
            8,
            (0,),
            7,
            {0: "learner", **{i: f"generator-{i}" for i in range(1, 8)}},
        ),
        (4, (0, 1), 2, {0: "learner", 1: "learner", 2: "generator-1", 3: "generator-2"}),
        (8, (0, 1), 6, {0: "learner", 1: "learner", **{i: f"generator-{i - 1}" for i in range(2, 8)}}),
        (8, (0, 1, 2, 3), 4, {**dict.fromkeys(range(4), "learner"), **{i: f"generator-{i - 3}" for i in range(4, 8)}}),
        (8, (6, 7), 6, {**{i: f"generator-{i + 1}" for i in range(6)}, 6: "learner", 7: "learner"}),
        (4, (0,), 2, {0: "learner", 1: "generator-1", 2: "generator-2", 3: "idle"}),
    ],
)
def test_plan_gives_each_replica_its_own_gpu_and_never_the_learners(gpus, learner, replicas, expected):
    assert plan(gpus, learner, replicas) == expected


def test_one_gpu_colocated_shares_gpu_0():
    assert plan(1, (0,), 1, colocated=True) == {0: "learner+generator-1"}
    assert leasable_gpus(1, (0,), colocated=True) == (0,)


@pytest.mark.parametrize(("gpus", "learner"), [(2, (0,)), (4, (0,)), (8, (0,)), (8, (0, 1)), (1, (0,))])
def test_one_replica_too_many_is_refused_naming_the_scale(gpus, learner):
    colocated = gpus == 1
    fit = 1 if colocated else gpus - len(learner)
    plan(gpus, learner, fit, colocated=colocated)
    with pytest.raises(PlacementError, match=rf"--scale generator={fit}\b"):
        plan(gpus, learner, fit + 1, colocated=colocated)


def test_one_gpu_without_colocated_mode_is_refused_naming_the_override():
    with pytest.raises(PlacementError, match=r"none is left for a generator.*deploy/one-gpu.yml"):
        leasable_gpus(1, (0,), colocated=False)


def test_learner_gpu_outside_the_host_is_refused():
    with pytest.raises(PlacementError, match=r"name \[2\], but this host has 2 GPUs.*LEARNER_GPUS"):
        leasable_gpus(2, (2,), colocated=False)
    with pytest.raises(PlacementError, match="set LEARNER_GPUS"):
        leasable_gpus(1, (), colocated=True)
    with pytest.raises(PlacementError, match="at least one"):
        leasable_gpus(0, (), colocated=False)


def test_first_free_and_tensor_parallel_needs():
    assert first_free((1, 2, 3), {1: "gen-a"}, 1) == (2,)
    assert first_free((1, 2, 3), {2: "gen-a"}, 2) == (1, 3)
    assert first_free((1, 2, 3), {1: "a", 3: "b"}, 2) is None
    message = no_free_gpu_message("gpu-box", (2, 3), {2: "gen-a", 3: "gen-b"}, 2, (0, 1))
    assert "'gpu-box'" in message and "GPU 2: gen-a, GPU 3: gen-b" in message
    assert "the learner's [0, 1]" in message and "(docker compose up --scale generator=1)" in message
    colocated = no_free_gpu_message("gpu-box", (0,), {0: "gen-a"}, 1, (0,), colocated=True)
    assert "never leased" not in colocated and "shared with the learner" in colocated
    assert "(docker compose -f docker-compose.yml -f deploy/one-gpu.yml up --scale generator=1)" in colocated


def test_memory_shares_must_fit_one_gpu():
    assert memory_share_error(0.4, 0.5) is None
    assert memory_share_error(0.55, 0.45) is None  # exactly the whole GPU is allowed
    error = memory_share_error(0.6, 0.5)
    assert error is not None
    assert "generator.gpu_memory_utilization (0.6)" in error and "learner.gpu_memory_share (0.5)" in error
    assert "1.10" in error
    unset = memory_share_error(0.4, None)
    assert unset is not None and "learner.gpu_memory_share" in unset and "0.60" in unset


def _settings(**fields) -> GeneratorSettings:
    return GeneratorSettings(model="/m", api_token="t", **fields)


def test_settings_check_the_layout_before_anything_starts():
    assert _settings(gpu_count="auto", learner_gpus="0").gpu_count == "auto"
    assert _settings(gpu_count=8, learner_gpus="0,1").learner_gpu_indices == (0, 1)
    with pytest.raises(ValueError, match="none is left for a generator"):
        _settings(gpu_count=1, learner_gpus="0")
    with pytest.raises(ValueError, match="tensor_parallel_size 4 needs that many GPUs"):
        _settings(gpu_count=4, learner_gpus="0", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="colocated mode leases the learner's GPU"):
        _settings(colocated=True, learner_gpus="0")
    with pytest.raises(ValueError, match=r"set generator\.learner_gpus"):
        _settings(gpu_count="auto", colocated=True)
    with pytest.raises(ValueError, match="gpu_count is -1"):
        _settings(gpu_count=-1)
    assert _settings(gpu_count=1, learner_gpus="0", colocated=True).colocated
