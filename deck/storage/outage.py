"""What a long-running service (``deck follow``, ``deck merge --follow``) does while it cannot
go on: the store or broker is down, the publisher has not written yet. It says so once per
distinct problem and retries, never exits for it."""

from __future__ import annotations

import logging


class Waiting:
    """The first occurrence of each problem at WARNING on ``log``, repeats at DEBUG, and a wait
    that doubles from ``poll_s`` up to ``max_s``; :meth:`ok` after a success resets both (and
    says the problem is gone). ``what`` names the service and its URI in each line."""

    def __init__(self, what: str, poll_s: float, log: logging.Logger, max_s: float = 30.0) -> None:
        self.what, self.poll_s, self.max_s = what, poll_s, max(max_s, poll_s)
        self.log = log
        self.wait_s = poll_s
        self.last: str | None = None

    def failed(self, e: Exception) -> float:
        """Log ``e`` (once per distinct problem) and return how long to wait now."""
        text = str(e)
        level = logging.DEBUG if text == self.last else logging.WARNING
        self.log.log(level, "%s: %s; retrying (every %g s at most)", self.what, text, self.max_s)
        self.last = text
        wait, self.wait_s = self.wait_s, min(self.wait_s * 2, self.max_s)
        return wait

    def ok(self) -> None:
        if self.last is not None:
            self.log.info("%s: going on (the problem above is gone)", self.what)
        self.last, self.wait_s = None, self.poll_s
