"""A generator service in tests: its environment, its API token, and what tests read from it (its engine gauge,
its registration) or check it against (transformers' logprobs)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from shared.registry import RegistryStats, live_generators

TOKEN = "test-token-" + "x" * 32
ENGINE_START_S = 300


def generator_environment(model: Path, port: int, generator_id: str, redis_url: str, prefix: str) -> dict[str, str]:
    """A generator of the tiny model on core 0, float32, in ``prefix``'s streams."""
    return {
        "GENERATOR_MODEL": str(model),
        "GENERATOR_PORT": str(port),
        "GENERATOR_GENERATOR_ID": generator_id,
        "GENERATOR_MAX_MODEL_LEN": "512",
        "GENERATOR_DTYPE": "float32",
        "GENERATOR_OMP_CPUS": "0",
        "REDIS_URL": redis_url,
        "STREAM_PREFIX": prefix,
        "API_TOKEN": TOKEN,
    }


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


async def engine_requests(http, url) -> float:
    """The generator's prompts sampling in the engine now (its Prometheus gauge)."""
    for line in (await http.get(f"{url}/metrics")).text.splitlines():
        if line.startswith("asyncgrpo_generator_engine_requests "):
            return float(line.split()[-1])
    return 0.0


async def registered_replica(redis_client, keys, generator_id: str = "g1"):
    """The one replica's registration (its first heartbeat follows the ready line, after the engine described
    itself)."""
    deadline = time.monotonic() + 60
    while not (registered := await live_generators(redis_client, keys, RegistryStats())):
        assert time.monotonic() < deadline, f"{generator_id} never registered"
        await asyncio.sleep(0.2)
    [registered_one] = registered
    assert registered_one.generator_id == generator_id
    return registered_one


def reference_logprobs(model_dir, prompt_ids, completion_ids, temperature, banned: int | None = None) -> torch.Tensor:
    """transformers' log_softmax(logits / T) of each completion token after the prompt, float32; ``banned``: a
    token masked at every position (as vLLM's min_tokens masks the end of text)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1]
    if banned is not None:
        logits[:, banned] = float("-inf")
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(1, torch.tensor(completion_ids, dtype=torch.long).unsqueeze(1)).squeeze(1)
