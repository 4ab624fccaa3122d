"""The learner's start-up line: one short summary at INFO (model, objective, batch arithmetic, device); every
resolved setting, secrets masked, goes to ``<run_dir>/settings.toml`` (the launcher's ``config.toml`` beside it
is the file the run was started from) and to the DEBUG log."""

from __future__ import annotations

import logging
import runpy
import tomllib
from pathlib import Path

import pytest

from services.learner.startup import write_settings_file
from shared import service
from shared.config.base import CONFIG_ENV
from shared.config.learner import LearnerSettings
from shared.runs import SETTINGS_FILE, settings_path, startup_summary

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo-cpu.toml"
_SHORT = 400  # characters: one line a reader takes in at once (the full dump is about 3,500)


def _settings(tmp_path: Path, **overrides) -> LearnerSettings:
    fields = dict(model="some/model", runs_dir=str(tmp_path / "runs"), run_name="exp1", group_size=4)
    return LearnerSettings(**{**fields, "groups_per_step": 2, "micro_batch_size": 4, **overrides})


def test_the_summary_names_model_objective_batch_and_device(tmp_path):
    line = startup_summary(_settings(tmp_path, loss_type="grpo", device="cpu", max_staleness=2))
    assert len(line) < _SHORT
    for part in ("some/model", "cpu", "loss_type grpo", "2 groups x G=4 = 8 completions", "max_staleness 2"):
        assert part in line, (part, line)
    assert str(tmp_path / "runs" / "exp1" / SETTINGS_FILE) in line


def test_the_settings_file_holds_every_resolved_setting_masked(tmp_path):
    settings = _settings(tmp_path, api_token="a-secret-token-of-32-characters-x")
    path = write_settings_file(settings)
    assert path == settings.run_dir / "settings.toml" == settings_path(settings)
    assert not (settings.run_dir / "config.toml").exists()  # the launcher's file, never the learner's
    text = path.read_text()
    assert "a-secret-token" not in text
    table = tomllib.loads(text)["learner"]
    expected = {k: v for k, v in settings.masked().items() if v is not None}
    expected["data"] = {k: v for k, v in expected["data"].items() if v is not None}
    assert table == expected


def test_main_logs_the_summary_at_info_and_the_settings_at_debug(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("LEARNER_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv(CONFIG_ENV, str(DEMO))  # main sets it; monkeypatch takes it back after the test
    monkeypatch.setattr(service, "setup_logging", lambda name, level: None)  # keep caplog's handler
    seen = []

    async def serve(settings):
        seen.append(settings)
        return 0

    with caplog.at_level(logging.DEBUG, logger="services.learner"):
        status = service.main("learner", LearnerSettings, serve, "d", ["--config", str(DEMO)], summary=startup_summary)
    assert status == 0
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert info == [f"settings: {startup_summary(seen[0])}"]
    assert len(info[0]) < _SHORT
    assert any("'kl_estimator'" in message for message in debug)


def test_the_learner_process_passes_its_summary(monkeypatch):
    """``python -m services.learner`` gives :func:`shared.service.main` the summary (run as ``__main__``)."""
    calls = []
    monkeypatch.setattr(service, "main", lambda *args, **kwargs: calls.append(kwargs) or 0)
    with pytest.raises(SystemExit):
        runpy.run_module("services.learner", run_name="__main__")
    assert calls == [{"summary": startup_summary}]
