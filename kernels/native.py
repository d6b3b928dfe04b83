"""The native CPU bitmap kernel (``kernels/_jagged.c``): loading it and calling it.

The extension is built at install when a C compiler is there (``pyproject.toml``,
``optional = true``); without it :func:`native_available` is false and the CPU bitmap path uses
the numpy fallback in :mod:`deck.kernels.numpy_bitmap` (same results). The kernel keeps one bit
per row in 64-bit words: one pass marks a table's ids, one word-at-a-time scan emits and clears
its set rows.
"""

from __future__ import annotations

import functools
import importlib
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from .checks import out_of_range
from .cpu_pool import give_back_map, run_all, split_tables, take_map, workers

__all__ = ["native_available", "native_module", "native_scan_groups"]

try:  # the native CPU kernel (kernels/_jagged.c), built at install when a C compiler is there
    _native: Any = importlib.import_module("deck.kernels._jagged")
except ImportError:  # pragma: no cover - depends on the install
    _native = None


def native_available() -> bool:
    """Whether the extension is loaded (read at each call, so tests can switch it off)."""
    return _native is not None


def native_module() -> Any:
    """The loaded extension module, or None without it (read at each call, so tests can switch
    it off)."""
    return _native


def native_scan_groups(
    ptrs: list[int],
    lens: list[int],
    pieces: list[int],
    itemsize: int,
    bounds: list[int],
    ids_of: Callable[[int], np.ndarray],
) -> tuple[list[tuple[int, int]], list[tuple[np.ndarray, np.ndarray]]]:
    """Mark and scan by the native kernel, from id arrays given by address: the groups of tables,
    and per group its distinct ids (table-local, ascending per table) with per-table cuts (as
    :func:`deck.kernels.numpy_bitmap.numpy_scan_groups`).

    Piece ``p`` is ``lens[p]`` ids of ``itemsize`` bytes at ``ptrs[p]``; table ``t`` owns pieces
    ``[pieces[t], pieces[t + 1])``. The caller keeps the arrays alive. ``ids_of(t)`` gives table
    ``t``'s ids to name one out of range in the error.
    """
    kernel = _native
    assert kernel is not None
    num_tables = len(bounds)
    lengths = [sum(lens[pieces[t] : pieces[t + 1]]) for t in range(num_tables)]
    # One bit per row in 64-bit words, a whole number of words per table (so that groups of
    # tables on different threads never share a word).
    words = [-(-b // 64) for b in bounds]
    word_starts = [0, *itertools.accumulate(words)]
    # Marking an id is a random write; scanning a word is a sequential load of 8 bytes.
    costs = [count + w for count, w in zip(lengths, words, strict=True)]
    groups = split_tables(costs, workers(sum(costs), num_tables))
    buffer = take_map(word_starts[-1] * 8)
    bits = buffer[: word_starts[-1] * 8].view(np.uint64)
    ptr_array = np.asarray(ptrs, dtype=np.int64)
    len_array = np.asarray(lens, dtype=np.int64)
    bound_array = np.asarray(bounds, dtype=np.int64)
    piece_array = np.asarray(pieces, dtype=np.int64)

    def mark_and_scan(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        out = np.empty(sum(lengths[lo:hi]), dtype=np.int64)
        counts = np.empty(hi - lo, dtype=np.int64)
        written, bad = kernel.mark_scan(
            ptr_array,
            len_array,
            piece_array[lo : hi + 1],
            itemsize,
            bound_array[lo:hi],
            bits[word_starts[lo] : word_starts[hi]],
            out,
            counts,
        )
        if bad >= 0:  # the kernel cleared its words
            raise out_of_range(lo + bad, ids_of(lo + bad), bounds)
        cuts = np.zeros(hi - lo + 1, dtype=np.int64)
        np.cumsum(counts, out=cuts[1:])
        return out[:written], cuts

    scanned = run_all([functools.partial(mark_and_scan, lo, hi) for lo, hi in groups])
    give_back_map(buffer)
    return groups, scanned
