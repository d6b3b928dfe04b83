"""A full collection of reference cycles that really runs, whatever the other threads do.

``gc.collect()`` returns at once, collecting nothing, while another thread's collection is in
progress -- and a collection lets other threads run whenever a finalizer it calls releases the
GIL (a file closed, a tensor freed, a lock waited for), which the stager's threads, allocating
all the time, make common. A checkpoint that collects the graph of a dropped forward before
counting the lookups still waiting for their backward must not skip that collection, or it
refuses at random (:meth:`deck.trainer.chain.Chain._snapshot`).
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

_cond = threading.Condition()  # reentrant: a collection may start inside a held section
_running = 0  # collections in progress, any thread (0 or 1: CPython runs one at a time)
_here = threading.local()  # collections this thread ran (``.runs``)


def _track(phase: str, info: dict[str, Any]) -> None:
    global _running
    with _cond:
        if phase == "start":
            _running += 1
            _here.runs = getattr(_here, "runs", 0) + 1
        else:
            _running = max(0, _running - 1)  # (a collection begun before this module's import)
            _cond.notify_all()


gc.callbacks.append(_track)


def _await_other_collection(timeout: float) -> bool:
    """Wait until no collection is in progress (False: still one after ``timeout`` s)."""
    with _cond:
        return _cond.wait_for(lambda: _running == 0, timeout)


def collect_cycles(timeout: float = 10.0) -> bool:
    """Run a full collection in this thread, first waiting for one in progress in another
    thread to end. True once it ran; False if other threads' collections kept it from running
    for ``timeout`` seconds (a finalizer that blocks)."""
    deadline = time.monotonic() + timeout
    while _await_other_collection(max(0.0, deadline - time.monotonic())):
        before = getattr(_here, "runs", 0)
        gc.collect()
        if getattr(_here, "runs", 0) > before:
            return True
        # Another thread began one between the wait and the call: wait for that one too.
    return False
