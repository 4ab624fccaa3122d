"""``asyncgrpo run`` as the user runs it: ``python -m services.launcher run --config FILE`` in a process of its
own from the repository root, its output captured (tests and benchmarks start the pipeline this way)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.processes import ROOT


def run_pipeline(
    config: Path, timeout_s: float, env: dict[str, str] | None = None, cpus: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the launcher on ``config`` to its end (``env``: the whole environment, default this one's; ``cpus``:
    the launcher's own cores, ``taskset -c`` syntax; the services it starts take the cores their settings name)."""
    command = [sys.executable, "-m", "services.launcher", "run", "--config", str(config)]
    return subprocess.run(
        ["taskset", "-c", cpus, *command] if cpus else command,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
