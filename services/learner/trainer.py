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

Entropy (:mod:`services.learner.entropy`) comes from the same forward as the logprobs and is logged as
``entropy``. With ``top_entropy_quantile`` < 1 the threshold is the quantile of the active tokens' entropies
over the whole batch (every rank's rows) under the policy the step starts from, taken in the no-grad pass of
step 1 (a no-grad pass of its own with ``old_logprobs = "reuse"``); all ``num_iterations`` reuse it. The
adaptive entropy controller (TRL's) updates ``entropy_coef`` after each optimizer step from the batch's
entropy over the tokens the loss acts on.

Under torchrun (:mod:`services.learner.distributed`) each rank runs these on its block of the batch's rows
with the whole batch's normalisers, and the metrics are summed across ranks.

Precision (:mod:`services.learner.hardware`): the weights, their gradients and AdamW's state are in
``param_dtype`` (float32); forwards run in ``compute_dtype`` under autocast on one device (FSDP2 casts the
gathered weights itself under torchrun); logprobs and the loss are float32.
"""

from __future__ import annotations

import dataclasses
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
from services.learner.loss import (
    DEFAULT_AGGREGATION,
    LossConfig,
    LossInputs,
    adaptive_entropy_coef,
    compute_loss,
    entropy_threshold,
    high_entropy_mask,
)
from services.learner.policy import EntropyMode, completion_logprobs_and_entropy, merged_weights
from shared.config.learner import LearnerSettings


def loss_config(s: LearnerSettings) -> LossConfig:
    """The loss's hyper-parameters from the settings. A ``bnpo`` aggregation becomes ``dapo`` with the
    batch's token count: the exact token mean over all micro-batches. The entropy coefficient is set per step."""
    aggregation = s.loss_aggregation or DEFAULT_AGGREGATION[s.loss_type]
    return LossConfig(
        loss_type=s.loss_type,
        aggregation="dapo" if aggregation == "bnpo" else aggregation,  # type: ignore[arg-type]
        ratio_level=s.ratio_level,
        epsilon_low=s.epsilon_low,
        epsilon_high=s.epsilon_high,
        delta=s.delta,
        beta=s.beta,
        kl_estimator=s.kl_estimator,
        kl_bias_correction=s.kl_bias_correction,
        cispo_clip_max=s.cispo_clip_max,
        cispo_clip_min=s.cispo_clip_min,
        sapo_temperature_pos=s.sapo_temperature_pos,
        sapo_temperature_neg=s.sapo_temperature_neg,
        vespo_k_pos=s.vespo_k_pos,
        vespo_lambda_pos=s.vespo_lambda_pos,
        vespo_k_neg=s.vespo_k_neg,
        vespo_lambda_neg=s.vespo_lambda_neg,
        importance_level=s.importance_level,
        kl_cov_ratio=s.kl_cov_ratio,
        kl_cov_coef=s.kl_cov_coef,
        off_policy_mask_threshold=s.off_policy_mask_threshold,
        top_entropy_quantile=s.top_entropy_quantile,
    )


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
        self.loss_config = loss_config(settings)
        self.entropy_coef = settings.entropy_coef  # moved by the adaptive controller
        self.last_entropy = math.inf  # TRL's start: the adaptive bonus waits for a first measurement

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def state_dict(self) -> dict:
        """Scheduler and step; the optimizer too on one rank (on several, :meth:`save_optimizer` writes it)."""
        state = {"scheduler": self.scheduler.state_dict(), "step": self.step, "ranks": self.topology.world_size}
        state["entropy_control"] = {"entropy_coef": self.entropy_coef, "last_entropy": self.last_entropy}
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
        control = state.get("entropy_control", {})
        self.entropy_coef = control.get("entropy_coef", self.entropy_coef)
        self.last_entropy = control.get("last_entropy", self.last_entropy)

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
    def _logprobs_no_grad(
        self, model: torch.nn.Module, batch: TrainBatch, passes: list[TrainBatch | None], entropy: EntropyMode = "none"
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        was_training = model.training
        model.eval()
        try:
            parts, entropies = [], []
            for mb in passes:
                with compute_context(self.autocast, self.device):
                    logprobs, h = completion_logprobs_and_entropy(
                        model, mb or self._padding(batch), share_prompts=self.share_prompts, entropy=entropy
                    )
                if mb is not None:
                    parts.append(logprobs)
                    entropies.append(h)
        finally:
            model.train(was_training)
        empty = torch.zeros((0, batch.completion_length), device=self.device)
        logprobs = torch.cat(parts) if parts else empty
        if entropy == "none":
            return logprobs, None
        return logprobs, torch.cat(entropies) if entropies else empty  # type: ignore[arg-type]

    def _loss_mask(self, batch: TrainBatch) -> torch.Tensor:
        """[B, T] the tokens the loss sums over: completion tokens, minus truncated completions if masked."""
        if not self.settings.mask_truncated_completions:
            return batch.completion_mask
        return batch.completion_mask * (~batch.truncated.bool()).to(batch.completion_mask.dtype).unsqueeze(1)

    def _entropy_threshold(self, entropies: torch.Tensor, local: TrainBatch, out: dict[str, torch.Tensor]) -> None:
        """The batch-wide entropy quantile (all ranks' active tokens) and the count of tokens at or above it."""
        mask = self._loss_mask(local)
        active = entropies[mask.bool()].float().cpu()
        threshold = entropy_threshold(torch.cat(distributed.gather_objects(active)), self.settings.top_entropy_quantile)
        acting = float(high_entropy_mask(entropies, mask, threshold).sum())
        out["entropy_threshold"] = threshold
        out["entropy_tokens"] = torch.tensor(distributed.sum_across({"acting": acting})["acting"])

    def prepare(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        """Old logprobs, reference logprobs and importance weights of this rank's rows (no gradient), and the
        batch's entropy threshold when ``top_entropy_quantile`` < 1.

        With ``old_logprobs = "reuse"`` the old logprobs (and the importance weights that need them) come
        from the training forward instead: with one iteration the weights are the same, so are the numbers.
        """
        s = self.settings
        started = time.perf_counter()
        local, passes = self._plan(batch)
        out: dict[str, torch.Tensor] = {}
        quantile = s.top_entropy_quantile < 1.0
        entropies = None
        if s.old_logprobs == "recompute":
            out["old_logprobs"], entropies = self._logprobs_no_grad(
                self.model, batch, passes, "value" if quantile else "none"
            )
            if s.importance_correction:
                out["importance_weights"] = self._weights(out["old_logprobs"], local)
        elif quantile:
            _, entropies = self._logprobs_no_grad(self.model, batch, passes, "value")
        if entropies is not None:
            self._entropy_threshold(entropies, local, out)
        out["seconds/old_logprobs"] = torch.tensor(time.perf_counter() - started)
        if s.beta > 0:
            assert self.reference is not None, "beta > 0 needs a reference model"
            real = [mb for mb in passes if mb is not None]  # the reference replica runs no collective
            out["ref_logprobs"], _ = self._logprobs_no_grad(self.reference, batch, real)
        return out

    def _batch_normalisers(self, batch: TrainBatch, prepared: dict[str, torch.Tensor]) -> dict:
        """The whole batch's counts each micro-batch's loss is normalised by, so that they add up exactly."""
        loss_tokens = float(self._loss_mask(batch).sum())
        return {
            "entropy_threshold": prepared.get("entropy_threshold"),
            "max_completion_length": self.settings.max_completion_length,
            "num_items_in_batch": loss_tokens,
            "num_sequences": batch.size,
            "num_entropy_tokens": prepared.get("entropy_tokens", loss_tokens),
        }

    def _step_config(self) -> LossConfig:
        """The loss config of this optimizer step: the adaptive bonus applies while the last entropy <= target."""
        s = self.settings
        coef = self.entropy_coef
        if s.adaptive_entropy and self.last_entropy > s.entropy_target:
            coef = 0.0
        return dataclasses.replace(self.loss_config, entropy_coef=coef)

    def accumulate_gradients(self, batch: TrainBatch, prepared: dict[str, torch.Tensor]) -> dict[str, float]:
        """Backward of the whole batch's loss, micro-batch by micro-batch; returns summed metrics."""
        s = self.settings
        total_tokens = float(batch.completion_mask.sum())
        batch_wide = self._batch_normalisers(batch, prepared)
        config = self._step_config()
        entropy_mode: EntropyMode = "grad" if config.entropy_coef != 0.0 else "value"
        # FSDP averages gradients over ranks; each rank's loss is its share of the whole batch's loss.
        rank_scale = float(self.topology.world_size)
        totals: dict[str, float] = {"loss": 0.0, "entropy/acting_sum": 0.0, "entropy/acting_tokens": 0.0}
        reused_weights: list[torch.Tensor] = []
        _, passes = self._plan(batch)
        start = 0
        for planned in passes:
            mb = planned or self._padding(batch)
            rows = slice(start, start + mb.size)
            with compute_context(self.autocast, self.device):
                logprobs, entropies = completion_logprobs_and_entropy(
                    self.model, mb, share_prompts=self.share_prompts, entropy=entropy_mode
                )
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
            inputs = LossInputs(
                logprobs=logprobs,
                old_logprobs=old,
                advantages=mb.advantages,
                mask=mb.completion_mask,
                ref_logprobs=prepared["ref_logprobs"][rows] if "ref_logprobs" in prepared else None,
                behaviour_logprobs=mb.behaviour_logprobs,
                importance_weights=weights,
                entropies=entropies,
                truncated=mb.truncated if s.mask_truncated_completions else None,
                **batch_wide,
            )
            out = compute_loss(inputs, config)
            (out.loss * rank_scale).backward()
            tokens = float(mb.completion_mask.sum())
            totals["loss"] += float(out.loss.detach())
            totals["entropy/acting_sum"] += out.acting_entropy_sum
            totals["entropy/acting_tokens"] += out.acting_tokens
            for name, value in out.metrics.items():  # token means -> token-weighted sums
                totals[name] = totals.get(name, 0.0) + value * tokens
        totals = distributed.sum_across(totals)
        for name in list(totals):
            if name not in ("loss", "entropy/acting_sum", "entropy/acting_tokens"):
                totals[name] /= max(total_tokens, 1.0)
        if reused_weights:
            prepared["importance_weights"] = torch.cat(reused_weights)
        self._control_entropy(totals)
        return totals

    def _control_entropy(self, totals: dict[str, float]) -> None:
        """TRL's adaptive controller after the step; ``entropy_coef`` logged as TRL does."""
        s = self.settings
        acting_sum, acting = totals.pop("entropy/acting_sum"), totals.pop("entropy/acting_tokens")
        if s.adaptive_entropy:
            self.last_entropy = acting_sum / max(acting, 1.0)
            self.entropy_coef = adaptive_entropy_coef(
                self.entropy_coef,
                self.last_entropy,
                target=s.entropy_target,
                delta=s.entropy_coef_delta,
                coef_min=s.entropy_coef_min,
                coef_max=s.entropy_coef_max,
            )
        if s.adaptive_entropy or s.entropy_coef:
            totals["entropy_coef"] = self.entropy_coef

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
