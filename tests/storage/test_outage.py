"""What a long-running service does while the store cannot be reached (deck.storage.outage)."""

from __future__ import annotations

import logging

import pytest

from deck.storage.outage import Waiting


def test_a_waiting_service_says_each_problem_once_and_backs_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logging.getLogger("deck.serve.follow")
    w = Waiting("deck follow kafka://h:1/t", poll_s=2.0, log=log, max_s=10.0)
    with caplog.at_level(logging.DEBUG, logger="deck.serve.follow"):
        waits = [w.failed(RuntimeError("the topic does not exist (yet)")) for _ in range(5)]
        assert waits == [2.0, 4.0, 8.0, 10.0, 10.0]
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "does not exist" in warned[0].getMessage()
        assert "deck follow kafka://h:1/t" in warned[0].getMessage()
        assert w.failed(RuntimeError("no broker answers")) == 10.0  # a new problem: said again
        w.ok()
        assert w.failed(RuntimeError("no broker answers")) == 2.0  # back to the poll interval
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 3 and not any("going on" in w for w in warned), warned
