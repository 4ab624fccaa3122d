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
"""

from __future__ import annotations

import math
import time

import torch

from services.learner.batch import TrainBatch
from services.learner.importance import importance_weight_metrics, importance_weights
from services.learner.loss import policy_loss
from services.learner.policy import completion_logprobs, logprobs_no_grad
from services.learner.settings import LearnerSettings


def lr_lambda(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to ``min_ratio`` at ``total_steps``."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    def __init__(self, model: torch.nn.Module, settings: LearnerSettings, reference: torch.nn.Module | None = None):
        self.model = model
        self.settings = settings
        self.reference = reference
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

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]

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

    def prepare(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        """Old logprobs, reference logprobs and importance weights of a batch (no gradient).

        With ``old_logprobs = "reuse"`` the old logprobs (and the importance weights that need them) come
        from the training forward instead: with one iteration the weights are the same, so are the numbers.
        """
        s = self.settings
        started = time.perf_counter()
        out: dict[str, torch.Tensor] = {}
        if s.old_logprobs == "recompute":
            out["old_logprobs"] = logprobs_no_grad(self.model, batch, s.micro_batch_size)
            if s.importance_correction:
                out["importance_weights"] = self._weights(out["old_logprobs"], batch)
        out["seconds/old_logprobs"] = torch.tensor(time.perf_counter() - started)
        if s.beta > 0:
            assert self.reference is not None, "beta > 0 needs a reference model"
            out["ref_logprobs"] = logprobs_no_grad(self.reference, batch, s.micro_batch_size)
        return out

    def accumulate_gradients(self, batch: TrainBatch, prepared: dict[str, torch.Tensor]) -> dict[str, float]:
        """Backward of the whole batch's loss, micro-batch by micro-batch; returns summed metrics."""
        s = self.settings
        total_tokens = float(batch.completion_mask.sum())
        loss_type = "dapo" if s.loss_type == "bnpo" else s.loss_type  # exact token mean across micro-batches
        totals: dict[str, float] = {"loss": 0.0}
        reused_weights: list[torch.Tensor] = []
        start = 0
        for mb in batch.micro_batches(s.micro_batch_size):
            rows = slice(start, start + mb.size)
            start += mb.size
            logprobs = completion_logprobs(self.model, mb)
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
            loss.backward()
            tokens = float(mb.completion_mask.sum())
            totals["loss"] += float(loss.detach())
            for name, value in metrics.items():  # token means -> token-weighted sums
                totals[name] = totals.get(name, 0.0) + value * tokens
        for name in list(totals):
            if name != "loss":
                totals[name] /= max(total_tokens, 1.0)
        if reused_weights:
            prepared["importance_weights"] = torch.cat(reused_weights)
        return totals

    def train(self, batch: TrainBatch) -> list[dict[str, float]]:
        """``num_iterations`` optimizer steps on ``batch``; one metrics dict per step."""
        prepared = self.prepare(batch)
        results = []
        for _ in range(self.settings.num_iterations):
            started = time.perf_counter()
            self.optimizer.zero_grad(set_to_none=True)
            metrics = self.accumulate_gradients(batch, prepared)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in self.model.parameters() if p.requires_grad], self.settings.max_grad_norm
            )
            metrics["learning_rate"] = self.scheduler.get_last_lr()[0]
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            metrics["grad_norm"] = float(grad_norm)
            metrics["seconds/train"] = time.perf_counter() - started
            metrics["seconds/old_logprobs"] = float(prepared["seconds/old_logprobs"])
            if "importance_weights" in prepared:
                metrics.update(importance_weight_metrics(prepared["importance_weights"], batch.completion_mask))
            results.append(metrics)
        return results
