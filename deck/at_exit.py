"""Checkpoints still in the background when a process ends without ``close()`` are finished,
not lost.

A script that falls off its end (or leaves on an exception outside ``with``) never calls
``close()``. Its checkpoints staged in memory would die with the daemon threads that write
them, and a commit thread running on would fail at the first thread pool it submits to,
because ``concurrent.futures`` refuses new work once the interpreter shuts down. So every
open checkpointer is registered here, and one hook closes those still open, non-collectively
(the other ranks may be gone), before the thread pools shut down.

The hook is a ``threading`` exit hook, not ``atexit``: ``threading._shutdown`` calls those
(newest first) before it joins the threads and before ``atexit`` runs, and
``concurrent.futures`` registers its own pool shutdown the same way. This module imports it
first, so ours is registered after it and runs before it. ``os._exit`` and a kill skip all
of this: what a process killed that way loses is what ``release=first_tier`` is for.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401  (registers its exit hook before ours: see above)
import logging
import os
import threading
from typing import Protocol

logger = logging.getLogger("deck.trainer.checkpointer")


class Closable(Protocol):
    def close(self, collective: bool = True) -> None: ...
    def close_at_exit(self) -> None: ...


_open: dict[int, Closable] = {}  # by id(), oldest first
_lock = threading.Lock()


def keep_open(ckpt: Closable) -> None:
    """Close ``ckpt`` when the process exits, unless :func:`forget` was called first. Holds a
    reference to it until then: a checkpointer whose last reference is dropped without
    ``close()`` still finishes what it staged."""
    with _lock:
        _open[id(ckpt)] = ckpt


def forget(ckpt: Closable) -> None:
    """``ckpt`` was closed: nothing to do for it at exit."""
    with _lock:
        _open.pop(id(ckpt), None)


def still_open() -> list[Closable]:
    """The checkpointers not closed yet, oldest first."""
    with _lock:
        return list(_open.values())


def close_open() -> None:
    """Close every checkpointer still open, newest first, each on this rank only; one that
    raises is logged and the others are still closed. Called at interpreter exit."""
    for ckpt in reversed(still_open()):
        try:
            ckpt.close_at_exit()
        except Exception:
            logger.exception("deck: closing a checkpointer at exit failed")


def _forked() -> None:
    # A forked child (a DataLoader worker, say) has copies of the parent's checkpointers but
    # none of their threads: closing them at its exit would wait forever for work only the
    # parent does, and give back the parent's writer lease.
    with _lock:
        _open.clear()


threading._register_atexit(close_open)  # type: ignore[attr-defined]
os.register_at_fork(after_in_child=_forked)
