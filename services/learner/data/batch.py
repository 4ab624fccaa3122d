"""Training batches: scored groups -> padded tensors, split into micro-batches.

Layout of a batch of B completions: prompts are left-padded to the longest prompt P and completions
right-padded to the longest completion T, so every completion starts at column P:

    input_ids      [B, P + T]   pad..pad prompt | completion pad..pad
    attention_mask [B, P + T]   1 on real tokens
    position_ids   [B, P + T]   0, 1, ... from each row's first real token (what the generator used)
    completion_ids [B, T], completion_mask [B, T], behaviour_logprobs [B, T], loss_mask [B, T]
    advantages [B], temperatures [B], policy_versions [B], group_index [B], truncated [B], prompt_index [B]

(``loss_mask`` and ``prompt_index`` are properties: the fields ``sampled_mask`` and ``row_prompts`` where a batch
has trajectories or per-sample prompts, else the completion mask and the group index.)

Two masks (docs/concepts/multi-turn-design.md §2.10). ``completion_mask`` is 1 on every real token after the prompt: it
drives attention, positions and packing lengths. ``loss_mask`` is 1 on the tokens the policy sampled, a subset:
a multi-turn trajectory's tool results and template tokens are context only (0), so the loss, the importance
weights, the entropy, the KL, every token count and the LM head see the loss mask alone. A single-turn
completion samples every token: its loss mask equals its completion mask.

A row's prompt is its rollout's, or the completion's own ``prompt_token_ids`` when the environment's reset gave
that sample a prompt of its own; ``prompt_index`` numbers the distinct prompts (rows of one group with identical
prompt ids share an index, and only consecutive rows of one index share a prompt's forward).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from shared.records import Completion, Rollout, ScoredGroup
from shared.sampled_versions import trajectory_version


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
    # [B, T] float: 1 on sampled tokens; None: every completion token was sampled (no trajectory in the batch).
    sampled_mask: torch.Tensor | None = None
    # [B] which prompt each row reads; None: its group's (no per-sample prompt in the batch).
    row_prompts: torch.Tensor | None = None

    @property
    def loss_mask(self) -> torch.Tensor:
        """[B, T] 1 on the tokens the policy sampled: what the loss, the LM head and every count read."""
        return self.completion_mask if self.sampled_mask is None else self.sampled_mask

    @property
    def prompt_index(self) -> torch.Tensor:
        """[B] which prompt each row reads: consecutive rows of one index share its forward."""
        return self.group_index if self.row_prompts is None else self.row_prompts

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def completion_length(self) -> int:
        return self.completion_ids.shape[1]

    @property
    def num_tokens(self) -> int:
        """The tokens the loss acts on: the sampled ones."""
        return int(self.loss_mask.sum())

    def _map(self, change: Callable[[torch.Tensor], torch.Tensor], keep: Collection[str] = ()) -> TrainBatch:
        """A batch of ``change`` applied to every tensor but the fields named in ``keep`` (the fields left None
        stay None)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        changed: dict[str, Any] = {
            name: value if value is None or name in keep else change(value) for name, value in values.items()
        }
        return TrainBatch(**changed)

    def rows(self, index: slice) -> TrainBatch:
        return self._map(lambda tensor: tensor[index])

    def micro_batches(self, size: int) -> Iterator[TrainBatch]:
        for start in range(0, self.size, size):
            yield self.rows(slice(start, start + size))

    def to(self, device: torch.device) -> TrainBatch:
        """The batch on ``device``, but for ``temperatures``: B floats the host reads to decide whether the
        logits are divided at all (:meth:`sampling_temperatures`), which on a GPU would be a wait per pass."""
        return self._map(lambda tensor: tensor.to(device), keep=("temperatures",))

    def sampling_temperatures(self) -> torch.Tensor | None:
        """[B] each row's sampling temperature, or None when every one is 1: the logits are then used as they are
        (dividing by 1 changes no value, and over a 150k vocabulary it is a pass over the logits forward and
        backward)."""
        return None if bool((self.temperatures == 1.0).all()) else self.temperatures


@dataclass
class _Rows:
    """The groups' completions as unpadded rows, in order: what :func:`collate` pads into a batch."""

    prompts: list[torch.Tensor] = field(default_factory=list)  # each [P_i] int64
    completions: list[torch.Tensor] = field(default_factory=list)  # each [T_i] int64
    behaviour: list[torch.Tensor] = field(default_factory=list)  # each [T_i] float32
    loss_masks: list[torch.Tensor] = field(default_factory=list)  # each [T_i] float32
    temperatures: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    group_index: list[int] = field(default_factory=list)
    prompt_index: list[int] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)


def row_prompt(rollout: Rollout, completion: Completion) -> np.ndarray:
    """The prompt ids a completion continues: its own (a per-sample prompt from the environment's reset) or its
    rollout's."""
    own = completion.prompt_token_ids
    return rollout.prompt_token_ids if own is None else own


def row_version(rollout: Rollout, completion: Completion) -> int:
    """The policy version of a row for staleness: the oldest version over its sampled tokens
    (:func:`shared.sampled_versions.trajectory_version`), the rollout's start version when no token carries one."""
    oldest = trajectory_version(completion.token_versions, completion.loss_mask)
    return rollout.policy_version if oldest is None else oldest


def _loss_mask(completion: Completion) -> torch.Tensor:
    """[N] float32: 1 on sampled tokens; all ones for a single-turn completion (no loss mask)."""
    if completion.loss_mask is None:
        return torch.ones(len(completion.token_ids), dtype=torch.float32)
    return torch.from_numpy(completion.loss_mask.astype(np.float32))


def _rows(groups: Sequence[ScoredGroup]) -> _Rows:
    """One row per completion of ``groups``, group after group; rows of a group with identical prompt ids
    share a prompt index."""
    rows = _Rows()
    distinct = 0  # prompts numbered so far
    for index, group in enumerate(groups):
        rollout = group.rollout
        prompts: dict[bytes, int] = {}  # this group's distinct prompt ids -> their index
        for completion in rollout.completions:
            prompt = row_prompt(rollout, completion).astype(np.int64)
            if prompt.tobytes() not in prompts:
                prompts[prompt.tobytes()], distinct = distinct, distinct + 1
            rows.prompt_index.append(prompts[prompt.tobytes()])
            rows.group_index.append(index)
            rows.prompts.append(torch.from_numpy(prompt))
            rows.completions.append(torch.from_numpy(completion.token_ids.astype("int64")))
            rows.behaviour.append(torch.from_numpy(completion.behaviour_logprobs.copy()))
            rows.loss_masks.append(_loss_mask(completion))
            rows.temperatures.append(rollout.task.sampling.temperature)
            rows.policy_versions.append(row_version(rollout, completion))
            rows.truncated.append(completion.finish_reason == "length")
    return rows


def _right_padded(parts: Sequence[torch.Tensor], length: int, fill: float, dtype: torch.dtype) -> torch.Tensor:
    """[B, length] the 1-D ``parts`` from column 0, ``fill`` after each one's end."""
    out = torch.full((len(parts), length), fill, dtype=dtype)
    for row, part in enumerate(parts):
        out[row, : len(part)] = part
    return out


def collate(groups: Sequence[ScoredGroup], advantages: Sequence[torch.Tensor], pad_id: int) -> TrainBatch:
    """Stack the completions of ``groups`` (with the given per-group advantages [G]) into one batch: each row
    is its prompt (:func:`row_prompt`) left-padded, then its completion right-padded (module docstring)."""
    rows = _rows(groups)
    prompt_len = max(len(p) for p in rows.prompts)
    completion_len = max(1, max(len(c) for c in rows.completions))
    completion_ids = _right_padded(rows.completions, completion_len, pad_id, torch.long)
    input_ids = torch.full((len(rows.prompts), prompt_len), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows.prompts), prompt_len + completion_len), dtype=torch.long)
    for row, (prompt, completion) in enumerate(zip(rows.prompts, rows.completions, strict=True)):
        input_ids[row, prompt_len - len(prompt) :] = prompt
        attention[row, prompt_len - len(prompt) : prompt_len + len(completion)] = 1
    completion_mask = _right_padded([torch.ones(len(c)) for c in rows.completions], completion_len, 0.0, torch.float32)
    sampled_mask = _right_padded(rows.loss_masks, completion_len, 0.0, torch.float32)
    return TrainBatch(
        input_ids=torch.cat([input_ids, completion_ids], dim=1),
        attention_mask=attention,
        position_ids=(attention.cumsum(dim=1) - 1).clamp(min=0),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        behaviour_logprobs=_right_padded(rows.behaviour, completion_len, 0.0, torch.float32),
        advantages=torch.cat([a.to(torch.float32) for a in advantages]),
        temperatures=torch.tensor(rows.temperatures, dtype=torch.float32),
        policy_versions=torch.tensor(rows.policy_versions, dtype=torch.long),
        group_index=torch.tensor(rows.group_index, dtype=torch.long),
        truncated=torch.tensor(rows.truncated, dtype=torch.bool),
        sampled_mask=None if torch.equal(sampled_mask, completion_mask) else sampled_mask,
        row_prompts=None if rows.prompt_index == rows.group_index else torch.tensor(rows.prompt_index),
    )
