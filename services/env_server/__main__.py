"""Serve a Python environment over HTTP (protocol ``asyncgrpo.env/v1``).

    ENV_SERVER_API_TOKEN=<token> python -m services.env_server --environment my_env:MyEnv [--tools mod:fn ...]
        [--host 127.0.0.1] [--port 8010] [--session-idle-ttl-s 600]

The class has TRL's ``environment_factory`` shape (``reset(**row)``, tool methods, optional ``get_reward``);
``--tools`` adds plain tool functions (alone, they are the whole environment). Every path but ``/health`` needs
``Authorization: Bearer <token>``, the token read from ``$ENV_SERVER_API_TOKEN``: at least 32 characters and no
``change-me`` placeholder, else the server refuses to start (exit status 2). Give the generator the same one
(``[environment] bearer_token_env``).
"""

from __future__ import annotations

import asyncio
import os
import sys

from services.env_server.app import build, parse_args, serve, start_problems
from shared.telemetry import setup_logging


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__ or "", argv)
    problems = start_problems(args)
    if problems:
        sys.stderr.write("".join(f"env_server: {problem}\n" for problem in problems))
        raise SystemExit(2)
    setup_logging("env_server", os.environ.get("LOG_LEVEL", "INFO"))
    app, settings = build(args)
    asyncio.run(serve(app, settings))


if __name__ == "__main__":
    main()
