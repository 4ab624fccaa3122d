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


def collate(groups: Sequence[ScoredGroup], advantages: Sequence[torch.Tensor], pad_id: int) -> TrainBatch:
    """Stack the completions of ``groups`` (with the given per-group advantages [G]) into one batch."""
    prompts, completions, behaviour, temps, versions, group_index, truncated = [], [], [], [], [], [], []
    for index, group in enumerate(groups):
        rollout = group.rollout
        for completion in rollout.completions:
            group_index.append(index)
            prompts.append(torch.from_numpy(rollout.prompt_token_ids.astype("int64")))
            completions.append(torch.from_numpy(completion.token_ids.astype("int64")))
            behaviour.append(torch.from_numpy(completion.behaviour_logprobs.copy()))
            temps.append(rollout.task.sampling.temperature)
            versions.append(rollout.policy_version)
            truncated.append(completion.finish_reason == "length")
    batch_size = len(prompts)
    prompt_len = max(len(p) for p in prompts)
    completion_len = max(1, max(len(c) for c in completions))
    input_ids = torch.full((batch_size, prompt_len + completion_len), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    completion_ids = torch.full((batch_size, completion_len), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((batch_size, completion_len), dtype=torch.float32)
    behaviour_lp = torch.zeros((batch_size, completion_len), dtype=torch.float32)
    for row, (prompt, completion, logprobs) in enumerate(zip(prompts, completions, behaviour, strict=True)):
        n = len(completion)
        input_ids[row, prompt_len - len(prompt) : prompt_len] = prompt
        input_ids[row, prompt_len : prompt_len + n] = completion
        attention[row, prompt_len - len(prompt) : prompt_len + n] = 1
        completion_ids[row, :n] = completion
        completion_mask[row, :n] = 1.0
        behaviour_lp[row, :n] = logprobs
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=position_ids,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        behaviour_logprobs=behaviour_lp,
        advantages=torch.cat([a.to(torch.float32) for a in advantages]),
        temperatures=torch.tensor(temps, dtype=torch.float32),
        policy_versions=torch.tensor(versions, dtype=torch.long),
        group_index=torch.tensor(group_index, dtype=torch.long),
        truncated=torch.tensor(truncated, dtype=torch.bool),
    )
