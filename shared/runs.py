"""Run directories, and which checkpoint a starting learner may continue from.

A run is named (``learner.run_name``, a timestamp by default) and owns ``<runs_dir>/<run_name>/``: its
``checkpoints/``, ``metrics.jsonl`` (with ``batches.jsonl``, ``dropped.jsonl``, ``tensorboard/``) and, under
``asyncgrpo run``, the services' ``logs/``. The learner writes every resolved setting (secrets masked) to
``<run_dir>/settings.toml`` and logs only :func:`startup_summary`; it writes the run's identity to
``<checkpoint_dir>/run.json`` when it starts, and every checkpoint carries a copy: the run's name, its model
(path and a fingerprint of its files) and the settings that make a checkpoint another experiment when they
change (:data:`IDENTITY_SETTINGS`).

:func:`checkpoint_to_resume` is the one rule, applied by ``asyncgrpo run`` before it starts anything and by
the learner itself: a run continues from its own newest checkpoint; while it has none, from ``resume_from``
if set; else it starts fresh. A checkpoint of another run, of another model, or written with other
identity settings is refused with the reason and the fix. Torch-free, so the launcher can use it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from shared.config.learner import LearnerSettings

log = logging.getLogger(__name__)

RUN_FILE = "run.json"
SETTINGS_FILE = "settings.toml"  # config.toml beside it is the launcher's: the file the run was started from
STEP_PREFIX = "step-"
# Changing one of these makes a checkpoint's continuation a different experiment (or unloadable: LoRA, dtype).
IDENTITY_SETTINGS = (
    "group_size",
    "loss_type",
    "loss_aggregation",
    "ratio_level",
    "epsilon_low",
    "epsilon_high",
    "beta",
    "lora_rank",
    "lora_alpha",
    "lora_target_modules",
    "param_dtype",
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_SAMPLE_BYTES = 1 << 16  # read from the start, middle and end of each weights file: cheap, and differs by model


class ResumeRefused(ValueError):
    """A checkpoint this run must not continue from; the message says why and what to change."""


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints (``step-N``, not ``step-N.tmp``) in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX) and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX) :]))


def model_fingerprint(model: str) -> str:
    """A short hash of a model directory's config and weight files (name, size, sampled bytes); a model
    that is not a local directory (a hub name) is identified by its name."""
    path = Path(model)
    if not path.is_dir():
        return f"name:{model}"
    digest = hashlib.sha256()
    for file in sorted(path.iterdir()):
        if file.name == "config.json" or file.suffix in _WEIGHT_SUFFIXES:
            digest.update(f"{file.name}:{file.stat().st_size}:".encode())
            digest.update(_sample(file))
    return digest.hexdigest()[:16]


def _sample(file: Path) -> bytes:
    size = file.stat().st_size
    with file.open("rb") as handle:
        if size <= 3 * _SAMPLE_BYTES:
            return handle.read()
        chunks = []
        for offset in (0, size // 2, size - _SAMPLE_BYTES):
            handle.seek(offset)
            chunks.append(handle.read(_SAMPLE_BYTES))
        return b"".join(chunks)


def run_identity(settings: LearnerSettings) -> dict[str, Any]:
    """What a checkpoint records about the run that wrote it (JSON-ready)."""
    chosen = {name: getattr(settings, name) for name in IDENTITY_SETTINGS}
    chosen["data.source"] = settings.data.source
    model = Path(settings.model)
    return json.loads(
        json.dumps(
            {
                "run_name": settings.run_name,
                "model": str(model.resolve()) if model.exists() else settings.model,
                "model_fingerprint": model_fingerprint(settings.model),
                "settings": chosen,
            }
        )
    )


def write_run_file(settings: LearnerSettings, identity: dict[str, Any]) -> Path:
    """``<checkpoint_dir>/run.json``, which every checkpoint of the run copies."""
    directory = Path(settings.checkpoint_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / RUN_FILE
    path.write_text(json.dumps(identity, indent=2) + "\n")
    return path


def settings_path(settings: LearnerSettings) -> Path:
    """``<run_dir>/settings.toml``: where the learner writes its resolved settings when it starts."""
    return settings.run_dir / SETTINGS_FILE


def startup_summary(settings: LearnerSettings) -> str:
    """The learner's one start-up line: model, objective, batch arithmetic and device; the rest of its
    settings are in :func:`settings_path`."""
    objective = settings.algorithm or f"loss_type {settings.loss_type}"
    return (
        f"model {settings.model} on {settings.device} ({settings.param_dtype} weights, "
        f"{settings.compute_dtype} compute); {objective}, beta {settings.beta:g}, lr {settings.lr:g}, "
        f"old_logprobs {settings.old_logprobs}; {settings.groups_per_step} groups x G={settings.group_size} = "
        f"{settings.completions_per_step} completions a step in micro-batches of {settings.micro_batch_size}, "
        f"max_staleness {settings.max_staleness}, {settings.max_steps} steps; "
        f"every setting: {settings_path(settings)}"
    )


def read_identity(checkpoint: Path) -> dict[str, Any] | None:
    """The identity a checkpoint records (None: written before identities were, or by hand)."""
    path = checkpoint / RUN_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def identity_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Each way ``current`` differs from a checkpoint's ``saved`` identity (the run's name aside); a setting
    the checkpoint does not record is not compared."""
    problems = []
    if saved.get("model_fingerprint") != current["model_fingerprint"]:
        problems.append(
            f"model: the checkpoint was trained from {saved.get('model')!r} (fingerprint "
            f"{saved.get('model_fingerprint')}), this run's is {current['model']!r} "
            f"(fingerprint {current['model_fingerprint']})"
        )
    recorded = saved.get("settings", {})
    for name, value in current["settings"].items():
        if name in recorded and recorded[name] != value:
            problems.append(f"{name}: the checkpoint's is {recorded[name]!r}, this run's {value!r}")
    return problems


def checkpoint_to_resume(settings: LearnerSettings, identity: dict[str, Any]) -> Path | None:
    """The checkpoint this run continues from, None to start fresh; :class:`ResumeRefused` when the run
    would continue from a checkpoint that is not its own or not like it."""
    own = list_checkpoints(Path(settings.checkpoint_dir))
    if own:
        saved = read_identity(own[-1])
        if saved is not None or not settings.resume_from:
            return _own_checkpoint(settings, identity, own[-1], saved)
    if settings.resume_from:
        return _resume_from(settings, identity)
    return None


def _own_checkpoint(
    settings: LearnerSettings, identity: dict[str, Any], newest: Path, saved: dict[str, Any] | None
) -> Path:
    where = f"{newest.parent} (newest {newest.name})"
    if not settings.resume:
        raise ResumeRefused(
            f"run {settings.run_name!r} already has checkpoints in {where} and resume = false: choose another "
            "run_name (or checkpoint_dir) for a new run, or set resume = true to continue this one"
        )
    if saved is None:
        raise ResumeRefused(
            f"{newest} records no run (it was written before checkpoints recorded their run, model and "
            f"settings), so it cannot be checked: set resume_from = '{newest}' to continue from it anyway, "
            "or choose another checkpoint_dir for a new run"
        )
    if saved.get("run_name") != settings.run_name:
        raise ResumeRefused(
            f"{where} holds checkpoints of run {saved.get('run_name')!r}, not of this run "
            f"{settings.run_name!r}: set run_name = '{saved.get('run_name')}' to continue that run, or choose "
            f"another checkpoint_dir for a new one (with resume_from = '{newest}' to start from it)"
        )
    _refuse_differences(newest, saved, identity)
    return newest


def _resume_from(settings: LearnerSettings, identity: dict[str, Any]) -> Path:
    path = Path(settings.resume_from)
    checkpoint = path if (path / "state.json").is_file() else next(reversed(list_checkpoints(path)), None)
    if checkpoint is None:
        raise ResumeRefused(
            f"resume_from = {settings.resume_from!r} is neither a checkpoint (a step-N directory with state.json) "
            "nor a directory holding one"
        )
    saved = read_identity(checkpoint)
    if saved is None:
        log.warning("%s records no run, model or settings: resuming from it unchecked (resume_from)", checkpoint)
        return checkpoint
    _refuse_differences(checkpoint, saved, identity)
    return checkpoint


def _refuse_differences(checkpoint: Path, saved: dict[str, Any], identity: dict[str, Any]) -> None:
    problems = identity_differences(saved, identity)
    if problems:
        raise ResumeRefused(
            f"checkpoint {checkpoint} is not this run's to continue:\n  - "
            + "\n  - ".join(problems)
            + "\nSet those back to continue it; to start a new run from its weights instead, give it a new "
            f"run_name and set model = '{checkpoint}' (step count and optimizer state start over)"
        )
