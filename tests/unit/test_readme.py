"""The README is the short front page: its commands are the Makefile's and CI's, it stays short, and every
relative link in it and in docs/ reaches a file (and, with a #fragment, a heading of that file).

The generated settings tables live in docs/reference/settings.md, checked by tests/unit/test_reference_docs.py.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

from tests.support.processes import ROOT

README = (ROOT / "README.md").read_text()
README_MAX_LINES = 300  # the front page; the manual is the site under docs/
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$", re.MULTILINE)


def prose(markdown: str) -> str:
    """The text outside code: fenced blocks and inline code spans removed."""
    return _INLINE_CODE.sub("", _FENCE.sub("", markdown))


def relative_links(markdown: str) -> list[str]:
    """Link and image targets outside code that name a path (no scheme, not a bare #fragment)."""
    return [t for t in _LINK.findall(prose(markdown)) if not re.match(r"^[a-z][a-z0-9+.-]*:|^#", t)]


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension (MkDocs, GitHub alike for plain text) gives a heading."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(markdown: str) -> set[str]:
    """Every heading's anchor in a Markdown file (code spans in a heading keep their text)."""
    return {slug(h.replace("`", "")) for h in _HEADING.findall(_FENCE.sub("", markdown))}


def broken_links(page: Path) -> list[str]:
    """``"target: why"`` for each relative link of ``page`` whose file or heading does not exist."""
    broken = []
    for target in relative_links(page.read_text()):
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve()
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file.read_text()):
            broken.append(f"{target}: no heading with anchor #{fragment} in {path}")
    return broken


def test_ci_runs_the_readme_test_command():
    assert "make test" in README
    assert re.search(r"^make test$", (ROOT / ".ci" / "run").read_text(), re.MULTILINE)
    assert "make demo" in README


def test_every_make_command_in_the_readme_is_a_makefile_target():
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    named = set(re.findall(r"\bmake ([a-z][a-z-]*)", README))
    assert named and named <= targets, f"README names make targets the Makefile lacks: {sorted(named - targets)}"


def test_readme_stays_a_front_page():
    lines = README.count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move prose into docs/ (at most {README_MAX_LINES})"
    assert "<!-- settings tables" not in README, "the settings tables live in docs/reference/settings.md"


@pytest.mark.parametrize(
    "page",
    [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "there.md").write_text("# A page\n\n## The `demo` run\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#the-demo-run) [gone](missing.md) [bad anchor](there.md#nope) [web](https://x.org/a.md)\n"
        "`[in code](missing.md)`\n```\n[in a block](missing.md)\n```\n"
    )
    assert [line.split(":")[0] for line in broken_links(page)] == ["missing.md", "there.md#nope"]


def test_slug_is_the_toc_extensions():
    assert slug("Multi-turn tool use: design") == "multi-turn-tool-use-design"
    assert slug("The transport (and what it guarantees)") == "the-transport-and-what-it-guarantees"
    assert slug("2.2 Records: schema version 2 (shared/records.py)") == "22-records-schema-version-2-sharedrecordspy"
