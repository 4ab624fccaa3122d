"""A service's real HTTP app over a hand-written state, served by uvicorn in a process of its own, so a test
can watch the real server read (or not read) a hostile body and measure the process from outside.

    GUARD_TOKEN=<token> python -m tests.support.guarded_server {generator,scorer,learner} PORT MAX_REQUEST_BYTES

The generator's engine is a stand-in that is never asked to sample (the tests send no valid request); the
scorer and learner have no loop. Every route, the guard and the body parsing are the services' own.
"""

from __future__ import annotations

import os
import sys

import uvicorn
from fastapi import FastAPI


class IdleEngine:
    """Loaded and serving version 0, so requests reach validation (with no engine a route answers 503 first)."""

    weights_ok = True
    policy_version = 0


def build(service: str, token: str, limit: int) -> FastAPI:
    common = {"api_token": token, "max_request_bytes": limit}
    if service == "generator":
        from services.generator.app import GeneratorAppState, build_app

        async def announced() -> None:
            return None

        state = GeneratorAppState(**common, generator_id="g", announced_version=announced, engine=IdleEngine())
        return build_app(state)
    if service == "scorer":
        from services.scorer.app import ScorerAppState
        from services.scorer.app import build_app as scorer_app

        return scorer_app(ScorerAppState(**common, not_ready_reason=lambda: ""))
    from services.learner.app import LearnerAppState
    from services.learner.app import build_app as learner_app

    return learner_app(LearnerAppState(**common))


if __name__ == "__main__":
    name, port, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    uvicorn.run(build(name, os.environ["GUARD_TOKEN"], limit), host="127.0.0.1", port=port, log_level="warning")
