"""Two generator replicas on one prompts stream: a push reaches both (its linear weights stored transposed, as
vLLM-CPU's prepacking reads them fastest) and greedy decoding then matches transformers on the pushed weights;
no prompt is done twice; a SIGKILLed replica's prompts are finished by the other, and the next push goes to
the survivor alone."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.learner.model import linear_weight_names
from shared.codec import decode, encode
from shared.keys import Keys
from shared.records import PromptTask, Rollout, SamplingSpec
from shared.registry import RegistryStats, live_generators
from shared.streams import StreamProducer
from tests.support.processes import start_service
from tests.support.redis_server import free_port
from tests.support.tiny_model import build_tiny_llama
from weight_sync.sender import WeightPusher

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

TOKEN = "replica-token-" + "x" * 32


def _start(name: str, core: str, model, redis_url: str, prefix: str):
    port = free_port()
    service = start_service(
        name,
        "services.generator",
        {
            "GENERATOR_MODEL": str(model),
            "GENERATOR_PORT": str(port),
            "GENERATOR_GENERATOR_ID": name,
            "GENERATOR_PUBLIC_URL": f"http://127.0.0.1:{port}",
            "GENERATOR_MAX_MODEL_LEN": "512",
            "GENERATOR_DTYPE": "float32",
            "GENERATOR_OMP_CPUS": core,
            "GENERATOR_CLAIM_IDLE_MS": "3000",
            "GENERATOR_HEARTBEAT_TTL_S": "3",
            "GENERATOR_MAX_PROMPTS_IN_FLIGHT": "4",
            "REDIS_URL": redis_url,
            "STREAM_PREFIX": prefix,
            "API_TOKEN": TOKEN,
        },
    )
    service.port = port
    return service


async def _fingerprint(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    reply = await http.get(f"{url}/weights/fingerprint", headers={"Authorization": f"Bearer {TOKEN}"})
    reply.raise_for_status()
    return reply.json()


async def test_two_replicas_share_prompts_survive_a_kill_and_take_pushes(tmp_path, redis_url, redis_client, keys):
    model_a = build_tiny_llama(tmp_path / "A", seed=1)
    model_b = build_tiny_llama(tmp_path / "B", seed=2)
    keys = Keys(keys.prefix)
    survivor = _start("gen-a", "0", model_a, redis_url, keys.prefix)
    victim = _start("gen-b", "1", model_a, redis_url, keys.prefix)
    try:
        for service in (survivor, victim):
            await asyncio.to_thread(service.wait_for_line, "ready on port", 300)
        deadline = time.monotonic() + 60  # the first heartbeat (registration) follows the ready line
        while (
            len(generators := await live_generators(redis_client, keys, RegistryStats())) < 2
            and time.monotonic() < deadline
        ):
            await asyncio.sleep(0.2)
        assert sorted(g.generator_id for g in generators) == ["gen-a", "gen-b"]

        # One push reaches both processes over gloo, and both then hold model B's weights. Both engines repack
        # their linear layers (oneDNN), so those weights travel transposed.
        assert all(g.transposed_linear for g in generators)
        # Both stack q/k/v and gate/up, so those pieces travel joined: each stacked weight arrives as one view.
        stacks = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
        assert all(g.stacked_linear == stacks for g in generators), [g.stacked_linear for g in generators]
        pusher = WeightPusher(bind_port=0, advertise_host="127.0.0.1", api_token=TOKEN)
        learner_b = AutoModelForCausalLM.from_pretrained(model_b, dtype=torch.float32)
        reference = {n: float(p.detach().double().sum()) for n, p in learner_b.named_parameters()}
        named = list(AutoModelForCausalLM.from_pretrained(model_b, dtype=torch.float32).named_parameters())
        linear = linear_weight_names(learner_b)
        assert "model.layers.0.self_attn.q_proj.weight" in linear and "model.embed_tokens.weight" not in linear
        async with httpx.AsyncClient(timeout=300) as http:
            report = await pusher.push(named, 1, generators, http, linear=linear)
            assert set(report.generators) == {"gen-a", "gen-b"}
            for service in (survivor, victim):
                fingerprint = await _fingerprint(http, service.url)
                # vLLM fuses q/k/v and gate/up; compare the unfused embedding and norms directly.
                for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
                    assert fingerprint[name] == pytest.approx(reference[name], rel=1e-6), (service.name, name)
                assert "loaded over gloo (direct copy)" in service.output(), service.output()[-3000:]
                # q/k/v and gate/up arrived joined; the engines left their oneDNN handles to the first step after
                # the push: the greedy request below makes them, and must decode what the pushed model does.
                loaded = re.search(
                    r"(\d+) tensors joined to the one before, (\d+) kernel handles left to the first step",
                    service.output(),
                )
                assert loaded and int(loaded.group(1)) > 0 and int(loaded.group(2)) > 0, service.output()[-3000:]
                greedy = {"prompts": ["item 7: the"], "sampling": {"temperature": 0, "max_tokens": 24}}
                reply = await http.post(
                    f"{service.url}/generate", json=greedy, headers={"Authorization": f"Bearer {TOKEN}"}
                )
                assert reply.status_code == 200, reply.text
                result = reply.json()["results"][0]
                prompt = result["prompt_token_ids"]
                expected = learner_b.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
                got = result["completions"][0]["token_ids"]
                assert len(got) >= 1 and got == expected[0, len(prompt) :].tolist()[: len(got)], service.name

            # 40 prompts through both replicas; kill one while it holds prompts.
            tasks = [
                PromptTask(prompt=f"item {i}:", group_size=4, policy_version=1, sampling=SamplingSpec(max_tokens=48))
                for i in range(40)
            ]
            await StreamProducer(redis_client, keys.prompts).add_many([(t.task_id, encode(t)) for t in tasks])
            deadline = time.monotonic() + 240
            while True:
                done = [decode(f[b"data"], Rollout) for _, f in await redis_client.xrange(keys.rollouts)]
                if sum(r.generator_id == "gen-b" for r in done) >= 2:
                    break
                assert time.monotonic() < deadline, victim.output()[-3000:]
                await asyncio.sleep(0.1)
            held = [
                c
                for c in (await redis_client.xpending_range(keys.prompts, "generators", "-", "+", 100))
                if c["consumer"] == b"gen-b"
            ]
            victim.kill()
            while await redis_client.xlen(keys.rollouts) < len(tasks):
                assert time.monotonic() < deadline, survivor.output()[-3000:]
                await asyncio.sleep(0.2)
            rollouts = [decode(f[b"data"], Rollout) for _, f in await redis_client.xrange(keys.rollouts)]
            per_group = Counter(r.group_id for r in rollouts)
            assert set(per_group) == {t.task_id for t in tasks}
            assert max(per_group.values()) == 1, "a prompt was processed twice"
            by_generator = Counter(r.generator_id for r in rollouts)
            assert (await redis_client.xpending(keys.prompts, "generators"))["pending"] == 0
            print(
                f"\nrollouts={len(rollouts)} unique={len(per_group)} by_generator={dict(by_generator)} "
                f"held_by_killed_replica={len(held)}"
            )

            # The dead replica drops out when its heartbeat expires; the next push goes to the survivor only.
            await asyncio.sleep(3.5)
            generators = await live_generators(redis_client, keys, RegistryStats())
            assert [g.generator_id for g in generators] == ["gen-a"]
            report = await pusher.push(named, 2, generators, http)
            assert report.generators == ("gen-a",)
            assert (await http.get(f"{survivor.url}/ready")).json()["policy_version"] == 2
    finally:
        victim.kill()
        assert survivor.stop() == 0, survivor.output()[-3000:]
