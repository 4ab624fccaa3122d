"""The executor a CPU engine runs its worker with: vLLM's multiprocess executor, except that its engine core
waits for the worker's answer to a weight push by blocking on its notification instead of spinning.

vLLM's engine core talks to its worker process through shared-memory queues, and a reader keeps polling a
queue (``sched_yield`` in a loop) for a second after it last read from it, and only then waits for the writer's
notification (a zmq message the writer sends after every message). On the CPU the launcher gives a
generator's processes one set of cores; on a one-core generator the engine core's polling shares the core
with the worker, and while the worker receives a push over gloo, whose thread sleeps and wakes for each
chunk a socket brings, the polling stretched the receive: the engine core took 55 % of the core during
pushes, and a push to 2 generators took 0.43 s instead of 0.26 s (``bench/weight_push.py --transport gloo``,
2-core AMD EPYC). While a ``weight_channel_*`` call runs, the engine core here waits for that notification
from the start instead, for at most :data:`POLL_S` before it looks again (the writer's publisher keeps one
notification in its queue and drops the next while that one has not left, so one can be missed): it wakes when
the answer comes and otherwise takes next to nothing of the core. A queue without the notification socket sleeps
``POLL_S`` between looks. Every other call (sampling steps included: the polling is what makes a step's hand-off
quick, and a sleeping poll made sampling 13 % slower) waits as vLLM does, except that a sampling step still
pending when ``weight_channel_open`` is called (with asynchronous scheduling vLLM resolves earlier futures
first) is waited for the quiet way too: at most ``POLL_S`` later, once per push, before the pause. vLLM's optional
spin-loop extension (``VLLM_USE_SPINLOOP_EXT``, off by default) spins before every wait and is left as it is.

vLLM chooses an executor per engine (``distributed_executor_backend``, which takes an ``Executor``
subclass); a CPU engine runs the multiprocess one whatever is asked (vLLM's CPU platform needs the process
for its OpenMP settings), so this class changes nothing else. The queue's poll is reached through vLLM
internals (``response_mqs``, each queue's ``_spin_condition``); where they are missing (another vLLM), the
calls wait as vLLM does and the log says so once. ``tests/unit/test_generator_executor.py`` checks the
internals of the vLLM installed here.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import zmq
from vllm.v1.executor.multiproc_executor import MultiprocExecutor

log = logging.getLogger(__name__)

POLL_S = 0.005  # the longest the engine core waits for a notification before it looks at the worker's answer again
QUIET_PREFIX = "weight_channel_"  # the weight push's worker calls (weight_sync.receiver)


def waits_quietly(method: object, non_block: bool) -> bool:
    """Whether a ``collective_rpc`` of ``method`` waits quietly (:func:`quiet_waits`): a blocking weight push
    call."""
    return isinstance(method, str) and method.startswith(QUIET_PREFIX) and not non_block


@contextlib.contextmanager
def quiet_waits(queues: Sequence[Any], poll_s: float = POLL_S) -> Iterator[bool]:
    """While inside, each of ``queues`` (vLLM ``MessageQueue`` readers) waits for a message by waiting for its
    writer's notification, at most ``poll_s`` at a time (:func:`notified_or_slept`), instead of yielding the
    core in a loop. Yields False, changing nothing, where a queue lacks the poll this replaces."""
    conditions = [getattr(queue, "_spin_condition", None) for queue in queues]
    if not conditions or any(c is None or not callable(getattr(c, "wait", None)) for c in conditions):
        yield False
        return
    before = [vars(condition).get("wait") for condition in conditions]  # None: the class's method
    for condition in conditions:
        condition.wait = notified_or_slept(condition, poll_s)  # an instance attribute, over the class's method
    try:
        yield True
    finally:
        for condition, earlier in zip(conditions, before, strict=True):
            if earlier is None:
                del condition.wait
            else:
                condition.wait = earlier


def notified_or_slept(condition: Any, poll_s: float) -> Callable[..., None]:
    """A ``wait`` for vLLM's ``SpinCondition`` ``condition`` that blocks until its writer's notification
    arrives (taking it) or ``poll_s`` has passed; one that sleeps ``poll_s`` where the condition has no
    notification socket to wait on."""
    poller, notified = getattr(condition, "poller", None), getattr(condition, "local_notify_socket", None)
    if poller is None or notified is None:
        return lambda timeout_ms=None: time.sleep(poll_s)
    poll_ms = max(1, round(poll_s * 1000))

    def wait(timeout_ms: int | None = None) -> None:
        if notified in dict(poller.poll(timeout=poll_ms)):
            notified.recv(flags=zmq.NOBLOCK, copy=False)

    return wait


class WeightPushExecutor(MultiprocExecutor):
    """vLLM's multiprocess executor whose engine core waits quietly for the worker while a weight call runs."""

    _warned = False

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None,
                       non_block: bool = False, **rest: Any) -> Any:  # fmt: skip
        if not waits_quietly(method, non_block):
            return super().collective_rpc(method, timeout, args, kwargs, non_block, **rest)
        with quiet_waits(getattr(self, "response_mqs", ())) as quiet:
            if not quiet and not WeightPushExecutor._warned:
                WeightPushExecutor._warned = True
                log.warning(
                    "the engine core's queues to its workers have no poll to replace (another vLLM, or workers on "
                    "other nodes): it busy-polls while it waits for weight pushes (slower pushes on a one-core "
                    "generator)"
                )
            return super().collective_rpc(method, timeout, args, kwargs, non_block, **rest)
