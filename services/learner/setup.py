"""Builds a ready-to-run :class:`LearnerLoop` from settings: resume, model, data, streams, weight store.

Kept apart from ``__main__`` so tests can build the same learner in-process.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import redis.asyncio as aioredis
import torch
from prometheus_client import CollectorRegistry

from services.learner import distributed
from services.learner.checkpoint import LearnerState, list_checkpoints, load_state
from services.learner.distributed import Topology
from services.learner.feeder import PromptFeeder, load_rows
from services.learner.hardware import resolve_precision
from services.learner.observability import MetricsSink
from services.learner.policy import load_policy, reference_model
from services.learner.train_loop import FEEDER_POSITION, LearnerLoop
from services.learner.trainer import Trainer
from services.learner.weight_push import WeightPusher
from shared.codec import encode
from shared.config.learner import LearnerSettings
from shared.keys import Keys
from shared.records import ChatMessage, DatasetPosition, SamplingSpec
from shared.streams import StreamConsumer
from shared.telemetry import MetricsGauges

log = logging.getLogger(__name__)


def check_context(settings: LearnerSettings, model_config) -> None:
    """max_prompt_length + max_completion_length must fit the model (a clear error names the fix)."""
    problem = settings.context_problem(settings.model_context or getattr(model_config, "max_position_embeddings", 0))
    if problem:
        raise ValueError(problem)


def prompt_length_counter(tokenizer):
    """Tokens a chat prompt takes once templated, as the generator will tokenize it."""

    def count(messages: tuple[ChatMessage, ...]) -> int:
        prefill = messages[-1].role == "assistant"
        encoded = tokenizer.apply_chat_template(
            [m.model_dump() for m in messages],
            tokenize=True,
            continue_final_message=prefill,
            add_generation_prompt=not prefill,
        )
        return len(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    return count


def build_trainer(settings: LearnerSettings, topology: Topology | None = None):
    """The trainer (resumed from the latest checkpoint when there is one), the tokenizer, the learner's
    state and whether it resumed. Every rank builds its own; on several ranks the model is sharded."""
    topology = topology or Topology()
    distributed.check_batch(settings.completions_per_step, settings.lora_rank, topology)
    torch.manual_seed(settings.seed)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    checkpoints = list_checkpoints(Path(settings.checkpoint_dir)) if settings.resume else []
    state, trainer_state = LearnerState(), None
    model_path, adapter = settings.model, None
    if checkpoints:
        state, trainer_state = load_state(checkpoints[-1])
        if settings.lora_rank:
            adapter = str(checkpoints[-1] / "adapter")
        else:
            model_path = str(checkpoints[-1])
        log.info("resuming from %s (step %d)", checkpoints[-1], state.step)
    model, tokenizer = load_policy(settings, model_path, adapter)
    check_context(settings, model.config)
    precision = resolve_precision(settings.param_dtype, settings.compute_dtype, settings.device)
    log.info("precision: %s", precision.describe())
    reference = None
    if settings.beta > 0:
        initial = load_policy(settings, settings.model)[0] if checkpoints else model
        reference = reference_model(initial, precision.compute)
    if topology.distributed:
        distributed.shard_model(model, precision.compute)
    trainer = Trainer(model, settings, reference, topology)
    if trainer_state is not None:
        trainer.load_state_dict(trainer_state, checkpoints[-1])
    return trainer, tokenizer, state, bool(checkpoints)


async def build_learner(
    settings: LearnerSettings,
    client: aioredis.Redis,
    http: httpx.AsyncClient,
    registry: CollectorRegistry,
    topology: Topology | None = None,
) -> tuple[LearnerLoop, bool]:
    """The learner loop (the leader's, on several ranks), and whether it resumed from a checkpoint."""
    keys = Keys(settings.stream_prefix)
    trainer, tokenizer, state, resumed = build_trainer(settings, topology)

    saved_position = await client.hget(keys.learner_state, FEEDER_POSITION)
    if saved_position:
        position = DatasetPosition.model_validate(json.loads(saved_position))
    else:
        position = DatasetPosition(epoch=state.feeder_epoch, index=state.feeder_index)
    sampling = SamplingSpec(
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
        min_p=settings.min_p,
        repetition_penalty=settings.repetition_penalty,
        max_tokens=settings.max_completion_length,
    )
    feeder = PromptFeeder(
        load_rows(settings.data),
        settings.data,
        sampling,
        settings.group_size,
        position,
        prompt_length=prompt_length_counter(tokenizer),
        max_prompt_length=settings.max_prompt_length,
    )
    consumer = StreamConsumer(
        client,
        keys,
        keys.scored,
        Keys.LEARNER,
        "learner",
        batch_size=settings.groups_per_step,
        claim_idle_ms=settings.claim_idle_ms,
        max_deliveries=settings.max_deliveries,
    )
    await consumer.start()
    pusher = WeightPusher(
        bind_port=settings.weight_sync_port,
        advertise_host=settings.weight_sync_host,
        api_token=settings.api_token.get_secret_value(),
        bucket_bytes=settings.weight_bucket_mb << 20,
        timeout_s=settings.weight_push_timeout_s,
        join_timeout_s=settings.weight_join_timeout_s,
        device=torch.device(settings.device),
    )
    # Published at start for operators and generators: the learner's physical GPU and library versions.
    await client.hset(keys.learner_state, "runtime", encode(pusher.runtime()))
    sink = MetricsSink(Path(settings.log_dir), MetricsGauges(registry), settings.max_steps, settings.progress)
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
    )
    return loop, resumed
