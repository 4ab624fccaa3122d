"""Generator process: ``python -m services.generator [--config FILE]``. Wiring only: lease the GPU(s), serve
HTTP while vLLM loads the latest checkpoint (or the base model), then turn prompts into rollouts until stopped."""

import sys
from functools import partial

from shared.config.generator import GeneratorSettings
from shared.keys import Keys
from shared.lifecycle import Service, run_service
from shared.registry import latest_weights_version
from shared.service import main


async def start(service: Service[GeneratorSettings]) -> None:
    from services.generator.app import GeneratorAppState, build_app  # imports vLLM: after the config check
    from services.generator.heartbeat import GeneratorTelemetry
    from services.generator.rollout_loop import RolloutLoop
    from services.generator.startup import load_engine, take_gpus, trajectory_runner

    settings, keys, name = service.settings, service.keys, service.settings.generator_id
    lease = await take_gpus(service)
    announced = partial(latest_weights_version, service.client, keys, service.registry_stats)
    state = service.app_state(GeneratorAppState, generator_id=name, announced_version=announced)
    port = await service.serve_http(build_app(state))
    state.engine = engine = await load_engine(service)
    if service.stop.is_set():  # stopped while vLLM loaded (a signal, /shutdown, a lost GPU lease): never joins
        return await service.finish()
    in_flight, runner = settings.max_prompts_in_flight, trajectory_runner(service, engine)
    consumer = await service.consumer(keys.prompts, Keys.GENERATORS, name, batch_size=in_flight)
    rollouts = service.producer(keys.rollouts, settings.max_rollout_backlog)
    loop = RolloutLoop(engine, consumer, rollouts, name, in_flight, runner, bounds=settings)
    GeneratorTelemetry.attach(service, engine, loop, consumer, lease, settings.url(port))
    service.announce(f"generator {name} ready on port {port}")
    await service.run_until_stopped(loop.run)


serve = partial(run_service, "generator", start=start)

if __name__ == "__main__":
    sys.exit(main("generator", GeneratorSettings, serve, __doc__))
