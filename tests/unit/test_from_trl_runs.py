"""A translated TRL or verl recipe names a run, not directories (issue 64, item 2): ``output_dir`` becomes the
default run name, so ``asyncgrpo run --run-name NAME`` puts checkpoints and metrics together under NAME, a
second experiment from the same file gets its own directory, and a run started again under its name resumes
(resume is the default, as the docs say), instead of being refused with another run's checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.launcher.interop.trl import from_trl
from services.launcher.interop.verl import from_verl
from shared.config.learner import LearnerSettings
from shared.runs import checkpoint_to_resume, run_identity, write_run_file
from tests.unit.test_translation import trl_defaults

TRL_RECIPE = {
    "model_name_or_path": "some/model",
    "output_dir": "experiments/conv-grpo",
    "per_device_train_batch_size": 8,
    "num_generations": 8,
    "max_steps": 20,
    "learning_rate": 1e-6,
}


def _model(tmp: Path) -> Path:
    directory = tmp / "model"
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "model.safetensors").write_bytes(b"weights")
    return directory


def _settings(tmp: Path, learner: dict, **overrides) -> LearnerSettings:
    """The translated [learner] table as `asyncgrpo run` resolves it, from ``tmp`` (the working directory)."""
    table = {**learner, "model": str(_model(tmp)) if not (tmp / "model").exists() else str(tmp / "model")}
    table["runs_dir"] = str(tmp / table.get("runs_dir", "runs"))
    return LearnerSettings(**{**table, **overrides})


def _checkpoint(settings: LearnerSettings, step: int) -> None:
    write_run_file(settings, run_identity(settings))
    path = Path(settings.checkpoint_dir) / f"step-{step}"
    path.mkdir(parents=True)
    (path / "state.json").write_text(json.dumps({"step": step}))
    (path / "run.json").write_text((Path(settings.checkpoint_dir) / "run.json").read_text())


def test_output_dir_is_the_default_run_name_and_resume_is_ours(tmp_path):
    learner = from_trl(dict(TRL_RECIPE), trl_defaults()).tables["learner"]
    assert (learner["run_name"], learner["runs_dir"]) == ("conv-grpo", "experiments")
    assert not {"checkpoint_dir", "log_dir", "resume"} & set(learner)
    settings = _settings(tmp_path, learner)
    assert settings.resume is True
    assert Path(settings.checkpoint_dir) == tmp_path / "experiments" / "conv-grpo" / "checkpoints"
    assert Path(settings.log_dir) == tmp_path / "experiments" / "conv-grpo"


def test_runs_named_from_one_translated_file_each_own_their_directory_and_resume(tmp_path):
    learner = from_trl(dict(TRL_RECIPE), trl_defaults()).tables["learner"]
    conv1 = _settings(tmp_path, learner, run_name="conv1")  # asyncgrpo run --run-name conv1
    assert Path(conv1.checkpoint_dir).parent == Path(conv1.log_dir) == conv1.run_dir
    _checkpoint(conv1, 20)
    again = _settings(tmp_path, learner, run_name="conv1", max_steps=40)  # the same run, trained longer
    assert checkpoint_to_resume(again, run_identity(again)) == Path(conv1.checkpoint_dir) / "step-20"
    std1 = _settings(tmp_path, learner, run_name="std1")  # a second experiment from the same file
    assert checkpoint_to_resume(std1, run_identity(std1)) is None


@pytest.mark.parametrize(
    "value, resume", [(None, None), (True, True), ("true", True), (False, False), ("false", False)]
)
def test_resume_from_checkpoint(value, resume):
    fields = dict(TRL_RECIPE, resume_from_checkpoint=value)
    assert from_trl(fields, trl_defaults()).tables["learner"].get("resume") is resume


def test_an_output_dir_that_names_no_run_is_left_to_the_run_name():
    result = from_trl(dict(TRL_RECIPE, output_dir="./"), trl_defaults())
    assert "run_name" not in result.tables["learner"]
    assert any("names no run" in note for note in result.notes)


def test_verl_default_local_dir_is_the_run_name_too():
    flat = {
        "trainer.default_local_dir": "ckpts/proj/exp-1",
        "actor_rollout_ref.model.path": "some/model",
        "actor_rollout_ref.rollout.n": 8,
        "data.train_batch_size": 4,
        "algorithm.adv_estimator": "grpo",
    }
    learner = from_verl(flat, None).tables["learner"]
    assert (learner["run_name"], learner["runs_dir"]) == ("exp-1", "ckpts/proj")
    assert "checkpoint_dir" not in learner
