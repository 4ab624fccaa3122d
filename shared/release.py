"""Dropping an object whose destructor blocks, off the thread that is done with it."""

from __future__ import annotations

import threading
from typing import Any


def release_in_background(holder: list[Any], name: str) -> None:
    """Empty ``holder``, a list holding the only references to some objects, on a daemon thread, so their
    destructors run there (the caller drops its own references *before* calling: otherwise the last one,
    and the destructor, could still be the caller's). A gloo process group's destructor waits for its
    threads and sockets: 17-20 ms per group (measured with torch 2.13 on the 2-core CI machine), which the
    end of a weight push need not wait for; the waiting releases the GIL."""
    threading.Thread(target=holder.clear, name=name, daemon=True).start()
