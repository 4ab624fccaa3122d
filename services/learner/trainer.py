"""One GRPO update on one batch: old logprobs, reference logprobs, importance weights, loss, optimizer.

Per batch (TRL's semantics for ``num_iterations`` = mu):

1. ``old_logprobs``: the current weights' logprobs of the completions, without gradient, in training-sized
   micro-batches. They are the proximal policy of the clipped ratio and stay fixed for all mu iterations.
2. ``ref_logprobs`` from the frozen initial model when beta > 0.
3. Importance weights pi_old / pi_behaviour (the generator's logprobs), truncated or masked.
4. mu times: the loss over micro-batches with gradient accumulation, clipping, an AdamW step and a
   scheduler step. The per-micro-batch scaling makes the accumulated gradient exactly the gradient of the
   chosen aggregation over the whole batch (``bnpo``/``dapo``: token sums over the batch's token count;
   ``grpo``: sequence means over B; ``dr_grpo``: sums over B * max_completion_length).

Under torchrun (:mod:`services.learner.distributed`) each rank runs these on its block of the batch's rows
with the whole batch's normalisers, and the metrics are summed across ranks.

Precision (:mod:`services.learner.hardware`): the weights, their gradients and AdamW's state are in
``param_dtype`` (float32); forwards run in ``compute_dtype`` under autocast on one device (FSDP2 casts the
gathered weights itself under torchrun); logprobs and the loss are float32.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from services.learner import distributed
from services.learner.batch import TrainBatch
from services.learner.distributed import Channel, Topology
from services.learner.hardware import Precision, compute_context, resolve_precision
from services.learner.importance import importance_weight_metrics, importance_weights
from services.learner.loss import policy_loss
from services.learner.policy import completion_logprobs, merged_weights
from services.learner.settings import LearnerSettings


def lr_lambda(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to ``min_ratio`` at ``total_steps``."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    """The optimizer and the update of one batch; on several ranks, this rank's share of it.

    ``model`` is already sharded (:func:`distributed.shard_model`) when ``topology`` has several ranks.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        settings: LearnerSettings,
        reference: torch.nn.Module | None = None,
        topology: Topology | None = None,
    ):
        self.model = model
        self.settings = settings
        self.reference = reference
        self.topology = topology or Topology()
        self.channel = Channel(self.topology)
        # The shared-prompt forward runs a pass count that depends on group boundaries; FSDP's collectives
        # need the same count on every rank, which the padded forward gives.
        self.share_prompts = not self.topology.distributed
        self.precision = resolve_precision(settings.param_dtype, settings.compute_dtype, settings.device)
        # Sharded, FSDP2's MixedPrecisionPolicy casts the gathered weights (distributed.shard_model).
        self.autocast = Precision() if self.topology.distributed else self.precision
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=settings.lr,
            betas=(settings.adam_beta1, settings.adam_beta2),
            weight_decay=settings.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_lambda(step, settings.warmup_steps, settings.max_steps, settings.min_lr_ratio),
        )
        self.step = 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def state_dict(self) -> dict:
        """Scheduler and step; the optimizer too on one rank (on several, :meth:`save_optimizer` writes it)."""
        state = {"scheduler": self.scheduler.state_dict(), "step": self.step, "ranks": self.topology.world_size}
        if not self.topology.distributed:
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict, checkpoint: Path | None = None) -> None:
        """Restore :meth:`state_dict`; on several ranks the optimizer comes from ``checkpoint``/optimizer."""
        if self.topology.distributed:
            if checkpoint is None:
                raise ValueError("a sharded learner restores its optimizer from a checkpoint directory")
            distributed.load_optimizer(self.model, self.optimizer, checkpoint / "optimizer")
        elif "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            raise ValueError(
                f"this checkpoint was written by {state.get('ranks')} learner ranks (its optimizer is sharded "
                "under optimizer/); resume it with torchrun, or start from its model with resume = false"
            )
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]

    def save_optimizer(self, path: Path) -> None:
        """On several ranks: every rank writes its optimizer shards under ``path``. Called by the leader."""
        if self.topology.distributed:
            self.channel.send(Channel.SAVE_OPTIMIZER, str(path))
            distributed.save_optimizer(self.model, self.optimizer, path)

    @contextmanager
    def full_weights(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """(name, tensor) of the whole model as vLLM names them (LoRA merged); on the leader."""
        if self.topology.distributed:
            self.channel.send(Channel.WEIGHTS)
            with distributed.full_weights(self.model) as named:
                yield named
        else:
            with merged_weights(self.model) as named:
                yield named

    def stop_followers(self) -> None:
        self.channel.send(Channel.STOP)

    def _weights(self, old: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
        s = self.settings
        return importance_weights(
            old,
            batch.behaviour_logprobs,
            batch.completion_mask,
            level=s.importance_level,
            mode=s.importance_mode,
            cap=s.importance_cap,
            cap_min=s.importance_cap_min,
        )

    def _plan(self, batch: TrainBatch) -> tuple[TrainBatch, list[TrainBatch | None]]:
        """This rank's rows of ``batch`` and its forward passes (None: a zero-weighted padding pass)."""
        if not self.topology.distributed:
            return batch, list(batch.micro_batches(self.settings.micro_batch_size))
        local = batch.rows(distributed.split_rows(batch.size, self.topology))
        plan = distributed.micro_batch_plan(batch.size, self.settings.micro_batch_size, self.topology)
        return local, [None if rows is None else local.rows(rows) for rows in plan]

    def _padding(self, batch: TrainBatch) -> TrainBatch:
        return batch.rows(slice(0, 1))

    @torch.no_grad()
    def _logprobs_no_grad(self, model: torch.nn.Module, batch: TrainBatch, passes: list[TrainBatch | None]):
        was_training = model.training
        model.eval()
        try:
            parts = []
            for mb in passes:
                with compute_context(self.autocast, self.device):
                    logprobs = completion_logprobs(model, mb or self._padding(batch), share_prompts=self.share_prompts)
                if mb is not None:
                    parts.append(logprobs)
        finally:
            model.train(was_training)
        return torch.cat(parts) if parts else torch.zeros((0, batch.completion_length), device=self.device)

    def prepare(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        """Old logprobs, reference logprobs and importance weights of this rank's rows (no gradient).

        With ``old_logprobs = "reuse"`` the old logprobs (and the importance weights that need them) come
        from the training forward instead: with one iteration the weights are the same, so are the numbers.
        """
        s = self.settings
        started = time.perf_counter()
        local, passes = self._plan(batch)
        out: dict[str, torch.Tensor] = {}
        if s.old_logprobs == "recompute":
            out["old_logprobs"] = self._logprobs_no_grad(self.model, batch, passes)
            if s.importance_correction:
                out["importance_weights"] = self._weights(out["old_logprobs"], local)
        out["seconds/old_logprobs"] = torch.tensor(time.perf_counter() - started)
        if s.beta > 0:
            assert self.reference is not None, "beta > 0 needs a reference model"
            real = [mb for mb in passes if mb is not None]  # the reference replica runs no collective
            out["ref_logprobs"] = self._logprobs_no_grad(self.reference, batch, real)
        return out

    def accumulate_gradients(self, batch: TrainBatch, prepared: dict[str, torch.Tensor]) -> dict[str, float]:
        """Backward of the whole batch's loss, micro-batch by micro-batch; returns summed metrics."""
        s = self.settings
        total_tokens = float(batch.completion_mask.sum())
        loss_type = "dapo" if s.loss_type == "bnpo" else s.loss_type  # exact token mean across micro-batches
        # FSDP averages gradients over ranks; each rank's loss is its share of the whole batch's loss.
        rank_scale = float(self.topology.world_size)
        totals: dict[str, float] = {"loss": 0.0}
        reused_weights: list[torch.Tensor] = []
        _, passes = self._plan(batch)
        start = 0
        for planned in passes:
            mb = planned or self._padding(batch)
            rows = slice(start, start + mb.size)
            with compute_context(self.autocast, self.device):
                logprobs = completion_logprobs(self.model, mb, share_prompts=self.share_prompts)
            if planned is None:  # padding pass: keeps the ranks' collectives in step, adds no gradient
                (logprobs.sum() * 0.0).backward()
                continue
            start += mb.size
            if "old_logprobs" in prepared:
                old = prepared["old_logprobs"][rows]
                weights = prepared["importance_weights"][rows] if "importance_weights" in prepared else None
            else:
                old = logprobs.detach()
                weights = self._weights(old, mb) if s.importance_correction else None
                if weights is not None:
                    reused_weights.append(weights)
            loss, metrics = policy_loss(
                logprobs,
                old,
                mb.advantages,
                mb.completion_mask,
                loss_type=loss_type,
                epsilon_low=s.epsilon_low,
                epsilon_high=s.epsilon_high,
                delta=s.delta,
                beta=s.beta,
                ref_logprobs=prepared["ref_logprobs"][rows] if "ref_logprobs" in prepared else None,
                importance_weights=weights,
                max_completion_length=s.max_completion_length,
                num_items_in_batch=total_tokens,
            )
            if loss_type in ("grpo", "dr_grpo"):
                loss = loss * (mb.size / batch.size)
            (loss * rank_scale).backward()
            tokens = float(mb.completion_mask.sum())
            totals["loss"] += float(loss.detach())
            for name, value in metrics.items():  # token means -> token-weighted sums
                totals[name] = totals.get(name, 0.0) + value * tokens
        totals = distributed.sum_across(totals)
        for name in list(totals):
            if name != "loss":
                totals[name] /= max(total_tokens, 1.0)
        if reused_weights:
            prepared["importance_weights"] = torch.cat(reused_weights)
        return totals

    def _importance_metrics(self, batch: TrainBatch, prepared: dict[str, torch.Tensor]) -> dict[str, float]:
        if "importance_weights" not in prepared:
            return {}
        local, _ = self._plan(batch)
        pairs = distributed.gather_objects((prepared["importance_weights"].cpu(), local.completion_mask.cpu()))
        weights = torch.cat([w for w, _ in pairs])
        mask = torch.cat([m for _, m in pairs])
        return importance_weight_metrics(weights, mask)

    def train(self, batch: TrainBatch) -> list[dict[str, float]]:
        """``num_iterations`` optimizer steps on ``batch``; one metrics dict per step.

        On several ranks the leader calls this with the whole batch; it sends the batch to the others.
        """
        self.channel.send(Channel.TRAIN, batch.to(torch.device("cpu")))
        return self.train_shard(batch)

    def train_shard(self, batch: TrainBatch) -> list[dict[str, float]]:
        """:meth:`train` on this rank's share of ``batch`` (the whole batch on one rank)."""
        batch = batch.to(self.device)
        prepared = self.prepare(batch)
        results = []
        for _ in range(self.settings.num_iterations):
            started = time.perf_counter()
            self.optimizer.zero_grad(set_to_none=True)
            metrics = self.accumulate_gradients(batch, prepared)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in self.model.parameters() if p.requires_grad], self.settings.max_grad_norm
            )
            if hasattr(grad_norm, "full_tensor"):  # a DTensor when the parameters are sharded
                grad_norm = grad_norm.full_tensor()
            metrics["learning_rate"] = self.scheduler.get_last_lr()[0]
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            metrics["grad_norm"] = float(grad_norm)
            metrics["seconds/train"] = time.perf_counter() - started
            metrics["seconds/old_logprobs"] = float(prepared["seconds/old_logprobs"])
            metrics.update(self._importance_metrics(batch, prepared))
            results.append(metrics)
        return results
