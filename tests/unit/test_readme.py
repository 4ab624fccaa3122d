"""The README documents the code: every setting has a row, the test command is the one CI runs."""

from __future__ import annotations

from shared.config.generator import GeneratorSettings
from shared.config.launcher import LauncherSettings
from shared.config.learner import DataSettings, LearnerSettings
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


def test_ci_runs_the_readme_test_command():
    assert "make test" in README
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert "make demo" in README
