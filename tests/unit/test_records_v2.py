"""Schema v2 records (docs/concepts/multi-turn-design.md §2.2): tool calls, trajectories and their loss masks.

v1 goldens (encoded before v2 existed) decode forever, a record that uses no v2 field is still written as v1
byte for byte, v2 records round-trip, and each validator refuses its bad case naming what is wrong.
"""

from __future__ import annotations

from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from shared.codec import WireError, decode, encode
from shared.records import RECORDS_BY_KIND, SCHEMA_VERSION, Rollout, ScoredGroup
from shared.trajectory import ChatMessage, ToolCall, ToolFunction, TrajectoryInfo
from tests.support.factories import (
    make_rollout,
    make_scored,
    make_task,
    make_trajectory_completion,
    make_trajectory_rollout,
)
from tests.support.make_records_v1 import GOLDEN_DIR, golden_records

GOLDENS = sorted(GOLDEN_DIR.glob("*.msgpack"))


def _envelope(data: bytes) -> dict:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def test_there_is_a_golden_of_every_kind():
    kinds = {_envelope(path.read_bytes())["kind"] for path in GOLDENS}
    assert kinds == set(RECORDS_BY_KIND)
    assert {path.stem for path in GOLDENS} == set(golden_records())


@pytest.mark.parametrize("path", GOLDENS, ids=lambda p: p.stem)
def test_v1_goldens_decode_and_re_encode_byte_identical(path: Path):
    data = path.read_bytes()
    assert _envelope(data)["v"] == 1
    record = decode(data)
    assert record.wire_version() == 1
    assert encode(record) == data


@pytest.mark.parametrize("stem", sorted(golden_records()))
def test_a_record_without_v2_fields_encodes_as_the_v1_golden(stem: str):
    assert encode(golden_records()[stem]) == (GOLDEN_DIR / f"{stem}.msgpack").read_bytes()


def test_single_turn_dumps_leave_the_v2_fields_out():
    message = ChatMessage(role="user", content="hi")
    assert message.model_dump() == {"role": "user", "content": "hi"}
    completion = make_rollout().completions[0]
    assert set(completion.model_dump()) == {
        "text",
        "token_ids",
        "behaviour_logprobs",
        "finish_reason",
        "token_versions",
    }


@pytest.mark.parametrize(
    "record",
    [make_trajectory_rollout(), make_scored(make_trajectory_rollout())],
    ids=["rollout", "scored_group"],
)
def test_v2_records_round_trip_as_v2(record):
    data = encode(record)
    assert _envelope(data)["v"] == SCHEMA_VERSION == 2
    decoded = decode(data)
    assert decoded.wire_version() == 2
    assert encode(decoded) == data
    first = (decoded.rollout if isinstance(decoded, ScoredGroup) else decoded).completions[0]
    assert first.loss_mask is not None and first.loss_mask.dtype == np.uint8
    assert first.messages[0].tool_calls[0].function.arguments == {"a": 2, "b": 3}
    assert first.messages[1].tool_call_id == "call-0"
    assert first.trajectory.env_latency_s.dtype == np.float32


def test_one_v2_field_anywhere_makes_the_record_v2():
    message = ChatMessage(role="tool", content="5", name="add")
    task = make_task(prompt=(ChatMessage(role="user", content="2+3?"), message))
    assert task.wire_version() == 2
    assert make_rollout(make_task(group_size=1), completions=(make_trajectory_completion(),)).wire_version() == 2
    reasoning = ChatMessage(role="assistant", content="x", reasoning_content="")  # set, though empty
    assert make_task(prompt=(reasoning,)).wire_version() == 2


def test_a_v1_envelope_carrying_v2_fields_is_refused():
    envelope = _envelope(encode(make_trajectory_rollout()))
    envelope["v"] = 1
    with pytest.raises(WireError, match="v: a schema v1 record cannot carry fields of v2"):
        decode(msgpack.packb(envelope, use_bin_type=True), Rollout)


def test_a_v2_envelope_without_v2_fields_is_read():
    envelope = _envelope(encode(make_rollout()))
    envelope["v"] = 2
    assert decode(msgpack.packb(envelope, use_bin_type=True), Rollout).wire_version() == 1


@pytest.mark.parametrize("version", [0, 3, True, "2", None])
def test_unknown_versions_are_refused_naming_what_is_read(version):
    envelope = _envelope(encode(make_rollout()))
    envelope["v"] = version
    with pytest.raises(WireError, match=r"v: schema version .* is not supported .*reads 1 and 2"):
        decode(msgpack.packb(envelope, use_bin_type=True))


_MASK = np.array([1, 1, 1, 0, 0, 1, 1], dtype=np.uint8)


def _with(array: np.ndarray, position: int, value) -> np.ndarray:
    changed = array.copy()
    changed[position] = value
    return changed


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"loss_mask": _MASK[:-1]}, "loss_mask has 6 entries but token_ids has 7"),
        ({"loss_mask": _with(_MASK, 0, 2)}, "loss_mask must hold only 0 .* and 1"),
        ({"loss_mask": _with(_MASK, 6, 0)}, r"last token must be sampled \(loss_mask\[-1\] == 1\)"),
        ({"trajectory": None}, "a completion with a loss_mask needs its trajectory"),
        ({"token_versions": None}, "a completion with a loss_mask needs token_versions"),
        (
            {"behaviour_logprobs": np.array([-0.5, -0.25, -0.125, -0.1, 0.0, -1.0, -0.75], np.float32)},
            "behaviour_logprobs must be 0.0 where loss_mask is 0",
        ),
        (
            {"token_versions": np.array([3, 3, 3, 3, -1, 4, 4], np.int32)},
            "token_versions must be -1 where loss_mask is 0",
        ),
        (
            {"token_versions": np.array([3, -1, 3, -1, -1, 4, 4], np.int32)},
            "token_versions must be >= 0 where loss_mask is 1",
        ),
        ({"prompt": ()}, "prompt, where given, must not be empty"),
        ({"prompt_token_ids": np.zeros(0, np.int32)}, "prompt_token_ids, where given, must not be empty"),
    ],
)
def test_each_completion_validator_refuses_its_bad_case(overrides, message):
    with pytest.raises(ValidationError, match=message):
        make_trajectory_completion(**overrides)


def test_the_mask_validators_hold_on_the_wire_too():
    envelope = _envelope(encode(make_trajectory_rollout()))
    completion = envelope["body"]["completions"][1]
    completion["behaviour_logprobs"] = msgpack.ExtType(1, encode_array(np.full(7, -0.5, np.float32)))
    with pytest.raises(WireError, match=r"completions\.1: .*behaviour_logprobs must be 0\.0 where loss_mask is 0"):
        decode(msgpack.packb(envelope, use_bin_type=True), Rollout)
    envelope = _envelope(encode(make_trajectory_rollout()))
    envelope["body"]["completions"][0]["loss_mask"] = msgpack.ExtType(1, encode_array(np.ones(7, np.int32)))
    with pytest.raises(WireError, match=r"completions\.0\.loss_mask: .*expected dtype uint8, got int32"):
        decode(msgpack.packb(envelope, use_bin_type=True), Rollout)


def encode_array(array: np.ndarray) -> bytes:
    from shared.codec import _pack_default

    return _pack_default(array).data


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: TrajectoryInfo(turns=0), "turns"),
        (lambda: TrajectoryInfo(turns=2, tool_calls=1, tool_errors=2), r"tool_errors \(2\) exceeds tool_calls \(1\)"),
        (lambda: TrajectoryInfo(turns=1, env_reward=float("nan")), "env_reward"),
        (lambda: TrajectoryInfo(turns=1, env_latency_s=[0.1, -1.0]), "env_latency_s must be finite and not negative"),
        (lambda: TrajectoryInfo(turns=1, cut="bored"), "cut"),
        (lambda: ToolFunction(name="f", arguments={"x": float("inf")}), "arguments hold inf .*JSON object"),
        (lambda: ToolFunction(name="", arguments={}), "name"),
        (lambda: ToolCall(id="c", type="other", function=ToolFunction(name="f")), "type"),
        (
            lambda: ChatMessage(role="user", content="", tool_calls=()),
            "only an assistant message has tool_calls, not one with role user",
        ),
        (
            lambda: ChatMessage(role="tool", content="", reasoning_content="x"),
            "only an assistant message has reasoning_content",
        ),
        (
            lambda: ChatMessage(role="assistant", content="", tool_call_id="c"),
            "only a tool message has tool_call_id, not one with role assistant",
        ),
        (
            lambda: ChatMessage(role="user", content="", name="bob"),
            "only a tool message has name, not one with role user",
        ),
    ],
)
def test_each_message_and_trajectory_validator_refuses_its_bad_case(build, message):
    with pytest.raises(ValidationError, match=message):
        build()


def test_the_new_records_are_frozen_and_strict():
    completion = make_trajectory_completion()
    with pytest.raises(ValidationError):
        completion.messages[0].tool_calls[0].function.name = "other"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="surprise"):
        TrajectoryInfo(turns=1, surprise=1)  # type: ignore[call-arg]
    assert not completion.loss_mask.flags.writeable
    assert not completion.trajectory.env_latency_s.flags.writeable
    assert not TrajectoryInfo(turns=1).env_latency_s.flags.writeable


@settings(max_examples=200, deadline=None)
@given(
    mask=st.lists(st.integers(0, 2), min_size=1, max_size=12),
    logprobs=st.lists(st.sampled_from([0.0, -0.5]), min_size=12, max_size=12),
    versions=st.lists(st.integers(-2, 3), min_size=12, max_size=12),
)
def test_any_completion_the_validators_accept_keeps_the_mask_invariants(mask, logprobs, versions):
    n = len(mask)
    try:
        completion = make_trajectory_completion(
            text="",
            token_ids=np.arange(n, dtype=np.int32),
            loss_mask=np.array(mask, dtype=np.uint8),
            behaviour_logprobs=np.array(logprobs[:n], dtype=np.float32),
            token_versions=np.array(versions[:n], dtype=np.int32),
        )
    except ValidationError:
        return
    sampled = completion.loss_mask == 1
    assert set(completion.loss_mask.tolist()) <= {0, 1} and completion.loss_mask[-1] == 1
    assert np.all(completion.behaviour_logprobs[~sampled] == 0.0)
    assert np.all(completion.token_versions[~sampled] == -1) and np.all(completion.token_versions[sampled] >= 0)
    rollout = make_rollout(make_task(group_size=1), completions=(completion,))
    assert encode(decode(encode(rollout))) == encode(rollout)
