"""Example reward plugin process: ``python -m services.reward_plugin [--port 9000] [--target-chars 200]``."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal

import uvicorn

from services.reward_plugin.app import build_app


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m services.reward_plugin", description=__doc__)
    parser.add_argument("--host", default=os.environ.get("PLUGIN_HOST", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("PLUGIN_PORT", "9000")))
    parser.add_argument("--target-chars", type=int, default=int(os.environ.get("PLUGIN_TARGET_CHARS", "200")))
    args = parser.parse_args()
    server = uvicorn.Server(
        uvicorn.Config(build_app(args.target_chars), host=args.host, port=args.port, log_level="warning")
    )
    asyncio.run(_serve(server))


async def _serve(server: uvicorn.Server) -> None:
    """Serve until SIGTERM or SIGINT, then exit with status 0."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, lambda: setattr(server, "should_exit", True))
    await server.serve()


if __name__ == "__main__":
    main()
