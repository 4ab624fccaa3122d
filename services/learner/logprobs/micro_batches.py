"""The micro-batch plan: which rows of a batch each forward pass takes.

Three plans, chosen once per trainer:

* **padded** (one process, no token budget): consecutive slices of ``micro_batch_size`` rows;
* **packed** (one process, a token budget: ``max_tokens_per_micro_batch``, auto on every device): consecutive
  rows up to the budget and ``micro_batch_size``, packed into one row without padding
  (:mod:`services.learner.logprobs.packing`), each prompt once when ``share_prompts``;
* **ranks** (torchrun): this rank's block of rows, in passes padded and row-counted so that every rank runs
  the same number of passes (:func:`distributed.micro_batch_plan`); a pass of None is a zero-weighted padding
  pass, and prompts are never shared.
"""

from __future__ import annotations

import torch

from services.learner import distributed
from services.learner.data.batch import TrainBatch
from services.learner.distributed import Topology
from services.learner.logprobs.packing import (
    check_attention,
    plan_micro_batches,
    resolve_share_prompts,
    resolve_token_budget,
    sequence_lengths,
)
from shared.config.learner import LearnerSettings


class MicroBatchPlanner:
    """This rank's rows of a batch and its forward passes over them (see the module docstring)."""

    def __init__(self, settings: LearnerSettings, topology: Topology, model: torch.nn.Module) -> None:
        device_type = next(model.parameters()).device.type
        self.topology = topology
        self.micro_batch_size = settings.micro_batch_size
        self.share_prompts = resolve_share_prompts(settings.share_prompts, device_type, topology.distributed)
        # Under torchrun the ranks' pass counts must match (distributed.micro_batch_plan): padded, row-counted.
        attention = getattr(model.config, "_attn_implementation", None) or "sdpa"
        self.token_budget = 0
        if not topology.distributed:
            sequence = settings.max_prompt_length + settings.max_completion_length
            self.token_budget = resolve_token_budget(
                settings.max_tokens_per_micro_batch, device_type, settings.micro_batch_size, sequence, attention
            )
        if self.packed:
            check_attention(attention, self.share_prompts)

    @property
    def packed(self) -> bool:
        """Whether micro-batches are packed without padding (:mod:`services.learner.logprobs.packing`)."""
        return self.token_budget > 0

    def plan(self, batch: TrainBatch, size: int = 0) -> tuple[TrainBatch, list[TrainBatch | None]]:
        """This rank's rows of ``batch`` and its forward passes of at most ``size`` rows, micro_batch_size when 0
        (None: a zero-weighted padding pass). Packed, a pass also holds at most the token budget, scaled by
        ``size`` / micro_batch_size (a no-grad pass of more rows takes proportionally more tokens)."""
        size = size or self.micro_batch_size
        if not self.topology.distributed and not self.packed:
            return batch, list(batch.micro_batches(size))
        if not self.topology.distributed:
            prompts, completions = sequence_lengths(batch)
            plan = plan_micro_batches(
                prompts,
                completions,
                batch.prompt_index.tolist(),
                max_tokens=max(1, self.token_budget * size // self.micro_batch_size),
                max_rows=size,
                share_prompts=self.share_prompts,
            )
            return batch, [batch.rows(rows) for rows in plan]
        local = batch.rows(distributed.split_rows(batch.size, self.topology))
        plan = distributed.micro_batch_plan(batch.size, size, self.topology)
        return local, [None if rows is None else local.rows(rows) for rows in plan]

    @staticmethod
    def padding(batch: TrainBatch) -> TrainBatch:
        """The rows a zero-weighted padding pass runs on."""
        return batch.rows(slice(0, 1))
