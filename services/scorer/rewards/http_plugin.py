"""HTTP reward plugins: protocol ``asyncgrpo.reward/v1`` and ``/v2`` (``shared/reward_protocol.py``), retries, auth.

    POST <url>   {"protocol": "asyncgrpo.reward/v1", "items": [{"prompt", "completion", "completion_ids",
                  "columns"}, ...]}  ->  200 {"rewards": [float | null, ...], "extra": {...}}
    GET <health_url>  -> 200 when the plugin can score (probed once at start)

A multi-turn tool-use group (``RewardBatch.multi_turn``) is sent as ``asyncgrpo.reward/v2``: its messages
carry tool calls and tool results, and each item its ``env_reward`` (taken out of the columns). Every other
group is sent as v1, byte for byte as before v2 existed, so a v1 plugin keeps working for single-turn runs.

Within one call (``shared.resilience.HttpEndpoint``), transport errors, timeouts, 5xx, 408 and 429 are
retried ``retries`` times with exponential backoff (each retry counted and logged at DEBUG); other answers
are not, since the same bytes would get the same answer. Whatever still fails raises
:class:`PluginCallError` with the HTTP status and an excerpt of the body; the caller
(``functions.run_function``) counts it against the reward's breaker, and the scoring loop holds the group
back (required reward) or uses NaN (optional). ``headers`` (including a bearer token) go with every request
and are never logged.

The request is built and encoded once per group, before anything is sent, with the protocol's own model: a
group it cannot carry (a column that is not plain JSON, one named after a reward-function argument, more
items than the protocol allows) raises :class:`RewardInputError`, a bad record rather than an outage, so
the plugin's breaker and ``/ready`` are left alone.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import httpx
from pydantic import ValidationError

from services.scorer.rewards.functions import RewardBatch, RewardError, RewardFunction, RewardInputError, RewardStats
from shared.columns import ENV_REWARD_COLUMN
from shared.resilience import HttpCallError, HttpEndpoint, body_excerpt
from shared.reward_protocol import PROTOCOL, PROTOCOL_V2, RewardRequest, RewardRequestV2, RewardResponse

log = logging.getLogger(__name__)


class PluginCallError(RewardError, HttpCallError):
    """The plugin gave no usable answer; the message names the status and quotes the body."""


def parse_answer(reply: httpx.Response, expected: int) -> list[float | None]:
    """The rewards of a 200 answer, or PluginCallError saying what is wrong with it."""
    try:
        body = RewardResponse.model_validate_json(reply.content)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        problem = f"{where}: {error['msg']}" if where else error["msg"]
        raise PluginCallError(
            f"HTTP 200 with a malformed answer ({problem}); {body_excerpt(reply.text)}", reply.status_code
        ) from None
    if len(body.rewards) != expected:
        raise PluginCallError(
            f"HTTP 200 with {len(body.rewards)} rewards for {expected} items; {body_excerpt(reply.text)}", 200
        )
    return list(body.rewards)


class HttpRewardPlugin(HttpEndpoint):
    """A reward function served over HTTP: the endpoint's retries, and its breaker counted by ``run_function``."""

    error_type = PluginCallError
    label: ClassVar[str] = "reward plugin"

    def __init__(
        self, name: str, url: str, client: httpx.AsyncClient, *, required: bool = True, **endpoint: Any
    ) -> None:
        super().__init__(name, url, client, subject="reward", logger=log, **endpoint)
        self.stats = RewardStats()
        self.function = RewardFunction(name, self.score, self.stats, required=required, breaker=self.breaker)

    def as_function(self) -> RewardFunction:
        return self.function

    async def probe(self, attempts: int = 5, delay_s: float = 1.0) -> bool:
        """GET the health URL until it answers 200; if it never does, open the breaker and return False.

        The scorer still starts: it is not ready, takes no rollouts while a required plugin's breaker is
        open, and lets one rollout through as the trial once ``breaker_reset_s`` has passed.
        """
        return await super().probe(attempts, delay_s)

    async def score(self, batch: RewardBatch) -> list[float | None]:
        body = request_body(batch)
        expected = len(batch)
        async with self.semaphore:
            return await self.request(
                lambda reply: parse_answer(reply, expected), body=body, context=f"group {batch.group_id}"
            )

    def on_retry(self, exc: BaseException | None, attempt: int, delay_s: float, context: str) -> None:
        status = getattr(exc, "status", None)
        if status is not None and status >= 500:
            self.stats.retried_5xx += 1
        else:
            self.stats.retried_transport += 1
        super().on_retry(exc, attempt, delay_s, context)


def request_body(batch: RewardBatch) -> bytes:
    """The group's request as JSON bytes, checked by the protocol's model; RewardInputError saying why the
    group cannot be sent (the record's fault: retrying would send the same bytes)."""
    try:
        if batch.multi_turn:
            request_v2 = RewardRequestV2.model_validate({"protocol": PROTOCOL_V2, "items": _items_v2(batch)})
            return request_v2.model_dump_json().encode()
        request = RewardRequest.model_validate({"protocol": PROTOCOL, "items": _items(batch)})
        return request.model_dump_json().encode()
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise RewardInputError(f"the group cannot be sent to the plugin: {where}: {error['msg']}") from None
    except (TypeError, ValueError) as exc:  # what serialising a value pydantic let through may raise
        raise RewardInputError(f"the group cannot be encoded as JSON: {type(exc).__name__}: {exc}") from None


def _items(batch: RewardBatch) -> list[dict[str, Any]]:
    return [
        {
            "prompt": batch.prompts[i],
            "completion": batch.completions[i],
            "completion_ids": list(batch.completion_ids[i]),
            "columns": {key: values[i] for key, values in batch.columns.items()},
        }
        for i in range(len(batch))
    ]


def _items_v2(batch: RewardBatch) -> list[dict[str, Any]]:
    """v2 items: v1's fields, with ``env_reward`` an item field of its own rather than a column."""
    rewards = batch.columns.get(ENV_REWARD_COLUMN) or [None] * len(batch)
    items = _items(batch)
    for item, env_reward in zip(items, rewards, strict=True):
        item["columns"].pop(ENV_REWARD_COLUMN, None)
        item["env_reward"] = env_reward
    return items
