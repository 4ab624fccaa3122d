"""The CPU mixed-precision test on CUDA: bf16 compute over float32 master weights keeps the update.

5 steps at lr 1e-6 on the tiny Llama: >= 90% of the master weights move, and the update is within 30%
(relative L2) of the float32 run's on the same batch; bf16 weights (the old behaviour) lose it.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.mixed_precision import moved_fraction, relative_l2, train_update, update_of
from tests.support.tiny_model import build_tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=3, logit_scale=1.0)


def test_bf16_compute_over_float32_master_weights_keeps_the_update_on_cuda(tiny, capsys):
    reference = update_of(*train_update(tiny, "cuda", "float32", "float32"))
    before, after = train_update(tiny, "cuda", "float32", "bfloat16")
    assert all(t.dtype == torch.float32 and t.is_cuda for t in after.values())
    moved = moved_fraction(before, after)
    distance = relative_l2(update_of(before, after), reference)
    bf16_before, bf16_after = train_update(tiny, "cuda", "bfloat16", "bfloat16")
    bf16_moved = moved_fraction(bf16_before, bf16_after)
    with capsys.disabled():
        print(
            f"\ncuda {torch.cuda.get_device_name()}: bf16 compute moved {moved:.4f}, relative L2 {distance:.4f}; "
            f"bf16 weights moved {bf16_moved:.4f}"
        )
    assert moved >= 0.90
    assert 1e-4 < distance <= 0.30
    assert bf16_moved < 0.10
