"""Where a file or module that a configuration names is found: one rule for every one of them.

A relative path (``data.source`` and ``learner.eval_data`` files, ``[environment] chat_template``) and a module
(a Python reward ``module:function``, an environment class, a tool function) are looked for

1. in the folder of the configuration file the user passed,
2. in the working directory,
3. (modules only) on ``sys.path``, as Python imports anything else.

So ``my_env.py`` beside ``my.toml`` imports, and ``data/train.jsonl`` next to it reads, whatever directory
``asyncgrpo run --config path/to/my.toml`` is started from. Outputs (``runs_dir``, ``checkpoint_dir``,
``log_dir``) are not looked up: they are made relative to the working directory, as TRL's ``output_dir`` is.

``asyncgrpo run`` starts the services from a copy of the file in the run directory
(:func:`services.launcher.run_config.write_run_config`); the copy's top-level ``search_path`` records the
absolute folders the user's file was resolved against (its folder, then the working directory of that start),
so the services, and a later ``asyncgrpo run --config runs/<name>/config.toml``, look where the user's file
was. A user may set ``search_path`` in their own file too: its entries, relative to the file's folder, replace
step 1.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from shared.config.base import CONFIG_ENV, read_config_file

SEARCH_PATH_KEY = "search_path"  # top-level key of a configuration file: the folders its names resolve against


def search_dirs(config_file: str | Path | None = None) -> list[Path]:
    """The folders a relative name of ``config_file`` (else ``$ASYNCGRPO_CONFIG``) is looked for in, in order:
    the file's ``search_path`` (else its folder), then the working directory. Absolute, without repeats."""
    chosen = config_file or os.environ.get(CONFIG_ENV)
    dirs: list[Path] = []
    if chosen:
        path = Path(chosen).expanduser().resolve()
        listed = read_config_file(path).get(SEARCH_PATH_KEY) if path.is_file() else None
        if listed is not None and not (isinstance(listed, list) and all(isinstance(d, str) for d in listed)):
            raise ValueError(f"{path}: {SEARCH_PATH_KEY} must be a list of folders, got {listed!r}")
        dirs = [(path.parent / Path(d).expanduser()).resolve() for d in listed] if listed else [path.parent]
    dirs.append(Path.cwd().resolve())
    return list(dict.fromkeys(dirs))


def locate(name: str, dirs: Sequence[Path]) -> Path | None:
    """The existing file or folder ``name`` stands for: itself when absolute, else the first of ``dirs`` that
    holds it (absolute); None when none does."""
    path = Path(name).expanduser()
    if path.is_absolute():
        return path if path.exists() else None
    return next(((d / path).resolve() for d in dirs if (d / path).exists()), None)


def looked_in(name: str, dirs: Sequence[Path]) -> str:
    """Where :func:`locate` looked for ``name``, for an error message."""
    path = Path(name).expanduser()
    return str(path) if path.is_absolute() else ", ".join(str(d / path) for d in dirs)


def module_home(module_name: str, dirs: Sequence[Path]) -> Path | None:
    """The first of ``dirs`` that holds the top-level module or package of ``module_name`` (``a.b``: ``a``)."""
    top = module_name.partition(".")[0]
    for directory in dirs:
        if (directory / f"{top}.py").is_file() or (directory / top / "__init__.py").is_file():
            return directory
    return None


def import_named_module(module_name: str, dirs: Sequence[Path]) -> ModuleType:
    """Import ``module_name`` by the rule: from the first of ``dirs`` that holds it (that folder goes to the
    front of ``sys.path``, so the module's own sibling imports work), else from ``sys.path``. ImportError
    naming every place looked when it is nowhere."""
    home = module_home(module_name, dirs)
    if home is not None:
        if str(home) in sys.path:
            sys.path.remove(str(home))
        sys.path.insert(0, str(home))
        importlib.invalidate_caches()
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if home is not None or exc.name != module_name.partition(".")[0]:
            raise  # found, but something it imports is missing: Python's own message names it
        places = ", ".join(str(d) for d in dirs)
        raise ModuleNotFoundError(
            f"No module named {module_name!r} (looked in {places}, then on sys.path)", name=exc.name
        ) from exc
