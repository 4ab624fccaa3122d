"""Every benchmark's --quick mode runs and prints its table and ratio (no timing is asserted here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.processes import ROOT

BENCHES = {
    "transport.py": "ratio ours/raw (groups/s):",
    "learner.py": "ratio ours/bare (tokens/s):",
    "weight_push.py": "ratio ours/raw:",
    "async_vs_sync.py": "ratio measured/ideal:",
    "multi_turn.py": "ratio multi/single (tokens/s):",
    "vs_trl.py": "vs_trl quick (ours only):",
}


@pytest.mark.parametrize("script", sorted(BENCHES))
def test_bench_quick_prints_its_ratio(script):
    if script in ("weight_push.py", "async_vs_sync.py", "multi_turn.py", "vs_trl.py"):
        pytest.importorskip("vllm")
    result = subprocess.run(
        [sys.executable, f"bench/{script}", "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=1200
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith(BENCHES[script]), result.stdout[-2000:]
    print(f"\n{script}: {last}")
