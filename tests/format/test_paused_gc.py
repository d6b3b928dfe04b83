"""``paused_gc``: the cyclic collector is off inside, back as it was after the last block ends,
whatever the nesting, the threads or an exception."""

from __future__ import annotations

import gc
import threading

import pytest

from deck.format.jsonio import paused_gc


def test_nested_and_failing_blocks_leave_the_collector_as_it_was() -> None:
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        with pytest.raises(ValueError), paused_gc():
            raise ValueError
        assert not gc.isenabled()  # the outer block still runs
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()


def test_blocks_in_threads_count_together() -> None:
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with paused_gc():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(10)
    with paused_gc():
        pass
    assert not gc.isenabled()  # the other thread's block still runs
    leave.set()
    t.join(10)
    assert gc.isenabled()
