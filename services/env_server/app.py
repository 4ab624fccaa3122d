"""The environment server's command line and wiring: its arguments, the checks before it serves (the token, the
environment loading), and the serve loop. The app itself is ``environments/server.py``; the options are
documented in :mod:`services.env_server.__main__` (``--help``)."""

from __future__ import annotations

import argparse
import logging
import os

from fastapi import FastAPI

from environments.python_env import python_environment
from environments.server import build_app
from shared.config.environment import ENV_SERVER_TOKEN_ENV, EnvServerSettings
from shared.lifecycle import http_server, stop_on_signals

log = logging.getLogger("services.env_server")


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="python -m services.env_server", description=description, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--environment", help="module:Class of TRL's environment_factory shape")
    parser.add_argument("--tools", nargs="+", default=[], metavar="MOD:FN", help="plain tool functions")
    parser.add_argument("--host", default=env("ENV_SERVER_HOST", "127.0.0.1"), help="address to bind")
    parser.add_argument("--port", type=int, default=int(env("ENV_SERVER_PORT", "8010")))
    parser.add_argument(
        "--session-idle-ttl-s", type=float, default=600.0, help="close a session idle this long (seconds)"
    )
    parser.add_argument("--concurrency", type=int, default=16, help="worker threads for sync methods")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="seconds per call before it is a fault")
    parser.add_argument("--max-request-bytes", type=int, default=4 << 20, help="413 past this body size")
    parser.add_argument(
        "--max-sessions",
        type=int,
        default=EnvServerSettings.model_fields["max_sessions"].default,
        help="429 for a create past this many open sessions",
    )
    parser.add_argument("--token-env", default=ENV_SERVER_TOKEN_ENV, help="variable holding the bearer token")
    parser.add_argument("--api-docs", action="store_true", help="serve /docs and /openapi.json (behind the token)")
    return parser.parse_args(argv)


def settings_of(args: argparse.Namespace) -> EnvServerSettings:
    return EnvServerSettings(
        host=args.host,
        port=args.port,
        session_idle_ttl_s=args.session_idle_ttl_s,
        api_token=os.environ.get(args.token_env) or None,
        max_request_bytes=args.max_request_bytes,
        max_sessions=args.max_sessions,
    )


def start_problems(args: argparse.Namespace) -> list[str]:
    """What keeps the server from starting, each naming the fix."""
    if not args.environment and not args.tools:
        return ["name the environment: --environment module:Class and/or --tools module:function ..."]
    try:
        settings = settings_of(args)
    except ValueError as exc:
        return [str(exc)]
    return [problem.replace(f"${ENV_SERVER_TOKEN_ENV}", f"${args.token_env}") for problem in settings.start_problems()]


def build(args: argparse.Namespace) -> tuple[FastAPI, EnvServerSettings]:
    """The app serving the environment ``args`` name; SystemExit naming the problem when it cannot load."""
    settings = settings_of(args)
    name = args.environment or f"tools {','.join(args.tools)}"
    try:
        environment = python_environment(
            args.environment, args.tools, name=name, concurrency=args.concurrency, timeout_s=args.timeout_s
        )
    except ValueError as exc:
        raise SystemExit(f"env_server: {exc}") from exc
    assert settings.api_token is not None  # start_problems refused a missing one
    app = build_app(
        environment,
        token=settings.api_token.get_secret_value(),
        session_idle_ttl_s=settings.session_idle_ttl_s,
        max_request_bytes=settings.max_request_bytes,
        max_sessions=settings.max_sessions,
        api_docs=args.api_docs,
    )
    return app, settings


async def serve(app: FastAPI, settings: EnvServerSettings) -> None:
    """Serve until SIGTERM or SIGINT, then exit with status 0 (open sessions are closed first)."""
    stop = stop_on_signals()
    async with http_server(app, settings.host, settings.port) as port:
        log.info("environment server %s listening on %s:%d", app.title, settings.host, port)
        await stop.wait()
