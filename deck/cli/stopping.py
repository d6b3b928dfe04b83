"""How a long-running command (``deck merge --follow`` and its worker processes) stops on
SIGINT / SIGTERM: by an event its loop waits on, set without a lock taken in a signal handler."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

STOP_SIGNALS = frozenset((signal.SIGINT, signal.SIGTERM))


def _noted(_signum: int, _frame: Any) -> None:
    """The Python-level handler: nothing (the C-level one wrote the number to the wakeup fd)."""


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """Inside, SIGINT and SIGTERM set ``stop`` (from the main thread only). A signal this
    process ignores (inherited: a command started in the background of a shell ignores SIGINT)
    stays ignored, as Python itself leaves it: its workers must not stop on a group's SIGINT
    that their command does not take (a break-it finding: they did, and it started them again
    for ever).

    Not by calling ``stop.set()`` in the handler: Python runs a handler on the main thread
    between two bytecodes, possibly inside ``stop.wait()`` while it holds the event's lock,
    which ``set()`` takes too -- the process then waits on itself for ever (a break-it finding:
    a ``deck merge --follow`` worker hung on SIGTERM, its parent waiting for it). The signal's
    number goes through a pipe (``signal.set_wakeup_fd``, written by the C-level handler) to a
    thread that sets the event."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    previous_fd = signal.set_wakeup_fd(w)
    taken = [s for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN]
    previous = {s: signal.signal(s, _noted) for s in taken}

    def watch() -> None:
        while data := os.read(r, 64):
            if any(n in STOP_SIGNALS for n in data):
                stop.set()

    watcher = threading.Thread(target=watch, name="deck-signals", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(previous_fd)
        os.close(w)  # (its read returns b"": the watcher ends)
        watcher.join()
        os.close(r)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """SIGINT and SIGTERM held pending while inside: a child process started here inherits the
    mask, so a stop that comes while it is still starting is delivered once it unblocks them
    (:func:`unblock_stop_signals`, after :func:`stop_on_signals`), not by the default action
    (killed, or a KeyboardInterrupt's traceback from its bootstrap)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def unblock_stop_signals() -> None:
    """What a child started under :func:`stop_signals_blocked` calls once it can stop."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def hold_stop_signals() -> None:
    """Block SIGINT and SIGTERM for the rest of this process: what a stopped worker calls once
    its loop has ended, so that a second stop (its command's, after the group's) cannot kill it
    before it has said how it ended."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
