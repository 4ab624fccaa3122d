"""The engine's weight update against a hand-written stand-in for vLLM's AsyncLLM: the order of the steps, and
what every failure leaves behind (the push's channel closed, sampling paused until a push succeeds).

The real update path (vLLM's workers receiving over gloo) is in ``tests/integration/test_generator.py``.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.generator.engine import Engine
from services.generator.weight_update import WeightUpdateError
from shared.config.generator import GeneratorSettings
from shared.records import SamplingSpec, WeightVersionAnnouncement

RECEIVED = {"bytes": 64.0, "seconds": 0.1, "receive_wait_seconds": 0.01, "load_seconds": 0.02, "direct": 1.0}


class FakeLLM:
    """Records the calls the engine makes; ``fail`` names the one that raises."""

    def __init__(self, fail: str = "") -> None:
        self.fail = fail
        self.salts: list[str] = []  # the cache_salt of every request, in order
        self.hold: asyncio.Event | None = None  # set: requests answer once it is
        self.calls: list[str] = []
        self.channel_open = False
        self.paused = False

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail:
            raise RuntimeError(f"{name} broke")

    async def collective_rpc(self, method: str, args: tuple = ()) -> list:
        if method == "weight_channel_open":
            self.channel_open = True  # even a join that fails may leave a half-made group behind
        if method == "weight_channel_close":
            self.channel_open = False
        self._call(method)
        return [dict(RECEIVED)] if method == "weight_channel_receive" else [None]

    @property
    def engine_core(self) -> FakeLLM:  # AsyncLLM's client of the engine core process
        return self

    async def pause_scheduler_async(self, *, mode: str, clear_cache: bool) -> None:
        assert (mode, clear_cache) == ("keep", False)
        self._call("pause_scheduler")
        self.paused = True

    async def pause_generation(self, *, mode: str, clear_cache: bool) -> None:  # an operator's POST /pause
        self._call("pause_generation")
        self.paused = True

    async def resume_generation(self) -> None:
        self._call("resume_generation")
        self.paused = False

    async def reset_prefix_cache(self, *, reset_running_requests: bool) -> None:
        self._call("reset_prefix_cache")

    async def generate(self, prompt: dict, params, request_id: str):
        """One completion per sequence, its one token the prompt's last."""
        self.salts.append(prompt["cache_salt"])
        if self.hold is not None:
            await self.hold.wait()
        token = prompt["prompt_token_ids"][-1]
        step = {token: SimpleNamespace(logprob=-0.5)}
        outputs = [
            SimpleNamespace(index=i, text="", token_ids=[token], logprobs=[step], finish_reason="stop")
            for i in range(params.n)
        ]
        yield SimpleNamespace(outputs=outputs)


@pytest.fixture
async def store_port():
    """A listening port standing in for the learner's store (the engine checks it is reachable)."""
    server = await asyncio.start_server(lambda reader, writer: writer.close(), "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


def _engine(llm: FakeLLM, in_flight_at_push: str = "recompute") -> Engine:
    settings = GeneratorSettings(model="tiny", in_flight_at_push=in_flight_at_push)
    return Engine(settings, llm, tokenizer=None, policy_version=2)


def _announcement(port: int, version: int = 3) -> WeightVersionAnnouncement:
    return WeightVersionAnnouncement(
        policy_version=version, rendezvous=f"127.0.0.1:{port}", namespace="push/3", ranks={"g1": 1}, world_size=2
    )


async def test_update_joins_pauses_receives_closes_resets_and_resumes(store_port):
    llm = FakeLLM()
    engine = _engine(llm)
    result = await engine.update_weights(_announcement(store_port), "g1")
    assert llm.calls == [
        "weight_channel_open",
        "pause_scheduler",
        "weight_channel_receive",
        "weight_channel_close",
        "reset_prefix_cache",
        "resume_generation",
    ]
    assert engine.policy_version == 3 and engine.weights_ok and not llm.paused and not llm.channel_open
    assert result["in_flight_at_push"] == "recompute" and result["in_flight_requests"] == 0
    assert result["bytes"] == 64.0 and result["transport"] == "gloo" and result["direct_load"]
    assert set(result) >= {
        "join_seconds",
        "pause_seconds",
        "transfer_seconds",
        "close_seconds",
        "reset_seconds",
        "resume_seconds",
    }


async def test_keeping_in_flight_requests_resets_nothing_and_salts_the_cache_anew(store_port):
    llm = FakeLLM()
    engine = _engine(llm, in_flight_at_push="keep")
    engine.active_requests = 3  # prompts sampling when the push pauses the engine
    salt = engine.loads.salt
    result = await engine.update_weights(_announcement(store_port), "g1")
    assert "reset_prefix_cache" not in llm.calls and llm.calls[-1] == "resume_generation"
    assert result["in_flight_at_push"] == "keep" and result["in_flight_requests"] == 3
    assert engine.policy_version == 3 and engine.loads.salt != salt and not llm.paused


async def test_each_load_of_weights_has_its_own_salt_and_a_failed_one_keeps_the_last(store_port):
    llm = FakeLLM(fail="weight_channel_receive")
    engine = _engine(llm)
    salts = [engine.loads.salt]
    with pytest.raises(WeightUpdateError):
        await engine.update_weights(_announcement(store_port), "g1")
    assert engine.loads.salt == salts[0] and engine.policy_version == 2  # sampling stays paused anyway
    llm.fail = ""
    for version in (3, 2, 3):  # a restarted learner's push goes back to a version seen before
        await engine.update_weights(_announcement(store_port, version=version), "g1")
        salts.append(engine.loads.salt)
    assert len(set(salts)) == 4


@pytest.mark.parametrize("in_flight_at_push", ["recompute", "keep"])
async def test_every_request_carries_the_salt_of_the_weights_it_starts_under(store_port, in_flight_at_push):
    llm = FakeLLM()
    engine = _engine(llm, in_flight_at_push)
    spec = SamplingSpec(max_tokens=4)
    await engine.sample([1, 2, 3], spec, n=2)
    await engine.sample_turn([1, 2, 3], spec, max_tokens=4, stop_token_ids=[2], seed=None)
    before = engine.loads.salt
    await engine.update_weights(_announcement(store_port), "g1")
    group = await engine.sample([1, 2, 3], spec, n=2)
    turn = await engine.sample_turn([1, 2, 3], spec, max_tokens=4, stop_token_ids=[2], seed=None)
    assert llm.salts == [before, before, engine.loads.salt, engine.loads.salt] and before != engine.loads.salt
    assert group.policy_version == turn.version == 3


async def test_a_request_sampled_while_the_weights_went_back_and_forward_again_says_so(store_port):
    llm = FakeLLM()
    llm.hold = asyncio.Event()
    engine = _engine(llm)  # at version 2
    spec = SamplingSpec(max_tokens=4)
    group = asyncio.create_task(engine.sample([1, 2, 3], spec, n=2))
    turn = asyncio.create_task(engine.sample_turn([1, 2, 3], spec, max_tokens=4, stop_token_ids=[2], seed=None))
    await asyncio.sleep(0)  # both requests are in the engine
    for version in (1, 2):  # a restarted learner's push back to 1, then forward to 2
        await engine.update_weights(_announcement(store_port, version=version), "g1")
    llm.hold.set()
    group_done, turn_done = await group, await turn
    assert (group_done.policy_version, group_done.finished_policy_version, group_done.lowest_policy_version) == (
        2,
        2,
        1,
    )
    assert (turn_done.version, turn_done.finished_version, turn_done.lowest_version) == (2, 2, 1)
    # A request begun after them saw no version below its own.
    assert (await engine.sample([1, 2, 3], spec, n=1)).lowest_policy_version == 2


@pytest.mark.parametrize("fail", ["pause_scheduler", "weight_channel_receive", "reset_prefix_cache"])
async def test_a_failure_after_joining_closes_the_channel_and_keeps_sampling_paused(store_port, fail):
    llm = FakeLLM(fail=fail)
    engine = _engine(llm)
    with pytest.raises(WeightUpdateError, match=f"{fail} broke") as caught:
        await engine.update_weights(_announcement(store_port), "g1")
    assert caught.value.applied_nothing is False
    assert not llm.channel_open and "weight_channel_close" in llm.calls
    assert not engine.weights_ok and "resume_generation" not in llm.calls
    assert engine.policy_version == 2
    # The next push succeeds and sampling resumes.
    llm.fail = ""
    await engine.update_weights(_announcement(store_port, version=4), "g1")
    assert engine.weights_ok and engine.policy_version == 4 and not llm.paused and not llm.channel_open


async def test_a_failed_resume_is_reported_and_the_engine_waits_for_the_next_push(store_port):
    llm = FakeLLM(fail="resume_generation")
    engine = _engine(llm)
    with pytest.raises(WeightUpdateError, match="resume_generation broke") as caught:
        await engine.update_weights(_announcement(store_port), "g1")
    assert caught.value.applied_nothing is False and not engine.weights_ok and not llm.channel_open


async def test_a_failed_join_touches_nothing_and_closes_the_channel(store_port):
    llm = FakeLLM(fail="weight_channel_open")
    engine = _engine(llm)
    with pytest.raises(WeightUpdateError, match="could not join") as caught:
        await engine.update_weights(_announcement(store_port), "g1")
    assert caught.value.applied_nothing is True
    assert engine.weights_ok and engine.policy_version == 2
    assert llm.calls == ["weight_channel_open", "weight_channel_close"] and not llm.channel_open


async def test_an_update_keeps_an_operators_pause(store_port):
    llm = FakeLLM()
    engine = _engine(llm)
    await engine.pause()
    await engine.update_weights(_announcement(store_port), "g1")
    assert engine.policy_version == 3 and engine.weights_ok and llm.paused
    assert llm.calls.count("resume_generation") == 0


async def test_an_unreachable_store_is_refused_before_anything_is_called():
    llm = FakeLLM()
    engine = _engine(llm)
    with pytest.raises(WeightUpdateError, match="not reachable") as caught:
        await engine.update_weights(_announcement(1), "g1")
    assert caught.value.applied_nothing is True and llm.calls == []


def test_the_kv_cache_block_is_32_on_cpus_unless_configured():
    from services.generator.engine import engine_block_size

    assert engine_block_size(None, on_cpu=True) == 32
    assert engine_block_size(None, on_cpu=False) is None  # vLLM's own default on GPUs
    assert engine_block_size(128, on_cpu=True) == 128 and engine_block_size(64, on_cpu=False) == 64


def test_auto_dtype_on_a_cpu_is_the_one_it_computes_in_and_vllms_own_on_a_gpu():
    from services.generator.engine import engine_dtype

    amx = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
    avx2 = "processor\t: 0\nflags\t\t: fpu avx2 fma\n"
    assert engine_dtype("auto", on_cpu=True, cpuinfo=amx) == "bfloat16"
    assert engine_dtype("auto", on_cpu=True, cpuinfo=avx2) == "float32"
    assert engine_dtype("auto", on_cpu=False, cpuinfo=amx) == "auto"  # vLLM's: the checkpoint's dtype
    for dtype in ("float32", "bfloat16", "float16"):  # set explicitly: as set, on any hardware
        assert engine_dtype(dtype, on_cpu=True, cpuinfo=amx) == dtype == engine_dtype(dtype, on_cpu=True, cpuinfo=avx2)
