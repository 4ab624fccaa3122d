"""The completions tables (TRL's log_completions): rows built from scored groups, when they are due, and their
JSONL and Markdown forms."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from services.learner.metrics.completions_log import (
    cell_text,
    completion_rows,
    completions_due,
    jsonl_records,
    markdown_table,
    table_columns,
)
from shared.chat import prompt_ids
from shared.records import ChatMessage, ScoredGroup
from shared.trajectory import TrajectoryInfo
from tests.support.factories import make_rollout, make_task, make_trajectory_completion
from tests.support.tiny_model import build_tokenizer

NAN = math.nan


def ids_text(ids: list[int]) -> str:
    """A stand-in tokenizer's decode that shows exactly which ids it was given."""
    assert all(type(i) is int for i in ids)  # plain ints, as a tokenizer's decode takes them
    return " ".join(f"<{i}>" for i in ids)


def _group(prompt, texts, per_func, rewards, advantages, names=("accuracy", "format"), version=3) -> ScoredGroup:
    """A scored group of ``texts``; ``prompt`` None: the factory's conversation (system + user)."""
    overrides = {} if prompt is None else {"prompt": prompt}
    task = make_task(group_size=len(texts), policy_version=version, **overrides)
    rollout = make_rollout(task)
    completions = tuple(c.model_copy(update={"text": t}) for c, t in zip(rollout.completions, texts, strict=True))
    rollout = rollout.model_copy(update={"completions": completions})
    return ScoredGroup(
        rollout=rollout,
        reward_names=names,
        rewards_per_func=np.array(per_func, dtype=np.float32),
        rewards=np.array(rewards, dtype=np.float32),
        advantages=np.array(advantages, dtype=np.float32),
    )


def test_one_row_per_completion_with_each_reward_and_nan_as_none():
    group = _group("2+3=", ["5", "6"], [[1.0, 0.5], [NAN, 0.25]], [1.5, 0.25], [0.5, -0.5])
    assert completion_rows([group], limit=16, decode=ids_text) == [
        {
            "group_id": group.group_id,
            "policy_version": 3,
            "prompt": "2+3=",
            "prompt_text": "<0> <1> <2> <3> <4>",  # the factory's rollout prompt ids, decoded
            "completion": "5",
            "rewards/accuracy": 1.0,
            "rewards/format": 0.5,
            "reward": 1.5,
            "advantage": 0.5,
        },
        {
            "group_id": group.group_id,
            "policy_version": 3,
            "prompt": "2+3=",
            "prompt_text": "<0> <1> <2> <3> <4>",
            "completion": "6",
            "rewards/accuracy": None,
            "rewards/format": 0.25,
            "reward": 0.25,
            "advantage": -0.5,
        },
    ]


def test_a_conversation_prompt_is_kept_as_its_messages_and_a_reward_named_reward_keeps_its_own_column():
    # Weight 0.5: the function's 1.0 and the combined 0.5 are two columns.
    group = _group(None, ["a", "b"], [[1.0], [0.0]], [0.5, 0.0], [0.0, 0.0], names=("reward",))
    row = completion_rows([group], limit=1, decode=ids_text)[0]
    assert row["prompt"] == [
        {"role": "system", "content": "Answer."},
        {"role": "user", "content": "What is 2+3?"},
    ]
    assert (row["rewards/reward"], row["reward"]) == (1.0, 0.5)


def test_the_limit_takes_the_batch_first_completions_group_by_group():
    first = _group("p1", ["a", "b"], [[0, 0], [1, 1]], [0, 2], [-1, 1])
    second = _group("p2", ["c", "d"], [[0, 0], [1, 1]], [0, 2], [-1, 1], version=4)
    rows = completion_rows([first, second], limit=3, decode=ids_text)
    assert [(r["prompt"], r["completion"], r["policy_version"]) for r in rows] == [
        ("p1", "a", 3),
        ("p1", "b", 3),
        ("p2", "c", 4),
    ]
    assert (
        completion_rows([first, second], limit=10, decode=ids_text)
        == rows + completion_rows([second], limit=2, decode=ids_text)[1:]
    )


@pytest.mark.parametrize(
    ("first_step", "steps", "every", "due"),
    [
        (1, 1, 0, False),  # off
        (1, 1, 1, True),
        (3, 1, 3, True),
        (4, 1, 3, False),
        (1, 2, 2, True),  # num_iterations = 2: the batch trains steps 1 and 2
        (3, 2, 2, True),  # steps 3, 4
        (3, 2, 5, False),  # steps 3, 4
        (5, 2, 5, True),  # steps 5, 6
    ],
)
def test_a_table_is_due_when_the_batch_trains_a_multiple_of_the_interval(first_step, steps, every, due):
    assert completions_due(first_step, steps, every) is due


def test_columns_are_the_union_in_first_seen_order():
    assert table_columns([{"a": 1, "b": 2}, {"a": 1, "c": 3}]) == ["a", "b", "c"]


def test_cells_as_text():
    assert cell_text(None) == ""
    assert cell_text(0.25) == "0.25"
    assert cell_text([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>"}]) == (
        "user: hi\nassistant: <think>"
    )


def test_markdown_table_keeps_each_completion_in_its_cell():
    rows = [
        {"prompt": "p", "completion": "a | b\nc", "reward": 1.0},
        {"prompt": "q", "completion": "d", "reward": None},
    ]
    assert markdown_table(rows) == (
        "| prompt | completion | reward |\n|---|---|---|\n| p | a \\| b<br>c | 1.0 |\n| q | d |  |"
    )


def test_jsonl_records_carry_the_step_first():
    text = jsonl_records(7, [{"completion": "a", "reward": None}, {"completion": "b", "reward": 1.0}])
    assert text == '{"step": 7, "completion": "a", "reward": null}\n{"step": 7, "completion": "b", "reward": 1.0}\n'
    assert [json.loads(line)["step"] for line in text.splitlines()] == [7, 7]


def test_a_trajectory_row_has_its_messages_counters_and_own_prompt_and_stays_json():
    own_prompt = (ChatMessage(role="user", content="What is 2+3? The calculator is on."),)
    plain = make_trajectory_completion()
    cut = make_trajectory_completion(
        prompt=own_prompt,
        prompt_token_ids=np.arange(3, dtype=np.int32),
        trajectory=TrajectoryInfo(turns=4, tool_calls=3, tool_errors=2, env_reward=None, cut="max_turns"),
    )
    rollout = make_rollout(make_task(group_size=2), completions=(plain, cut))
    group = _group("2+3=", ["", ""], [[1.0, 0.0], [0.0, 0.0]], [1.0, 0.0], [0.5, -0.5])
    group = group.model_copy(update={"rollout": rollout})
    first, second = completion_rows([group], limit=4, decode=ids_text)
    assert first["messages"] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call-0", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
            ],
            "reasoning_content": "2+3 needs the tool",
        },
        {"role": "tool", "content": "5", "tool_call_id": "call-0", "name": "add"},
        {"role": "assistant", "content": "<answer>5</answer>"},
    ]
    assert {k: first[k] for k in ("turns", "tool_calls", "tool_errors", "env_reward", "cut")} == {
        "turns": 2,
        "tool_calls": 1,
        "tool_errors": 0,
        "env_reward": 1.0,
        "cut": None,
    }
    assert first["prompt"] == [
        {"role": "system", "content": "Answer."},
        {"role": "user", "content": "What is 2+3?"},
    ]
    assert second["prompt"] == [{"role": "user", "content": "What is 2+3? The calculator is on."}]
    # Each prompt_text renders the ids that completion was sampled after: the rollout's, or its own.
    assert (first["prompt_text"], second["prompt_text"]) == ("<0> <1> <2> <3> <4>", "<0> <1> <2>")
    assert (second["turns"], second["tool_errors"], second["env_reward"], second["cut"]) == (4, 2, None, "max_turns")
    assert json.loads(jsonl_records(1, [first, second]).splitlines()[1])["cut"] == "max_turns"
    assert cell_text(first["messages"]) == (
        'assistant:  -> add({"a": 2, "b": 3})\ntool: 5\nassistant: <answer>5</answer>'
    )
    assert "messages" in table_columns([first, second])


def test_a_single_turn_row_gains_no_trajectory_column():
    row = completion_rows([_group("p", ["a"], [[1.0, 0.0]], [1.0], [0.0])], limit=1, decode=ids_text)[0]
    assert not {"messages", "turns", "tool_calls", "tool_errors", "env_reward", "cut"} & set(row)


def test_prompt_text_is_the_chat_templated_prompt_the_model_read():
    """With a real tokenizer: the generator sent the chat-templated prompt's ids, and the row shows them as text,
    special tokens and generation prompt included (TRL's completions table shows its prompts so)."""
    tokenizer = build_tokenizer()
    group = _group(None, ["5", "6"], [[1.0], [0.0]], [1.0, 0.0], [0.5, -0.5], names=("accuracy",))
    messages = [m.model_dump() for m in group.rollout.task.prompt]
    ids = prompt_ids(tokenizer, group.rollout.task.prompt)  # as the generator tokenizes it
    rollout = group.rollout.model_copy(update={"prompt_token_ids": np.asarray(ids, dtype=np.int32)})
    rows = completion_rows([group.model_copy(update={"rollout": rollout})], limit=2, decode=tokenizer.decode)
    rendered = (
        "<|im_start|>system\nAnswer.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert [row["prompt_text"] for row in rows] == [rendered, rendered]
    assert rows[0]["prompt"] == messages  # the messages stay beside it
    assert json.loads(jsonl_records(3, rows).splitlines()[0])["prompt_text"] == rendered
