"""A weight push that lands while a request samples, in both modes of ``generator.in_flight_at_push``, with the
real vLLM engine (CPU build), two tiny Llamas built here (A and B) and real Redis.

What a mode does to a request's KV cache shows in its behaviour logprobs, checked against transformers: the tokens
before the push are A's; after it, under ``recompute``, B's over the whole sequence (its KV recomputed under B),
and under ``keep`` B's reading the KV A computed (transformers' cache of A continued by B), far from B's own. A
request submitted after a push meets no prefix-cache block of one submitted before it (the cache's salt is new at
each load): its logprobs are B's exactly while the same prompt's blocks, computed under A, are still in the cache
(under ``keep``, which resets nothing, this fails without the salt).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from shared.keys import Keys
from tests.support.generator_service import (
    ENGINE_START_S,
    TOKEN,
    auth,
    engine_requests,
    generator_environment,
    reference_logprobs,
    registered_replica,
)
from tests.support.processes import start_service
from tests.support.redis_server import free_port
from tests.support.tiny_model import build_tiny_llama
from weight_sync.sender import WeightPusher

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

EXACT = 1e-3  # vLLM's behaviour logprobs against transformers under the same weights and KV (float32)
CONTEXT = 8192  # long requests: a pause lands mid-request even when a busy machine delays it by seconds
PROMPT = "".join(f"step {i}: the quick brown fox jumps over the lazy dog. " for i in range(3))  # 5 blocks of 32


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return tuple(build_tiny_llama(root / name, seed=seed, max_positions=CONTEXT) for name, seed in (("A", 1), ("B", 2)))


@pytest.fixture(scope="module", params=["recompute", "keep"])
def generator(request, models, redis_url):
    port = free_port()
    prefix = f"test-push-{request.param}-{int(time.time() * 1000) % 10**8}"
    env = {
        **generator_environment(models[0], port, "g1", redis_url, prefix),
        "GENERATOR_PUBLIC_URL": f"http://127.0.0.1:{port}",
        "GENERATOR_IN_FLIGHT_AT_PUSH": request.param,
        "GENERATOR_MAX_MODEL_LEN": str(CONTEXT),
    }
    service = start_service(f"generator-{request.param}", "services.generator", env)
    service.port, service.mode, service.keys = port, request.param, Keys(prefix)
    try:
        service.wait_for_line("ready on port", ENGINE_START_S)
        yield service
    finally:
        code = service.stop()
        assert code == 0, service.output()[-4000:]


class Pushes:
    """The learner's side: pushes A or B to the one replica as the next version."""

    def __init__(self, generator, models, registration, http: httpx.AsyncClient) -> None:
        self.generator, self.http, self.registration = generator, http, registration
        self.named = {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32) for name, path in models}
        self.pusher = WeightPusher(bind_port=0, advertise_host="127.0.0.1", api_token=TOKEN, bucket_bytes=256 << 10)

    async def push(self, model: str) -> int:
        served = (await self.http.get(f"{self.generator.url}/ready")).json()["policy_version"]
        named = list(self.named[model].named_parameters())
        await self.pusher.push(named, served + 1, [self.registration], self.http)
        return served + 1


@pytest.fixture
async def pushes(generator, models, redis_client):
    registration = await registered_replica(redis_client, generator.keys)
    async with httpx.AsyncClient(timeout=300) as http:
        yield Pushes(generator, zip("AB", models, strict=True), registration, http)


async def _generate(http, url: str, max_tokens: int) -> dict:
    """One completion of ``PROMPT`` at temperature 1; the end of text is masked (min_tokens = max_tokens)."""
    body = {"prompts": [PROMPT], "sampling": {"max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 1.0}}
    reply = await http.post(f"{url}/generate", json=body, headers=auth())
    assert reply.status_code == 200, reply.text
    return reply.json()["results"][0]


def _gaps(model_dir, result: dict, end_of_text: int) -> torch.Tensor:
    """|behaviour logprob - transformers' under ``model_dir``| per completion token, the end of text masked as
    vLLM's min_tokens masks it."""
    [completion] = result["completions"]
    reference = reference_logprobs(
        model_dir, result["prompt_token_ids"], completion["token_ids"], 1.0, banned=end_of_text
    )
    return (torch.tensor(completion["logprobs"]) - reference).abs()


def _end_of_text(model_dir) -> int:
    return AutoModelForCausalLM.from_pretrained(model_dir).config.eos_token_id


def _kept_gaps(models, result: dict, pushed_at: int, end_of_text: int) -> torch.Tensor:
    """|behaviour logprob - B's reading A's KV| per token from ``pushed_at`` on: A computed the KV of the prompt
    and of every token before the last one it sampled (vLLM's step computes the KV of its input token), B the
    rest."""
    a, b = (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32) for path in models)
    [completion] = result["completions"]
    tokens = completion["token_ids"]
    with torch.no_grad():
        cache = a(torch.tensor([result["prompt_token_ids"] + tokens[: pushed_at - 1]]), use_cache=True).past_key_values
        logits = b(torch.tensor([tokens[pushed_at - 1 : -1]]), past_key_values=cache, use_cache=True).logits[0]
    logits[:, end_of_text] = float("-inf")
    reference = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens[pushed_at:]).unsqueeze(1)).squeeze(1)
    return (torch.tensor(completion["logprobs"][pushed_at:]) - reference).abs()


async def _seconds_per_token(http, url: str) -> float:
    """This machine's decode time per token of one request (the slope between a short and a long one, so the
    HTTP round trip and the prefill drop out)."""
    timed = []
    for tokens in (32, 512):
        start = time.monotonic()
        await _generate(http, url, max_tokens=tokens)
        timed.append(time.monotonic() - start)
    return max((timed[1] - timed[0]) / (512 - 32), 1e-6)


async def _paused_mid_request(http, url: str, max_tokens: int, per_token: float, budget_s: float = 360.0):
    """A request of ``max_tokens`` sampling, the engine paused about a quarter of the way through it: the wait
    comes from the decode rate measured on this machine (an AMX Xeon samples the tiny model's 1800 tokens in
    well under a second, an AVX2 core in several), halved after each try that finished before the pause (this
    process's clock is rough here: on 2 cores beside the engine a sleep of 0.4 s has lasted 2.7 s). Tries go on
    for ``budget_s``: beside another test worker's engine the decode rate and the pause's latency change from one
    try to the next (seen: six 1.8k-token tries, waits 1.05 s down to 0.03 s, all ended before the pause)."""
    wait = 0.25 * max_tokens * per_token
    attempts, give_up_at = 0, time.monotonic() + budget_s
    while attempts < 6 or time.monotonic() < give_up_at:
        attempts += 1
        sampling = asyncio.create_task(_generate(http, url, max_tokens=max_tokens))
        deadline = time.monotonic() + 120
        while await engine_requests(http, url) < 1 and not sampling.done():
            assert time.monotonic() < deadline, "the request never reached the engine"
            await asyncio.sleep(0.005)
        await asyncio.sleep(wait)
        assert (await http.post(f"{url}/pause", headers=auth())).status_code == 200
        if not sampling.done():
            print(f"\ndecode {per_token * 1e3:.3f} ms/token: paused {wait:.3f} s after the request reached the engine")
            return sampling
        assert (await http.post(f"{url}/resume", headers=auth())).status_code == 200
        await sampling
        print(f"\nthe request ended before a pause {wait:.3f} s after it reached the engine: halving the wait")
        wait = max(wait / 2, 0.01)
    raise AssertionError(f"{attempts} requests of {max_tokens} tokens each ended before the pause")


async def test_a_push_mid_request_recomputes_its_kv_or_keeps_it(generator, models, pushes):
    http, url = pushes.http, generator.url
    await pushes.push("A")
    await _generate(http, url, max_tokens=2)  # the first step after a push finishes its loading (CPU kernels)
    max_tokens = CONTEXT - 5 * 32 - 64  # as long as the context allows (the prompt is 5 blocks of 32)
    sampling = await _paused_mid_request(http, url, max_tokens, await _seconds_per_token(http, url))
    try:  # the push lands mid-request
        version = await pushes.push("B")
    finally:  # never leave the module's engine paused for the next test
        assert (await http.post(f"{url}/resume", headers=auth())).status_code == 200
    result = await sampling
    assert (result["policy_version"], result["finished_policy_version"]) == (version - 1, version)

    end_of_text = _end_of_text(models[0])
    under_a, under_b = _gaps(models[0], result, end_of_text), _gaps(models[1], result, end_of_text)
    pushed_at = int((under_a > EXACT).nonzero()[0])  # the first token not sampled by A
    print(
        f"\n{generator.mode}: {pushed_at} of {len(under_a)} tokens sampled before the push; after it "
        f"|behaviour - B| max {float(under_b[pushed_at:].max()):.2e}, median {float(under_b[pushed_at:].median()):.2e}"
    )
    assert 1 < pushed_at < len(under_a) - 50, "the push did not land mid-request"
    if generator.mode == "recompute":  # every token after the push: B's, over KV B recomputed
        assert float(under_b[pushed_at:].max()) < EXACT
    else:  # B reading the KV A computed: exactly that, and nowhere near B's own
        kept = _kept_gaps(models, result, pushed_at, end_of_text)
        print(f"|behaviour - B over A's KV| max {float(kept.max()):.2e}")
        assert float(kept.max()) < EXACT
        assert float(under_b[pushed_at:].median()) > 100 * EXACT
    assert f"1 prompts in flight ({'kept' if generator.mode == 'keep' else 'recomputed'})" in generator.output()


async def test_a_request_after_a_push_reads_no_block_cached_before_it(generator, models, pushes):
    http, url = pushes.http, generator.url
    end_of_text = _end_of_text(models[0])
    await pushes.push("A")
    under_a = _gaps(models[0], await _generate(http, url, max_tokens=8), end_of_text)
    assert float(under_a.max()) < EXACT  # the prompt's blocks are now cached, computed under A
    await pushes.push("B")
    for _ in range(2):  # the second reads the blocks the first computed under B
        under_b = _gaps(models[1], await _generate(http, url, max_tokens=8), end_of_text)
        assert float(under_b.max()) < EXACT, under_b
