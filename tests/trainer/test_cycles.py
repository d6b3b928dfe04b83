"""``gc.collect()`` collects nothing while another thread's collection is in progress (one whose
finalizer released the GIL); the checkpoint's collection of dropped forwards' graphs waits for
that one and then runs (a spurious "still wait for their backward" refusal otherwise)."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator

import pytest

from deck.trainer import cycles
from deck.trainer.chain import gc_paused


@pytest.fixture(autouse=True)
def _only_explicit_collections() -> Iterator[None]:
    """No automatic collection: one in the test's own thread could run a blocking finalizer
    meant for the other thread's collection, and wait for itself."""
    with gc_paused():
        yield


class _Cycle:
    def __init__(self) -> None:
        self.me = self


class _BlockingFinalizer(_Cycle):
    """Garbage whose finalizer, run inside a collection, waits (releasing the GIL)."""

    def __init__(self, entered: threading.Event, release: threading.Event) -> None:
        super().__init__()
        self.entered, self.release = entered, release

    def __del__(self) -> None:
        self.entered.set()
        self.release.wait()


def _collecting_through(entered: threading.Event, release: threading.Event) -> threading.Thread:
    """A thread that collects a :class:`_BlockingFinalizer`: in its collection from ``entered``
    until ``release``."""

    def collect() -> None:
        _BlockingFinalizer(entered, release)
        gc.collect()

    thread = threading.Thread(target=collect)
    thread.start()
    return thread


def test_a_collection_waits_for_another_threads_collection_and_then_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entered, release = threading.Event(), threading.Event()
    other = _collecting_through(entered, release)
    try:
        assert entered.wait(60)  # the other thread is inside its collection now
        garbage = _Cycle()
        alive = weakref.ref(garbage)
        del garbage
        assert gc.collect() == 0 and alive() is not None  # what CPython does: nothing

        waits = []
        wait = cycles._await_turn

        def release_then_wait(after: int, timeout: float) -> bool:
            waits.append(timeout)
            release.set()  # the other collection can end only once this thread waits for it
            return wait(after, timeout)

        monkeypatch.setattr(cycles, "_await_turn", release_then_wait)
        assert cycles.collect_cycles()
        assert alive() is None
        assert waits
    finally:
        release.set()
        other.join()


def test_a_collection_blocked_by_a_finalizer_gives_up_at_its_timeout() -> None:
    entered, release = threading.Event(), threading.Event()
    other = _collecting_through(entered, release)
    try:
        assert entered.wait(60)
        assert not cycles.collect_cycles(timeout=0.01)
    finally:
        release.set()
        other.join()
    assert cycles.collect_cycles(timeout=0.01)


def test_a_full_collection_another_thread_runs_after_the_call_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(A thread that collects in a loop must not keep the checkpoint waiting for a turn.)"""
    garbage = _Cycle()
    alive = weakref.ref(garbage)
    del garbage
    wait = cycles._await_turn
    here: list[str] = []

    def another_thread_collects_then_wait(after: int, timeout: float) -> bool:
        other = threading.Thread(target=gc.collect)
        other.start()
        other.join()
        return wait(after, timeout)

    def count_here(phase: str, info: dict[str, int]) -> None:
        if threading.current_thread() is threading.main_thread() and info["generation"] == 2:
            here.append(phase)  # a full collection run here

    monkeypatch.setattr(cycles, "_await_turn", another_thread_collects_then_wait)
    gc.callbacks.append(count_here)
    try:
        assert cycles.collect_cycles()
    finally:
        gc.callbacks.remove(count_here)
    assert alive() is None and here == []  # freed by the other thread's; none run here


def test_a_thread_collecting_in_a_loop_does_not_keep_the_call_waiting() -> None:
    stop = threading.Event()
    started = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            gc.collect()
            started.set()

    other = threading.Thread(target=churn)
    other.start()
    try:
        assert started.wait(60)
        garbage = _Cycle()
        alive = weakref.ref(garbage)
        del garbage
        # Waiting for a turn of its own, it would get one only by chance (the churn starts the
        # next collection before this thread wakes) and give up after 10 s.
        assert cycles.collect_cycles()
        assert alive() is None
    finally:
        stop.set()
        other.join()
