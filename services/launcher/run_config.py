"""The run directory's copy of the configuration: the one file every service of ``asyncgrpo run`` reads.

``<run_dir>/config.toml`` is the user's file with the run's name, the launcher's own overrides (the demo's
``--quick`` budgets) and, at the top, ``search_path``: the absolute folders its relative names resolve against
(:mod:`shared.config.locations`: the folder of the user's file, then the working directory of this start).
A module beside the user's file, a template or a data file next to it is then found from the copy too, by the
services, by a later start from the copy (``asyncgrpo run --config runs/<name>/config.toml``) and by its start-up
check. Each start writes it again, so it is always what the last start ran.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomli_w

from shared.config.base import read_config_file
from shared.config.locations import SEARCH_PATH_KEY, search_dirs

RUN_CONFIG = "config.toml"

Overrides = Mapping[str, Mapping[str, Any]]  # table -> setting -> value


def run_config_document(config: Path, overrides: Overrides | None = None) -> dict[str, Any]:
    """The copy's content: ``config``'s tables with ``overrides`` set in them and ``search_path`` at the top."""
    document = read_config_file(config)
    document[SEARCH_PATH_KEY] = [str(directory) for directory in search_dirs(config)]
    for table, values in (overrides or {}).items():
        document[table] = {**document.get(table, {}), **values}
    return document


def write_run_config(config: Path, run_dir: Path, overrides: Overrides | None = None) -> Path:
    """Write ``<run_dir>/config.toml`` from ``config`` and ``overrides`` (whole, through a temporary file: a
    service never reads half of it) and return its path. ``config`` may be that copy itself."""
    document = run_config_document(config, overrides)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RUN_CONFIG
    partial = path.with_name(f".{RUN_CONFIG}.{os.getpid()}")
    partial.write_text(tomli_w.dumps(document))
    partial.replace(path)
    return path
