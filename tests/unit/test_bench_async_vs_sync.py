"""bench/async_vs_sync.py's phase arithmetic: the generator's busy time from overlapping sampling intervals,
and the ideal speedup of perfect overlap."""

from __future__ import annotations

import logging

import pytest

from bench import async_vs_sync as bench


def test_busy_time_counts_overlapping_intervals_once_and_gaps_not_at_all():
    assert bench.busy_seconds([]) == 0.0
    assert bench.busy_seconds([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.75)]) == 4.0
    assert bench.busy_seconds([(5.0, 6.0), (0.0, 1.0)]) == 2.0


def test_sampling_per_batch_leaves_the_first_batch_out():
    batches = [
        {"sampling_started_at": [0.0], "sampling_finished_at": [100.0]},
        {"sampling_started_at": [200.0, 201.0], "sampling_finished_at": [203.0, 204.0]},
        {"sampling_started_at": [210.0, 220.0], "sampling_finished_at": [212.0, 221.0]},
    ]
    assert bench.sampling_per_batch(batches) == pytest.approx((4.0 + 2.0 + 1.0) / 2)


def test_the_ideal_speedup_of_perfect_overlap():
    assert bench.phase_ideal(4.0, 6.0) == pytest.approx(10.0 / 6.0)
    assert bench.phase_ideal(3.0, 3.0) == 2.0


def _step(time: float, step: float, wait: float, train: float, push: float) -> dict[str, float]:
    return {"time": time, "seconds/step": step, "seconds/wait": wait, "seconds/train_wall": train, "seconds/sync": push}


def test_seconds_per_step_leaves_out_the_final_checkpoint_and_keeps_the_last_push():
    records = [
        _step(100.0, 9.0, 3.0, 5.0, 1.0),  # step 1: start-up's, left out
        _step(106.0, 6.0, 0.5, 5.0, 0.5),
        _step(112.0, 6.0, 0.5, 5.0, 0.5),
        _step(122.0, 10.0, 0.5, 5.0, 0.5),  # ends with a 4 s checkpoint after its push
    ]
    assert bench.seconds_per_step(records) == pytest.approx((122.0 - 4.0 - 100.0) / 3)
    assert bench.seconds_per_step(records[:3]) == pytest.approx(6.0)
    with pytest.raises(ValueError, match="at least 2 training steps"):
        bench.seconds_per_step(records[:1])


def test_the_prompts_in_flight_at_each_push_come_from_the_generators_log(caplog):
    """The lines the generator writes (``update_report``), so a change of its wording fails here."""
    from services.generator.weight_update import Phases, update_report

    worker = {"bytes": 64.0, "receive_wait_seconds": 0.01, "load_seconds": 0.02, "direct": 1.0}
    with caplog.at_level(logging.INFO, logger="services.generator.weight_update"):
        for version, prompts, mode in ((1, 0, "keep"), (2, 12, "recompute"), (3, 3, "keep")):
            update_report([worker], "shm", Phases(), version, prompts, mode)
            logging.getLogger("services.generator.weight_update").info("an unrelated line: 7 prompts in flight")
    assert bench.prompts_in_flight_at_pushes(caplog.text) == [0, 12, 3]
    assert bench.prompts_in_flight_at_pushes("") == []
