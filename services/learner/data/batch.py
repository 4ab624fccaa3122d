"""Training batches: scored groups -> padded tensors, split into micro-batches.

Layout of a batch of B completions: prompts are left-padded to the longest prompt P and completions
right-padded to the longest completion T, so every completion starts at column P:

    input_ids      [B, P + T]   pad..pad prompt | completion pad..pad
    attention_mask [B, P + T]   1 on real tokens
    position_ids   [B, P + T]   0, 1, ... from each row's first real token (what the generator used)
    completion_ids [B, T], completion_mask [B, T], behaviour_logprobs [B, T]
    advantages [B], temperatures [B], policy_versions [B], group_index [B], truncated [B]
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields

import torch

from shared.records import ScoredGroup


@dataclass
class TrainBatch:
    """One padded batch of B completions (layout and shapes in the module docstring)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    temperatures: torch.Tensor
    policy_versions: torch.Tensor
    group_index: torch.Tensor  # [B] which group each row belongs to (rows of a group are contiguous)
    truncated: torch.Tensor  # [B] bool: the completion hit max_tokens (finish_reason "length")

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def completion_length(self) -> int:
        return self.completion_ids.shape[1]

    @property
    def num_tokens(self) -> int:
        return int(self.completion_mask.sum())

    def rows(self, index: slice) -> TrainBatch:
        return TrainBatch(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def micro_batches(self, size: int) -> Iterator[TrainBatch]:
        for start in range(0, self.size, size):
            yield self.rows(slice(start, start + size))

    def to(self, device: torch.device) -> TrainBatch:
        return TrainBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


@dataclass
class _Rows:
    """The groups' completions as unpadded rows, in order: what :func:`collate` pads into a batch."""

    prompts: list[torch.Tensor]  # each [P_i] int64
    completions: list[torch.Tensor]  # each [T_i] int64
    behaviour: list[torch.Tensor]  # each [T_i] float32
    temperatures: list[float]
    policy_versions: list[int]
    group_index: list[int]
    truncated: list[bool]


def _rows(groups: Sequence[ScoredGroup]) -> _Rows:
    """One row per completion of ``groups``, group after group."""
    rows = _Rows([], [], [], [], [], [], [])
    for index, group in enumerate(groups):
        rollout = group.rollout
        for completion in rollout.completions:
            rows.group_index.append(index)
            rows.prompts.append(torch.from_numpy(rollout.prompt_token_ids.astype("int64")))
            rows.completions.append(torch.from_numpy(completion.token_ids.astype("int64")))
            rows.behaviour.append(torch.from_numpy(completion.behaviour_logprobs.copy()))
            rows.temperatures.append(rollout.task.sampling.temperature)
            rows.policy_versions.append(rollout.policy_version)
            rows.truncated.append(completion.finish_reason == "length")
    return rows


def collate(groups: Sequence[ScoredGroup], advantages: Sequence[torch.Tensor], pad_id: int) -> TrainBatch:
    """Stack the completions of ``groups`` (with the given per-group advantages [G]) into one batch."""
    rows = _rows(groups)
    batch_size = len(rows.prompts)
    prompt_len = max(len(p) for p in rows.prompts)
    completion_len = max(1, max(len(c) for c in rows.completions))
    input_ids = torch.full((batch_size, prompt_len + completion_len), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    completion_ids = torch.full((batch_size, completion_len), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((batch_size, completion_len), dtype=torch.float32)
    behaviour_lp = torch.zeros((batch_size, completion_len), dtype=torch.float32)
    for row, (prompt, completion, logprobs) in enumerate(
        zip(rows.prompts, rows.completions, rows.behaviour, strict=True)
    ):
        n = len(completion)
        input_ids[row, prompt_len - len(prompt) : prompt_len] = prompt
        input_ids[row, prompt_len : prompt_len + n] = completion
        attention[row, prompt_len - len(prompt) : prompt_len + n] = 1
        completion_ids[row, :n] = completion
        completion_mask[row, :n] = 1.0
        behaviour_lp[row, :n] = logprobs
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=(attention.cumsum(dim=1) - 1).clamp(min=0),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        behaviour_logprobs=behaviour_lp,
        advantages=torch.cat([a.to(torch.float32) for a in advantages]),
        temperatures=torch.tensor(rows.temperatures, dtype=torch.float32),
        policy_versions=torch.tensor(rows.policy_versions, dtype=torch.long),
        group_index=torch.tensor(rows.group_index, dtype=torch.long),
        truncated=torch.tensor(rows.truncated, dtype=torch.bool),
    )
