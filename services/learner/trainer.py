"""One GRPO update on one batch: old logprobs, reference logprobs, importance weights, loss, optimizer.

Per batch (TRL's semantics for ``num_iterations`` = mu):

1. ``old_logprobs``: the current weights' logprobs of the completions, without gradient, in training-sized
   micro-batches. They are the proximal policy of the clipped ratio and stay fixed for all mu iterations.
2. ``ref_logprobs`` from the frozen initial model when beta > 0.
3. Importance weights pi_old / pi_behaviour (the generator's logprobs), truncated or masked.
4. mu times: the loss over micro-batches with gradient accumulation, clipping, an AdamW step and a
   scheduler step. Each micro-batch's loss is divided by the whole batch's counts
   (:class:`~services.learner.loss.BatchNormalisers`), so the accumulated gradient is exactly the gradient
   of the chosen aggregation over the whole batch; :mod:`services.learner.loss` does all of that arithmetic.

Steps 1-3 give a :class:`PreparedBatch`, fixed for the mu iterations; each iteration's backward gives a
:class:`StepResult`.

Entropy (:mod:`services.learner.entropy`) comes from the same forward as the logprobs and is logged as
``entropy``. With ``top_entropy_quantile`` < 1 the threshold is the quantile of the active tokens' entropies
over the whole batch (every rank's rows) under the policy the step starts from, taken in the no-grad pass of
step 1 (a no-grad pass of its own with ``old_logprobs = "reuse"``); all ``num_iterations`` reuse it. The
adaptive entropy controller (TRL's) updates ``entropy_coef`` after each optimizer step from the batch's
entropy over the tokens the loss acts on.

Micro-batches (:mod:`services.learner.packing`): with a token budget (``max_tokens_per_micro_batch``, auto on
every device) consecutive rows up to the budget and ``micro_batch_size`` are packed into one row without
padding; each group's prompt once when ``share_prompts`` (auto: on for the CPU, off for CUDA). The results
come back in the padded [b, T] layout, so the loss and its normalisers do not change.

Under torchrun (:mod:`services.learner.distributed`) each rank runs these on its block of the batch's rows
with the whole batch's normalisers, and the metrics are summed across ranks; its micro-batches are padded and
row-counted, prompts unshared (every rank must run the same number of passes).

Precision (:mod:`services.learner.hardware`): the weights, their gradients and AdamW's state are in
``param_dtype`` (float32); forwards run in ``compute_dtype`` under autocast on one device (FSDP2 casts the
gathered weights itself under torchrun); logprobs and the loss are float32.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.learner import distributed
from services.learner.batch import TrainBatch
from services.learner.batch_metrics import clip_ratio_extremes, sampling_logp_difference_metrics
from services.learner.distributed import Channel, Topology
from services.learner.hardware import Precision, compute_context, resolve_precision
from services.learner.importance import importance_weight_metrics, importance_weights
from services.learner.lm_head import Stats
from services.learner.loss import (
    BatchNormalisers,
    LossInputs,
    LossOutputs,
    active_mask,
    adaptive_entropy_coef,
    compute_loss,
    entropy_threshold,
    high_entropy_mask,
)
from services.learner.packing import (
    check_attention,
    plan_micro_batches,
    resolve_share_prompts,
    resolve_token_budget,
    sequence_lengths,
)
from services.learner.policy import EntropyMode, completion_logprobs_and_entropy, linear_weight_names, merged_weights
from shared.config.learner import LearnerSettings
from shared.config.objective import Objective

_ACTING_SUM, _ACTING_TOKENS = "entropy/acting_sum", "entropy/acting_tokens"  # summed, not logged


@dataclass(frozen=True)
class PreparedBatch:
    """What :meth:`Trainer.prepare` computes without gradient for this rank's B_r rows of a batch; fixed for
    all ``num_iterations`` optimizer steps on it."""

    old_logprobs: torch.Tensor | None  # [B_r, T]; None with old_logprobs = "reuse" (the training forward's)
    importance_weights: torch.Tensor | None  # [B_r, T]; None without importance correction or with "reuse"
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
    batch's ``batch_tokens`` completion tokens; ``used``: the importance weights of each micro-batch."""
    tokens = max(batch_tokens, 1.0)
    acting_entropy = sums[_ACTING_SUM] / max(sums[_ACTING_TOKENS], 1.0)
    metrics = {
        name: value if name == "loss" else value / tokens
        for name, value in sums.items()
        if name not in (_ACTING_SUM, _ACTING_TOKENS)
    }
    return StepResult(metrics, torch.cat(used) if used else None, acting_entropy)


def lr_lambda(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to ``min_ratio`` at ``total_steps``."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _optimizer(
    model: torch.nn.Module, s: LearnerSettings
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable parameters, and its warm-up + cosine schedule (:func:`lr_lambda`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=s.lr, betas=(s.adam_beta1, s.adam_beta2), weight_decay=s.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_lambda(step, s.warmup_steps, s.max_steps, s.min_lr_ratio)
    )
    return optimizer, scheduler


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
        if settings.beta > 0 and reference is None:
            raise ValueError(
                f"beta = {settings.beta} needs a reference model: pass reference=reference_model(model) "
                "(services.learner.policy) to Trainer, or set beta = 0 to train without the KL term"
            )
        self.model = model
        self.settings = settings
        self.reference = reference
        self.topology = topology or Topology()
        self.channel = Channel(self.topology)
        device_type = self.device.type
        self.share_prompts = resolve_share_prompts(settings.share_prompts, device_type, self.topology.distributed)
        # Under torchrun the ranks' pass counts must match (distributed.micro_batch_plan): padded, row-counted.
        self.token_budget = 0
        if not self.topology.distributed:
            sequence = settings.max_prompt_length + settings.max_completion_length
            self.token_budget = resolve_token_budget(
                settings.max_tokens_per_micro_batch, device_type, settings.micro_batch_size, sequence
            )
        if self.packed:
            check_attention(getattr(model.config, "_attn_implementation", None) or "sdpa", self.share_prompts)
        self.precision = resolve_precision(settings.param_dtype, settings.compute_dtype, settings.device)
        # Sharded, FSDP2's MixedPrecisionPolicy casts the gathered weights (distributed.shard_model).
        self.autocast = Precision() if self.topology.distributed else self.precision
        self.optimizer, self.scheduler = _optimizer(model, settings)
        self.step = 0
        self.objective = Objective.of(settings)
        self.entropy_coef = settings.entropy_coef  # moved by the adaptive controller
        self.last_entropy = math.inf  # TRL's start: the adaptive bonus waits for a first measurement

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def packed(self) -> bool:
        """Whether micro-batches are packed without padding (:mod:`services.learner.packing`)."""
        return self.token_budget > 0

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

    @property
    def pushes_parameters(self) -> bool:
        """Whether :meth:`full_weights` hands out the parameters themselves (one process, no LoRA), which a
        push may then move into its kept buffers (``weight_sync.placement.place_parameters``)."""
        return not self.topology.distributed and not hasattr(self.model, "get_base_model")

    @functools.cached_property
    def linear_weights(self) -> frozenset[str]:
        """Names of the weights in :meth:`full_weights` that only linear layers hold (they may travel
        transposed to CPU engines: ``WeightPusher.push``'s ``linear``)."""
        return linear_weight_names(self.model)

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

    def _plan(self, batch: TrainBatch, size: int = 0) -> tuple[TrainBatch, list[TrainBatch | None]]:
        """This rank's rows of ``batch`` and its forward passes of at most ``size`` rows, micro_batch_size when 0
        (None: a zero-weighted padding pass). Packed, a pass also holds at most the token budget, scaled by
        ``size`` / micro_batch_size (a no-grad pass of more rows takes proportionally more tokens)."""
        size = size or self.settings.micro_batch_size
        if not self.topology.distributed and not self.packed:
            return batch, list(batch.micro_batches(size))
        if not self.topology.distributed:
            prompts, completions = sequence_lengths(batch)
            plan = plan_micro_batches(
                prompts,
                completions,
                batch.group_index.tolist(),
                max_tokens=max(1, self.token_budget * size // self.settings.micro_batch_size),
                max_rows=size,
                share_prompts=self.share_prompts,
            )
            return batch, [batch.rows(rows) for rows in plan]
        local = batch.rows(distributed.split_rows(batch.size, self.topology))
        plan = distributed.micro_batch_plan(batch.size, size, self.topology)
        return local, [None if rows is None else local.rows(rows) for rows in plan]

    def _padding(self, batch: TrainBatch) -> TrainBatch:
        return batch.rows(slice(0, 1))

    def _forward(self, model: torch.nn.Module, mb: TrainBatch, entropy: EntropyMode) -> Stats:
        """Log-probabilities [b, T] (and entropies) of one pass, under the compute dtype's autocast."""
        with compute_context(self.autocast, self.device):
            return completion_logprobs_and_entropy(
                model,
                mb,
                share_prompts=self.share_prompts,
                entropy=entropy,
                chunk_tokens=self.settings.logprob_chunk_tokens,
                packed=self.packed,
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
                    logprobs, h = self._forward(model, mb or self._padding(batch), entropy)
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

    def _loss_mask(self, batch: TrainBatch) -> torch.Tensor:
        """[B, T] the tokens the loss sums over: completion tokens, minus truncated completions if masked."""
        truncated = batch.truncated if self.settings.mask_truncated_completions else None
        return active_mask(batch.completion_mask, truncated)

    def _entropy_threshold(self, entropies: torch.Tensor, local: TrainBatch) -> tuple[torch.Tensor, float]:
        """The batch-wide entropy quantile (all ranks' active tokens) and the count of tokens at or above it."""
        mask = self._loss_mask(local)
        active = entropies[mask.bool()].float().cpu()
        threshold = entropy_threshold(torch.cat(distributed.gather_objects(active)), self.settings.top_entropy_quantile)
        acting = float(high_entropy_mask(entropies, mask, threshold).sum())
        return threshold, distributed.sum_across({"acting": acting})["acting"]

    def _normalisers(self, batch: TrainBatch, local: TrainBatch, entropies: torch.Tensor | None) -> BatchNormalisers:
        """The whole batch's counts; with this rank's entropies [B_r, T], its entropy threshold too."""
        if entropies is None:
            return BatchNormalisers.of_batch(self._loss_mask(batch))
        threshold, acting = self._entropy_threshold(entropies, local)
        return BatchNormalisers.of_batch(self._loss_mask(batch), entropy_threshold=threshold, num_entropy_tokens=acting)

    def prepare(self, batch: TrainBatch) -> PreparedBatch:
        """Old logprobs, reference logprobs and importance weights of this rank's rows (no gradient, passes of
        ``no_grad_micro_batch_size``), and the batch's normalisers, with its entropy threshold when
        ``top_entropy_quantile`` < 1.

        With ``old_logprobs = "reuse"`` the old logprobs (and the importance weights that need them) come
        from the training forward instead: with one iteration the weights are the same, so are the numbers.
        """
        s = self.settings
        started = time.perf_counter()
        local, passes = self._plan(batch, s.no_grad_micro_batch_size)
        entropy: EntropyMode = "value" if s.top_entropy_quantile < 1.0 else "none"
        old: torch.Tensor | None = None
        entropies: torch.Tensor | None = None
        weights: torch.Tensor | None = None
        ref: torch.Tensor | None = None
        if s.old_logprobs == "recompute":
            old, entropies = self._logprobs_no_grad(self.model, batch, passes, entropy)
            weights = self._weights(old, local) if s.importance_correction else None
        elif entropy == "value":
            _, entropies = self._logprobs_no_grad(self.model, batch, passes, entropy)
        normalisers = self._normalisers(batch, local, entropies)
        seconds = time.perf_counter() - started
        if s.beta > 0 and self.reference is not None:  # __init__ makes sure of the reference
            real = [mb for mb in passes if mb is not None]  # the reference replica runs no collective
            ref, _ = self._logprobs_no_grad(self.reference, batch, real)
        return PreparedBatch(old, weights, ref, normalisers, seconds, self._logp_difference(local, old))

    def _step_config(self) -> Objective:
        """The loss config of this optimizer step: the adaptive bonus applies while the last entropy <= target."""
        s = self.settings
        coef = self.entropy_coef
        if s.adaptive_entropy and self.last_entropy > s.entropy_target:
            coef = 0.0
        return self.objective.model_copy(update={"entropy_coef": coef})

    def _old_and_weights(
        self, logprobs: torch.Tensor, mb: TrainBatch, rows: slice, prepared: PreparedBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A micro-batch's old logprobs [b, T] and importance weights [b, T] (or None): the prepared ones at
        ``rows``, or with ``old_logprobs = "reuse"`` those of the training forward ``logprobs``."""
        if prepared.old_logprobs is not None:
            weights = prepared.importance_weights
            return prepared.old_logprobs[rows], None if weights is None else weights[rows]
        old = logprobs.detach()
        return old, self._weights(old, mb) if self.settings.importance_correction else None

    def _micro_batch_backward(
        self, mb: TrainBatch, rows: slice, prepared: PreparedBatch, config: Objective, entropy_mode: EntropyMode
    ) -> tuple[LossOutputs, torch.Tensor | None]:
        """Forward, loss and backward of one micro-batch (``rows`` of this rank's); the importance weights used."""
        logprobs, entropies = self._forward(self.model, mb, entropy_mode)
        old, weights = self._old_and_weights(logprobs, mb, rows, prepared)
        inputs = LossInputs(
            logprobs=logprobs,
            old_logprobs=old,
            advantages=mb.advantages,
            mask=mb.completion_mask,
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
        logprobs, _ = self._forward(self.model, self._padding(batch), entropy_mode)
        (logprobs.sum() * 0.0).backward()

    def accumulate_gradients(self, batch: TrainBatch, prepared: PreparedBatch) -> StepResult:
        """Backward of the whole batch's loss, micro-batch by micro-batch; the metrics summed over ranks."""
        config = self._step_config()
        entropy_mode: EntropyMode = "grad" if config.entropy_coef != 0.0 else "value"
        sums = {"loss": 0.0, _ACTING_SUM: 0.0, _ACTING_TOKENS: 0.0}
        used: list[torch.Tensor] = []
        per_micro_batch: list[dict[str, float]] = []
        _, passes = self._plan(batch)
        start = 0
        for mb in passes:
            if mb is None:
                self._padding_backward(batch, entropy_mode)
                continue
            out, weights = self._micro_batch_backward(mb, slice(start, start + mb.size), prepared, config, entropy_mode)
            start += mb.size
            if weights is not None:
                used.append(weights)
            _add_outputs(sums, out, tokens=float(mb.completion_mask.sum()))
            if mb.completion_mask.any():
                per_micro_batch.append(out.metrics)
        result = _step_result(distributed.sum_across(sums), used, float(batch.completion_mask.sum()))
        every_rank = [m for ms in distributed.gather_objects(per_micro_batch) for m in ms]
        result.metrics.update(clip_ratio_extremes(every_rank))
        return result

    def _control_entropy(self, acting_entropy: float) -> dict[str, float]:
        """TRL's adaptive controller after the step; ``entropy_coef`` logged as TRL does."""
        s = self.settings
        if s.adaptive_entropy:
            self.last_entropy = acting_entropy
            self.entropy_coef = adaptive_entropy_coef(
                self.entropy_coef,
                self.last_entropy,
                target=s.entropy_target,
                delta=s.entropy_coef_delta,
                coef_min=s.entropy_coef_min,
                coef_max=s.entropy_coef_max,
            )
        return {"entropy_coef": self.entropy_coef} if s.adaptive_entropy or s.entropy_coef else {}

    def _logp_difference(self, local: TrainBatch, old: torch.Tensor | None) -> dict[str, float]:
        """|behaviour - recomputed old| logprob figures over every rank's completion tokens (collective)."""
        if old is None:
            return {}
        parts = distributed.gather_objects((local.behaviour_logprobs.cpu(), old.cpu(), local.completion_mask.cpu()))
        behaviour, recomputed, mask = (torch.cat(column) for column in zip(*parts, strict=True))
        return sampling_logp_difference_metrics(behaviour, recomputed, mask)

    def _importance_metrics(self, batch: TrainBatch, weights: torch.Tensor | None) -> dict[str, float]:
        if weights is None:
            return {}
        local, _ = self._plan(batch)
        pairs = distributed.gather_objects((weights.cpu(), local.completion_mask.cpu()))
        return importance_weight_metrics(torch.cat([w for w, _ in pairs]), torch.cat([m for _, m in pairs]))

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
        return [self._optimizer_step(batch, prepared) for _ in range(self.settings.num_iterations)]

    def _optimizer_step(self, batch: TrainBatch, prepared: PreparedBatch) -> dict[str, float]:
        """One optimizer step on the prepared batch; its metrics."""
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        result = self.accumulate_gradients(batch, prepared)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.model.parameters() if p.requires_grad], self.settings.max_grad_norm
        )
        if hasattr(grad_norm, "full_tensor"):  # a DTensor when the parameters are sharded
            grad_norm = grad_norm.full_tensor()
        learning_rate = float(self.scheduler.get_last_lr()[0])
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return {
            **result.metrics,
            **self._control_entropy(result.acting_entropy),
            "learning_rate": learning_rate,
            "grad_norm": float(grad_norm),
            "seconds/train": time.perf_counter() - started,
            "seconds/old_logprobs": prepared.seconds_old_logprobs,
            **self._importance_metrics(batch, result.importance_weights),
            **prepared.sampling_metrics,
        }
