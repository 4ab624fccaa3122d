"""The generator's late-join choice: the learner's latest checkpoint when this replica can read it, else the
base model at version 0."""

from __future__ import annotations

import subprocess
import sys

from services.generator.startup import initial_weights
from shared.records import CheckpointAnnouncement


def test_a_late_replica_loads_the_announced_checkpoint(tmp_path):
    checkpoint = tmp_path / "step-00012"
    checkpoint.mkdir()
    announced = CheckpointAnnouncement(policy_version=12, step=12, path=str(checkpoint))
    assert initial_weights(announced, "Qwen/Qwen2.5-0.5B-Instruct") == (str(checkpoint), 12)


def test_without_a_readable_checkpoint_the_base_model_at_version_0(tmp_path):
    assert initial_weights(None, "Qwen/Qwen2.5-0.5B-Instruct") == ("Qwen/Qwen2.5-0.5B-Instruct", 0)
    elsewhere = CheckpointAnnouncement(policy_version=7, step=7, path=str(tmp_path / "on-another-host"))
    assert initial_weights(elsewhere, "base") == ("base", 0)


def test_start_up_decisions_load_without_vllm():
    """Leasing and the late-join choice run before vLLM is imported (a refused replica never loads it)."""
    code = "import sys, services.generator.startup; assert 'vllm' not in sys.modules and 'torch' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
