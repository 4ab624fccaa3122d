"""Each test's tier follows from its folder and from what it starts (tests/support/tiers.py), never a list."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiers import tier

MODULE = """
import subprocess
import pytest
from tests.support.processes import start_service
from tests.support.tiny_model import build_tiny_llama


def _helper():
    return subprocess.run(["true"])


def _two_steps_away():
    return _helper()


@pytest.fixture
def tiny(tmp_path):
    return build_tiny_llama(tmp_path / "m", seed=0)


def test_pure():
    assert 1 + 1 == 2


def test_runs_a_subprocess():
    subprocess.run(["true"])


def test_through_a_helper():
    _two_steps_away()


def test_starts_a_service():
    start_service("x", "services.scorer", {})


def test_with_a_tiny_checkpoint(tiny):
    assert tiny


class TestGrouped:
    def test_in_a_class(self):
        _helper()
"""


@pytest.fixture
def tree(tmp_path) -> Path:
    for folder in ("unit", "integration", "e2e"):
        (tmp_path / folder).mkdir()
    (tmp_path / "unit" / "test_mod.py").write_text(MODULE)
    return tmp_path


@pytest.mark.parametrize(
    ("function", "fixtures", "expected"),
    [
        ("test_pure", [], "unit"),
        ("test_pure", ["tmp_path", "monkeypatch"], "unit"),
        ("test_runs_a_subprocess", [], "process"),
        ("test_through_a_helper", [], "process"),
        ("test_starts_a_service", [], "process"),
        ("test_with_a_tiny_checkpoint", ["tiny", "tmp_path"], "process"),
        ("TestGrouped", [], "process"),
        ("test_pure", ["redis_client", "keys"], "integration"),
    ],
)
def test_a_unit_folder_test_is_tiered_by_what_it_starts(tree, function, fixtures, expected):
    assert tier(tree / "unit" / "test_mod.py", function, fixtures, tests=tree) == expected


def test_the_other_folders_give_their_tier(tree):
    (tree / "e2e" / "test_bench_smoke.py").write_text("def test_x(): ...\n")
    (tree / "integration" / "test_y.py").write_text("def test_y(): ...\n")
    assert tier(tree / "integration" / "test_y.py", "test_y", [], tests=tree) == "integration"
    assert tier(tree / "e2e" / "test_bench_smoke.py", "test_x", [], tests=tree) == "bench"


def test_every_collected_test_has_one_tier(request):
    """This very module: its tests start nothing but files in tmp_path, so they are unit tests."""
    tiers = [m.name for m in request.node.iter_markers() if m.name in {"unit", "process", "integration"}]
    assert tiers == ["unit"]
