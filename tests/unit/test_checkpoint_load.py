"""A checkpoint's ``trainer.pt`` is read with ``torch.load(weights_only=True)``: tensors and plain values only,
so a file someone else put in the checkpoint directory cannot run code in the learner. What the learner saves
there (AdamW and its schedule after real steps, every RNG's state) still comes back exactly, and so does a
``trainer.pt`` of the previous format (numpy's RNG key as an array)."""

from __future__ import annotations

import json
import math
import pickle
import random

import numpy as np
import pytest
import torch

from services.learner.checkpoint import _rng_state, load_state


def _checkpoint(tmp_path, trainer_state, rng) -> None:
    (tmp_path / "state.json").write_text(json.dumps({"step": 2, "policy_version": 2}))
    torch.save({"trainer": trainer_state, "rng": rng}, tmp_path / "trainer.pt")  # as save_checkpoint writes it


class _RunsCode:
    """What an attacker's pickle holds: unpickling it calls ``marker.write_text`` (it could call anything)."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (type(self.marker).write_text, (self.marker, "code ran"))


def test_a_trainer_pt_that_would_run_code_is_refused_and_runs_none(tmp_path):
    marker = tmp_path / "pwned"
    _checkpoint(tmp_path, {"step": 2, "payload": _RunsCode(marker)}, _rng_state())
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_state(tmp_path)
    assert not marker.exists()


def test_optimizer_schedule_and_rng_states_come_back_exactly(tmp_path):
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
    trainer_state = {
        "scheduler": scheduler.state_dict(),
        "step": 2,
        "ranks": 1,
        "entropy_control": {"entropy_coef": 0.01, "last_entropy": math.inf},
        "optimizer": optimizer.state_dict(),
    }
    np.random.seed(3)
    random.seed(3)
    torch.manual_seed(3)
    np.random.standard_normal()  # numpy keeps a cached Gaussian: saved too
    _checkpoint(tmp_path, trainer_state, _rng_state())
    expected = (np.random.standard_normal(), np.random.rand(), random.random(), torch.rand(2).tolist())
    np.random.seed(0)
    random.seed(0)
    torch.manual_seed(0)

    state, loaded = load_state(tmp_path)
    assert (np.random.standard_normal(), np.random.rand(), random.random(), torch.rand(2).tolist()) == expected
    assert state.step == 2 and loaded["entropy_control"]["last_entropy"] == math.inf
    restored = torch.optim.AdamW(model.parameters(), lr=1e-3)
    restored.load_state_dict(loaded["optimizer"])
    for before, after in zip(optimizer.state.values(), restored.state.values(), strict=True):
        assert torch.equal(before["exp_avg"], after["exp_avg"]) and torch.equal(before["step"], after["step"])
    assert restored.param_groups[0]["betas"] == (0.9, 0.99)
    assert loaded["scheduler"]["last_epoch"] == 2


def test_a_trainer_pt_of_the_previous_format_still_loads(tmp_path):
    np.random.seed(5)
    random.seed(5)
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    _checkpoint(tmp_path, {"step": 2}, rng)
    expected = (np.random.rand(), random.random())
    np.random.seed(0)
    random.seed(0)
    _, loaded = load_state(tmp_path)
    assert loaded == {"step": 2} and (np.random.rand(), random.random()) == expected
