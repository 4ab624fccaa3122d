"""``asyncgrpo run``: the whole pipeline on one machine, from one configuration file.

The file is validated across services first, with the launcher's own checks
(:func:`shared.config.pipeline.launch_or_exit`: every problem named, exit status 2), before Redis or any
service starts. Then Redis (the one at ``$REDIS_URL`` if it answers, else one started here for the run),
and the :class:`~services.launcher.supervisor.Supervisor` runs the services to the learner's end.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
from pathlib import Path

from services.launcher.local_redis import use_or_start_redis
from services.launcher.supervisor import Supervisor
from shared.config.pipeline import launch_or_exit

log = logging.getLogger("asyncgrpo")

INTERRUPTED = 130  # the shell's code for a run stopped by Ctrl-C or SIGTERM


def run(config: Path, *, prefix: str | None = None) -> tuple[int, dict[str, int]]:
    """Run the pipeline of ``config`` to the learner's end; returns its exit code and every child's."""
    pipeline = launch_or_exit(config)
    env = {"STREAM_PREFIX": prefix or os.environ.get("STREAM_PREFIX") or f"run-{secrets.token_hex(3)}"}
    env["REDIS_URL"], redis_server = use_or_start_redis()
    try:
        return _supervise(Supervisor(config, env, pipeline.launcher))
    finally:
        if redis_server is not None:
            redis_server.stop()


def _supervise(supervisor: Supervisor) -> tuple[int, dict[str, int]]:
    """Start every service, wait for the learner, stop the rest; SIGTERM or Ctrl-C stops everyone."""
    interrupted = False

    def on_signal(signum, frame):
        nonlocal interrupted
        interrupted = True
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_signal)
    code = 1
    try:
        code = supervisor.watch(supervisor.start_all())
    except KeyboardInterrupt:
        interrupted = True
        log.warning("interrupted: stopping every service")
    finally:
        codes = supervisor.stop_all()
        signal.signal(signal.SIGTERM, previous)
    for name, child_code in codes.items():
        log.info("%s exited with %d", name, child_code)
    return (INTERRUPTED if interrupted else code), codes
