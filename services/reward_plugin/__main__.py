"""Serve a Python reward function as an HTTP reward plugin (protocol ``asyncgrpo.reward/v1``).

    python -m services.reward_plugin --function my_module:my_reward [--port 9000] [--token-env PLUGIN_TOKEN]

Without ``--function`` it serves the example brevity reward (``--target-chars``). The module must be
importable (on PYTHONPATH or installed); the function has TRL's signature.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from services.reward_plugin.app import build_app, make_brevity
from shared.lifecycle import http_server, stop_on_signals
from shared.reward_protocol import load_reward_function
from shared.telemetry import setup_logging


def load_function(path: str) -> Callable[..., Any]:
    """The ``--function`` to serve; SystemExit with the loader's message when it cannot be imported."""
    try:
        return load_reward_function(path)
    except ValueError as exc:
        raise SystemExit(f"--function: {exc}") from exc


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m services.reward_plugin", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--function", help="module:function with TRL's reward signature (default: brevity)")
    parser.add_argument("--name", help="the reward's name in /health and logs (default: the function's)")
    parser.add_argument("--host", default=os.environ.get("PLUGIN_HOST", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("PLUGIN_PORT", "9000")))
    parser.add_argument("--target-chars", type=int, default=int(os.environ.get("PLUGIN_TARGET_CHARS", "200")))
    parser.add_argument(
        "--token-env",
        default="PLUGIN_TOKEN",
        help="environment variable holding the bearer token /score requires (unset or empty: no auth)",
    )
    args = parser.parse_args()
    setup_logging("reward_plugin", os.environ.get("LOG_LEVEL", "INFO"))
    function = load_function(args.function) if args.function else make_brevity(args.target_chars)
    name = args.name or (args.function.partition(":")[2] if args.function else "brevity")
    app = build_app(function, name=name, token=os.environ.get(args.token_env, ""))
    asyncio.run(_serve(app, args.host, args.port))


async def _serve(app: FastAPI, host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT, then exit with status 0."""
    stop = stop_on_signals()
    async with http_server(app, host, port):
        await stop.wait()


if __name__ == "__main__":
    main()
