"""Learner process: ``python -m services.learner [--config FILE]``. Wiring only."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry

from services.learner.settings import LearnerSettings
from shared.keys import Keys
from shared.redis_conn import connect
from shared.telemetry import MetricsGauges, setup_logging

log = logging.getLogger("services.learner")


def check_context(settings: LearnerSettings, model_config) -> None:
    """max_prompt_length + max_completion_length must fit the model (a clear error names the fix)."""
    context = settings.model_context or getattr(model_config, "max_position_embeddings", 0)
    if context and settings.max_prompt_length + settings.max_completion_length > context:
        raise SystemExit(
            f"max_prompt_length ({settings.max_prompt_length}) + max_completion_length "
            f"({settings.max_completion_length}) exceeds the model's context ({context}); lower either"
        )


async def serve(settings: LearnerSettings) -> int:
    import httpx
    import torch
    import uvicorn

    from services.learner.app import build_app
    from services.learner.checkpoint import LearnerState, list_checkpoints, load_state
    from services.learner.feeder import PromptFeeder, load_rows
    from services.learner.observability import MetricsSink
    from services.learner.policy import load_policy, reference_model
    from services.learner.train_loop import FEEDER_POSITION, LearnerLoop
    from services.learner.trainer import Trainer
    from services.learner.weight_push import WeightPusher
    from shared.records import DatasetPosition, SamplingSpec
    from shared.streams import StreamConsumer

    torch.manual_seed(settings.seed)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    keys = Keys(settings.stream_prefix)
    client = await connect(settings.redis_url)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)

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
    reference = None
    if settings.beta > 0:
        reference = reference_model(load_policy(settings, settings.model)[0] if checkpoints else model)
    trainer = Trainer(model, settings, reference)
    if trainer_state is not None:
        trainer.load_state_dict(trainer_state)

    saved_position = await client.hget(keys.learner_state, FEEDER_POSITION)
    if saved_position:
        position = DatasetPosition.model_validate(json.loads(saved_position))
    else:
        position = DatasetPosition(epoch=state.feeder_epoch, index=state.feeder_index)
    sampling = SamplingSpec(
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
        max_tokens=settings.max_completion_length,
    )

    def prompt_length(messages) -> int:
        encoded = tokenizer.apply_chat_template(
            [m.model_dump() for m in messages],
            tokenize=True,
            continue_final_message=messages[-1].role == "assistant",
            add_generation_prompt=messages[-1].role != "assistant",
        )
        return len(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    feeder = PromptFeeder(
        load_rows(settings.data),
        settings.data,
        sampling,
        settings.group_size,
        position,
        prompt_length=prompt_length,
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
        device=torch.device(settings.device),
    )
    registry = CollectorRegistry()
    sink = MetricsSink(Path(settings.log_dir), MetricsGauges(registry), settings.max_steps, settings.progress)
    app = build_app(api_token=settings.api_token.get_secret_value(), registry=registry, stop=stop)
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning"))
    server_task = asyncio.create_task(server.serve())
    try:
        async with httpx.AsyncClient() as http:
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
            app.state.loop = loop
            keepalive = asyncio.create_task(consumer.run_keepalive(stop))
            print(f"learner ready: step {trainer.step}, weight store on port {pusher.port}", flush=True)
            await loop.run(stop, resumed=bool(checkpoints))
            stop.set()
            await keepalive
        print(
            f"learner finished: step {trainer.step}, checkpoint {loop.last_checkpoint}, metrics {sink.path}",
            flush=True,
        )
        return 0
    except Exception:
        log.exception("learner stopped on an error")
        return 1
    finally:
        sink.close()
        server.should_exit = True
        await server_task
        await client.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.learner", description=__doc__)
    parser.add_argument("--config", help="TOML file (else $ASYNCGRPO_CONFIG); [learner], [data], [common] are read")
    args = parser.parse_args(argv)
    settings = LearnerSettings.load(args.config)
    setup_logging("learner", settings.log_level)
    log.info("settings: %s", settings.masked())
    return asyncio.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
