"""The CPU jagged-unique kernels: the bitmap path (native mark-and-scan, or its numpy fallback)
and the composite-key sort path. The rest of the work is numpy: its large allocations are
huge-page backed, which makes the first touch of a big temporary cheap (torch's CPU allocator's
are not)."""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import numpy as np
import torch

from .common import Unique
from .cpu_pool import run_all
from .native import native_available, native_scan_groups
from .numpy_bitmap import numpy_scan_groups

__all__ = ["cpu_bitmap", "cpu_sort", "cpu_table_max"]


def cpu_table_max(values: torch.Tensor, lengths: list[int]) -> list[int]:
    """Largest id of each table (-1 for an empty one), one O(n) pass."""
    out = [-1] * len(lengths)
    nonempty = [t for t, count in enumerate(lengths) if count > 0]
    if not nonempty:
        return out
    v = values.contiguous().numpy()
    starts = np.fromiter(itertools.accumulate([0, *lengths[:-1]]), dtype=np.int64)
    # reduceat over the starts of non-empty tables: each range then spans exactly one table,
    # because the empty tables in between contribute no elements.
    maxima = np.maximum.reduceat(v, starts[nonempty])
    for t, m in zip(nonempty, maxima.tolist(), strict=True):
        out[t] = int(m)
    return out


class _Outputs(NamedTuple):
    """The bitmap path's output arrays, which the groups of tables fill in disjoint slices."""

    values: np.ndarray
    inverse: np.ndarray | None
    first: np.ndarray | None


def cpu_bitmap(
    values: torch.Tensor,
    lengths: list[int],
    bounds: list[int],
    *,
    check_ids: bool,
    return_inverse: bool,
    return_first: bool,
) -> Unique:
    """Bitmap jagged unique on CPU; ids must satisfy ``0 <= id < bounds[table]``.

    With ``check_ids`` that is verified on the way, at no extra pass over the ids for the upper
    bound (numpy's fancy assignment raises on an index past the table's slice of the map) and one
    per worker for the sign (numpy would silently wrap a negative index).
    """
    v = values.contiguous().numpy()
    n = v.size
    num_tables = len(lengths)
    starts = [0, *itertools.accumulate(lengths)]
    if native_available():
        groups, scanned = native_scan_groups(
            [v.ctypes.data + start * v.itemsize for start in starts[:-1]],
            lengths,
            list(range(num_tables + 1)),
            v.itemsize,
            bounds,
            lambda t: v[starts[t] : starts[t + 1]],
        )
    else:
        groups, scanned = numpy_scan_groups(v, starts, lengths, bounds, check_ids)

    counts: list[int] = []
    for _, cuts in scanned:
        counts.extend(np.diff(cuts).tolist())
    bases = [0, *itertools.accumulate(rows.size for rows, _ in scanned)]
    num_unique = bases[-1]
    out = _Outputs(
        values=np.empty(num_unique, dtype=v.dtype),
        inverse=np.empty(n, dtype=np.int64) if return_inverse or return_first else None,
        first=np.empty(num_unique, dtype=np.int64) if return_first else None,
    )
    emit = functools.partial(_emit_group, v, starts, bounds, groups, scanned, bases, out)
    run_all([functools.partial(emit, g) for g in range(len(groups))])
    return Unique(
        values=torch.from_numpy(out.values),
        lengths=counts,
        inverse=torch.from_numpy(out.inverse)
        if return_inverse and out.inverse is not None
        else None,
        first=torch.from_numpy(out.first) if out.first is not None else None,
    )


def _emit_group(
    v: np.ndarray,
    starts: list[int],
    bounds: list[int],
    groups: list[tuple[int, int]],
    scanned: list[tuple[np.ndarray, np.ndarray]],
    bases: list[int],
    out: _Outputs,
    g: int,
) -> None:
    """Write group ``g``'s distinct ids (and, when wanted, inverse and first) into ``out``."""
    lo, hi = groups[g]
    rows, cuts = scanned[g]
    base = bases[g]
    out.values[base : base + rows.size] = rows
    inverse = out.inverse
    if inverse is None:
        return
    rank_dtype = np.int32 if out.values.size < 2**31 else np.int64
    # One rank map the size of the group's largest table, reused table after table: it stays
    # cache-resident where a map over all the group's rows would not, and int32 halves it.
    rank = np.empty(max(bounds[lo:hi], default=0), dtype=rank_dtype)
    for i, t in enumerate(range(lo, hi)):
        a, b = base + int(cuts[i]), base + int(cuts[i + 1])
        # Entries left over from the previous table are never read: only this table's ids
        # are looked up, and each of them was just written.
        rank[out.values[a:b]] = np.arange(a, b, dtype=rank_dtype)
        # mode="clip" skips numpy's bounds-checking ("raise") path; ids are in range here.
        inverse[starts[t] : starts[t + 1]] = np.take(
            rank, v[starts[t] : starts[t + 1]], mode="clip"
        )
    del rank
    if out.first is not None:
        # The groups own disjoint slices of `first`, so their scatter-min calls cannot race.
        out.first[base : base + rows.size] = v.size
        np.minimum.at(
            out.first,
            inverse[starts[lo] : starts[hi]],
            np.arange(starts[lo], starts[hi], dtype=np.int64),
        )


def cpu_sort(
    values: torch.Tensor,
    lengths: list[int],
    id_bits: int,
    *,
    return_inverse: bool,
    return_first: bool,
) -> Unique:
    """Composite-key sort jagged unique on CPU; requires ``0 <= id < 2**id_bits``."""
    v = values.contiguous().numpy()
    n = v.size
    num_tables = len(lengths)
    key_dtype = np.int32 if num_tables.bit_length() + id_bits <= 31 else np.int64
    starts = [0, *itertools.accumulate(lengths)]
    # numpy buffers: huge-page backed, so first touch is cheap (torch's CPU allocator is not).
    key = np.empty(n, dtype=key_dtype)
    for t in range(num_tables):
        np.bitwise_or(
            v[starts[t] : starts[t + 1]],
            key_dtype(t << id_bits),
            out=key[starts[t] : starts[t + 1]],
            casting="unsafe",
        )
    sorted_key = np.empty(n, dtype=key_dtype)
    perm = np.empty(n, dtype=np.int64)
    # torch's sort runs on the intra-op thread pool: about twice as fast as numpy's here.
    torch.sort(
        torch.from_numpy(key),
        stable=True,
        out=(torch.from_numpy(sorted_key), torch.from_numpy(perm)),
    )
    del key
    is_start = np.empty(n, dtype=np.bool_)
    is_start[:1] = True
    np.not_equal(sorted_key[1:], sorted_key[:-1], out=is_start[1:])
    run_starts = np.flatnonzero(is_start)
    unique_keys = sorted_key[run_starts]
    del sorted_key
    mask = key_dtype((1 << id_bits) - 1)
    unique_values = np.bitwise_and(unique_keys, mask).astype(v.dtype, copy=False)
    edges = np.arange(num_tables + 1, dtype=np.int64) << id_bits
    counts = np.diff(np.searchsorted(unique_keys, edges.astype(key_dtype))).tolist()
    inverse = None
    if return_inverse:
        inverse = np.empty(n, dtype=np.int64)
        inverse[perm] = np.cumsum(is_start, dtype=np.int64) - 1
    first = perm[run_starts] if return_first else None
    return Unique(
        values=torch.from_numpy(np.ascontiguousarray(unique_values)),
        lengths=counts,
        inverse=torch.from_numpy(inverse) if inverse is not None else None,
        first=torch.from_numpy(first) if first is not None else None,
    )
