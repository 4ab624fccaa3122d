"""Which training dtype the hardware runs fast: ``dtype = "auto"`` resolves here.

bf16 is fast where the hardware computes in it: CUDA devices that support it, and CPUs with AMX or
AVX512-BF16 (measured on one such CPU: about 7x faster than float32 for SmolLM2-135M). Elsewhere it is
emulated and much slower: on an AVX2-only AMD EPYC here, one forward + backward of SmolLM2-135M over
8 x 170 tokens on one core took 232 s in bf16 and 14 s in float32. Only torch is imported, so the
benchmark environment (TRL's) can use it too.
"""

from __future__ import annotations

from pathlib import Path

import torch

BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first processor in a /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes in bf16 (AMX or AVX512-BF16); False when /proc/cpuinfo cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    return bool(cpu_flags(cpuinfo) & BF16_CPU_FLAGS)


def auto_dtype(device: str) -> str:
    """ "bfloat16" where ``device`` computes in it natively, else "float32"."""
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """The torch dtype of a ``dtype`` setting ("auto", "float32" or "bfloat16")."""
    if name == "auto":
        name = auto_dtype(device)
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
