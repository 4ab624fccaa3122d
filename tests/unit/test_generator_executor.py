"""The CPU engine's executor (services/generator/executor.py): while a weight call runs, the engine core's wait
for the worker's answer blocks on the writer's notification instead of spinning. Checked on the vLLM installed
here, with its real shared-memory message queue (a writer and a reader in two threads of this process)."""

from __future__ import annotations

import inspect
import threading
import time

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm.distributed.device_communicators.shm_broadcast import MessageQueue  # noqa: E402
from vllm.v1.executor.multiproc_executor import MultiprocExecutor  # noqa: E402

from services.generator.engine import cpu_executor  # noqa: E402
from services.generator.executor import (  # noqa: E402
    POLL_S,
    WeightPushExecutor,
    notified_or_slept,
    quiet_waits,
    waits_quietly,
)


@pytest.fixture
def queue_pair():
    """A vLLM message queue with one local reader: (writer, reader), both ready."""
    writer = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1 << 16, max_chunks=4)
    readers = []
    joining = threading.Thread(
        target=lambda: readers.append(MessageQueue.create_from_handle(writer.export_handle(), 0)) or None
    )
    joining.start()
    joining.join(10)
    reader = readers[0]
    ready = threading.Thread(target=reader.wait_until_ready)
    ready.start()
    writer.wait_until_ready()
    ready.join(10)
    yield writer, reader


def _read_once(writer, reader) -> None:
    """A message written and read, so that the reader's next wait comes right after a read (when vLLM's reader
    spins)."""
    writer.enqueue("first")
    assert reader.dequeue(timeout=5) == "first"


def _wait_cpu_seconds(
    writer, reader, write_after_s: float, quiet: bool, poll_s: float = POLL_S
) -> tuple[float, float, object]:
    """The reader's CPU seconds and wall seconds for a dequeue whose message the writer sends after
    ``write_after_s``, right after an earlier read (when vLLM's reader spins), and what it read."""
    _read_once(writer, reader)
    out = {}

    def read() -> None:
        started, cpu = time.perf_counter(), time.thread_time()
        if quiet:
            with quiet_waits([reader], poll_s) as installed:
                assert installed
                out["got"] = reader.dequeue(timeout=5)
        else:
            out["got"] = reader.dequeue(timeout=5)
        out["cpu"], out["wall"] = time.thread_time() - cpu, time.perf_counter() - started

    thread = threading.Thread(target=read)
    thread.start()
    time.sleep(write_after_s)
    writer.enqueue("second")
    thread.join(10)
    return out["cpu"], out["wall"], out["got"]


def test_a_weight_call_s_wait_is_quiet_where_vllm_s_spins(queue_pair):
    writer, reader = queue_pair
    spin_cpu, spin_wall, got = _wait_cpu_seconds(writer, reader, 0.4, quiet=False)
    assert got == "second" and spin_wall >= 0.35
    assert spin_cpu > 0.2 * spin_wall, f"vLLM's reader no longer spins ({spin_cpu:.3f} of {spin_wall:.3f} s)"
    quiet_cpu, quiet_wall, got = _wait_cpu_seconds(writer, reader, 0.4, quiet=True)
    assert got == "second"
    # A wait blocked on the notification costs next to no CPU; a spin, all of it.
    assert quiet_cpu < 0.15 * quiet_wall, f"{quiet_cpu:.3f} s of CPU in a {quiet_wall:.3f} s quiet wait"
    assert quiet_cpu < 0.25 * spin_cpu, f"{quiet_cpu:.3f} s of CPU waiting quietly against {spin_cpu:.3f} s spinning"
    assert quiet_wall < 0.4 + 0.1  # the answer is seen soon after its arrival


def test_the_wait_wakes_at_the_writer_s_notification_not_at_the_end_of_its_poll(queue_pair):
    writer, reader = queue_pair
    cpu, wall, got = _wait_cpu_seconds(writer, reader, 0.3, quiet=True, poll_s=3.0)
    assert got == "second"
    assert wall < 0.3 + 0.5, f"answered {wall:.3f} s after the read began (message written at 0.3 s, poll 3 s)"
    assert cpu < 0.05, f"{cpu:.3f} s of CPU blocked on the notification"


def test_a_shutdown_ends_a_quiet_wait_at_once(queue_pair):
    writer, reader = queue_pair
    _read_once(writer, reader)
    threading.Timer(0.2, reader.shutdown).start()
    started = time.perf_counter()
    with quiet_waits([reader], poll_s=3.0), pytest.raises(RuntimeError, match="cancelled"):
        reader.dequeue(timeout=10)
    assert time.perf_counter() - started < 0.2 + 0.5  # the cancel wakes the wait, not the end of its 3-s poll


def test_a_quiet_wait_still_times_out(queue_pair):
    writer, reader = queue_pair
    _read_once(writer, reader)
    started = time.perf_counter()
    with quiet_waits([reader]), pytest.raises(TimeoutError):
        reader.dequeue(timeout=0.3)
    assert 0.29 < time.perf_counter() - started < 0.3 + 0.2


@pytest.mark.parametrize(("method", "quiet"), [("weight_channel_receive", True), ("execute_model", False)])
def test_the_executor_waits_quietly_for_weight_calls_only_and_puts_vllm_s_wait_back(
    queue_pair, monkeypatch, method, quiet
):
    _, reader = queue_pair
    condition = reader._spin_condition
    seen = []

    def vllm_s(self, method, timeout=None, args=(), kwargs=None, non_block=False, **rest):
        seen.append("wait" in vars(condition))
        raise RuntimeError("the worker failed")

    monkeypatch.setattr(MultiprocExecutor, "collective_rpc", vllm_s)
    executor = WeightPushExecutor.__new__(WeightPushExecutor)  # no engine: only its queues matter here
    executor.response_mqs = [reader]
    with pytest.raises(RuntimeError, match="the worker failed"):
        executor.collective_rpc(method)
    assert seen == [quiet]
    assert "wait" not in vars(condition)  # vLLM's own wait again, after the call raised


def test_a_condition_without_a_notification_socket_sleeps_between_looks():
    class Plain:
        def wait(self, timeout_ms=None):
            raise AssertionError("vLLM's own wait was called")

    wait = notified_or_slept(Plain(), 0.05)
    started = time.perf_counter()
    wait()
    assert 0.04 < time.perf_counter() - started < 0.5


def test_the_queue_s_own_poll_comes_back_afterwards(queue_pair):
    _, reader = queue_pair
    condition = reader._spin_condition
    with quiet_waits([reader]):
        assert "wait" in vars(condition)
    assert "wait" not in vars(condition) and condition.wait.__func__ is type(condition).wait


def test_nested_quiet_waits_put_back_what_was_there(queue_pair):
    _, reader = queue_pair
    condition = reader._spin_condition
    with quiet_waits([reader], poll_s=0.001):
        outer = condition.wait
        with quiet_waits([reader]):
            assert condition.wait is not outer
        assert condition.wait is outer
    assert "wait" not in vars(condition)


def test_a_queue_without_the_poll_is_left_as_it_is():
    class Other:
        pass

    other = Other()
    with quiet_waits([other]) as quiet:
        assert not quiet
    assert vars(other) == {}


@pytest.mark.parametrize(
    ("method", "non_block", "sleeps"),
    [
        ("weight_channel_receive", False, True),
        ("weight_channel_open", False, True),
        ("weight_channel_receive", True, False),  # a future: nothing waits here
        ("execute_model", False, False),  # sampling steps keep vLLM's quick hand-off
        ("weight_runtime", False, False),
        (lambda worker: None, False, False),
    ],
)
def test_which_calls_wait_by_sleeping(method, non_block, sleeps):
    assert waits_quietly(method, non_block) is sleeps


def test_the_cpu_engine_s_executor_calls_vllm_s_as_vllm_declares_it():
    assert cpu_executor() is WeightPushExecutor and issubclass(WeightPushExecutor, MultiprocExecutor)
    # WeightPushExecutor passes these positionally: a reordering in vLLM must fail here, not in a push.
    names = list(inspect.signature(MultiprocExecutor.collective_rpc).parameters)[:6]
    assert names == ["self", "method", "timeout", "args", "kwargs", "non_block"]
    assert 0 < POLL_S <= 0.01  # a notification missed is seen at the next look
