"""The objective's settings are defined once (shared/config/objective.py), and ``algorithm`` fills the scorer's
and the learner's tables together, overridable field by field and shown by ``config explain``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from services.launcher.explain import explain
from shared.config.learner import LearnerSettings
from shared.config.objective import ALGORITHMS, LOSS_TYPES, Objective
from shared.config.pipeline import PipelineConfig
from shared.config.scorer import ScorerSettings

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / "shared" / "config" / "objective.py"
SOURCES = [p for d in ("shared", "services") for p in sorted((ROOT / d).rglob("*.py")) if p != HOME]


def _second_definitions(path: Path, names: set[str]) -> list[str]:
    """Class-level fields and parameters with a default named like an objective setting."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.target.id in names:
                    found.append(f"{path.relative_to(ROOT)}:{item.lineno} {node.name}.{item.target.id}")
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno} {node.name}({name}=...)" for name in _defaults(node) & names
            ]
    return found


def _defaults(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Parameters given a default value (None, "not given", is not a value)."""
    args = node.args
    pairs = list(zip(args.args[len(args.args) - len(args.defaults) :], args.defaults, strict=True))
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None]
    return {a.arg for a, d in pairs if not (isinstance(d, ast.Constant) and d.value is None)}


def test_every_objective_setting_is_defined_once():
    names = set(Objective.model_fields)
    found = [hit for path in SOURCES for hit in _second_definitions(path, names)]
    assert not found, "objective settings defined again outside shared/config/objective.py:\n" + "\n".join(found)


def test_the_loss_types_are_listed_once():
    listing = '"grpo", "bnpo", "dr_grpo"'
    assert listing in HOME.read_text()
    again = [str(p.relative_to(ROOT)) for p in SOURCES if listing in p.read_text()]
    assert not again, f"the loss types are listed again in {again}; import LOSS_TYPES"
    assert LearnerSettings.model_fields["loss_type"].annotation == Objective.model_fields["loss_type"].annotation
    assert set(LOSS_TYPES) == {
        "grpo",
        "bnpo",
        "dr_grpo",
        "dapo",
        "luspo",
        "cispo",
        "sapo",
        "vespo",
        "geo_mean",
        "kl_cov",
    }


def test_the_learner_objective_is_the_objective_with_its_defaults():
    assert Objective.of(LearnerSettings(model="/m")) == Objective()


def _pipeline(tmp_path: Path, body: str) -> PipelineConfig:
    path = tmp_path / "pipeline.toml"
    path.write_text(body + '\n[generator]\nmodel = "/m"\n[learner]\nmodel = "/m"\n')
    return PipelineConfig.load(path)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_an_algorithm_fills_both_tables(tmp_path, name):
    pipeline = _pipeline(tmp_path, f'algorithm = "{name}"\n[scorer]\n')
    for table in ("scorer", "learner"):
        for field, value in ALGORITHMS[name][table].items():
            assert getattr(getattr(pipeline, table), field) == value, (table, field)


def test_dr_grpo_in_config_explain_and_an_override_shown_not_refused(tmp_path):
    text = explain(_pipeline(tmp_path, 'algorithm = "dr_grpo"\n[scorer]\n'))
    assert "Algorithm: dr_grpo" in text
    assert "scorer.scale_rewards                    'none'      (recipe)" in text
    assert "learner.loss_type                       'dr_grpo'   (recipe)" in text
    overridden = _pipeline(tmp_path, 'algorithm = "dr_grpo"\n[scorer]\nscale_rewards = "group"\n')
    assert overridden.scorer.scale_rewards == "group" and overridden.learner.loss_type == "dr_grpo"
    text = explain(overridden)
    assert "scorer.scale_rewards                    'group'     (overrides the recipe's 'none')" in text
    assert "note: learner.loss_type = 'dr_grpo' with scorer.scale_rewards = 'group'" in text


def test_an_explicit_field_and_the_environment_win_over_the_recipe(monkeypatch):
    assert LearnerSettings(model="/m", algorithm="dapo", epsilon_high=0.3).epsilon_high == 0.3
    monkeypatch.setenv("SCORER_SCALE_REWARDS", "batch")
    assert ScorerSettings(algorithm="dr_grpo").scale_rewards == "batch"


def test_a_wrong_algorithm_name_is_refused_with_the_names():
    with pytest.raises(ValueError, match="dr_grpo"):
        LearnerSettings(model="/m", algorithm="drgrpo")
