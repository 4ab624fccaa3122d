"""The generator's HTTP shell: health, readiness, metrics, ad-hoc sampling, pause/resume, weight updates.

``/health``, ``/ready`` and ``/metrics`` are open; every other endpoint needs the bearer token (401 without
it, checked before the body is read; see :mod:`shared.http`). The routes read the service through
:class:`GeneratorAppState`; the engine is there once it has loaded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from services.generator.engine import Engine, InvalidPromptError
from services.generator.weight_update import WeightUpdateError
from shared.app import Probes, Readiness, service_app
from shared.http import Authorized, FiniteJsonRoute, ServiceState, state_dependency
from shared.records import ChatMessage, SamplingSpec, WeightVersionAnnouncement

router = APIRouter(route_class=FiniteJsonRoute)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompts: list[Annotated[str, Field(min_length=1)] | Annotated[list[ChatMessage], Field(min_length=1)]] = Field(
        min_length=1, max_length=256, description="Text prompts, or chat prompts (lists of messages)."
    )
    n: int = Field(1, ge=1, le=64, description="Completions per prompt.")
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)


class GeneratedCompletion(BaseModel):
    text: str
    token_ids: list[int]
    logprobs: list[float] = Field(description="Behaviour logprob of each sampled token.")
    finish_reason: str


class GeneratedPrompt(BaseModel):
    prompt_token_ids: list[int]
    completions: list[GeneratedCompletion]
    policy_version: int = Field(description="Policy version when sampling started.")
    finished_policy_version: int = Field(description="Policy version when the last completion finished.")
    lowest_policy_version: int = Field(
        description="The lowest policy version served while it sampled: below policy_version, the weights went back "
        "(a restarted learner's push) and some tokens were sampled by older weights than the stamp."
    )


class GenerateResponse(BaseModel):
    policy_version: int
    results: list[GeneratedPrompt]


class Status(BaseModel):
    status: str
    policy_version: int | None = None
    detail: str = ""


class WeightUpdateResult(BaseModel):
    policy_version: int
    bytes: float
    seconds: float
    pause_seconds: float = 0.0
    join_seconds: float = 0.0
    transfer_seconds: float = Field(0.0, description="receiving and loading, overlapped")
    receive_wait_seconds: float = Field(0.0, description="part of transfer spent waiting for data")
    load_seconds: float = Field(0.0, description="part of transfer spent loading into the engine")
    deferred_handles: int = Field(0, description="CPU kernel handles left to the engine's first step after the push")
    close_seconds: float = Field(0.0, description="leaving the push's group")
    reset_seconds: float = Field(0.0, description="preempting the in-flight requests for their recompute")
    resume_seconds: float = 0.0
    in_flight_requests: int = Field(0, description="prompts sampling when the push paused the engine")
    in_flight_at_push: str = Field("", description="what the push did to them: recompute or keep")
    transport: str = Field("", description="gloo, nccl, ipc or shm")
    direct_load: bool = Field(False, description="copied straight into the parameters (else layerwise reload)")
    in_place_bytes: float = Field(
        0.0, description="bytes received straight into parameters that are views of the receive buffers (CPU)"
    )
    copied_shared_bytes: float = Field(
        0.0, description="shm: bytes of layers that kept pointing into the learner's shared memory, copied"
    )


@dataclass(kw_only=True)
class GeneratorAppState(ServiceState):
    generator_id: str
    announced_version: Callable[[], Awaitable[int | None]]  # the version the learner last announced
    engine: Engine | None = None  # set once loaded


StateDep = Annotated[GeneratorAppState, Depends(state_dependency(GeneratorAppState))]


def get_engine(state: StateDep) -> Engine:
    if state.engine is None:
        raise HTTPException(503, "the engine is still starting")
    return state.engine


EngineDep = Annotated[Engine, Depends(get_engine)]


async def readiness(state: GeneratorAppState) -> Readiness:
    """Ready when the engine is loaded, its last weight update applied, and it serves the announced version."""
    engine = state.engine
    if engine is None:
        return Readiness(False, Status(status="starting", detail="engine loading"))
    announced = await state.announced_version()
    if not engine.weights_ok:
        detail = "the last weight update failed; waiting for the learner's next push"
    elif announced is not None and engine.policy_version < announced:
        detail = f"serving version {engine.policy_version}, learner announced {announced}"
    else:
        return Readiness(True, Status(status="ready", policy_version=engine.policy_version))
    return Readiness(False, Status(status="not_ready", policy_version=engine.policy_version, detail=detail))


PROBES = Probes(
    model=Status, ready=readiness, ready_summary="The engine is loaded and serves the announced weight version"
)


async def _generate_one(
    engine: Engine, prompt: str | list[ChatMessage], sampling: SamplingSpec, n: int
) -> GeneratedPrompt:
    ids = engine.tokenize(prompt if isinstance(prompt, str) else tuple(prompt))
    group = await engine.sample(ids, sampling, n)
    return GeneratedPrompt(
        prompt_token_ids=ids,
        completions=[
            GeneratedCompletion(
                text=c.text,
                token_ids=c.token_ids.tolist(),
                logprobs=c.behaviour_logprobs.tolist(),
                finish_reason=c.finish_reason,
            )
            for c in group.completions
        ],
        policy_version=group.policy_version,
        finished_policy_version=group.finished_policy_version,
        lowest_policy_version=group.lowest_policy_version,
    )


@router.post(
    "/generate",
    response_model=GenerateResponse,
    dependencies=[Authorized],
    summary="Ad-hoc sampling",
    responses={422: {"description": "Invalid request, a prompt too long, or over the token budget"}},
)
async def generate(body: GenerateRequest, engine: EngineDep) -> GenerateResponse:
    asked = len(body.prompts) * body.n * body.sampling.max_tokens
    if asked > engine.settings.generate_token_budget:
        raise HTTPException(
            422,
            f"this request may generate {asked} tokens (prompts x n x max_tokens); the limit "
            f"is {engine.settings.generate_token_budget} (generator.generate_token_budget)",
        )
    try:
        results = await asyncio.gather(*(_generate_one(engine, p, body.sampling, body.n) for p in body.prompts))
    except InvalidPromptError as exc:
        raise HTTPException(422, str(exc)) from None
    return GenerateResponse(policy_version=engine.policy_version, results=list(results))


@router.post("/pause", response_model=Status, dependencies=[Authorized], summary="Stop sampling (in-flight kept)")
async def pause(engine: EngineDep) -> Status:
    await engine.pause()
    return Status(status="paused", policy_version=engine.policy_version)


@router.post(
    "/resume",
    response_model=Status,
    dependencies=[Authorized],
    summary="Resume sampling",
    responses={409: {"description": "The last weight update failed"}},
)
async def resume(engine: EngineDep) -> Status:
    try:
        await engine.resume()
    except RuntimeError as exc:
        raise HTTPException(409, str(exc)) from None
    return Status(status="running", policy_version=engine.policy_version)


@router.post(
    "/weights/update",
    response_model=WeightUpdateResult,
    dependencies=[Authorized],
    summary="Receive a weight push from the learner and serve the new version",
    responses={
        409: {"description": "Version older than the one served"},
        422: {"description": "Not applied: no rank for this replica, or the learner's store is unreachable"},
        502: {"description": "The transfer failed midway; sampling stays paused until a push succeeds"},
    },
)
async def update_weights(body: WeightVersionAnnouncement, state: StateDep, engine: EngineDep) -> WeightUpdateResult:
    generator_id = state.generator_id
    if body.policy_version < engine.policy_version and not body.reset:
        raise HTTPException(409, f"serving version {engine.policy_version}; refusing older {body.policy_version}")
    if not body.participates(generator_id):
        raise HTTPException(422, f"the push names no rank for {generator_id}")
    try:
        result = await engine.update_weights(body, generator_id)
    except WeightUpdateError as exc:
        raise HTTPException(422 if exc.applied_nothing else 502, str(exc)) from None
    return WeightUpdateResult(policy_version=engine.policy_version, **result)


@router.get("/weights/fingerprint", dependencies=[Authorized], summary="Sum of every parameter, per name")
async def fingerprint(engine: EngineDep) -> dict[str, float]:
    return await engine.fingerprint()


def build_app(state: GeneratorAppState) -> FastAPI:
    return service_app(
        state,
        PROBES,
        title="asyncgrpo generator",
        description="Samples G completions per prompt with vLLM and takes new weights without a restart.",
        routers=[router],
    )
