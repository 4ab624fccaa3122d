"""The generator's start-up decisions: which GPU(s) this replica takes, and which weights it loads first.

* GPU lease: every replica of a host takes its own free GPU indices in the host's lease namespace before
  CUDA starts, and makes them the only ones CUDA sees (:class:`services.generator.gpu_lease.GpuLease`).
  No free GPU, or an impossible placement: the replica does not start (exit status 2, the fix named).
  The one-GPU memory split between vLLM and the learner is checked by the pipeline config, at every start.
* Late joining: a replica that starts after the learner published a checkpoint loads that checkpoint and
  its policy version instead of the base model, so it does not sample from weights many versions old until
  the learner's next push. A checkpoint this replica cannot see on its disk is ignored (base model, version
  0; the next push brings it up to date).
* Shared-memory probe: a CPU replica leaves a probe file in ``weight_shm_dir`` and names it in its
  registration; a CPU learner that sees it pushes weights to this replica through shared memory
  (``shared.shm``). The file goes when the replica ends (or, after a SIGKILL, at the next learner start).
"""

from __future__ import annotations

import asyncio
import logging
import os
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from services.generator.gpu_lease import GpuLease, LeaseLost, NoFreeGpuError, host_gpu_count
from shared.config.generator import GeneratorSettings
from shared.gpu_placement import PlacementError, leasable_gpus
from shared.lifecycle import NotStarting, Service
from shared.records import CheckpointAnnouncement, ShmProbe
from shared.registry import latest_checkpoint
from shared.shm import make_probe, usable_dir

if TYPE_CHECKING:
    from services.generator.engine import Engine
    from services.generator.trajectory.runner import TrajectoryRunner

log = logging.getLogger("services.generator")


async def lease_gpus(settings: GeneratorSettings, lease: GpuLease) -> None:
    """Take this replica's GPU(s) in the host's lease namespace and make them the only ones CUDA sees.
    Raises PlacementError or NoFreeGpuError, naming the fix."""
    total = host_gpu_count() if settings.gpu_count == "auto" else settings.gpu_count
    learner = settings.learner_gpu_indices
    candidates = leasable_gpus(total, learner, settings.colocated)
    indices = await lease.acquire(candidates, settings.tensor_parallel_size, learner, settings.colocated)
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # the order NVML counted and nvidia-smi shows
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, indices))
    log.info(
        "leased GPU(s) %s of %d in lease namespace %r (learner's GPUs %s%s)",
        indices,
        total,
        lease.host,
        list(learner),
        ", shared: colocated" if settings.colocated else "",
    )


async def take_gpus(service: Service[GeneratorSettings]) -> GpuLease:
    """The replica's lease (released when the service ends), holding its GPU(s) when it uses any. The lease
    is renewed from its own thread from now on; if another replica takes one of its GPUs anyway, the replica
    stops with an error (exit status 1) rather than share the GPU (once the engine's load, which cannot be
    interrupted, is over)."""
    settings = service.settings
    lease = GpuLease(
        service.client, service.keys, settings.gpu_host_key, settings.generator_id, settings.heartbeat_ttl_s
    )
    service.on_exit(lease.release)
    if settings.gpu_count:
        try:
            await lease_gpus(settings, lease)
        except (PlacementError, NoFreeGpuError) as exc:
            raise NotStarting(str(exc)) from exc
        loop = asyncio.get_running_loop()
        lost: asyncio.Future[LeaseLost] = loop.create_future()
        # The keeper reports a loss once, and nothing else settles ``lost``.
        lease.keep_alive(settings.redis_url, lambda exc: loop.call_soon_threadsafe(lost.set_result, exc))
        service.spawn(partial(fail_when_lost, lost))
    return lease


async def fail_when_lost(lost: asyncio.Future[LeaseLost], stop: asyncio.Event) -> None:
    """Until ``stop``: if ``lost`` resolves (another replica holds this replica's GPU), stop the service and
    raise, so it ends with an error instead of running a second engine on that GPU."""
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({lost, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if lost.done():
        stop.set()
        raise RuntimeError(f"stopping this replica: {lost.result()}")


def initial_weights(checkpoint: CheckpointAnnouncement | None, base_model: str) -> tuple[str, int]:
    """The weights to load first and their policy version: the learner's latest checkpoint when this
    replica can read it, else the base model at version 0."""
    if checkpoint is not None and Path(checkpoint.path).exists():
        return checkpoint.path, checkpoint.policy_version
    return base_model, 0


async def load_engine(service: Service[GeneratorSettings]) -> Engine:
    """The vLLM engine on the initial weights (shut down when the service ends), loaded while the event loop
    goes on serving HTTP (``/health`` answers, ``/ready`` says the engine is loading). A stop meanwhile takes
    effect once the load is over: the caller then ends without joining."""
    from services.generator.engine import Engine

    model_path, version = initial_weights(
        await latest_checkpoint(service.client, service.keys, service.registry_stats), service.settings.model
    )
    if model_path != service.settings.model:
        log.info("joining late: loading checkpoint %s (policy version %d)", model_path, version)
    # On a thread: vLLM's start blocks until the model is loaded (minutes on a GPU), and on the event loop it
    # would leave /health unanswered meanwhile (a liveness probe then kills the replica) and SIGTERM unheard.
    # vLLM's client starts its output task on the loop at the first call to the engine (the first heartbeat
    # asks it to describe itself).
    engine = await asyncio.to_thread(Engine.start, service.settings, model_path, version)
    service.on_exit(engine.shutdown)
    return engine


def leave_shm_probe(service: Service[GeneratorSettings], lease: GpuLease) -> ShmProbe | None:
    """This CPU replica's shared-memory probe (removed when the service ends); None on GPUs, or when
    ``weight_shm_dir`` is empty or not a writable directory (then pushes come over gloo)."""
    directory = usable_dir(service.settings.weight_shm_dir)
    if lease.indices or directory is None:
        if not lease.indices and service.settings.weight_shm_dir:
            log.warning(
                "weight_shm_dir %s is not a writable directory: weights come over gloo",
                service.settings.weight_shm_dir,
            )
        return None
    try:
        probe, token = make_probe(directory)
    except OSError as exc:
        log.warning("could not leave a shared-memory probe in %s (%s): weights come over gloo", directory, exc)
        return None
    service.on_exit(probe.close)
    return ShmProbe(path=str(probe.path), token=token)


def trajectory_runner(service: Service[GeneratorSettings], engine: Engine) -> TrajectoryRunner | None:
    """With an ``[environment]`` table: the runner of multi-turn trajectories (None: one completion a sample).

    The chat template is checked before the first prompt is read (docs/concepts/multi-turn-design.md §2.4-2.5): a
    template that rewrites history, or whose turn close is not a special token, stops the replica (exit 2)
    with the probe, the first differing tokens and the fix. An HTTP environment names its tools only when a
    session opens, so its template is checked then, and a failure there stops the replica the same way."""
    settings = service.settings.environment
    if settings is None:
        return None
    from environments.build import build_environment
    from services.generator.trajectory.runner import TrajectoryRunner, TrajectorySettings
    from services.generator.trajectory.template import TemplateError

    template = _chat_template(settings.chat_template) if settings.chat_template else None
    environment = build_environment(settings)
    service.on_exit(environment.aclose)
    knobs = TrajectorySettings(
        max_turns=settings.max_turns,
        max_tool_response_tokens=settings.max_tool_response_tokens,
        max_model_len=service.settings.max_model_len,
        tool_parser=settings.tool_parser,
        chat_template=template,
        chat_template_kwargs=settings.chat_template_kwargs,
    )
    runner = TrajectoryRunner(engine, environment, knobs)
    tools = environment.tool_schemas()
    if tools is not None:
        try:
            runner.toolkits.get(tools)
        except TemplateError as exc:
            raise NotStarting(str(exc)) from exc
    log.info(
        "multi-turn: environment %s, at most %d turns, tool parser %s",
        environment.name,
        settings.max_turns,
        settings.tool_parser,
    )
    return runner


def _chat_template(name: str) -> str:
    """The text of ``[environment] chat_template``: an absolute path, or one found by the configuration's rule
    (:mod:`shared.config.locations`: beside the configuration file, then in the working directory)."""
    from shared.config.locations import locate, looked_in, search_dirs

    dirs = search_dirs()
    path = locate(name, dirs)
    if path is None or not path.is_file():
        raise NotStarting(f"environment.chat_template {name!r} is not a file (looked at {looked_in(name, dirs)})")
    return path.read_text()
