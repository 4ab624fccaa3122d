"""One GRPO update on one batch: old logprobs, reference logprobs, importance weights, loss, optimizer.

Per batch (TRL's semantics for ``num_iterations`` = mu):

1. ``old_logprobs``: the current weights' logprobs of the completions, without gradient, in training-sized
   micro-batches. They are the proximal policy of the clipped ratio and stay fixed for all mu iterations.
   (``old_logprobs = "reuse"``: the training forward's, detached; ``"behaviour"``: the generator's, and step 3
   has nothing to weight.)
2. ``ref_logprobs`` from the frozen initial model when beta > 0.
3. Importance weights pi_old / pi_behaviour (the generator's logprobs), truncated or masked.
4. mu times: the loss over micro-batches with gradient accumulation, clipping, an AdamW step and a
   scheduler step. Each micro-batch's loss is divided by the whole batch's counts
   (:class:`~services.learner.objective.loss.BatchNormalisers`), so the accumulated gradient is exactly the gradient
   of the chosen aggregation over the whole batch; :mod:`services.learner.objective.loss` does all of that arithmetic.

The loss acts on the batch's ``loss_mask`` (the tokens the policy sampled; a multi-turn trajectory's tool
results and template tokens are context only): the ratio, the importance weights, the entropy, the KL and every
token count read it, never ``completion_mask`` (docs/concepts/multi-turn-design.md §2.10).

Steps 1-3 give a :class:`PreparedBatch`, fixed for the mu iterations; each iteration's backward gives a
:class:`StepResult`.

Entropy (:mod:`services.learner.logprobs.entropy`) comes from the same forward as the logprobs and is logged as
``entropy``. With ``top_entropy_quantile`` < 1 the threshold is the quantile of the active tokens' entropies
over the whole batch (every rank's rows) under the policy the step starts from, taken in the no-grad pass of
step 1 (a no-grad pass of its own with ``"reuse"`` or ``"behaviour"``); all ``num_iterations`` reuse it. The
adaptive entropy controller (TRL's) updates ``entropy_coef`` after each optimizer step from the batch's
entropy over the tokens the loss acts on.

Micro-batches (:mod:`services.learner.logprobs.micro_batches`): with a token budget
(``max_tokens_per_micro_batch``, auto on every device) consecutive rows up to the budget and
``micro_batch_size`` are packed into one row without padding; each group's prompt once when ``share_prompts``
(auto: on for the CPU, off for CUDA). The results come back in the padded [b, T] layout, so the loss and its
normalisers do not change.

Under torchrun (:mod:`services.learner.distributed`) each rank runs these on its block of the batch's rows
with the whole batch's normalisers, and the metrics are summed across ranks; its micro-batches are padded and
row-counted, prompts unshared (every rank must run the same number of passes). The leader tells the other
ranks what to do through :class:`~services.learner.ranks.RankChannel`.

The trainer composes four parts: :class:`~services.learner.optimizer.OptimizerStep` (AdamW, the schedule,
clipping and precision: forwards in ``compute_dtype``, logprobs and the loss in float32),
:class:`~services.learner.logprobs.micro_batches.MicroBatchPlanner` (which rows each pass takes),
:class:`~services.learner.ranks.RankChannel` and
:class:`~services.learner.objective.entropy_control.EntropyController`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.learner import distributed
from services.learner.data.batch import TrainBatch
from services.learner.distributed import Topology
from services.learner.hardware import compute_context
from services.learner.logprobs.lm_head import Stats
from services.learner.logprobs.micro_batches import MicroBatchPlanner
from services.learner.logprobs.policy import EntropyMode, completion_logprobs_and_entropy
from services.learner.metrics import gathered
from services.learner.metrics.batch_metrics import clip_ratio_extremes
from services.learner.model import WeightExport
from services.learner.objective.entropy_control import EntropyController
from services.learner.objective.importance import importance_weights
from services.learner.objective.loss import (
    BatchNormalisers,
    LossInputs,
    LossOutputs,
    active_mask,
    compute_loss,
    entropy_threshold,
    high_entropy_mask,
)
from services.learner.optimizer import NONFINITE_STEP, OptimizerStep
from services.learner.ranks import RankChannel
from shared.config.learner import LearnerSettings
from shared.config.objective import Objective

_ACTING_SUM, _ACTING_TOKENS = "entropy/acting_sum", "entropy/acting_tokens"  # summed, not logged


@dataclass(frozen=True)
class PreparedBatch:
    """What :meth:`Trainer.prepare` computes without gradient for this rank's B_r rows of a batch; fixed for
    all ``num_iterations`` optimizer steps on it."""

    old_logprobs: torch.Tensor | None  # [B_r, T]; None with "reuse" (the training forward's) or "behaviour"
    importance_weights: torch.Tensor | None  # [B_r, T]; None without importance correction, "reuse" or "behaviour"
    ref_logprobs: torch.Tensor | None  # [B_r, T] when beta > 0
    normalisers: BatchNormalisers  # the whole batch's counts (and entropy threshold) every loss is divided by
    seconds_old_logprobs: float  # wall time of the old-logprob and entropy pass
    sampling_metrics: dict[str, float] = field(default_factory=dict)  # the logp difference, when recomputed


@dataclass(frozen=True)
class StepResult:
    """One optimizer step's backward over this rank's rows, summed over ranks."""

    metrics: dict[str, float]  # "loss" (sum of micro-batch losses) and token means under TRL's names
    importance_weights: torch.Tensor | None  # [B_r, T] the weights the loss used (prepared or reused)
    acting_entropy: float  # mean entropy over the tokens the policy term acted on (adaptive controller)


def _add_outputs(sums: dict[str, float], out: LossOutputs, tokens: float) -> None:
    """Add one micro-batch's outputs to the running ``sums``; its token means become token-weighted sums."""
    sums["loss"] += float(out.loss.detach())
    sums[_ACTING_SUM] += out.acting_entropy_sum
    sums[_ACTING_TOKENS] += out.acting_tokens
    for name, value in out.metrics.items():
        sums[name] = sums.get(name, 0.0) + value * tokens


def _step_result(sums: dict[str, float], used: list[torch.Tensor], batch_tokens: float) -> StepResult:
    """The step's result from the ranks' summed ``sums``: token-weighted sums back to token means over the
    batch's ``batch_tokens`` sampled tokens; ``used``: the importance weights of each micro-batch."""
    tokens = max(batch_tokens, 1.0)
    acting_entropy = sums[_ACTING_SUM] / max(sums[_ACTING_TOKENS], 1.0)
    metrics = {
        name: value if name == "loss" else value / tokens
        for name, value in sums.items()
        if name not in (_ACTING_SUM, _ACTING_TOKENS)
    }
    return StepResult(metrics, torch.cat(used) if used else None, acting_entropy)


def _importance_weights(old: torch.Tensor, batch: TrainBatch, s: LearnerSettings) -> torch.Tensor:
    """[b, T] pi_old / pi_behaviour of ``batch``'s tokens, bounded as the settings say."""
    return importance_weights(
        old,
        batch.behaviour_logprobs,
        batch.loss_mask,
        level=s.importance_level,
        mode=s.importance_mode,
        cap=s.importance_cap,
        cap_min=s.importance_cap_min,
    )


def _loss_mask(settings: LearnerSettings, batch: TrainBatch) -> torch.Tensor:
    """[B, T] the tokens the loss sums over: sampled tokens (the loss mask), minus truncated completions if
    masked."""
    truncated = batch.truncated if settings.mask_truncated_completions else None
    return active_mask(batch.loss_mask, truncated)


def old_and_weights(
    logprobs: torch.Tensor, mb: TrainBatch, rows: slice, prepared: PreparedBatch, settings: LearnerSettings
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A micro-batch's old logprobs [b, T] and importance weights [b, T] (or None), by ``old_logprobs``: the
    prepared ones at ``rows`` (``"recompute"``), the generator's (``"behaviour"``), or those of the training
    forward ``logprobs`` (``"reuse"``)."""
    if prepared.old_logprobs is not None:
        weights = prepared.importance_weights
        return prepared.old_logprobs[rows], None if weights is None else weights[rows]
    if settings.old_logprobs == "behaviour":  # pi_old = pi_behaviour: every importance weight is 1
        # Off the loss mask (padding, tool results) the ratio is 1, whatever the record holds there.
        sampled = mb.behaviour_logprobs.to(device=logprobs.device, dtype=logprobs.dtype)
        return torch.where(mb.loss_mask.bool(), sampled, logprobs.detach()), None
    old = logprobs.detach()
    return old, _importance_weights(old, mb, settings) if settings.importance_correction else None


class Trainer:
    """The update of one batch; on several ranks, this rank's share of it.

    ``model`` is already sharded (:func:`distributed.shard_model`) when ``topology`` has several ranks.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        settings: LearnerSettings,
        reference: torch.nn.Module | None = None,
        topology: Topology | None = None,
    ):
        if settings.beta > 0 and reference is None:
            raise ValueError(
                f"beta = {settings.beta} needs a reference model: pass reference=reference_model(model) "
                "(services.learner.model) to Trainer, or set beta = 0 to train without the KL term"
            )
        self.model = model
        self.settings = settings
        self.reference = reference
        self.topology = topology or Topology()
        self.ranks = RankChannel(self.topology)
        self.planner = MicroBatchPlanner(settings, self.topology, model)
        self.optimizer = OptimizerStep(model, settings, self.topology)
        self.export = WeightExport(model, self.topology, self.ranks)
        self.objective = Objective.of(settings)
        self.entropy_control = EntropyController(settings)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def step(self) -> int:
        """Optimizer steps taken: the policy version."""
        return self.optimizer.step

    def state_dict(self) -> dict:
        """Scheduler and step; the optimizer too on one rank (on several, :meth:`save_optimizer` writes it)."""
        return {**self.optimizer.state_dict(), "entropy_control": self.entropy_control.state_dict()}

    def load_state_dict(self, state: dict, checkpoint: Path | None = None) -> None:
        """Restore :meth:`state_dict`; on several ranks the optimizer comes from ``checkpoint``/optimizer."""
        self.optimizer.load_state_dict(state, checkpoint)
        self.entropy_control.load_state_dict(state.get("entropy_control", {}))

    def save_optimizer(self, path: Path) -> None:
        """On several ranks: every rank writes its optimizer shards under ``path``. Called by the leader."""
        if self.topology.distributed:
            self.ranks.save_optimizer(path)
            self.optimizer.save(path)

    def stop_followers(self) -> None:
        self.ranks.stop()

    def _forward(self, model: torch.nn.Module, mb: TrainBatch, entropy: EntropyMode) -> Stats:
        """Log-probabilities [b, T] (and entropies) of one pass, under the compute dtype's autocast."""
        with compute_context(self.optimizer.autocast, self.device):
            return completion_logprobs_and_entropy(
                model,
                mb,
                share_prompts=self.planner.share_prompts,
                entropy=entropy,
                chunk_tokens=self.settings.logprob_chunk_tokens,
                packed=self.planner.packed,
            )

    def _no_grad(self) -> AbstractContextManager:
        """``torch.inference_mode`` (no autograd bookkeeping, no version counters) on one rank; ``no_grad``
        under torchrun: FSDP2 gathers parameters into buffers that the training passes reuse, and a tensor made
        under inference_mode cannot take part in autograd later."""
        return torch.no_grad() if self.topology.distributed else torch.inference_mode()

    def _logprobs_no_grad(
        self,
        model: torch.nn.Module,
        batch: TrainBatch,
        passes: Sequence[TrainBatch | None],
        entropy: EntropyMode = "none",
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probabilities [B_r, T] (and entropies) of ``passes`` without gradient, in eval mode. The results
        are cloned out of inference mode: the loss may then save them for its backward like any tensor."""
        was_training = model.training
        model.eval()
        try:
            parts, entropies = [], []
            with self._no_grad():
                for mb in passes:
                    logprobs, h = self._forward(model, mb or self.planner.padding(batch), entropy)
                    if mb is not None:
                        parts.append(logprobs)
                        entropies.append(h)
        finally:
            model.train(was_training)
        empty = torch.zeros((0, batch.completion_length), device=self.device)
        logprobs = torch.cat(parts).clone() if parts else empty
        if entropy == "none":
            return logprobs, None
        return logprobs, torch.cat(entropies).clone() if entropies else empty  # type: ignore[arg-type]

    def _normalisers(self, batch: TrainBatch, local: TrainBatch, entropies: torch.Tensor | None) -> BatchNormalisers:
        """The whole batch's counts; with this rank's entropies [B_r, T], its entropy threshold too: the
        batch-wide quantile of all ranks' active tokens, and the count of tokens at or above it."""
        if entropies is None:
            return BatchNormalisers.of_batch(_loss_mask(self.settings, batch))
        mask = _loss_mask(self.settings, local)
        active = entropies[mask.bool()].float().cpu()
        threshold = entropy_threshold(torch.cat(distributed.gather_objects(active)), self.settings.top_entropy_quantile)
        acting = distributed.sum_across({"acting": float(high_entropy_mask(entropies, mask, threshold).sum())})
        return BatchNormalisers.of_batch(
            _loss_mask(self.settings, batch), entropy_threshold=threshold, num_entropy_tokens=acting["acting"]
        )

    def prepare(self, batch: TrainBatch) -> PreparedBatch:
        """Old logprobs, reference logprobs and importance weights of this rank's rows (no gradient, passes of
        ``no_grad_micro_batch_size``), and the batch's normalisers, with its entropy threshold when
        ``top_entropy_quantile`` < 1.

        With ``old_logprobs = "reuse"`` the old logprobs (and the importance weights that need them) come
        from the training forward instead: with one iteration the weights are the same, so are the numbers.
        With ``"behaviour"`` they are the generator's, taken per micro-batch, and there are no weights.
        """
        s = self.settings
        started = time.perf_counter()
        local, passes = self.planner.plan(batch, s.no_grad_micro_batch_size)
        entropy: EntropyMode = "value" if s.top_entropy_quantile < 1.0 else "none"
        old: torch.Tensor | None = None
        entropies: torch.Tensor | None = None
        weights: torch.Tensor | None = None
        ref: torch.Tensor | None = None
        if s.old_logprobs == "recompute":
            old, entropies = self._logprobs_no_grad(self.model, batch, passes, entropy)
            weights = _importance_weights(old, local, s) if s.importance_correction else None
        elif entropy == "value":
            _, entropies = self._logprobs_no_grad(self.model, batch, passes, entropy)
        normalisers = self._normalisers(batch, local, entropies)
        seconds = time.perf_counter() - started
        if s.beta > 0 and self.reference is not None:  # __init__ makes sure of the reference
            real = [mb for mb in passes if mb is not None]  # the reference replica runs no collective
            ref, _ = self._logprobs_no_grad(self.reference, batch, real)
        return PreparedBatch(old, weights, ref, normalisers, seconds, gathered.logp_difference(local, old))

    def _micro_batch_backward(
        self, mb: TrainBatch, rows: slice, prepared: PreparedBatch, config: Objective, entropy_mode: EntropyMode
    ) -> tuple[LossOutputs, torch.Tensor | None]:
        """Forward, loss and backward of one micro-batch (``rows`` of this rank's); the importance weights used."""
        logprobs, entropies = self._forward(self.model, mb, entropy_mode)
        old, weights = old_and_weights(logprobs, mb, rows, prepared, self.settings)
        inputs = LossInputs(
            logprobs=logprobs,
            old_logprobs=old,
            advantages=mb.advantages,
            mask=mb.loss_mask,
            ref_logprobs=None if prepared.ref_logprobs is None else prepared.ref_logprobs[rows],
            behaviour_logprobs=mb.behaviour_logprobs,
            importance_weights=weights,
            entropies=entropies,
            truncated=mb.truncated if self.settings.mask_truncated_completions else None,
        )
        out = compute_loss(inputs, config, prepared.normalisers)
        # FSDP averages gradients over ranks; each rank's loss is its share of the whole batch's loss.
        (out.loss * float(self.topology.world_size)).backward()
        return out, weights

    def _padding_backward(self, batch: TrainBatch, entropy_mode: EntropyMode) -> None:
        """A zero-weighted pass: keeps the ranks' collectives in step and adds no gradient."""
        logprobs, _ = self._forward(self.model, self.planner.padding(batch), entropy_mode)
        (logprobs.sum() * 0.0).backward()

    def accumulate_gradients(self, batch: TrainBatch, prepared: PreparedBatch) -> StepResult:
        """Backward of the whole batch's loss, micro-batch by micro-batch; the metrics summed over ranks."""
        config = self.entropy_control.objective(self.objective)
        entropy_mode: EntropyMode = "grad" if config.entropy_coef != 0.0 else "value"
        sums = {"loss": 0.0, _ACTING_SUM: 0.0, _ACTING_TOKENS: 0.0}
        used: list[torch.Tensor] = []
        per_micro_batch: list[dict[str, float]] = []
        _, passes = self.planner.plan(batch)
        start = 0
        for mb in passes:
            if mb is None:
                self._padding_backward(batch, entropy_mode)
                continue
            out, weights = self._micro_batch_backward(mb, slice(start, start + mb.size), prepared, config, entropy_mode)
            start += mb.size
            if weights is not None:
                used.append(weights)
            _add_outputs(sums, out, tokens=float(mb.loss_mask.sum()))
            if mb.loss_mask.any():
                per_micro_batch.append(out.metrics)
        result = _step_result(distributed.sum_across(sums), used, float(batch.loss_mask.sum()))
        every_rank = [m for ms in distributed.gather_objects(per_micro_batch) for m in ms]
        result.metrics.update(clip_ratio_extremes(every_rank))
        return result

    def _importance_metrics(self, batch: TrainBatch, weights: torch.Tensor | None) -> dict[str, float]:
        if weights is None:
            return {}
        local, _ = self.planner.plan(batch)
        return gathered.importance_metrics(weights, local.loss_mask)

    def train(self, batch: TrainBatch) -> list[dict[str, float]]:
        """``num_iterations`` optimizer steps on ``batch``; one metrics dict per step.

        On several ranks the leader calls this with the whole batch; it sends the batch to the others.
        """
        self.ranks.train(batch)
        return self.train_shard(batch)

    def train_shard(self, batch: TrainBatch) -> list[dict[str, float]]:
        """:meth:`train` on this rank's share of ``batch`` (the whole batch on one rank)."""
        batch = batch.to(self.device)
        prepared = self.prepare(batch)
        return [self._optimizer_step(batch, prepared) for _ in range(self.settings.num_iterations)]

    def _optimizer_step(self, batch: TrainBatch, prepared: PreparedBatch) -> dict[str, float]:
        """One optimizer step on the prepared batch; its metrics. A step whose loss or gradient norm is not finite
        is not applied (:meth:`OptimizerStep.apply`): its figures hold ``NONFINITE_STEP``, the loss and the norm."""
        started = time.perf_counter()
        self.optimizer.zero_grad()
        result = self.accumulate_gradients(batch, prepared)
        applied = self.optimizer.apply(result.metrics["loss"])
        if NONFINITE_STEP in applied:  # not applied: the entropy controller does not move either
            return {**result.metrics, **applied}
        return {
            **result.metrics,
            **self.entropy_control.update(result.acting_entropy),
            **applied,
            "seconds/train": time.perf_counter() - started,
            "seconds/old_logprobs": prepared.seconds_old_logprobs,
            **self._importance_metrics(batch, result.importance_weights),
            **prepared.sampling_metrics,
        }
