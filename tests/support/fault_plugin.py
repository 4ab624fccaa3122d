"""A real HTTP reward plugin process that misbehaves on purpose, for the scorer's fault tests.

Fixed routes: /ok/score answers correctly; /slow/score sleeps 5 s; /error/score answers 500;
/malformed/score answers invalid JSON; /wrong-count/score answers one reward too few.

Scripted route: /score answers correctly unless faults were queued with ``POST /faults``
``{"mode": ..., "count": n}`` (``count = -1``: until the next ``POST /faults``): the next n calls
``timeout`` (sleep 3 s), ``error`` (``status``, default 503, body "overloaded"), ``malformed`` (not JSON),
``wrong-count`` (one reward too few) or ``null`` (null for the first item). ``GET /calls`` counts calls
per outcome. With ``--token`` every route but /calls and /faults requires ``Authorization: Bearer <token>``.

The reward is the completion's number of token ids, so a test can check every value it gets back.
It also holds Python reward functions that fail on purpose (for in-process scorers).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections import Counter
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

app = FastAPI()
calls: Counter = Counter()
script: dict[str, Any] = {"mode": "ok", "count": 0, "status": 503}
TOKEN = {"value": ""}


def _authorized(request: Request) -> bool:
    return not TOKEN["value"] or request.headers.get("authorization") == f"Bearer {TOKEN['value']}"


@app.get("/health")
@app.get("/{mode}/health")
async def health(request: Request, mode: str = "ok"):
    if not _authorized(request):
        return PlainTextResponse("missing or wrong bearer token", status_code=401)
    return {"status": "ok"}


@app.get("/calls")
async def get_calls():
    return dict(calls)


@app.post("/faults")
async def set_faults(request: Request):
    script.update({"status": 503, **(await request.json())})
    return script


def _next_mode() -> str:
    if script["count"] == 0:
        return "ok"
    if script["count"] > 0:
        script["count"] -= 1
    return script["mode"]


@app.post("/score")
async def scripted(request: Request):
    if not _authorized(request):
        calls["unauthorized"] += 1
        return PlainTextResponse("missing or wrong bearer token", status_code=401)
    return await _answer(_next_mode(), await request.json(), status=script["status"])


@app.post("/{mode}/score")
async def fixed(mode: str, request: Request):
    return await _answer(mode, await request.json())


async def _answer(mode: str, body: dict, status: int = 500):
    calls[mode] += 1
    items = body["items"]
    if mode in ("slow", "timeout"):
        await asyncio.sleep(5 if mode == "slow" else 3)
    if mode == "error":
        return PlainTextResponse("overloaded", status_code=status)
    if mode == "malformed":
        return PlainTextResponse('{"rewards": [1.0,', media_type="application/json")
    rewards: list[float | None] = [float(len(item["completion_ids"])) for item in items]
    if mode == "wrong-count":
        rewards = rewards[:-1]
    if mode == "null":
        rewards[0] = None
    return JSONResponse({"rewards": rewards, "extra": {"mode": mode}})


# Python reward functions for in-process fault tests ------------------------------------------------------

python_calls: Counter = Counter()


def flaky_length(completions, completion_ids, **kwargs):
    """Raises on its first three calls, then gives each completion's number of token ids."""
    python_calls["flaky"] += 1
    if python_calls["flaky"] <= 3:
        raise ConnectionError(f"judge model still loading (call {python_calls['flaky']})")
    return [float(len(ids)) for ids in completion_ids]


def always_raises(completions, **kwargs):
    python_calls["always"] += 1
    raise ValueError("this reward has a bug")


# hangs_first: how many calls hang, and the event that ends every hang (set it when the test is over).
hang_script: dict[str, Any] = {"calls": 0, "release": threading.Event()}


def hangs_first(completions, completion_ids, **kwargs):
    """Hangs on its first ``hang_script["calls"]`` calls (until ``hang_script["release"]`` is set, at most
    60 s), then gives each completion's number of token ids."""
    python_calls["hang"] += 1
    if python_calls["hang"] <= hang_script["calls"]:
        hang_script["release"].wait(60)
    return [float(len(ids)) for ids in completion_ids]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token", default="")
    args = parser.parse_args()
    TOKEN["value"] = args.token
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
