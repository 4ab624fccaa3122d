"""Prose holds no history: the README, the site's home page, the guides, every setting's description and the
shipped configurations say what a thing does and how to use it; figures live in ``bench/results.jsonl`` and the
benchmarks page generated from it. A dated figure here (a date, a commit, a measured ``X against Y``, a
speed-up) fails, naming the line."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from collections.abc import Iterator

import pytest
from pydantic import BaseModel

import shared.config
from tests.support.processes import ROOT

README_QUICK_START_BY = 30  # lines: the two commands are on the first screen
_FIGURE = re.compile(
    r"\b20\d\d-\d\d-\d\d\b"  # a date: 2026-11-26
    r"|\bcommit [0-9a-f]{7,40}\b|\(\s*[0-9a-f]{7}(?:\+dirty)?\s*\)"  # a commit: "commit 6b8f608", "(72d5d3f)"
    r"|\d\.?\d*\s?(?:s|ms|min|%|×)?\s(?:\S+\s){0,3}?(?:instead of|against|vs)\s(?:\S+\s){0,2}?\d"  # X against Y
    r"|\d\.?\d*\s?×|\d\.\d+\s?x\b"  # a speed-up: 3.48×, 2.99x
)


def figures(text: str) -> list[str]:
    """The dated or measured figures in ``text``, each as its line number and the words around it."""
    return [
        f"line {text.count(chr(10), 0, m.start()) + 1}: {text[max(0, m.start() - 30) : m.end() + 30]!r}"
        for m in _FIGURE.finditer(text)
    ]


def _pages() -> Iterator[tuple[str, str]]:
    """The README, the home page, Getting started, the guides and the shipped configurations."""
    found = [*(ROOT / "docs" / "guides").glob("*.md"), *(ROOT / "configs").glob("*.toml")]
    named = sorted(str(path.relative_to(ROOT)) for path in found)
    for name in ("README.md", "docs/index.md", "docs/getting-started.md", *named):
        yield name, (ROOT / name).read_text()


def _settings_descriptions() -> Iterator[tuple[str, str]]:
    """Every field description and docstring of the settings classes in :mod:`shared.config`."""
    for module_info in pkgutil.iter_modules(shared.config.__path__):
        module = importlib.import_module(f"shared.config.{module_info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if not issubclass(cls, BaseModel) or cls.__module__ != module.__name__:
                continue
            yield f"{module.__name__}.{cls.__name__}", cls.__doc__ or ""
            for name, field in cls.model_fields.items():
                yield f"{module.__name__}.{cls.__name__}.{name}", field.description or ""


@pytest.mark.parametrize("name", [*(name for name, _ in _pages()), "settings descriptions"])
def test_no_dated_figures(name):
    texts = _settings_descriptions() if name == "settings descriptions" else [(name, dict(_pages())[name])]
    found = [f"{where} {figure}" for where, text in texts for figure in figures(text)]
    assert not found, f"{name} holds figures that belong to bench/results.jsonl:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "text, found",
    [
        ("held-out 0.00 -> 1.00 (2026-11-26, commit 6b8f608, 2 cores)", 2),
        ("the demo's first step took 5.7 s instead of 9.4 s (one CPU core)", 1),
        ("ran **3.48×** TRL's speed with held-out 0.853 against TRL's 0.802", 2),
        ("the run of 72d5d3f: (72d5d3f)", 1),
        ("packed 59 completion tokens/s, 2.99x a bare loop; 2.86 s/step shared vs 2.58 s not", 2),
        ("64 KiB is ample; groups_per_step × G completions; 2 groups x G=8; 3-digit x 2-digit; 2 cores", 0),
    ],
)
def test_what_counts_as_a_figure(text, found):
    assert len(figures(text)) == found, figures(text)


def test_quick_start_is_on_the_first_screen():
    lines = (ROOT / "README.md").read_text().splitlines()
    heading = next(i for i, line in enumerate(lines, 1) if line.startswith("## ") and "Quick start" in line)
    assert heading <= README_QUICK_START_BY, f"Quick start begins at line {heading}"
    assert "make demo" in "\n".join(lines[heading : heading + 10])
    assert "make test" in "\n".join(lines[heading : heading + 10])


def test_the_home_page_has_its_own_opening():
    """docs/index.md does not repeat the README's opening paragraph word for word."""
    readme = (ROOT / "README.md").read_text().split("\n\n")[1]
    assert " ".join(readme.split()) not in " ".join((ROOT / "docs" / "index.md").read_text().split())
