"""Builds a ready-to-run :class:`LearnerLoop` from settings: resume, model, data, streams, weight store;
and this rank's place under torchrun (the leader serves, the other ranks follow).

Kept apart from ``__main__`` so tests can build the same learner in-process.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import httpx
import redis.asyncio as aioredis
import torch
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from services.learner import distributed, ranks
from services.learner.checkpoint import LearnerState, load_state
from services.learner.data.admission import FEEDER_POSITION, RUNTIME
from services.learner.data.feeder import PromptFeeder, load_rows
from services.learner.distributed import Topology
from services.learner.evaluation import Evaluator, eval_sampling, eval_source, load_eval_rows
from services.learner.hardware import resolve_precision
from services.learner.metrics.metric_sinks import MetricsSink
from services.learner.metrics.trackers import TrackingRun
from services.learner.model import load_policy, reference_model
from services.learner.train_loop import LearnerLoop
from services.learner.trainer import Trainer
from shared.chat import prompt_ids
from shared.codec import encode
from shared.config.learner import LearnerSettings, missing_trackers
from shared.keys import Keys
from shared.lifecycle import NotStarting, start_consumer
from shared.records import ChatMessage, DatasetPosition, SamplingSpec
from shared.registry import RegistryStats, set_aside
from shared.runs import ResumeRefused, checkpoint_to_resume, run_identity, settings_path, write_run_file
from shared.streams import StreamProducer
from shared.telemetry import MetricsGauges
from weight_sync.sender import WeightPusher, learner_device

log = logging.getLogger(__name__)


def check_context(settings: LearnerSettings, model_config) -> None:
    """max_prompt_length + max_completion_length must fit the model (a clear error names the fix)."""
    problem = settings.context_problem(settings.model_context or getattr(model_config, "max_position_embeddings", 0))
    if problem:
        raise ValueError(problem)


def prompt_length_counter(tokenizer):
    """Tokens a prompt takes as the generator will tokenize it (:func:`shared.chat.prompt_ids`)."""

    def count(prompt: str | tuple[ChatMessage, ...]) -> int:
        return len(prompt_ids(tokenizer, prompt))

    return count


def build_trainer(settings: LearnerSettings, topology: Topology | None = None):
    """The trainer (resumed from the checkpoint :func:`resume_point` picks, if any), the tokenizer, the
    learner's state and whether it resumed. Every rank builds its own; on several ranks the model is sharded."""
    topology = topology or Topology()
    distributed.check_batch(settings.completions_per_step, settings.lora_rank, topology)
    torch.manual_seed(settings.seed)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    checkpoint = resume_point(settings)
    state, trainer_state = LearnerState(), None
    model_path, adapter = settings.model, None
    if checkpoint is not None:
        state, trainer_state = load_state(checkpoint)
        if settings.lora_rank:
            adapter = str(checkpoint / "adapter")
        else:
            model_path = str(checkpoint)
        log.info("run %s: resuming from %s (step %d)", settings.run_name, checkpoint, state.step)
    model, tokenizer = load_policy(settings, model_path, adapter)
    check_context(settings, model.config)
    precision = resolve_precision(settings.param_dtype, settings.compute_dtype, settings.device)
    log.info("precision: %s", precision.describe())
    reference = None
    if settings.beta > 0:
        initial = load_policy(settings, settings.model)[0] if checkpoint is not None else model
        reference = reference_model(initial, precision.compute)
    if topology.distributed:
        distributed.shard_model(model, precision.compute)
    trainer = Trainer(model, settings, reference, topology)
    if trainer_state is not None:
        trainer.load_state_dict(trainer_state, checkpoint)
    return trainer, tokenizer, state, checkpoint is not None


def resume_point(settings: LearnerSettings) -> Path | None:
    """The checkpoint this run continues from (its own newest, else ``resume_from``), None to start fresh;
    :class:`NotStarting` naming the reason and the fix when the checkpoint is another run's or unlike it."""
    try:
        return checkpoint_to_resume(settings, run_identity(settings))
    except ResumeRefused as exc:
        raise NotStarting(str(exc)) from exc


def sampling_spec(settings: LearnerSettings) -> SamplingSpec:
    """How the generators sample this run's completions."""
    return SamplingSpec(
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
        min_p=settings.min_p,
        repetition_penalty=settings.repetition_penalty,
        max_tokens=settings.max_completion_length,
        min_tokens=settings.min_completion_length,
    )


async def build_feeder(
    settings: LearnerSettings, client: aioredis.Redis, keys: Keys, state: LearnerState, tokenizer, stats: RegistryStats
) -> PromptFeeder:
    """The prompt feeder, at the position saved with the last admitted prompt (else the checkpoint's)."""
    position = await saved_feeder_position(client, keys, stats) or DatasetPosition(
        epoch=state.feeder_epoch, index=state.feeder_index
    )
    return PromptFeeder(
        load_rows(settings.data),
        settings.data,
        sampling_spec(settings),
        settings.group_size,
        position,
        prompt_length=prompt_length_counter(tokenizer),
        max_prompt_length=settings.max_prompt_length,
        sampling_seed=settings.sampling_seed,
    )


async def saved_feeder_position(client: aioredis.Redis, keys: Keys, stats: RegistryStats) -> DatasetPosition | None:
    """The feeder's position saved with the last admitted prompt; None without one, or when it is not a
    position (then set aside in the dead-letter stream, and the checkpoint's position is used)."""
    saved = await client.hget(keys.learner_state, FEEDER_POSITION)
    if saved is None:
        return None
    try:
        return DatasetPosition.model_validate_json(saved)
    except ValidationError as exc:
        reason = f"feeder position: ValidationError: {exc.errors()[0]['msg']}"
        await set_aside(client, keys, keys.learner_state, (FEEDER_POSITION, saved), reason, stats)
        return None


async def build_evaluator(settings: LearnerSettings, client: aioredis.Redis, keys: Keys, tokenizer) -> Evaluator | None:
    """The evaluator of ``eval_data`` or the ``[data]`` table's held-out rows (None without): its held-out rows
    (those over ``max_prompt_length`` left out, counted in the log) and its consumer of the evaluated stream."""
    source = eval_source(settings)
    if source is None:
        return None
    rows = load_eval_rows(settings)
    length = prompt_length_counter(tokenizer)
    fitting = [row for row in rows if length(row.prompt) <= settings.max_prompt_length]
    if len(fitting) < len(rows):
        log.warning(
            "evaluation: %d held-out prompts exceed max_prompt_length and are left out", len(rows) - len(fitting)
        )
    if not fitting:
        raise NotStarting(f"evaluation: no held-out prompt of {source} fits max_prompt_length")
    consumer = await start_consumer(
        client, keys, settings, stream=keys.evaluated, group=Keys.LEARNER, name="learner", batch_size=len(fitting)
    )
    log.info("evaluation: %d held-out prompts from %s", len(fitting), source)
    return Evaluator(
        fitting,
        eval_sampling(sampling_spec(settings), settings.eval_temperature),
        settings.eval_group_size,
        prompts=StreamProducer(client, keys.prompts),
        consumer=consumer,
        timeout_s=settings.eval_timeout_s,
    )


def rank_devices(settings: LearnerSettings) -> list[tuple[str, str | None]]:
    """Every learner rank's device and physical GPU UUID (None on CPU), in rank order: a collective, which
    every rank calls at the same point (after building its trainer)."""
    device = torch.device(settings.device)
    return distributed.gather_objects((str(device), learner_device(device).uuid))


async def start_pusher(
    settings: LearnerSettings, client: aioredis.Redis, keys: Keys, ranks: Sequence[tuple[str, str | None]] = ()
) -> WeightPusher:
    """The weight store the generators pull from; its runtime (the learner's physical GPU, every rank's, and
    library versions) is published for operators and generators."""
    pusher = WeightPusher(
        bind_port=settings.weight_sync_port,
        advertise_host=settings.weight_sync_host,
        api_token=settings.api_token.get_secret_value(),
        bind_host=settings.weight_sync_bind,
        allowed_hosts=settings.allowed_generator_hosts,
        bucket_bytes=settings.weight_bucket_mb << 20,
        timeout_s=settings.weight_push_timeout_s,
        join_timeout_s=settings.weight_join_timeout_s,
        device=torch.device(settings.device),
        shm_dir=settings.weight_shm_dir,
    )
    runtime = pusher.runtime(ranks)
    await client.hset(keys.learner_state, RUNTIME, encode(runtime))  # also what the loop checks Redis kept
    if len(ranks) > 1:
        log.info("learner ranks on %s", ", ".join(f"{device} ({uuid or 'no GPU'})" for device, uuid in ranks))
    return pusher


async def build_learner(
    settings: LearnerSettings,
    client: aioredis.Redis,
    http: httpx.AsyncClient,
    prometheus: CollectorRegistry,
    topology: Topology | None = None,
    registry_stats: RegistryStats | None = None,
) -> tuple[LearnerLoop, bool]:
    """The learner loop (the leader's, on several ranks), and whether it resumed from a checkpoint.
    ``registry_stats`` count the invalid registry values it reads (the service exports them; default: new)."""
    registry_stats = registry_stats or RegistryStats()
    problems = missing_trackers(settings.report_to)  # before the model loads: the fix is an install
    if problems:
        raise NotStarting("; ".join(problems))
    keys = Keys(settings.stream_prefix)
    trainer, tokenizer, state, resumed = build_trainer(settings, topology)
    ranks = rank_devices(settings)  # with the followers (see follow)
    feeder = await build_feeder(settings, client, keys, state, tokenizer, registry_stats)
    consumer = await start_consumer(
        client,
        keys,
        settings,
        stream=keys.scored,
        group=Keys.LEARNER,
        name="learner",
        batch_size=settings.groups_per_step,
    )
    evaluator = await build_evaluator(settings, client, keys, tokenizer)
    pusher = await start_pusher(settings, client, keys, ranks)
    write_run_file(settings, run_identity(settings))
    write_settings_file(settings)
    gauges = MetricsGauges(prometheus)
    resumed_step = state.step if resumed else None
    tracking = TrackingRun.from_settings(settings)
    sink = MetricsSink(Path(settings.log_dir), gauges, settings.max_steps, settings.progress, resumed_step, tracking)
    loop = LearnerLoop(
        settings=settings,
        client=client,
        keys=keys,
        trainer=trainer,
        tokenizer=tokenizer,
        feeder=feeder,
        consumer=consumer,
        pusher=pusher,
        http=http,
        sink=sink,
        state=state,
        evaluator=evaluator,
        registry_stats=registry_stats,
    )
    return loop, resumed


def write_settings_file(settings: LearnerSettings) -> Path:
    """Every resolved setting, secrets masked, as a ``[learner]`` table (``[learner.data]`` within) in
    ``<run_dir>/settings.toml``; a setting left unset (None) is left out, as TOML has no null."""
    import tomli_w

    path = settings_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps({"learner": _without_none(settings.masked())}))
    return path


def _without_none(table: dict) -> dict:
    return {k: _without_none(v) if isinstance(v, dict) else v for k, v in table.items() if v is not None}


def start_process(settings: LearnerSettings) -> tuple[LearnerSettings, Topology]:
    """This rank's place under torchrun (its process group started) and its settings with the device it
    got; on a GPU shared with vLLM, the learner's memory share is applied."""
    topology = distributed.topology_from_env()
    settings = settings.model_copy(update={"device": distributed.start(topology, settings.device)})
    if settings.device.startswith("cuda") and settings.gpu_memory_share < 1:
        torch.cuda.set_per_process_memory_fraction(settings.gpu_memory_share, torch.device(settings.device).index)
    return settings, topology


async def run_rank(settings: LearnerSettings, lead: Callable[[LearnerSettings, Topology], Awaitable[int]]) -> int:
    """This rank's process under torchrun (or alone): follow the leader, or ``lead``; the process group is
    left at the end, whatever happened, and a rank of a group whose work ended leaves at once (see
    ``distributed.exit_process``)."""
    settings, topology = start_process(settings)
    try:
        status = follow(settings, topology) if not topology.is_leader else await lead(settings, topology)
    finally:
        distributed.stop()
    if topology.distributed:
        distributed.exit_process(status)
    return status


def follow(settings: LearnerSettings, topology: Topology) -> int:
    """A rank other than 0 under torchrun: no port, no Redis; it runs the leader's commands. Exit status."""
    try:
        trainer, _, _, _ = build_trainer(settings, topology)
        rank_devices(settings)  # with the leader (see build_learner)
        steps = ranks.follow(trainer)
    except Exception:
        log.exception("learner rank %d stopped on an error", topology.rank)
        return 1
    print(f"learner rank {topology.rank} finished: step {steps}", flush=True)
    return 0
