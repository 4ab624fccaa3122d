"""Every command README.md and docs/ give a user to run has a smoke run in ``make test``.

A command is what a fenced block of README.md or any page of docs/ holds in one of three forms: ``make
<target>``, ``asyncgrpo <subcommand>`` (``asyncgrpo config <subcommand>``), ``python -m services.<x>``. A smoke
run is a test marked ``@pytest.mark.smokes("<command>")`` that runs it as the user types it (the marker is read
from the test files' source, so an unmarked or misspelt one counts for nothing). The few commands ``make test``
cannot run itself are in :data:`RUN_BY_CI`, each with the ``.ci/run`` line that runs it instead.

A documented command without a smoke run fails here, the day it is written (``make demo-tools`` once broke on
a fresh clone and nothing noticed).
"""

from __future__ import annotations

import ast
import re

from tests.support.processes import ROOT

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCED = re.compile(r"^ {0,3}(```|~~~)[^\n]*\n(.*?)^ {0,3}\1", re.M | re.S)
# A command starts a line (after any VAR=value assignments) or follows ;, &&, |, ` or $( ; a path before its
# name (.venv/bin/) is part of it.
COMMAND = re.compile(
    r"(?:^\s*(?:[A-Z_]+=\S+\s+)*|[;&|`(]\s*)(?:\S*/)?"
    r"(?:make(?:\s+-C\s+\S+)?(?:\s+[A-Z_]+=\S+)*\s+(?P<target>[a-z][\w-]*)"
    r"|asyncgrpo\s+(?P<sub>config\s+[a-z][\w-]*|[a-z][\w-]*)"
    r"|python[\d.]*\s+-m\s+(?P<module>services\.\w+))"
)
# Run by .ci/run, not by make test (each value is the line of .ci/run that runs it).
RUN_BY_CI = {
    "make test": "make test",  # the suite itself
    "make docs": "make docs",
    "make lint": "make lint",
    # `make lock` resolves against PyPI and rewrites requirements/; CI checks that the lock matches
    # pyproject.toml (lock-check) and installs it on a fresh machine (check-fresh-setup).
    "make lock": "make lock-check",
}


def documented_commands(text: str) -> set[str]:
    """The commands in ``text``'s fenced blocks, each as ``make <target>``, ``asyncgrpo <subcommand>`` or
    ``python -m services.<x>`` (options and values left out; comments after `` #`` ignored)."""
    found = set()
    for _, block in FENCED.findall(text):
        for line in block.splitlines():
            for match in COMMAND.finditer(line.split(" #")[0]):
                if match["target"]:
                    found.add(f"make {match['target']}")
                elif match["sub"]:
                    found.add(f"asyncgrpo {' '.join(match['sub'].split())}")
                else:
                    found.add(f"python -m {match['module']}")
    return found


def smoked_commands(source: str) -> set[str]:
    """The commands the ``pytest.mark.smokes(...)`` markers of a test module's ``source`` name."""
    smoked = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "smokes":
            smoked.update(arg.value for arg in node.args if isinstance(arg, ast.Constant))
    return smoked


def unsmoked(documents: dict[str, str], smoked: set[str]) -> dict[str, list[str]]:
    """Each documented command with no smoke run and no line in .ci/run, with the documents that give it."""
    missing: dict[str, list[str]] = {}
    for name, text in documents.items():
        for command in documented_commands(text) - smoked - set(RUN_BY_CI):
            missing.setdefault(command, []).append(name)
    return missing


def _smoked_in_tests() -> set[str]:
    smoked: set[str] = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        smoked |= smoked_commands(path.read_text())
    return smoked


def _documents() -> dict[str, str]:
    return {str(path.relative_to(ROOT)): path.read_text() for path in DOCUMENTS}


def test_every_documented_command_has_a_smoke_run():
    missing = unsmoked(_documents(), _smoked_in_tests())
    assert not missing, "documented commands with no test marked @pytest.mark.smokes(...): " + "; ".join(
        f"{command} (in {', '.join(sorted(where))})" for command, where in sorted(missing.items())
    )


def test_a_new_fenced_make_target_without_a_smoke_run_fails():
    readme = _documents()["README.md"]
    smoked = documented_commands(readme)  # as if every command there had its smoke run
    page = readme + "\n```bash\nmake frobnicate   # a new target\n```\n"
    assert unsmoked({"README.md": readme}, smoked) == {}
    assert unsmoked({"README.md": page}, smoked) == {"make frobnicate": ["README.md"]}


def test_commands_are_read_as_users_type_them():
    text = """
```bash
.venv/bin/asyncgrpo config explain configs/demo-cpu.toml   # make lint here is a comment
make -C ~/asyncgrpo DEMO_ARGS=--quick demo-tools
ENV_SERVER_API_TOKEN=<token> python -m services.env_server --environment my_env:MyEnv
GENERATOR_MODEL=/m .venv/bin/python3.11 -m services.generator
```
Outside a fence `make nothing` is prose, and so is a "make of the model" inside one:
```text
the make of the model; asyncgrpo run --config x.toml
```
"""
    assert documented_commands(text) == {
        "asyncgrpo config explain",
        "make demo-tools",
        "python -m services.env_server",
        "python -m services.generator",
        "asyncgrpo run",
    }


def test_the_smoke_markers_are_read_from_the_tests_source():
    source = (
        "import pytest\n"
        "pytestmark = [pytest.mark.e2e]\n"
        '@pytest.mark.smokes("make demo", "asyncgrpo demo")\n'
        "def test_a(): ...\n"
        '@pytest.mark.slow("make lint")\n'
        "def test_b(): ...\n"
    )
    assert smoked_commands(source) == {"make demo", "asyncgrpo demo"}


def test_what_ci_runs_instead_is_in_ci_run_and_each_smoked_make_target_exists():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert all(any(line.strip() == run for line in ci) for run in RUN_BY_CI.values())
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    make_commands = {c.split()[1] for c in _smoked_in_tests() | set(RUN_BY_CI) if c.startswith("make ")}
    assert make_commands <= targets, f"no such Makefile target: {sorted(make_commands - targets)}"
