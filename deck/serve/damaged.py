"""Published checkpoints a follower found damaged, tried again later.

A publish URI filled by a copy that lands a commit record before its chunks (a sync tool, a
slow copy), or a file repaired by hand, is served once it is whole, without a restart: a
damaged checkpoint is left out of the plans for a while that doubles on every failed try
(:data:`RETRY_FIRST_S` up to :data:`RETRY_MAX_S`), then planned and read again. A try that
fails the same way again is not said again; another problem is. Before, such a step was never
tried again and the server stayed on its last version until the next full, with nothing said
after the first error (a break-it finding).

Guarantees: nothing of a damaged checkpoint is ever applied (the read of a retried one checks
every file again, as the first did); the same instance is retried at most once per
:data:`RETRY_MAX_S` once it keeps failing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0


@dataclass
class _Damage:
    problem: str  # as said last
    due: float  # when it may be tried again (the clock's)
    wait: float  # the wait before ``due``: doubled at each failed try


class DamagedCheckpoints:
    """Checkpoint ids found damaged, and when each may be tried again (``clock``: seconds)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._found: dict[str, _Damage] = {}

    def waiting(self) -> frozenset[str]:
        """The ids not to plan now (their wait is not over)."""
        now = self._clock()
        return frozenset(i for i, d in self._found.items() if d.due > now)

    def found(self, ckpt_id: str, problem: str) -> bool:
        """``ckpt_id`` failed its read (again); True when this is news to say (the first
        failure, or a problem other than the one said last)."""
        before = self._found.get(ckpt_id)
        wait = RETRY_FIRST_S if before is None else min(2 * before.wait, RETRY_MAX_S)
        self._found[ckpt_id] = _Damage(problem, self._clock() + wait, wait)
        return before is None or before.problem != problem

    def repaired(self, ckpt_id: str) -> bool:
        """``ckpt_id`` was read whole: forgotten; True when it had been found damaged."""
        return self._found.pop(ckpt_id, None) is not None

    def known(self) -> frozenset[str]:
        """Every id found damaged and not read whole since."""
        return frozenset(self._found)
