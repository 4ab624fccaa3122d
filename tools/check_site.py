"""The built documentation site, opened from files in a real headless Chromium: ``make docs`` runs it.

    .venv-docs/bin/python tools/check_site.py build/site --screenshots build/screenshots

Every page of the site is opened from ``file://`` at 1280 px wide, as a reader who opens
``build/site/index.html`` sees it. A page fails when it scrolls sideways, when a table is wider than its box
(columns out of sight: a tall table's one scroll bar is at its bottom), when a code block is wider than its
box and does not scroll inside it, when an image on it does not load, or when one of its links into the site
opens a directory listing, a missing file, or a page without the anchor it names. Screenshots of the home page
and Getting started are written for CI to keep. Exit status 1 names every failure, 0 when there is none.

Selenium drives Debian's Chromium through Debian's chromedriver (``apt-get install chromium chromium-driver``;
requirements/docs-browser.txt pins selenium): both paths are given, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote, urldefrag, urlparse

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WIDTH, HEIGHT = 1280, 900
SCREENSHOTS = {"home.png": "index.html", "getting-started.png": "getting-started.html"}  # their pages' files
# Links, images and the widest boxes of a page, read in one script so each page costs one round trip.
_PAGE_SCRIPT = """
const root = document.documentElement;
const wide = [...document.querySelectorAll('.md-content *')]
  .filter(e => e.getBoundingClientRect().right > root.clientWidth + 1)
  .filter(e => !e.parentElement || e.parentElement.getBoundingClientRect().right <= root.clientWidth + 1)
  .slice(0, 3).map(e => e.tagName.toLowerCase() + (e.className ? '.' + e.className.split(' ')[0] : ''));
return {
  scroll: root.scrollWidth, client: root.clientWidth, wide: wide,
  links: [...document.querySelectorAll('a[href]')].map(a => a.href),
  broken: [...document.images].filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src),
  tables: [...document.querySelectorAll('.md-content table')]
    .map(t => [t.scrollWidth, (t.closest('.md-typeset__scrollwrap') || t.parentElement).clientWidth])
    .filter(([table, box]) => table > box + 1),
  clipped: [...document.querySelectorAll('.md-content pre > code')]
    .filter(c => c.scrollWidth > c.clientWidth + 1 && !['auto', 'scroll'].includes(getComputedStyle(c).overflowX))
    .map(c => c.textContent.split('\\n')[0].slice(0, 60)),
};
"""
# Chromium's listing of a directory opened as file:// (its own page, not one of the site's).
_LISTING_SCRIPT = "return document.querySelector('#parentDirLinkBox, #listingParsingErrorBox') !== null;"


@contextmanager
def chromium() -> Iterator:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)  # --no-sandbox: CI runs as root, where Chromium's sandbox cannot start
    options.add_argument(f"--window-size={WIDTH},{HEIGHT}")
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        driver.set_window_size(WIDTH, HEIGHT)
        yield driver
    finally:
        driver.quit()


def pages(site: Path) -> list[Path]:
    """Every HTML page the site built (MkDocs' 404 page aside: a server serves it, never a link)."""
    return sorted(path for path in site.rglob("*.html") if path != site / "404.html")


def check_page(driver, page: Path, site: Path) -> tuple[list[str], set[str]]:
    """The failures of ``page`` as opened, and the links it makes into the site (file URLs, anchors kept)."""
    driver.get(page.as_uri())
    found = driver.execute_script(_PAGE_SCRIPT)
    name = page.relative_to(site).as_posix()
    problems = [f"{name}: image {src} does not load" for src in found["broken"]]
    if found["scroll"] > found["client"]:
        problems.append(
            f"{name}: scrolls sideways at {WIDTH} px ({found['scroll']} px wide in {found['client']}; "
            f"widest: {', '.join(found['wide']) or '?'})"
        )
    problems += [f"{name}: a table {table} px wide in a box of {box} px" for table, box in found["tables"]]
    problems += [f"{name}: a code block is cut off at its right edge: {line!r}" for line in found["clipped"]]
    inside = {link for link in found["links"] if _inside(link, site)}
    return problems, inside


def _inside(link: str, site: Path) -> bool:
    url = urlparse(link)
    return url.scheme == "file" and Path(unquote(url.path)).is_relative_to(site)


def check_links(driver, links: dict[str, set[str]], site: Path) -> list[str]:
    """Open each linked target once: it must be one of the site's pages and hold every anchor linked to."""
    targets: dict[str, dict[str, set[str]]] = {}
    for source, found in links.items():
        for link in found:
            target, anchor = urldefrag(link)
            targets.setdefault(target, {}).setdefault(anchor, set()).add(source)
    problems = []
    for target, anchors in sorted(targets.items()):
        shown = Path(unquote(urlparse(target).path)).relative_to(site).as_posix() or "."
        sources = _pages_named(set().union(*anchors.values()))
        path = Path(unquote(urlparse(target).path))
        if not path.exists():
            problems.append(f"{sources}: link to {shown}, which does not exist")
            continue
        driver.get(target)
        if path.is_dir() or driver.execute_script(_LISTING_SCRIPT):
            problems.append(f"{sources}: link to {shown} opens a directory listing, not a page")
            continue
        problems += [
            f"{_pages_named(anchors[anchor])}: link to {shown}#{anchor}, an anchor the page lacks"
            for anchor in sorted(a for a in anchors if a)
            if not driver.execute_script("return document.getElementById(arguments[0]) !== null;", anchor)
        ]
    return problems


def _pages_named(names: set[str], shown: int = 3) -> str:
    first = ", ".join(sorted(names)[:shown])
    return first if len(names) <= shown else f"{first} and {len(names) - shown} more pages"


def check_site(site: Path, screenshots: Path | None) -> list[str]:
    """Every failure of the site built in ``site``; screenshots into ``screenshots`` when given."""
    site = site.resolve()
    if not (site / "index.html").is_file():
        return [f"{site} holds no index.html: build the site first (make docs)"]
    with chromium() as driver:
        problems: list[str] = []
        links: dict[str, set[str]] = {}
        for page in pages(site):
            found, links[page.relative_to(site).as_posix()] = check_page(driver, page, site)
            problems += found
        problems += check_links(driver, links, site)
        if screenshots is not None:
            problems += take_screenshots(driver, site, screenshots)
    return problems


def take_screenshots(driver, site: Path, folder: Path) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    problems = []
    for name, page in SCREENSHOTS.items():
        if not (site / page).is_file():
            problems.append(f"no {page} to take {name} of")
            continue
        driver.get((site / page).as_uri())
        driver.save_screenshot(str(folder / name))
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the built site (mkdocs build --site-dir)")
    parser.add_argument("--screenshots", type=Path, help="folder for home.png and getting-started.png")
    args = parser.parse_args(argv)
    problems = check_site(args.site, args.screenshots)
    for problem in problems:
        print(problem, file=sys.stderr)
    count = len(pages(args.site.resolve()))
    print(f"{count} pages opened in Chromium from file://: {len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
