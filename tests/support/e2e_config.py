"""The ``[learner]`` and ``[data]`` tables the end-to-end runs share (tests/e2e/test_faults.py,
test_multi_turn.py, test_multi_turn_faults.py): groups of 4, 2 per step, one micro-batch, staleness 2, no
progress bar, one generator enough to start, prompts from ``builtin:arithmetic``. Each run adds its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The multi-turn runs (test_multi_turn*.py): room for three turns of the tool-calling tiny model.
TOOL_RUN: dict[str, Any] = {"lr": 1e-3, "max_completion_length": 256, "max_prompt_length": 1024}


def learner_tables(model: Path, steps: int, **settings: Any) -> str:
    """TOML text of ``[learner]`` (the shared settings, then ``settings``, which may override them) and
    ``[data]``."""
    values: dict[str, Any] = {
        "model": str(model),
        "group_size": 4,
        "groups_per_step": 2,
        "micro_batch_size": 8,
        "max_steps": steps,
        "max_staleness": 2,
        "progress": "off",
        "min_generators": 1,
        **settings,
    }
    lines = [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    return "\n".join(["[learner]", *lines, "", "[data]", 'source = "builtin:arithmetic"', ""])
