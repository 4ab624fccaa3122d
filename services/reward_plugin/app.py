"""An HTTP reward plugin (protocol ``asyncgrpo.reward/v1`` and ``/v2``) around any Python reward function.

The function has TRL's signature, ``f(prompts, completions, completion_ids, **columns) -> list[float |
None]``, sync or async; it receives one group (the request's items) exactly as the scorer would call it
in-process: a v2 (multi-turn tool-use) group's completions are message lists with tool calls and tool
results, and its items' ``env_reward`` arrives as the ``env_reward`` column. Routes: ``POST /score`` (either
protocol; ``Authorization: Bearer <token>``), ``GET /health`` (200 = ready to score), ``GET /schema`` and
``GET /schema/v2`` (each protocol's JSON Schema). The token is checked before the body is read,
and the body is capped (:class:`shared.http.RequestGuard`, as in the services); a request that is not the
protocol, NaN included, gets a 422 that does not quote it. A function that raises, or answers something
other than one finite number or None per item, gets a 500 whose body says why (the scorer retries 5xx, then
holds the group if the reward is required).

The default function, :func:`make_brevity`, scores brevity: 1 for a completion of at most ``target_chars``
characters, falling linearly to 0 at twice that.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from shared.columns import ENV_REWARD_COLUMN
from shared.http import check_routes, guarded_app
from shared.reward_protocol import AnyRewardRequest, MessageV2, RewardItem, RewardItemV2, RewardResponse, json_schema

log = logging.getLogger("services.reward_plugin")

# The largest legitimate request is one group: G items, each with its prompt, completion text and
# completion_ids. On the wire a token costs at most ~15 bytes (<= 8 of UTF-8 text, <= 7 of a 6-digit id and
# its comma), so 64 completions of 32k tokens come to ~31 MB: 32 MiB takes them; raise it for more.
DEFAULT_MAX_REQUEST_BYTES = 32 << 20
PUBLIC_PATHS = frozenset({"/health", "/schema", "/schema/v2"})


def completion_text(completion: str | list[dict[str, Any]]) -> str:
    """A completion's text: the string itself, or the last chat message's content."""
    return completion if isinstance(completion, str) else str(completion[-1].get("content", ""))


def make_brevity(target_chars: int = 200) -> Callable[..., list[float]]:
    def brevity(completions: list, **kwargs: Any) -> list[float]:
        lengths = [len(completion_text(c)) for c in completions]
        return [1.0 if n <= target_chars else max(0.0, 1.0 - (n - target_chars) / target_chars) for n in lengths]

    return brevity


def trl_arguments(items: list[RewardItem] | list[RewardItemV2]) -> dict[str, Any]:
    """The request's items as TRL's keyword arguments: one list entry per item (a column missing from an
    item is None there); a v2 request's ``env_reward`` as the column of that name."""
    names = sorted({name for item in items for name in item.columns})
    kwargs = {
        "prompts": [_plain(item.prompt) for item in items],
        "completions": [_plain(item.completion) for item in items],
        "completion_ids": [item.completion_ids for item in items],
        **{name: [item.columns.get(name) for item in items] for name in names},
    }
    if items and isinstance(items[0], RewardItemV2):
        kwargs[ENV_REWARD_COLUMN] = [item.env_reward for item in items if isinstance(item, RewardItemV2)]
    return kwargs


def _plain(value: str | list) -> str | list[dict[str, Any]]:
    """A prompt or completion as TRL passes it: the string, or message dicts (v2: unset fields left out)."""
    if isinstance(value, str):
        return value
    return [m.model_dump(mode="json") if isinstance(m, MessageV2) else m.model_dump() for m in value]


def check_rewards(values: Any, expected: int) -> list[float | None]:
    """One finite number or None per item, else ValueError saying what is wrong."""
    if not isinstance(values, list | tuple) or len(values) != expected:
        size = f"{len(values)} values" if isinstance(values, list | tuple) else type(values).__name__
        raise ValueError(f"the reward function returned {size} for {expected} items")
    out: list[float | None] = []
    for value in values:
        if value is not None and (isinstance(value, str) or not math.isfinite(float(value))):
            raise ValueError(f"the reward function returned {value!r}; rewards are finite numbers or None")
        out.append(None if value is None else float(value))
    return out


async def call_reward(function: Callable[..., Any], items: list[RewardItem] | list[RewardItemV2]) -> list[float | None]:
    kwargs = trl_arguments(items)
    if inspect.iscoroutinefunction(function):
        values = await function(**kwargs)
    else:
        values = await asyncio.to_thread(function, **kwargs)
    return check_rewards(values, len(items))


def build_app(
    function: Callable[..., Any],
    *,
    token: str | None,
    name: str = "reward",
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    api_docs: bool = False,
) -> FastAPI:
    """The plugin app: every path but ``/health`` and ``/schema`` needs ``token`` (an empty one opens none);
    ``token=None`` serves them to anyone (``--allow-no-token``, local development on the loopback)."""
    app = guarded_app(
        title=f"asyncgrpo reward plugin: {name}",
        description=__doc__ or "",
        token=token,
        public=PUBLIC_PATHS,
        max_request_bytes=max_request_bytes,
        limit_setting="--max-request-bytes (PLUGIN_MAX_REQUEST_BYTES)",
        api_docs=api_docs,
    )
    schemas = {1: json_schema(1), 2: json_schema(2)}  # equal to the committed shared/schemas/reward_v*.json (tested)

    @app.get("/health", summary="200 when the plugin can score")
    async def health() -> dict[str, str]:
        return {"status": "ok", "reward": name}

    @app.get("/schema", summary="The protocol's JSON Schema (asyncgrpo.reward/v1)")
    async def get_schema() -> dict[str, Any]:
        return schemas[1]

    @app.get("/schema/v2", summary="The protocol's JSON Schema (asyncgrpo.reward/v2, multi-turn tool use)")
    async def get_schema_v2() -> dict[str, Any]:
        return schemas[2]

    @app.post("/score", response_model=RewardResponse, summary="One reward per item, in order")
    async def score(request: AnyRewardRequest) -> Any:
        try:
            rewards = await call_reward(function, request.items)
        except Exception as exc:
            log.exception("reward %s failed on a group of %d items", name, len(request.items))
            return JSONResponse({"detail": f"{type(exc).__name__}: {exc}"}, status_code=500)
        return RewardResponse(rewards=rewards, extra={"reward": name})

    check_routes(app)
    return app
