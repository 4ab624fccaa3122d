"""compute_dtype = "auto": bf16 only where the CPU computes in it; the precision policy it resolves to."""

from __future__ import annotations

import torch

from services.learner.hardware import Precision, resolve_dtype, resolve_precision
from shared.cpu_features import cpu_flags, cpu_has_native_bf16, cpu_native_dtype

SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\nmodel name\t: X\n"
EPYC_AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu sse2 avx2 fma\n"
GRAVITON = "processor\t: 0\nFeatures\t: fp asimd bf16 sve\n"


def test_bf16_is_native_only_with_amx_or_avx512_bf16():
    assert cpu_flags(EPYC_AVX2) == {"fpu", "sse2", "avx2", "fma"}
    assert cpu_has_native_bf16(SAPPHIRE_RAPIDS)
    assert not cpu_has_native_bf16(EPYC_AVX2)
    assert not cpu_has_native_bf16(GRAVITON)  # "bf16" on Arm is not an x86 flag we rely on
    assert not cpu_has_native_bf16("")
    assert cpu_native_dtype(SAPPHIRE_RAPIDS) == "bfloat16" and cpu_native_dtype(EPYC_AVX2) == "float32"


def test_explicit_dtypes_are_kept_and_auto_resolves_on_this_machine():
    assert resolve_dtype("float32", "cpu") is torch.float32
    assert resolve_dtype("bfloat16", "cpu") is torch.bfloat16
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert resolve_dtype("auto", "cpu") is expected


def test_precision_keeps_float32_weights_and_lowers_only_compute():
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    auto = resolve_precision("float32", "auto", "cpu")
    assert auto == Precision(param=torch.float32, compute=expected)
    assert auto.mixed == (expected == torch.bfloat16)
    mixed = resolve_precision("float32", "bfloat16", "cpu")
    assert mixed.mixed and mixed.describe() == "float32 weights, bfloat16 compute"
    assert not resolve_precision("bfloat16", "bfloat16", "cpu").mixed  # bf16 weights: nothing to cast
