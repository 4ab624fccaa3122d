"""The reward plugin's command line: its arguments and the checks it runs before it serves (the token).

The options are documented in :mod:`services.reward_plugin.__main__` (``--help``)."""

from __future__ import annotations

import argparse
import ipaddress
import os
from collections.abc import Callable
from typing import Any

from services.reward_plugin.app import DEFAULT_MAX_REQUEST_BYTES
from shared.config.base import TOKEN_HOWTO, token_problem
from shared.reward_protocol import load_reward_function

MIN_REQUEST_BYTES = 1024


def load_function(path: str) -> Callable[..., Any]:
    """The ``--function`` to serve; SystemExit with the loader's message when it cannot be imported."""
    try:
        return load_reward_function(path)
    except ValueError as exc:
        raise SystemExit(f"--function: {exc}") from exc


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="python -m services.reward_plugin", description=description, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--function", help="module:function with TRL's reward signature (default: brevity)")
    parser.add_argument("--name", help="the reward's name in /health and logs (default: the function's)")
    parser.add_argument("--host", default=env("PLUGIN_HOST", "127.0.0.1"), help="address to bind ($PLUGIN_HOST)")
    parser.add_argument("--port", type=int, default=int(env("PLUGIN_PORT", "9000")))
    parser.add_argument("--target-chars", type=int, default=int(env("PLUGIN_TARGET_CHARS", "200")))
    parser.add_argument(
        "--token-env", default="PLUGIN_TOKEN", help="environment variable holding the bearer token /score requires"
    )
    parser.add_argument(
        "--allow-no-token", action="store_true", help="serve /score without a token (loopback host only; local dev)"
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=int(env("PLUGIN_MAX_REQUEST_BYTES", str(DEFAULT_MAX_REQUEST_BYTES))),
        help="largest request body taken, 413 past it ($PLUGIN_MAX_REQUEST_BYTES; default: a group of 64 "
        "completions of 32k tokens)",
    )
    parser.add_argument("--api-docs", action="store_true", help="serve /docs and /openapi.json (behind the token)")
    return parser.parse_args(argv)


def start_problems(token: str, args: argparse.Namespace) -> list[str]:
    """What keeps the plugin from starting, each naming the fix: a weak token, or none without the opt-out."""
    if args.max_request_bytes < MIN_REQUEST_BYTES:
        return [f"--max-request-bytes is {args.max_request_bytes}; at least {MIN_REQUEST_BYTES}"]
    if token:
        problem = token_problem(token, f"${args.token_env}")
        return [problem] if problem else []
    if not args.allow_no_token:
        return [
            f"${args.token_env} is not set: /score needs a bearer token; {TOKEN_HOWTO}, set it here and give the "
            "scorer the same (the reward's bearer_token_env). For local development on 127.0.0.1, --allow-no-token"
        ]
    if not is_loopback(args.host):
        return [
            f"--allow-no-token would serve /score to anyone who reaches {args.host}: bind 127.0.0.1 (--host) or "
            f"set ${args.token_env}"
        ]
    return []


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
