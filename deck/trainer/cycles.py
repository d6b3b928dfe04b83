"""A full collection of reference cycles that really runs, whatever the other threads do.

``gc.collect()`` returns at once, collecting nothing, while another thread's collection is in
progress -- and a collection lets other threads run whenever a finalizer it calls releases the
GIL (a file closed, a tensor freed, a lock waited for), which the stager's threads, allocating
all the time, make common. A checkpoint that collects the graph of a dropped forward before
counting the lookups still waiting for their backward must not skip that collection, or it
refuses at random (:meth:`deck.trainer.chain.ChainWriter._snapshot`).
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

_OLDEST = len(gc.get_threshold()) - 1  # the generation of a full collection
_cond = threading.Condition()  # reentrant: a collection may start inside a held section
_running = 0  # collections in progress, any thread (0 or 1: CPython runs one at a time)
_full_started = 0  # full collections begun so far, any thread
_full_done = 0  # the latest of those to have ended (its number in _full_started's count)
_here = threading.local()  # the number of the full collection this thread runs (``.full``)


def _track(phase: str, info: dict[str, Any]) -> None:
    global _running, _full_started, _full_done
    with _cond:
        full = info.get("generation") == _OLDEST
        if phase == "start":
            _running += 1
            if full:
                _full_started += 1
                _here.full = _full_started
        else:
            _running = max(0, _running - 1)  # (a collection begun before this module's import)
            if full:
                _full_done = max(_full_done, getattr(_here, "full", 0))
            _cond.notify_all()


gc.callbacks.append(_track)


def _await_turn(after: int, timeout: float) -> bool:
    """Wait until no collection is in progress, or a full one numbered past ``after`` has ended
    (False: neither within ``timeout`` s)."""
    with _cond:
        return _cond.wait_for(lambda: _running == 0 or _full_done > after, timeout)


def collect_cycles(timeout: float = 10.0) -> bool:
    """Return once a full collection begun after this call has run, in this thread or another
    (True): another thread's counts (one collecting in a loop would otherwise keep this
    waiting for a turn); else this thread runs one, first waiting for one in progress in
    another thread to end. False if other threads' collections kept it from running for
    ``timeout`` seconds (a finalizer that blocks)."""
    deadline = time.monotonic() + timeout
    with _cond:
        after = _full_started
    while _await_turn(after, max(0.0, deadline - time.monotonic())):
        if _full_done > after:
            return True
        gc.collect()
        # Not run if another thread began one between the wait and the call: wait for it too.
    return False
