"""An example HTTP reward plugin (protocol ``asyncgrpo.reward/v1``), for compose and as a template.

It scores brevity: 1 for a completion of at most ``target_chars`` characters, falling linearly to 0 at
twice that. Replace :func:`score_item` with your judge (a model, a sandbox, a verifier) and keep the shell.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field

PROTOCOL = "asyncgrpo.reward/v1"


class Item(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str | list[dict[str, Any]]
    completion: str | list[dict[str, Any]]
    completion_ids: list[int] = []
    columns: dict[str, Any] = {}


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    protocol: str = Field(PROTOCOL, description="Must be asyncgrpo.reward/v1.")
    items: list[Item] = Field(max_length=4096)


class ScoreResponse(BaseModel):
    rewards: list[float | None]
    extra: dict[str, Any] = {}


def _text(completion: str | list[dict[str, Any]]) -> str:
    return completion if isinstance(completion, str) else str(completion[-1].get("content", ""))


def score_item(item: Item, target_chars: int) -> float | None:
    length = len(_text(item.completion))
    if length <= target_chars:
        return 1.0
    return max(0.0, 1.0 - (length - target_chars) / target_chars)


def build_app(target_chars: int = 200) -> FastAPI:
    app = FastAPI(title="asyncgrpo example reward plugin", description=__doc__)

    @app.get("/health", summary="Ready to score")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/score", response_model=ScoreResponse, summary="One reward per item, in order")
    async def score(request: ScoreRequest) -> ScoreResponse:
        if request.protocol != PROTOCOL:
            raise HTTPException(400, f"unsupported protocol {request.protocol!r}; this plugin speaks {PROTOCOL}")
        rewards = [score_item(item, target_chars) for item in request.items]
        return ScoreResponse(rewards=rewards, extra={"target_chars": target_chars})

    return app
