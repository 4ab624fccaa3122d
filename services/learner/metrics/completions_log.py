"""Tables of sampled completions and their rewards (TRL's ``log_completions``): what the policy wrote for which
prompt, how each reward function scored it and the advantage it got, every ``log_completions`` steps.

Reading a few completions is the quickest check that a reward function does what its author meant; the
metrics alone show that reward goes up, not why. Rows are plain JSON-able dicts: one per completion, columns
``group_id``, ``policy_version``, ``prompt`` (the text, or the ``{role, content}`` messages), ``prompt_text``
(the prompt as the model read it: its token ids decoded with the learner's tokenizer, so a conversation is
chat-templated, special tokens and all, as TRL's table shows it), ``completion``, ``rewards/<function>``
(None where the function gave no reward: NaN on the wire), ``reward`` (the weighted combination) and
``advantage``. The reward functions' columns are namespaced as in the metrics (``rewards/<function>/mean``)
so that a function named ``reward`` or ``prompt`` cannot overwrite another column.

A multi-turn trajectory's row also has ``messages`` (the conversation after the prompt: assistant turns with
their tool calls, tool results), ``turns``, ``tool_calls``, ``tool_errors``, ``env_reward`` and ``cut``; its
``prompt`` is its own where the environment's reset gave it one. Single-turn rows are what they were.

``advantage`` is the scorer's, normalised within the group; with ``scale_rewards = "batch"`` (or another
estimator that needs the whole batch) the learner trains on advantages recomputed over the batch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

from shared.records import ChatMessage, Completion, Rollout, ScoredGroup

Row = dict[str, Any]
Decode = Callable[[list[int]], str]  # token ids -> text, special tokens kept (the tokenizer's ``decode``)

REWARD_PREFIX = "rewards/"


def completions_due(first_step: int, steps: int, every: int) -> bool:
    """Whether a batch trained as optimizer steps ``first_step .. first_step + steps - 1`` gets a table:
    one of those steps is a multiple of ``every`` (0: never). With ``num_iterations`` > 1 a batch spans
    several steps, so "step % every == 0" on its first step alone could never hold."""
    if every <= 0:
        return False
    last = first_step + steps - 1
    return last // every > (first_step - 1) // every


def completion_rows(groups: Sequence[ScoredGroup], limit: int, decode: Decode) -> list[Row]:
    """The first ``limit`` completions of ``groups`` in batch order (whole groups first: a group's completions
    are compared with each other), one row each; ``decode`` renders their prompt ids as ``prompt_text``."""
    rows: list[Row] = []
    for group in groups:
        rollout = group.rollout
        prompt = _prompt_value(rollout.task.prompt)
        for i, completion in enumerate(rollout.completions):
            if len(rows) >= limit:
                return rows
            row: Row = {
                "group_id": group.group_id,
                "policy_version": rollout.policy_version,
                "prompt": prompt if completion.prompt is None else _prompt_value(completion.prompt),
                "prompt_text": prompt_text(rollout, completion, decode),
                "completion": completion.text,
                **trajectory_columns(completion),
            }
            for name, value in zip(group.reward_names, group.rewards_per_func[i], strict=True):
                row[REWARD_PREFIX + name] = _finite_or_none(value)
            row["reward"] = _finite_or_none(group.rewards[i])
            row["advantage"] = float(group.advantages[i])
            rows.append(row)
    return rows


def prompt_text(rollout: Rollout, completion: Completion, decode: Decode) -> str:
    """The prompt ``completion`` was sampled from as the model read it: its own prompt ids where a multi-turn
    environment's reset gave it one, else the rollout's, decoded (one decode per logged row)."""
    ids = rollout.prompt_token_ids if completion.prompt_token_ids is None else completion.prompt_token_ids
    return decode(ids.tolist())


def trajectory_columns(completion: Completion) -> Row:
    """A trajectory's columns: its messages (as JSON), turns, tool calls and errors, the environment's reward
    and why it was cut; none for a single-turn completion."""
    info = completion.trajectory
    columns: Row = {}
    if completion.messages:
        columns["messages"] = [message.model_dump(mode="json") for message in completion.messages]
    if info is not None:
        columns.update(
            turns=info.turns,
            tool_calls=info.tool_calls,
            tool_errors=info.tool_errors,
            env_reward=info.env_reward,
            cut=info.cut,
        )
    return columns


def table_columns(rows: Sequence[Row]) -> list[str]:
    """Every column of ``rows`` in the order first seen (groups scored by different reward functions have
    different ``rewards/*`` columns; a table needs them all)."""
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    return list(columns)


def cell_text(value: Any) -> str:
    """A cell as text: a conversation one ``role: content`` line per message (an assistant turn's tool calls
    after it as ``-> name(arguments)``), None empty, numbers as ``repr`` gives them (short and exact)."""
    if value is None:
        return ""
    if isinstance(value, list):
        return "\n".join(_message_text(m) for m in value)
    return str(value)


def _message_text(message: dict[str, Any]) -> str:
    """One message as ``role: content``, each tool call it makes appended as `` -> name(arguments)``."""
    calls = message.get("tool_calls") or ()
    called = "".join(f" -> {c['function']['name']}({json.dumps(c['function'].get('arguments', {}))})" for c in calls)
    return f"{message['role']}: {message['content']}{called}"


def markdown_table(rows: Sequence[Row]) -> str:
    """``rows`` as a Markdown table (TensorBoard's text tab renders it); line breaks become ``<br>`` and
    pipes are escaped so that every completion stays in its cell."""
    columns = table_columns(rows)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [_markdown_cell(cell_text(row.get(column))) for column in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def jsonl_records(step: int, rows: Sequence[Row]) -> str:
    """``rows`` as JSON lines, each with its ``step`` first (the resume truncation keys on it)."""
    return "".join(json.dumps({"step": step, **row}) + "\n" for row in rows)


def _prompt_value(prompt: str | tuple[ChatMessage, ...]) -> str | list[dict[str, str]]:
    """A prompt as JSON: text as it is, a conversation as its list of ``{role, content}`` messages."""
    if isinstance(prompt, str):
        return prompt
    return [message.model_dump() for message in prompt]


def _finite_or_none(value: float) -> float | None:
    """NaN (no reward) as None: JSON has no NaN, and a table shows an empty cell."""
    number = float(value)
    return None if math.isnan(number) else number


def _markdown_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\r\n", "\n").replace("\n", "<br>")
