"""Every benchmark's --quick mode runs and prints its table and ratio (no timing is asserted here), so a renamed
metric or a new record kind fails CI, not a user; a new script in bench/ must be listed here."""

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
    "logprob_chunks.py": "ratio chunked/whole (training peak MB):",
    "generator.py": "ratio service/vllm (tokens/s):",
    "push_mid_batch.py": "ratio with a push/without (batch s):",
}
# Scripts in bench/ that are not benchmarks: no ratio against a limit, so no --quick form.
NOT_BENCHES = {
    "record.py": "the results file's writer, imported by every bench",
    "profiling.py": "bench/learner.py's --profile (torch.profiler tables), run by its test below",
    "interference.py": "what two cores lose running at once, measured by async_vs_sync.py (its --quick too)",
    "trl_side.py": "TRL's side of vs_trl.py, run in .venv-bench",
    "trl_async_side.py": "TRL's asynchronous trainer's side of vs_trl.py, run in .venv-bench",
    "held_out.py": "vs_trl.py's judge of every system's final weights (run by vs_trl.py --quick on a tiny model)",
    "demo_tasks.py": "the feasibility probe that chose the demo's task (SmolLM2's base accuracy per task)",
    "demo_tools.py": "the feasibility probe that chose the tool demo's task; its pieces: tests/unit/test_demo_tools.py",
}


def test_every_script_in_bench_is_run_here_or_said_not_to_be_a_benchmark():
    scripts = {path.name for path in (ROOT / "bench").glob("*.py") if path.name != "__init__.py"}
    assert scripts == set(BENCHES) | set(NOT_BENCHES), "list each new bench/ script in BENCHES or NOT_BENCHES"


@pytest.mark.parametrize("script", sorted(BENCHES))
def test_bench_quick_prints_its_ratio(script, tmp_path):
    if script not in ("transport.py", "learner.py", "logprob_chunks.py"):
        pytest.importorskip("vllm")
    profile = ["--profile", str(tmp_path)] if script == "learner.py" else []  # bench/profiling.py too
    result = subprocess.run(
        [sys.executable, f"bench/{script}", "--quick", *profile],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith(BENCHES[script]), result.stdout[-2000:]
    for loop in ("bare", "ours") if profile else ():
        table = (tmp_path / f"{loop}.txt").read_text()
        assert table.startswith(f"{loop}: wall ") and "aten::mm" in table, table[:2000]
    if script == "async_vs_sync.py":  # bench/interference.py's line, measured on the phases' cores
        assert "a cache-resident matmul keeps" in result.stdout, result.stdout[-2000:]
    print(f"\n{script}: {last}")
