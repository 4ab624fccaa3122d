"""Every service's command line: ``python -m services.<name> [--config FILE]``.

``main(...)`` parses ``--config``, validates the whole configuration file across services (a clear message and
exit status 2 when invalid), takes the service's own table, sets up logging, logs the resolved settings with
secrets masked (or, where the service gives a ``summary``, that one line at INFO and them at DEBUG), and runs
the service's ``serve(settings)`` (built on :func:`shared.lifecycle.run_service`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar, cast

from shared.config.base import CONFIG_ENV, ServiceSettings
from shared.config.pipeline import load_or_exit
from shared.telemetry import setup_logging

S = TypeVar("S", bound=ServiceSettings)


def main(
    name: str,
    settings_cls: type[S],
    serve: Callable[[S], Coroutine[Any, Any, int]],
    description: str,
    argv: list[str] | None = None,
    summary: Callable[[S], str] | None = None,
) -> int:
    tables = ", ".join(f"[{t}]" for t in (settings_cls.toml_table, *settings_cls.extra_toml_tables))
    parser = argparse.ArgumentParser(prog=f"python -m services.{name}", description=description)
    parser.add_argument("--config", help=f"TOML file (else $ASYNCGRPO_CONFIG); {tables} and [common] are read")
    args = parser.parse_args(argv)
    if args.config:  # the whole process (a reward module beside the file, too) knows which file it runs
        os.environ[CONFIG_ENV] = str(Path(args.config).resolve())
    settings = cast(S, load_or_exit(args.config, name))  # its table, checked with the file, and its start checks
    setup_logging(name, settings.log_level)
    log = logging.getLogger(f"services.{name}")
    if summary is None:
        log.info("settings: %s", settings.masked())
    else:
        log.info("settings: %s", summary(settings))
        log.debug("settings: %s", settings.masked())
    return asyncio.run(serve(settings))
