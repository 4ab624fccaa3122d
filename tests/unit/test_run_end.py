"""How a learner run ends, as its last line says it, and what set a service's stop event."""

from __future__ import annotations

import asyncio

from services.learner.train_loop import RunEnd
from shared.lifecycle import StopEvent, stop_reason


def test_the_last_line_says_how_the_run_ended():
    assert RunEnd("max_steps", 90, 90).describe() == "learner finished: step 90 of 90"
    exhausted = RunEnd("data_exhausted", 42, 90, "1 epoch(s) of 2000 rows; 2000 admitted: 84 trained, 1916 stale")
    assert exhausted.describe() == (
        "learner finished: step 42 of 90, the data ran out (1 epoch(s) of 2000 rows; 2000 admitted: 84 trained, "
        "1916 stale)"
    )
    assert RunEnd("stopped", 42, 90, "SIGTERM").describe() == "learner stopped: step 42 of 90, by SIGTERM"


async def test_a_stop_event_keeps_what_set_it_first():
    stop = StopEvent()
    assert stop.reason is None and not stop.is_set()
    stop.set("SIGTERM")
    stop.set("the service is ending")
    assert stop.is_set() and stop.reason == "SIGTERM" and stop_reason(stop) == "SIGTERM"
    requested = StopEvent()
    requested.set()  # as POST /shutdown sets it
    assert stop_reason(requested) == "a stop request"
    plain = asyncio.Event()
    plain.set()
    assert stop_reason(plain) == "a stop request"
