"""The tier of every test, decided once from where it lives and what it starts (``tests/conftest.py`` applies it).

=============  =====================================================================================
tier           what a test in it starts
=============  =====================================================================================
``unit``       nothing: pure Python and torch in this process (``make test-fast``)
``process``    a subprocess, a process pool, a torch.distributed group or a tiny checkpoint on disk
``integration``a real Redis or a real HTTP server (tests/integration/)
``e2e``        every service as its own process (tests/e2e/)
``bench``      a benchmark's ``--quick`` run (tests/e2e/test_bench_smoke.py)
``gpu``        a CUDA device (tests/gpu/)
=============  =====================================================================================

A test under tests/unit/ is ``process`` when its function, a fixture it uses, or a helper either calls
(transitively, across the module and tests/support/) names one of :data:`PROCESS_STARTERS`. Nobody keeps a list
of test names: a new test lands in its tier by what it does. ``vllm`` and ``slow`` stay as markers of their own.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from functools import cache
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
FOLDER_TIERS = {"unit": "unit", "integration": "integration", "e2e": "e2e", "gpu": "gpu"}
TIERS = ("unit", "process", "integration", "e2e", "bench", "gpu")
BENCH_FILES = {"test_bench_smoke.py"}
# Names whose use means a process, a process group or a checkpoint on disk is started.
PROCESS_STARTERS = frozenset(
    {
        "subprocess",
        "Popen",
        "ProcessPoolExecutor",
        "multiprocessing",
        "start_service",
        "init_process_group",
        "isolated_preflight",
        "build_tiny_llama",
        "save_pretrained",
    }
)
REDIS_FIXTURES = frozenset({"redis_url", "redis_client"})


def _referenced(node: ast.AST) -> set[str]:
    """Every name and attribute name ``node`` mentions."""
    names = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            names.add(child.id)
        elif isinstance(child, ast.Attribute):
            names.add(child.attr)
    return names


def _definitions(tree: ast.Module) -> dict[str, set[str]]:
    """Each top-level function or class of a module, with the names its body mentions."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {node.name: _referenced(node) for node in tree.body if isinstance(node, kinds)}


def starting(definitions: dict[str, set[str]], starters: Iterable[str]) -> set[str]:
    """The definitions that mention a starter, or a definition that does (a fixed point)."""
    known = set(starters)
    found: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, mentions in definitions.items():
            if name not in found and mentions & (known | found):
                found.add(name)
                changed = True
    return found


@cache
def support_starters() -> frozenset[str]:
    """The helpers of tests/support/ that start something, with the starters themselves."""
    definitions: dict[str, set[str]] = {}
    for path in sorted((TESTS / "support").glob("*.py")):
        definitions.update(_definitions(ast.parse(path.read_text())))
    return frozenset(PROCESS_STARTERS | starting(definitions, PROCESS_STARTERS))


@cache
def module_definitions(path: Path) -> dict[str, set[str]]:
    return _definitions(ast.parse(path.read_text()))


@cache
def module_starters(path: Path) -> frozenset[str]:
    """The functions, classes and fixtures of the test module at ``path`` that start something, and every
    starter."""
    everything = support_starters()
    return frozenset(everything | starting(module_definitions(path), everything))


def tier(path: Path, function: str, fixtures: Iterable[str], tests: Path = TESTS) -> str:
    """The tier of test ``function`` (or test class) of the module at ``path`` under ``tests`` that uses
    ``fixtures``."""
    folder = FOLDER_TIERS.get(path.relative_to(tests).parts[0], "unit")
    if path.name in BENCH_FILES:
        return "bench"
    if folder != "unit":
        return folder
    if REDIS_FIXTURES & set(fixtures):
        return "integration"
    starters = module_starters(path)
    return "process" if function in starters or starters & set(fixtures) else "unit"
