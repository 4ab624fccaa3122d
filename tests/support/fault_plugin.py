"""A real HTTP reward plugin process whose routes misbehave on purpose, for the scorer's fault tests.

/ok/score answers correctly; /slow/score sleeps past any sane timeout; /error/score answers 500;
/malformed/score answers invalid JSON; /wrong-count/score answers one reward too few.
"""

from __future__ import annotations

import argparse
import asyncio

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

app = FastAPI()
calls: dict[str, int] = {}


@app.get("/{mode}/health")
async def health(mode: str):
    return {"status": "ok"}


@app.get("/calls")
async def get_calls():
    return calls


@app.post("/{mode}/score")
async def score(mode: str, request: Request):
    calls[mode] = calls.get(mode, 0) + 1
    items = (await request.json())["items"]
    if mode == "slow":
        await asyncio.sleep(5)
    if mode == "error":
        return PlainTextResponse("boom", status_code=500)
    if mode == "malformed":
        return PlainTextResponse('{"rewards": [1.0,', media_type="application/json")
    rewards = [float(len(item["completion_ids"])) for item in items]
    if mode == "wrong-count":
        rewards = rewards[:-1]
    return JSONResponse({"rewards": rewards, "extra": {"mode": mode}})


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    uvicorn.run(app, host="127.0.0.1", port=parser.parse_args().port, log_level="warning")
