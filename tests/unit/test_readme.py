"""The README documents the code: the settings tables are the generated ones, the test command is the one
CI runs."""

from __future__ import annotations

import socket

from services.launcher.docs_tables import TABLES, default_text, settings_tables
from shared.config.data import DataSettings
from shared.config.generator import GeneratorSettings
from shared.config.launcher import LauncherSettings
from shared.config.learner import LearnerSettings
from shared.config.scorer import RewardSpec, ScorerSettings
from tests.support.processes import ROOT

README = (ROOT / "README.md").read_text()


def test_every_setting_has_a_row():
    missing = [
        f"{cls.__name__}.{name}"
        for cls in (GeneratorSettings, ScorerSettings, LearnerSettings, DataSettings, RewardSpec, LauncherSettings)
        for name in cls.model_fields
        if f"| `{name}` |" not in README
    ]
    assert not missing, f"README lacks rows for {missing}; regenerate with `asyncgrpo config tables`"


def test_settings_tables_are_the_generated_ones():
    assert settings_tables() in README, "the README's settings tables are stale: paste `asyncgrpo config tables`"


def test_computed_defaults_are_declared_on_their_fields(monkeypatch):
    """A default computed from the machine is shown as its field declares, never as this machine's value."""
    computed = [
        f"{cls.__name__}.{name}"
        for cls, _, _ in TABLES
        for name, field in cls.model_fields.items()
        if default_text(field) == "hostname-based"
    ]
    assert computed == [
        "GeneratorSettings.generator_id",
        "GeneratorSettings.gpu_host_key",
        "ScorerSettings.scorer_id",
        "LearnerSettings.weight_sync_host",
    ]
    here = settings_tables()
    monkeypatch.setattr(socket, "gethostname", lambda: "another-machine")
    assert settings_tables() == here


def test_ci_runs_the_readme_test_command():
    assert "make test" in README
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert "make demo" in README
