"""The numpy fallback of the CPU bitmap mark-and-scan (one byte per row), used where no C
compiler built :mod:`deck.kernels.native`'s extension; same results, slower."""

from __future__ import annotations

import functools
import itertools

import numpy as np

from .checks import check_min_id, out_of_range
from .cpu_pool import give_back_map, run_all, split_tables, take_map, workers

__all__ = ["numpy_scan_groups"]


def numpy_scan_groups(
    v: np.ndarray, starts: list[int], lengths: list[int], bounds: list[int], check_ids: bool
) -> tuple[list[tuple[int, int]], list[tuple[np.ndarray, np.ndarray]]]:
    """Mark and scan with numpy (one byte per row): the groups of tables, and per group its
    distinct ids (table-local, ascending per table) with per-table cuts.

    Table ``t``'s ids are ``v[starts[t]:starts[t + 1]]``, all below ``bounds[t]``. With
    ``check_ids`` the sign is checked (one pass per group: numpy would wrap a negative index);
    an id past its bound always raises (numpy's fancy assignment does).
    """
    num_tables = len(lengths)
    row_starts = [0, *itertools.accumulate(bounds)]
    # Marking an id is a random byte write; zeroing and scanning a row is a sequential pass that
    # costs several times less, hence rows weigh 1/8 in the split.
    costs = [count + rows // 8 for count, rows in zip(lengths, bounds, strict=True)]
    groups = split_tables(costs, workers(sum(costs), num_tables))
    whole_map = take_map(row_starts[-1])

    def mark_and_scan(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        if check_ids and starts[hi] > starts[lo]:
            check_min_id(int(v[starts[lo] : starts[hi]].min()))
        base_row = row_starts[lo]
        bitmap = whole_map[base_row : row_starts[hi]]
        for t in range(lo, hi):
            if not lengths[t]:
                continue
            ids = v[starts[t] : starts[t + 1]]
            try:
                bitmap[row_starts[t] - base_row : row_starts[t + 1] - base_row][ids] = True
            except IndexError:
                raise out_of_range(t, ids, bounds) from None
        rows = np.flatnonzero(bitmap)
        bitmap[rows] = False  # all zero again, ready for the next call
        cuts = np.searchsorted(rows, np.asarray(row_starts[lo : hi + 1], dtype=np.int64) - base_row)
        for t in range(lo, hi):  # map rows -> table-local ids
            rows[cuts[t - lo] : cuts[t - lo + 1]] -= row_starts[t] - base_row
        return rows, cuts

    # On an error some marks may be left: the map is then dropped, not given back.
    scanned = run_all([functools.partial(mark_and_scan, lo, hi) for lo, hi in groups])
    give_back_map(whole_map)
    return groups, scanned
