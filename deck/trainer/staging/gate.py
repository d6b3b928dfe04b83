"""The stall gate: the stager's background threads start no new file while training is stalled.

On a box where the ranks' training threads have the cores to themselves, a spool writer
checksumming and writing an earlier part (a large full still being written when the next delta
is taken) competes with the copy and delays the vote's collective. The training thread closes
the gate for the copy and the vote and opens it before anything it does waits for the
background; a file a background thread is writing when the gate closes finishes.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)

# A background thread never waits longer than this at a closed gate: a stall that long is itself
# waiting for something (a path that forgot to open the gate would otherwise deadlock).
MAX_HOLD_S = 5.0


class StallGate:
    """Closed while the training thread is stalled in a checkpoint; background threads pass
    through :meth:`wait_open` before each file they start."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._closed = False
        self.waiting = 0  # background threads holding at the gate now

    def close(self) -> None:
        """Training thread: the stall begins; background threads hold before their next file."""
        with self._cond:
            self._closed = True

    def open(self) -> None:
        """Training thread: the stall ended, or it is about to wait for the background."""
        with self._cond:
            self._closed = False
            self._cond.notify_all()

    def wait_open(self) -> None:
        """Background thread: return once the gate is open (at most :data:`MAX_HOLD_S` later)."""
        with self._cond:
            self.waiting += 1
            try:
                if not self._cond.wait_for(lambda: not self._closed, timeout=MAX_HOLD_S):
                    logger.warning(
                        "deck: a background write waited %.1f s for a checkpoint stall to end; "
                        "going on",
                        MAX_HOLD_S,
                    )
            finally:
                self.waiting -= 1
