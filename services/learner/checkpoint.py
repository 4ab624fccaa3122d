"""Checkpoints a restarted learner resumes from without losing or repeating a group.

``<checkpoint_dir>/step-<N>/`` (by default ``runs/<run_name>/checkpoints/step-<N>``) holds:

* ``config.json``, ``model.safetensors``, tokenizer files: the full model (LoRA merged in), which
  transformers and vLLM load directly - late-joining generators start from it. These are the master
  weights as trained (float32 by default, ``param_dtype``); vLLM casts them at load to the generator's
  ``dtype``, and a resumed learner reads them back bit for bit;
* ``adapter/``: the LoRA adapter (float32), when training one;
* ``trainer.pt``: optimizer (one rank), scheduler and RNG states, as tensors and plain Python values only:
  it is read with ``torch.load(weights_only=True)``, which builds nothing else, so a ``trainer.pt`` put in the
  checkpoint directory by someone else cannot run code in the learner;
* ``optimizer/``: the optimizer's shards, when several ranks train (torch.distributed.checkpoint);
* ``state.json``: step, policy version, the feeder's position, the ids of every group trained so far and
  the run's counters;
* ``run.json``: the run's name, model and identity settings (:mod:`shared.runs`), copied from
  ``<checkpoint_dir>/run.json``: a checkpoint of another run, model or settings is not resumed.

A checkpoint is written to ``step-<N>.tmp`` and renamed when complete, so a crash mid-write leaves the
previous one intact; only the newest ``keep`` are kept.
"""

from __future__ import annotations

import importlib
import json
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.runs import RUN_FILE, STEP_PREFIX, list_checkpoints

__all__ = ["LearnerState", "list_checkpoints", "load_state", "save_checkpoint"]


@dataclass
class LearnerState:
    step: int = 0
    policy_version: int = 0
    feeder_epoch: int = 0
    feeder_index: int = 0
    trained_group_ids: list[str] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)


# What numpy arrays unpickle through (numpy 2 names): a trainer.pt written before RNG states were saved as
# tensors holds numpy's key as an array. Arrays are data, never code.
_LEGACY_NUMPY: list[Any] = [
    importlib.import_module("numpy._core.multiarray")._reconstruct,
    np.ndarray,
    np.dtype,
    np.dtypes.UInt32DType,
]


def _rng_state() -> dict[str, Any]:
    """Every RNG's state in types ``weights_only`` loading accepts (numpy's key as an int64 tensor)."""
    numpy = np.random.get_state(legacy=False)
    if not isinstance(numpy, dict) or numpy["bit_generator"] != "MT19937":
        raise TypeError(f"numpy's global RNG is {numpy!r:.40}, not the MT19937 a checkpoint saves")
    return {
        "torch": torch.get_rng_state(),
        "numpy": {
            "key": torch.from_numpy(numpy["state"]["key"].astype(np.int64)),
            "pos": int(numpy["state"]["pos"]),
            "has_gauss": int(numpy["has_gauss"]),
            "gauss": float(numpy["gauss"]),
        },
        "python": random.getstate(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    numpy = state["numpy"]
    if isinstance(numpy, dict):
        key = numpy["key"].numpy().astype(np.uint32)
        numpy = ("MT19937", key, numpy["pos"], numpy["has_gauss"], numpy["gauss"])
    np.random.set_state(numpy)  # a legacy checkpoint's tuple as it was saved
    random.setstate(state["python"])


def save_checkpoint(directory: Path, trainer, tokenizer, state: LearnerState, keep: int) -> Path:
    """Write ``step-<N>`` atomically and prune older checkpoints; returns its path.

    ``trainer`` is a :class:`~services.learner.trainer.Trainer`; on several ranks this runs on the leader
    and the other ranks take part in gathering the weights and writing the optimizer's shards.
    """
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{STEP_PREFIX}{state.step}"
    staging = directory / f"{STEP_PREFIX}{state.step}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    model = trainer.model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    with trainer.export.full_weights() as named:
        tensors = {name: tensor.contiguous().clone() for name, tensor in named}
    trainer.save_optimizer(staging / "optimizer")
    from safetensors.torch import save_file

    config = base.config.to_dict()
    config.pop("quantization_config", None)
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(staging)
    save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(staging)
    if hasattr(model, "peft_config"):
        model.save_pretrained(staging / "adapter")
    torch.save({"trainer": trainer.state_dict(), "rng": _rng_state()}, staging / "trainer.pt")
    (staging / "state.json").write_text(json.dumps(asdict(state)))
    if (directory / RUN_FILE).is_file():  # the run's identity travels with the checkpoint (resume_from)
        shutil.copyfile(directory / RUN_FILE, staging / RUN_FILE)
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    for old in list_checkpoints(directory)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_state(path: Path) -> tuple[LearnerState, dict]:
    """The learner state and trainer state of a checkpoint; restores the RNG states."""
    state = LearnerState(**json.loads((path / "state.json").read_text()))
    with torch.serialization.safe_globals(_LEGACY_NUMPY):
        saved = torch.load(path / "trainer.pt", weights_only=True)
    _set_rng_state(saved["rng"])
    return state, saved["trainer"]
