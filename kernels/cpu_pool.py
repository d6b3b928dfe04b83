"""What the CPU kernels keep between calls: the worker threads and the zeroed bitmap.

Fancy-index assignment, ``take`` and the native call are tight loops that release the GIL, so
disjoint groups of tables run on worker threads (as many as ``torch.get_num_threads()``). Both
the pool and the kept map are dropped in a forked child, which inherits neither usably.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import torch

__all__ = [
    "free_cached_buffers",
    "give_back_map",
    "run_all",
    "split_tables",
    "take_map",
    "workers",
]

# Below this much work (ids + rows / 8) a thread handoff costs more than it saves.
PARALLEL_MIN_WORK = 1 << 18
# The CPU bitmap kernel keeps its (zeroed) map between calls up to this size; see _ZeroedBytes.
CACHED_MAP_MAX_BYTES = 1 << 30

_T = TypeVar("_T")
_pool_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None


class _ZeroedBytes:
    """One all-zero byte buffer kept between calls of the CPU bitmap kernel.

    Compaction runs again and again with about the same number of rows. A fresh map costs a page
    fault per page, and under memory pressure (a page cache full of training data) each fault
    may first reclaim or compact memory: measured here at up to 200 ms of system time for a
    128 MB map. A kept map costs none of that: its user clears just the bytes it set (O(distinct
    ids)) and gives it back. Holds at most one buffer of at most ``CACHED_MAP_MAX_BYTES``; a
    call that finds it taken or too small allocates a fresh one. :func:`free_cached_buffers`
    drops it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffer: np.ndarray | None = None

    def take(self, size: int) -> np.ndarray:
        """An all-zero bool array of at least ``size`` bytes, owned by the caller until given back."""
        with self._lock:
            buffer, self._buffer = self._buffer, None
        if buffer is not None and buffer.size >= size:
            return buffer
        return np.zeros(size, dtype=np.bool_)

    def give_back(self, buffer: np.ndarray) -> None:
        """Keep ``buffer`` for the next call; it must be all zero again."""
        if buffer.nbytes > CACHED_MAP_MAX_BYTES:
            return
        with self._lock:
            if self._buffer is None or self._buffer.size < buffer.size:
                self._buffer = buffer

    def clear(self) -> None:
        with self._lock:
            self._buffer = None


_zeroed_bytes = _ZeroedBytes()


def take_map(size: int) -> np.ndarray:
    """An all-zero bool array of at least ``size`` bytes (the kept one when it is large enough),
    owned by the caller until :func:`give_back_map`. On an error, leave a map with marks in it
    to the garbage collector instead of giving it back."""
    return _zeroed_bytes.take(size)


def give_back_map(buffer: np.ndarray) -> None:
    """Keep ``buffer`` (all zero again) for the next :func:`take_map`."""
    _zeroed_bytes.give_back(buffer)


def free_cached_buffers() -> None:
    """Release the memory the CPU kernels keep between calls (one byte per row of the largest
    bitmap used so far, at most 1 GiB). The next call allocates afresh."""
    _zeroed_bytes.clear()


def _forget_pool_after_fork() -> None:
    # A forked child inherits the pool object but not its threads: work submitted there would
    # never run. Start afresh instead (and with a fresh cache, whose lock may have been held).
    global _pool, _pool_lock, _zeroed_bytes
    _pool = None
    _pool_lock = threading.Lock()
    _zeroed_bytes = _ZeroedBytes()


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def run_all(tasks: Sequence[Callable[[], _T]]) -> list[_T]:
    """Run ``tasks`` concurrently (the first on the calling thread) and return their results."""
    if len(tasks) <= 1:
        return [task() for task in tasks]
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=max(1, (os.cpu_count() or 2) - 1), thread_name_prefix="deck-kernels"
            )
        pool = _pool
    futures = [pool.submit(task) for task in tasks[1:]]
    try:
        head = tasks[0]()
    finally:
        # Let every task finish before returning or raising: they write into shared buffers.
        concurrent.futures.wait(futures)
    return [head, *(f.result() for f in futures)]


def split_tables(costs: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous table ranges ``[lo, hi)`` of roughly equal cost, at most ``parts`` of them."""
    num_tables = len(costs)
    if parts <= 1 or num_tables <= 1:
        return [(0, num_tables)]
    total = sum(costs)
    bounds = [0]
    running = 0
    for t, cost in enumerate(costs):
        running += cost
        # Cut once this part has its share; the last part takes whatever is left.
        if len(bounds) < parts and running >= total * len(bounds) / parts and t + 1 < num_tables:
            bounds.append(t + 1)
    bounds.append(num_tables)
    return [(lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo]


def workers(work: int, num_tables: int) -> int:
    """How many threads ``work`` (ids + scanned rows or words) over ``num_tables`` tables is
    worth: one below ``PARALLEL_MIN_WORK``, else up to ``torch.get_num_threads()``."""
    if work < PARALLEL_MIN_WORK:
        return 1
    return max(1, min(torch.get_num_threads(), num_tables))
