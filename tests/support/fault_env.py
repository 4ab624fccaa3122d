"""A real environment server (protocol ``asyncgrpo.env/v1``) that misbehaves on purpose, for the client's fault
tests.

It answers the protocol correctly unless faults were queued with ``POST /faults`` ``{"mode": ..., "count": n}``
(``count = -1``: until the next ``POST /faults``): the next n protocol calls (create, step, reward; never
DELETE) ``timeout`` (sleep 3 s, then answer) or ``error`` (``status``, default 503, body "overloaded").
``GET /calls`` counts calls by route and outcome; ``GET /sessions/count`` the open sessions. With ``--token``
every protocol route requires ``Authorization: Bearer <token>``.

    python -m tests.support.fault_env --port N [--token T]
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from collections import Counter
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

app = FastAPI()
calls: Counter = Counter()
script: dict[str, Any] = {"mode": "ok", "count": 0, "status": 503}
sessions: set[str] = set()
TOKEN = {"value": ""}
ECHO_TOOL = {
    "type": "function",
    "function": {
        "name": "echo",
        "description": "Echo the text.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
}


@app.get("/health")
async def health():
    return {"status": "ok", "protocol": "asyncgrpo.env/v1"}


@app.get("/calls")
async def get_calls():
    return dict(calls)


@app.get("/sessions/count")
async def count():
    return {"open": len(sessions)}


@app.post("/faults")
async def set_faults(request: Request):
    script.update({"status": 503, **(await request.json())})
    return script


async def _fault(request: Request, route: str) -> Response | None:
    """The scripted answer for this call, or None to answer it correctly."""
    if TOKEN["value"] and request.headers.get("authorization") != f"Bearer {TOKEN['value']}":
        calls[f"{route}:unauthorized"] += 1
        return PlainTextResponse("missing or wrong bearer token", status_code=401)
    mode = "ok"
    if script["count"] != 0:
        mode = script["mode"]
        if script["count"] > 0:
            script["count"] -= 1
    calls[f"{route}:{mode}"] += 1
    if mode == "timeout":
        await asyncio.sleep(3)
    if mode == "error":
        return PlainTextResponse("overloaded", status_code=script["status"])
    return None


@app.post("/sessions")
async def create(request: Request):
    body = await request.json()
    fault = await _fault(request, "create")
    if fault is not None:
        return fault
    session_id = uuid.uuid4().hex
    sessions.add(session_id)
    observation = f"row {body['row']['prompt']}"
    return JSONResponse({"session_id": session_id, "observation": observation, "tools": [ECHO_TOOL]}, 201)


@app.post("/sessions/{session_id}/step")
async def step(session_id: str, request: Request):
    body = await request.json()
    fault = await _fault(request, "step")
    if fault is not None:
        return fault
    results = [
        {
            "tool_call_id": call["id"],
            "name": call["name"],
            "content": str(call["arguments"].get("text")),
            "error": False,
        }
        for call in body["tool_calls"]
    ]
    return {"results": results, "done": False, "reward": None}


@app.post("/sessions/{session_id}/reward")
async def reward(session_id: str, request: Request):
    fault = await _fault(request, "reward")
    return fault if fault is not None else {"reward": 1.0}


@app.delete("/sessions/{session_id}")
async def close(session_id: str):
    calls["delete"] += 1
    if session_id not in sessions:
        return JSONResponse({"detail": "no such session"}, 404)
    sessions.discard(session_id)
    return Response(status_code=204)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token", default="")
    args = parser.parse_args()
    TOKEN["value"] = args.token
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
