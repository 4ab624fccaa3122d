"""Wire records round-trip; malformed bytes raise WireError naming the field."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from shared.codec import WireError, _pack_default, decode, encode
from shared.records import (
    CheckpointAnnouncement,
    Completion,
    GeneratorRegistration,
    PromptTask,
    Rollout,
    ScoredGroup,
    TensorSpec,
    WeightVersionAnnouncement,
)
from tests.support.factories import make_rollout, make_scored, make_task, make_trajectory_rollout


def _all_records():
    rollout = make_rollout()
    return [
        make_task(),
        make_task(prompt="plain text prompt", dataset_position=None),
        rollout,
        make_scored(rollout),
        GeneratorRegistration(generator_id="g1", url="http://127.0.0.1:8001", policy_version=3),
        WeightVersionAnnouncement(
            policy_version=4,
            layout=(TensorSpec(name="lm_head.weight", dtype="bfloat16", shape=(10, 4), bucket=0),),
            num_buckets=1,
            rendezvous="127.0.0.1:29500",
            namespace="push/4",
            ranks={"g1": 1},
            world_size=2,
        ),
        CheckpointAnnouncement(policy_version=4, step=8, path="/tmp/ckpt/step-8"),
        make_trajectory_rollout(),  # schema v2: tool calls, loss mask, trajectory
        make_scored(make_trajectory_rollout()),
    ]


def _equal(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
    if isinstance(a, BaseModel):
        return type(a) is type(b) and all(_equal(getattr(a, f), getattr(b, f)) for f in type(a).model_fields)
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("record", _all_records(), ids=lambda r: r.kind)
def test_every_record_round_trips(record):
    decoded = decode(encode(record))
    assert _equal(record, decoded)
    assert decode(encode(decoded)) is not None


def test_arrays_travel_packed_not_as_lists():
    rollout = make_rollout(tokens=1024)
    data = encode(rollout)
    # 4 completions * 1024 tokens * (4 bytes id + 4 bytes logprob), plus a small envelope.
    assert len(data) < 4 * 1024 * 8 + 2048
    assert decode(data, Rollout).completions[0].token_ids.dtype == np.int32


def test_expected_kind_is_enforced():
    with pytest.raises(WireError, match="expected a rollout record"):
        decode(encode(make_task()), Rollout)


def test_decoded_arrays_are_read_only():
    rollout = decode(encode(make_rollout()), Rollout)
    with pytest.raises(ValueError):
        rollout.completions[0].token_ids[0] = 1


def test_length_mismatch_names_the_field():
    with pytest.raises(ValidationError, match="behaviour_logprobs has 2 entries but token_ids has 3"):
        Completion(text="", token_ids=[1, 2, 3], behaviour_logprobs=[0.0, 0.0], finish_reason="stop")


def test_group_size_mismatch_is_rejected_on_decode():
    rollout = make_rollout(make_task(group_size=2))
    envelope = msgpack.unpackb(encode(rollout), raw=False, ext_hook=lambda c, d: msgpack.ExtType(c, d))
    envelope["body"]["completions"] = envelope["body"]["completions"][:1]
    data = msgpack.packb(envelope, use_bin_type=True)
    with pytest.raises(WireError, match="group_size is 2"):
        decode(data)


def test_wrong_dtype_on_the_wire_is_rejected():
    rollout = make_rollout(make_task(group_size=2))
    envelope = msgpack.unpackb(encode(rollout), raw=False, ext_hook=lambda c, d: msgpack.ExtType(c, d))
    wide = np.asarray(rollout.prompt_token_ids, dtype="<i8")
    envelope["body"]["prompt_token_ids"] = _pack_default(wide)  # a foreign writer's int64 ids
    with pytest.raises(WireError, match=r"prompt_token_ids: .*expected dtype int32, got int64"):
        decode(msgpack.packb(envelope, use_bin_type=True))


def test_disallowed_array_dtype_is_rejected():
    with pytest.raises(TypeError, match="cannot be encoded"):
        _pack_default(np.zeros(3, dtype=np.float16))
    bogus = msgpack.packb({"kind": "prompt_task", "v": 1, "body": {"x": msgpack.ExtType(1, b"\x09\x01")}})
    with pytest.raises(WireError, match="dtype code 9"):
        decode(bogus)


def test_unknown_kind_and_version_are_rejected():
    with pytest.raises(WireError, match="unknown record kind"):
        decode(msgpack.packb({"kind": "nope", "v": 1, "body": {}}))
    data = msgpack.unpackb(encode(make_task()), raw=False)
    data["v"] = 99
    with pytest.raises(WireError, match="schema version 99"):
        decode(msgpack.packb(data))


def test_extra_fields_are_rejected():
    data = msgpack.unpackb(encode(make_task()), raw=False)
    data["body"]["surprise"] = 1
    with pytest.raises(WireError, match="surprise"):
        decode(msgpack.packb(data))


def test_scored_group_shapes_are_checked():
    scored = make_scored()
    with pytest.raises(ValidationError, match="rewards_per_func has shape"):
        ScoredGroup(
            rollout=scored.rollout,
            reward_names=("only_one",),
            rewards_per_func=scored.rewards_per_func,
            rewards=scored.rewards,
            advantages=scored.advantages,
        )


def test_timestamps_are_taken_per_instance():
    first = make_task()
    second = make_task()
    assert first.task_id != second.task_id
    assert second.created_at >= first.created_at
    assert PromptTask.model_fields["created_at"].default_factory is not None


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_truncated_or_corrupted_bytes_raise_wire_error(data):
    encoded = encode(data.draw(st.sampled_from(_all_records())))
    mode = data.draw(st.sampled_from(["truncate", "flip", "garbage"]))
    if mode == "truncate":
        cut = data.draw(st.integers(0, len(encoded) - 1))
        corrupted = encoded[:cut]
    elif mode == "flip":
        position = data.draw(st.integers(0, len(encoded) - 1))
        bit = data.draw(st.integers(0, 7))
        corrupted = bytearray(encoded)
        corrupted[position] ^= 1 << bit
        corrupted = bytes(corrupted)
    else:
        corrupted = data.draw(st.binary(max_size=256))
    try:
        decoded = decode(corrupted)
    except WireError:
        return
    # A flipped bit inside a float or a string can still be a valid record: it must then re-encode.
    assert decode(encode(decoded)) is not None


def test_shared_does_not_import_torch():
    code = (
        "import sys, shared, shared.records, shared.codec, shared.streams, shared.config.base, "
        "shared.telemetry, shared.keys, shared.redis_conn; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert 'vllm' not in sys.modules, 'vllm imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
