"""The learner's precision policy, and which compute dtype the hardware runs fast (``compute_dtype = "auto"``).

Master weights and AdamW state stay in ``param_dtype`` (float32 by default): an AdamW step at lr 1e-6
changes a weight of size ~0.02 by less than half a bf16 unit in the last place, so bf16 weights would round
most updates away. The forward and backward run in ``compute_dtype``: autocast on one device, FSDP2's
``MixedPrecisionPolicy`` under torchrun (:mod:`services.learner.distributed`); gradients stay (and are
reduced) in float32.

bf16 is fast where the hardware computes in it: CUDA devices that support it, and CPUs with AMX or
AVX512-BF16 (measured on one such CPU: about 7x faster than float32 for SmolLM2-135M); elsewhere it is
emulated and much slower (:mod:`shared.cpu_features`, which reads the CPU's flags). Only torch and that module
are imported, so the benchmark environment (TRL's) can use it too.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from shared.cpu_features import cpu_native_dtype


def auto_dtype(device: str) -> str:
    """ "bfloat16" where ``device`` computes in it natively, else "float32"."""
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    return cpu_native_dtype()


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """The torch dtype of a dtype setting ("auto", "float32" or "bfloat16")."""
    if name == "auto":
        name = auto_dtype(device)
    return _DTYPES[name]


@dataclass(frozen=True)
class Precision:
    """Master weights (and optimizer state) in ``param``, forward and backward in ``compute``."""

    param: torch.dtype = torch.float32
    compute: torch.dtype = torch.float32

    @property
    def mixed(self) -> bool:
        """Whether compute runs in a lower precision than the master weights (autocast / FSDP casting)."""
        return self.compute != self.param and self.compute in (torch.bfloat16, torch.float16)

    def describe(self) -> str:
        name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
        return f"{name.get(self.param, self.param)} weights, {name.get(self.compute, self.compute)} compute"


def resolve_precision(param_dtype: str, compute_dtype: str, device: str) -> Precision:
    """The :class:`Precision` of the ``param_dtype`` and ``compute_dtype`` settings on ``device``.

    Compute never runs in a higher precision than the weights: bf16 weights compute in bf16.
    """
    param = resolve_dtype(param_dtype, device)
    compute = resolve_dtype(compute_dtype, device)
    if param == torch.bfloat16:
        compute = torch.bfloat16
    return Precision(param=param, compute=compute)


def compute_context(precision: Precision, device: torch.device | str) -> AbstractContextManager:
    """Autocast to the compute dtype when it is lower than the weights' (one device); else nothing.

    Under autocast, matrix multiplications run in bf16 while the weights, their gradients and the
    numerically sensitive ops (softmax, norms, losses) stay float32.
    """
    if not precision.mixed:
        return nullcontext()
    device_type = torch.device(device).type
    return torch.autocast(device_type=device_type, dtype=precision.compute)
