"""Serve a Python reward function as an HTTP reward plugin (protocol ``asyncgrpo.reward/v1``).

    PLUGIN_TOKEN=<token> python -m services.reward_plugin --function my_module:my_reward [--port 9000]

Without ``--function`` it serves the example brevity reward (``--target-chars``). The module is looked for in
the working directory, then on PYTHONPATH (or installed); the function has TRL's signature.

``/score`` needs ``Authorization: Bearer <token>``, the token read from ``$PLUGIN_TOKEN`` (or the variable
``--token-env`` names): at least 32 characters and no ``change-me`` placeholder, else the plugin refuses to
start (exit status 2). Give the scorer the same one (the reward's ``bearer_token_env``). ``--allow-no-token``
serves without one, on a loopback address only (local development). It binds 127.0.0.1 unless ``--host``
(``$PLUGIN_HOST``) says otherwise, e.g. ``0.0.0.0`` in a container the scorer reaches over the network.
"""

from __future__ import annotations

import asyncio
import os
import sys

from fastapi import FastAPI

from services.reward_plugin.app import build_app, make_brevity
from services.reward_plugin.cli import load_function, parse_args, start_problems
from shared.lifecycle import http_server, stop_on_signals
from shared.telemetry import setup_logging


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__ or "", argv)
    token = os.environ.get(args.token_env, "")
    problems = start_problems(token, args)
    if problems:
        print("\n".join(f"reward_plugin: {problem}" for problem in problems), file=sys.stderr)
        raise SystemExit(2)
    setup_logging("reward_plugin", os.environ.get("LOG_LEVEL", "INFO"))
    function = load_function(args.function) if args.function else make_brevity(args.target_chars)
    name = args.name or (args.function.partition(":")[2] if args.function else "brevity")
    app = build_app(
        function, name=name, token=token or None, max_request_bytes=args.max_request_bytes, api_docs=args.api_docs
    )
    asyncio.run(_serve(app, args.host, args.port))


async def _serve(app: FastAPI, host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT, then exit with status 0."""
    stop = stop_on_signals()
    async with http_server(app, host, port):
        await stop.wait()


if __name__ == "__main__":
    main()
