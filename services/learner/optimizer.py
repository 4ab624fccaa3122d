"""The optimizer step and its precision: AdamW over the trainable parameters, the learning-rate schedule,
gradient clipping, and the dtypes the weights and the forwards use.

Precision (:mod:`services.learner.hardware`): the weights, their gradients and AdamW's state are in
``param_dtype`` (float32); forwards run in ``compute_dtype`` under autocast on one device (FSDP2 casts the
gathered weights itself under torchrun, so there the autocast is a no-op :class:`Precision`).

On one rank the optimizer's state travels in the trainer's state dict; on several, each rank writes and
reads its own shards under a checkpoint's ``optimizer/`` (:func:`distributed.save_optimizer`). A resumed run
follows the schedule its own settings describe (``lr``, ``warmup_steps``, ``max_steps``, ``min_lr_ratio``)
from the restored step on, also from the first resumed step: a run resumed with a longer ``max_steps`` decays
over the new length (:meth:`OptimizerStep.load_state_dict`).

On one process on the CPU, AdamW runs PyTorch's fused kernel (:func:`fused_adamw`): one pass over each
parameter's memory instead of one per operation, about 6x faster on SmolLM2-135M (0.07 s against 0.45 s a step
on one AVX-512 core; on the demo's two cores it had been about a quarter of the learner's step beside the
generator, whose decoding competes for the same memory bandwidth). Its results differ from the per-tensor loop by
rounding (float32: a few ulp after several steps). The kernel walks each tensor's memory flat, whatever its
strides, so it runs only while every parameter, gradient and moment is contiguous (checked each step, else the
per-tensor loop), and the learner places only contiguous parameters in the weight push's buffers while it is on
(:class:`services.learner.weight_publisher.WeightPublisher`).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from services.learner import distributed
from services.learner.distributed import Topology
from services.learner.hardware import Precision, resolve_precision
from shared.config.learner import LearnerSettings
from shared.finite import step_problem

log = logging.getLogger(__name__)

# In a step's figures: 1 where the step was not applied (its loss or gradient norm was not finite).
NONFINITE_STEP = "step_not_applied"


def fused_adamw(params: list[torch.Tensor], distributed_run: bool) -> bool:
    """Whether AdamW runs fused: every trainable parameter a plain (not sharded) floating-point CPU tensor, one
    process. On CUDA PyTorch's default (the multi-tensor loop) stays; sharded parameters are DTensors."""
    return (
        bool(params)
        and not distributed_run
        and all(p.device.type == "cpu" and p.dtype in _FUSED_DTYPES and type(p.data) is torch.Tensor for p in params)
    )


_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def lr_lambda(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to ``min_ratio`` at ``total_steps``."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class OptimizerStep:
    """AdamW and its warm-up + cosine schedule (:func:`lr_lambda`) over ``model``'s trainable parameters, the
    precision they train in, and the count of steps taken (the policy version)."""

    def __init__(self, model: torch.nn.Module, settings: LearnerSettings, topology: Topology) -> None:
        s = settings
        self.model, self.topology, self.max_grad_norm, self.peak_lr = model, topology, s.max_grad_norm, s.lr
        self.precision = resolve_precision(s.param_dtype, s.compute_dtype, s.device)
        # Sharded, FSDP2's MixedPrecisionPolicy casts the gathered weights (distributed.shard_model).
        self.autocast = Precision() if topology.distributed else self.precision
        params = [p for p in model.parameters() if p.requires_grad]
        self.fused = fused_adamw(params, topology.distributed)
        self.warned_loop = False  # the fall-back from the fused kernel is logged once
        self.adamw = torch.optim.AdamW(
            params,
            lr=s.lr,
            betas=(s.adam_beta1, s.adam_beta2),
            weight_decay=s.weight_decay,
            fused=self.fused or None,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.adamw, lambda step: lr_lambda(step, s.warmup_steps, s.max_steps, s.min_lr_ratio)
        )
        self.step = 0

    def zero_grad(self) -> None:
        self.adamw.zero_grad(set_to_none=True)

    def apply(self, loss: float) -> dict[str, float]:
        """Clip the accumulated gradients, step AdamW and the schedule; ``learning_rate`` (the one this step
        used) and ``grad_norm`` (before clipping). ``loss``: the step's, summed over ranks.

        A step whose ``loss`` or gradient norm is not finite (:func:`shared.finite.step_problem`) is not
        applied: the gradients are dropped and the weights, AdamW's state, the schedule and the step count stay
        as they were; the figures then hold ``NONFINITE_STEP`` = 1. Both values are the same on every rank (the
        norm is the whole model's), so every rank skips the same steps."""
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.model.parameters() if p.requires_grad], self.max_grad_norm
        )
        if hasattr(grad_norm, "full_tensor"):  # a DTensor when the parameters are sharded
            grad_norm = grad_norm.full_tensor()
        learning_rate = float(self.adamw.param_groups[0]["lr"])
        if step_problem(loss, float(grad_norm)):
            self.zero_grad()
            return {"learning_rate": learning_rate, "grad_norm": float(grad_norm), NONFINITE_STEP: 1.0}
        if self.fused:  # PyTorch's fused CPU kernel walks each tensor's memory flat, whatever its strides
            for group in self.adamw.param_groups:
                flat = all(self._flat(p) for p in group["params"])
                if not flat and not self.warned_loop:
                    log.warning(
                        "AdamW takes its per-tensor loop (about 6x slower than the fused kernel on the CPU): a "
                        "parameter, its gradient or a moment is not contiguous; said once"
                    )
                    self.warned_loop = True
                group["fused"] = flat or None
        self.adamw.step()
        self.scheduler.step()
        self.step += 1
        return {"learning_rate": learning_rate, "grad_norm": float(grad_norm)}

    def _flat(self, param: torch.Tensor) -> bool:
        """Whether a parameter, its gradient and its AdamW moments are contiguous: the fused kernel updates
        element i of each at its memory offset i, so a parameter that lives in a transposed or sliced view (the
        weight push's buffers, :func:`weight_sync.send_buffers.place_parameters`) takes the per-tensor loop."""
        state = self.adamw.state.get(param, {})
        tensors = [param, param.grad, state.get("exp_avg"), state.get("exp_avg_sq")]
        return all(t is None or t.is_contiguous() for t in tensors)

    def make_state(self) -> None:
        """AdamW's state made now as its first step would make it (both moments zero, a step count of 0), so
        that the first step finds its memory made (``services.learner.train_loop.WarmUp``). The state comes from an
        AdamW step at learning rate 0 on zero gradients, which moves no weight (the decay multiplies by
        exactly 1, the update adds exactly 0) and leaves both moments zero; the step count goes back to 0.
        Nothing is made where the optimizer has state already (a resumed run)."""
        params = [p for group in self.adamw.param_groups for p in group["params"]]
        if not params or any(self.adamw.state.get(p) for p in params):
            return
        rates = [group["lr"] for group in self.adamw.param_groups]
        for p in params:
            p.grad = torch.zeros_like(p)
        try:
            for group in self.adamw.param_groups:
                group["lr"] = 0.0
            self.adamw.step()
        finally:
            for group, rate in zip(self.adamw.param_groups, rates, strict=True):
                group["lr"] = rate
            for p in params:
                p.grad = None
        for p in params:
            self.adamw.state[p]["step"].zero_()

    def state_dict(self) -> dict:
        """Scheduler and step; the optimizer too on one rank (on several, :meth:`save` writes it)."""
        state = {"scheduler": self.scheduler.state_dict(), "step": self.step, "ranks": self.topology.world_size}
        if not self.topology.distributed:
            state["optimizer"] = self.adamw.state_dict()
        return state

    def load_state_dict(self, state: dict, checkpoint: Path | None = None) -> None:
        """Restore :meth:`state_dict`; on several ranks the optimizer comes from ``checkpoint``/optimizer."""
        if self.topology.distributed:
            if checkpoint is None:
                raise ValueError("a sharded learner restores its optimizer from a checkpoint directory")
            distributed.load_optimizer(self.model, self.adamw, checkpoint / "optimizer")
        elif "optimizer" in state:  # with this learner's choice of kernel, not the checkpoint's run's
            saved = state["optimizer"]
            groups = [{**group, "fused": self.fused or None} for group in saved["param_groups"]]
            self.adamw.load_state_dict({**saved, "param_groups": groups})
        else:
            raise ValueError(
                f"this checkpoint was written by {state.get('ranks')} learner ranks (its optimizer is sharded "
                "under optimizer/); resume it with torchrun, or start from its model with resume = false"
            )
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self._follow_schedule()

    def _follow_schedule(self) -> None:
        """Set the learning rates to this run's schedule at the restored step. A checkpoint's optimizer and
        scheduler carry the rate its own run's settings gave for the next step; after a change of
        ``max_steps`` (or ``lr``, ``warmup_steps``, ``min_lr_ratio``) that is the old schedule's. The
        expression is LambdaLR's own, so the rate equals a fresh schedule's at this step exactly."""
        step, saved = self.scheduler.last_epoch, self.adamw.param_groups[0]["lr"]
        self.scheduler.base_lrs = [self.peak_lr] * len(self.adamw.param_groups)
        for group, schedule in zip(self.adamw.param_groups, self.scheduler.lr_lambdas, strict=True):
            group["initial_lr"] = self.peak_lr
            group["lr"] = self.peak_lr * schedule(step)
        if self.adamw.param_groups[0]["lr"] != saved:
            log.info(
                "resumed at step %d with this run's schedule: learning rate %.6g (the checkpoint's schedule: %.6g)",
                step,
                self.adamw.param_groups[0]["lr"],
                saved,
            )

    def save(self, path: Path) -> None:
        """On several ranks: this rank's optimizer shards under ``path`` (every rank calls it)."""
        distributed.save_optimizer(self.model, self.adamw, path)
