"""Run directories (issue 16, finding 5): a run owns ``<runs_dir>/<run_name>/``; it continues only from its own
checkpoints or ``resume_from``, and a checkpoint of another run, model or settings is refused with the reason;
metrics are not appended across runs. Pure: fabricated checkpoints (``state.json`` + ``run.json``); the real
learner's resume is tested in ``test_learner_resume_refusals`` with a tiny model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from services.learner.metrics.metric_sinks import MetricsSink
from shared.config.learner import LearnerSettings
from shared.runs import RUN_FILE, ResumeRefused, checkpoint_to_resume, run_identity
from shared.telemetry import MetricsGauges


def _model(tmp: Path, name: str = "model", weights: bytes = b"weights-1") -> Path:
    directory = tmp / name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "model.safetensors").write_bytes(weights)
    return directory


def _settings(tmp: Path, model: Path, **overrides) -> LearnerSettings:
    fields = dict(model=str(model), runs_dir=str(tmp / "runs"), group_size=4, groups_per_step=2, micro_batch_size=4)
    return LearnerSettings(**{**fields, **overrides})


def _checkpoint(settings: LearnerSettings, step: int, *, identity: bool = True) -> Path:
    """A checkpoint of ``settings``' run as the learner leaves it (the files the resume rule reads)."""
    path = Path(settings.checkpoint_dir) / f"step-{step}"
    path.mkdir(parents=True)
    (path / "state.json").write_text(json.dumps({"step": step}))
    if identity:
        (path / RUN_FILE).write_text(json.dumps(run_identity(settings)))
    return path


def test_a_run_owns_its_directory_and_explicit_directories_are_kept(tmp_path):
    model = _model(tmp_path)
    settings = _settings(tmp_path, model, run_name="exp-1")
    run_dir = tmp_path / "runs" / "exp-1"
    assert settings.run_dir == run_dir
    assert Path(settings.checkpoint_dir) == run_dir / "checkpoints" and Path(settings.log_dir) == run_dir
    explicit = _settings(tmp_path, model, checkpoint_dir=str(tmp_path / "ckpt"), log_dir=str(tmp_path / "logs"))
    assert (explicit.checkpoint_dir, explicit.log_dir) == (str(tmp_path / "ckpt"), str(tmp_path / "logs"))
    default = _settings(tmp_path, model)
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{4}", default.run_name), default.run_name
    assert _settings(tmp_path, model).run_name == default.run_name  # loading twice gives the same settings
    with pytest.raises(ValidationError, match=re.escape("run_name '../x' must be a directory name")):
        _settings(tmp_path, model, run_name="../x")


def test_a_new_run_does_not_continue_another_and_the_same_name_does(tmp_path):
    model = _model(tmp_path)
    first = _settings(tmp_path, model, run_name="first")
    newest = _checkpoint(first, 20)
    assert checkpoint_to_resume(_settings(tmp_path, model), run_identity(first)) is None  # a new, timestamped run
    again = _settings(tmp_path, model, run_name="first")
    assert checkpoint_to_resume(again, run_identity(again)) == newest


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"group_size": 8}, "group_size: the checkpoint's is 4, this run's 8"),
        ({"loss_type": "dapo"}, "loss_type: the checkpoint's is 'grpo', this run's 'dapo'"),
        ({"lora_rank": 8}, "lora_rank: the checkpoint's is 0, this run's 8"),
        ({"epsilon_high": 0.28}, "epsilon_high: the checkpoint's is 0.2, this run's 0.28"),
    ],
)
def test_a_checkpoint_with_other_settings_is_refused_with_the_reason(tmp_path, change, reason):
    model = _model(tmp_path)
    _checkpoint(_settings(tmp_path, model, run_name="r"), 10)
    changed = _settings(tmp_path, model, run_name="r", **change)
    with pytest.raises(ResumeRefused) as refused:
        checkpoint_to_resume(changed, run_identity(changed))
    assert reason in str(refused.value) and "new run_name" in str(refused.value)


def test_a_checkpoint_of_another_model_is_refused_and_a_moved_copy_is_not(tmp_path):
    model = _model(tmp_path)
    _checkpoint(_settings(tmp_path, model, run_name="r"), 10)
    other = _settings(tmp_path, _model(tmp_path, "other", b"weights-2"), run_name="r")
    with pytest.raises(ResumeRefused, match=r"model: the checkpoint was trained from '.*model' \(fingerprint"):
        checkpoint_to_resume(other, run_identity(other))
    moved = _settings(tmp_path, _model(tmp_path, "moved"), run_name="r")  # same files elsewhere: the same model
    assert checkpoint_to_resume(moved, run_identity(moved)) is not None


def test_resume_from_starts_a_new_run_from_another_runs_checkpoint(tmp_path):
    model = _model(tmp_path)
    source = _checkpoint(_settings(tmp_path, model, run_name="a"), 30)
    b = _settings(tmp_path, model, run_name="b", resume_from=str(source.parent))
    assert checkpoint_to_resume(b, run_identity(b)) == source
    own = _checkpoint(b, 40)  # once b has checkpoints of its own, a restart continues b, not a
    assert checkpoint_to_resume(b, run_identity(b)) == own
    unlike = _settings(tmp_path, model, run_name="c", resume_from=str(source), group_size=8)
    with pytest.raises(ResumeRefused, match="group_size"):
        checkpoint_to_resume(unlike, run_identity(unlike))
    nothing = _settings(tmp_path, model, run_name="d", resume_from=str(tmp_path / "nowhere"))
    with pytest.raises(ResumeRefused, match="is neither a checkpoint"):
        checkpoint_to_resume(nothing, run_identity(nothing))


def test_an_explicit_checkpoint_dir_of_another_run_and_old_checkpoints_are_refused(tmp_path):
    model = _model(tmp_path)
    shared = str(tmp_path / "ckpt")
    _checkpoint(_settings(tmp_path, model, run_name="a", checkpoint_dir=shared), 5)
    b = _settings(tmp_path, model, run_name="b", checkpoint_dir=shared)
    with pytest.raises(ResumeRefused, match="holds checkpoints of run 'a', not of this run 'b': set run_name = 'a'"):
        checkpoint_to_resume(b, run_identity(b))
    old_dir = str(tmp_path / "old")
    legacy = _checkpoint(_settings(tmp_path, model, checkpoint_dir=old_dir), 7, identity=False)
    new = _settings(tmp_path, model, run_name="n", checkpoint_dir=old_dir)
    with pytest.raises(ResumeRefused, match=f"set resume_from = '{re.escape(str(legacy))}'"):
        checkpoint_to_resume(new, run_identity(new))
    forced = _settings(tmp_path, model, run_name="n", checkpoint_dir=old_dir, resume_from=str(legacy))
    assert checkpoint_to_resume(forced, run_identity(forced)) == legacy


def test_resume_false_refuses_a_run_that_has_checkpoints(tmp_path):
    model = _model(tmp_path)
    _checkpoint(_settings(tmp_path, model, run_name="r"), 5)
    again = _settings(tmp_path, model, run_name="r", resume=False)
    with pytest.raises(ResumeRefused, match=r"already has checkpoints .* and resume = false"):
        checkpoint_to_resume(again, run_identity(again))


def _write_steps(log_dir: Path, steps: range, resumed_step: int | None = None) -> Path:
    sink = MetricsSink(log_dir, MetricsGauges(CollectorRegistry()), 10, "off", resumed_step)
    for step in steps:
        sink.write(step, {"reward": float(step)})
    sink.close()
    return sink.path


def test_metrics_are_not_appended_across_runs(tmp_path):
    log_dir = tmp_path / "logs"  # an explicit log_dir two runs share
    _write_steps(log_dir, range(1, 6))
    path = _write_steps(log_dir, range(1, 3))
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    aside = [p for p in log_dir.iterdir() if p.name.startswith("metrics.jsonl.")]
    assert len(aside) == 1 and len(aside[0].read_text().splitlines()) == 5  # the earlier run's, kept aside


def test_a_resumed_run_drops_the_metrics_after_its_checkpoint(tmp_path):
    log_dir = tmp_path / "logs"
    path = _write_steps(log_dir, range(1, 6))
    with path.open("a") as handle:
        handle.write('{"step": 6, "rew')  # cut short by a kill
    _write_steps(log_dir, range(4, 7), resumed_step=3)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]


def _write_completions(log_dir: Path, steps: range, resumed_step: int | None = None) -> Path:
    sink = MetricsSink(log_dir, MetricsGauges(CollectorRegistry()), 10, "off", resumed_step)
    for step in steps:
        sink.write_completions(step, [{"completion": "a"}, {"completion": "b"}])
    sink.close()
    return log_dir / "completions.jsonl"


def test_completion_tables_start_afresh_in_a_new_run_and_drop_the_retrained_steps_on_resume(tmp_path):
    log_dir = tmp_path / "logs"
    _write_completions(log_dir, range(1, 4))
    path = _write_completions(log_dir, range(1, 3))
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 1, 2, 2]
    (aside,) = [p for p in log_dir.iterdir() if p.name.startswith("completions.jsonl.")]
    assert len(aside.read_text().splitlines()) == 6  # the earlier run's, kept aside
    _write_completions(log_dir, range(2, 4), resumed_step=1)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 1, 2, 2, 3, 3]


def test_the_learner_continues_its_own_run_and_refuses_another_model(tmp_path):
    """The learner itself (``build_trainer``, every rank): a real checkpoint carries its run's identity."""
    from services.learner.checkpoint import LearnerState, save_checkpoint
    from services.learner.startup import build_trainer
    from shared.lifecycle import NotStarting
    from shared.runs import write_run_file
    from tests.support.tiny_model import build_tiny_llama

    tiny = build_tiny_llama(tmp_path / "tiny", seed=1, logit_scale=1.0)
    settings = _settings(tmp_path, tiny, run_name="a", max_completion_length=32, max_prompt_length=128)
    trainer, tokenizer, _, resumed = build_trainer(settings)
    assert not resumed
    write_run_file(settings, run_identity(settings))
    state = LearnerState(step=3, policy_version=3)
    checkpoint = save_checkpoint(Path(settings.checkpoint_dir), trainer, tokenizer, state, keep=2)
    assert json.loads((checkpoint / RUN_FILE).read_text())["run_name"] == "a"

    _, _, state, resumed = build_trainer(
        _settings(tmp_path, tiny, run_name="a", max_completion_length=32, max_prompt_length=128)
    )
    assert resumed and state.step == 3
    assert not build_trainer(_settings(tmp_path, tiny, run_name="b", max_completion_length=32, max_prompt_length=128))[
        3
    ]
    other = build_tiny_llama(tmp_path / "other", seed=2, logit_scale=1.0)
    with pytest.raises(NotStarting, match="model: the checkpoint was trained from"):
        build_trainer(_settings(tmp_path, other, run_name="a", max_completion_length=32, max_prompt_length=128))
