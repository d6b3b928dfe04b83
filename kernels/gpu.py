"""Jagged unique written with torch tensor ops only, for CUDA (and any non-CPU device).

:func:`deck.kernels.jagged_unique` dispatches here for tensors that are not on the CPU. The
functions are device-agnostic torch code, so the tests also run them on CPU tensors; on CUDA they
launch only stream-ordered kernels, and the places that must wait for the device are listed here:

- :func:`device_stats` copies one small tensor (lengths, min id, per-table max id) to the host:
  one sync, needed to validate the input and to pick an algorithm. The dispatcher skips it when
  ``validate=False`` and the host already knows what it needs (``num_rows`` given as host ints).
- the number of distinct ids is data dependent, and the output's size must be known on the host to
  allocate it, so each algorithm has exactly one ``nonzero`` (a sync). Nothing else reads device
  memory from the host: ``repeat_interleave`` gets ``output_size``, per-table counts come from
  ``searchsorted`` instead of ``bincount`` (which syncs to find its output length), and host
  metadata goes up through pinned memory with ``non_blocking=True``.

Inputs are assumed validated by the dispatcher (non-negative ids, lengths summing to the number of
ids, ids below the per-table bound on the bitmap path).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = ["DeviceStats", "bitmap_unique", "device_stats", "sort_unique"]


class DeviceStats(NamedTuple):
    """Host copies of what validation and algorithm choice need, fetched in one sync."""

    lengths: list[int]
    min_id: int | None  # None when there are no ids
    table_max: list[int] | None  # -1 for an empty table; None when not requested


class _Result(NamedTuple):
    values: torch.Tensor
    lengths: torch.Tensor  # int64, on the device
    inverse: torch.Tensor | None
    first: torch.Tensor | None


def _host_to_device(host: Sequence[int], device: torch.device) -> torch.Tensor:
    """A small int64 tensor on ``device`` without making the host wait for the device."""
    t = torch.tensor(list(host), dtype=torch.int64)
    if device.type == "cuda":
        # A copy from pageable memory may synchronise with the stream; a pinned one does not, and
        # the caching host allocator keeps the pinned block alive until the copy has run.
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def device_stats(values: torch.Tensor, lengths: torch.Tensor, *, table_max: bool) -> DeviceStats:
    """Per-table lengths, the smallest id and (optionally) each table's largest id, in one sync.

    Safe on invalid input: table membership is computed with ``searchsorted`` over the running
    sum of ``lengths``, which never indexes out of bounds even when ``lengths`` does not sum to
    ``values.numel()`` or holds negative entries, so the caller can validate the returned numbers.
    """
    device = values.device
    n = values.numel()
    num_tables = lengths.numel()
    lengths64 = lengths.to(device=device, dtype=torch.int64)
    parts = [lengths64]
    if n > 0:
        parts.append(values.min().to(torch.int64).reshape(1))
    want_max = table_max and n > 0 and num_tables > 0
    if want_max:
        ends = torch.cumsum(lengths64, 0)
        positions = torch.arange(n, device=device, dtype=torch.int64)
        table = torch.searchsorted(ends, positions, right=True).clamp_(max=num_tables - 1)
        tmax = torch.full((num_tables,), -1, dtype=torch.int64, device=device)
        tmax.scatter_reduce_(0, table, values.to(torch.int64), reduce="amax", include_self=True)
        parts.append(tmax)
    host = torch.cat(parts).tolist()  # the one device->host sync
    min_id = host[num_tables] if n > 0 else None
    tmax_host: list[int] | None = None
    if table_max:
        tmax_host = host[num_tables + 1 :] if want_max else [-1] * num_tables
    return DeviceStats(lengths=host[:num_tables], min_id=min_id, table_max=tmax_host)


def bitmap_unique(
    values: torch.Tensor,
    lengths: torch.Tensor,
    bounds: Sequence[int],
    *,
    return_inverse: bool,
    return_first: bool,
) -> _Result:
    """Jagged unique by marking ids in one bitmap that holds all tables back to back.

    Requires ``0 <= values[i] < bounds[table of i]``. Table ``t`` owns bitmap rows
    ``[sum(bounds[:t]), sum(bounds[:t + 1]))``, so one ``nonzero`` over the bitmap yields every
    table's distinct ids in ascending order, grouped by table: no sort at all, O(n + sum(bounds)).
    ``lengths`` must already live on ``values.device``.
    """
    device = values.device
    n = values.numel()
    starts_host = [0, *itertools.accumulate(bounds)]
    total_rows = starts_host[-1]
    row_starts = _host_to_device(starts_host, device)  # T + 1 entries, the last is total_rows
    # output_size keeps repeat_interleave from reading lengths back to size its output.
    element_base = torch.repeat_interleave(row_starts[:-1], lengths, output_size=n)
    key = values.to(torch.int64) + element_base
    del element_base
    bitmap = torch.zeros(total_rows, dtype=torch.bool, device=device)
    # Every write stores the same value, so duplicate keys cannot race to different results.
    bitmap.index_fill_(0, key, True)
    unique_keys = torch.nonzero(bitmap).squeeze(1)  # sync: the output size is data dependent
    del bitmap
    num_unique = unique_keys.numel()
    cuts = torch.searchsorted(unique_keys, row_starts)
    counts = cuts[1:] - cuts[:-1]
    unique_base = torch.repeat_interleave(row_starts[:-1], counts, output_size=num_unique)
    unique_values = (unique_keys - unique_base).to(values.dtype)
    inverse: torch.Tensor | None = None
    first: torch.Tensor | None = None
    if return_inverse or return_first:
        # A binary search per id rather than a rank map over the rows: no memory proportional to
        # the bounds (which a caller may force large), and on a GPU the search is cheap.
        inverse = torch.searchsorted(unique_keys, key)
        if return_first:
            first = _first_positions(inverse, num_unique)
    return _Result(unique_values, counts, inverse if return_inverse else None, first)


def sort_unique(
    values: torch.Tensor,
    lengths: torch.Tensor,
    num_tables: int,
    *,
    id_bits: int | None,
    return_inverse: bool,
    return_first: bool,
) -> _Result:
    """Jagged unique by one stable sort of a composite (table, id) key, or a two-sort lexsort.

    With ``id_bits`` set, every id must be below ``2 ** id_bits`` and
    ``num_tables.bit_length() + id_bits <= 63``: then ``table << id_bits | id`` orders by table
    first and by id second, and a single sort does all tables. With ``id_bits=None`` (ids too
    large to share 63 bits with the table index), a stable sort by id followed by a stable sort by
    table gives the same order. Ties keep input order, so each run's first element is the id's
    first occurrence. ``lengths`` must already live on ``values.device``.
    """
    device = values.device
    n = values.numel()
    tables = torch.arange(num_tables, device=device, dtype=torch.int64)
    table_of = torch.repeat_interleave(tables, lengths, output_size=n)
    if id_bits is not None:
        narrow = num_tables.bit_length() + id_bits <= 31
        # Fewer key bits is fewer radix passes (and half the bytes moved) in the sort.
        key_dtype = torch.int32 if narrow else torch.int64
        key = (table_of << id_bits).bitwise_or_(values.to(torch.int64)).to(key_dtype)
        del table_of
        sorted_key, perm = torch.sort(key, stable=True)
        del key
        is_start = torch.ones(n, dtype=torch.bool, device=device)
        torch.ne(sorted_key[1:], sorted_key[:-1], out=is_start[1:])
        starts = torch.nonzero(is_start).squeeze(1)  # sync: the output size is data dependent
        unique_keys = sorted_key[starts]
        del sorted_key
        unique_values = (unique_keys & ((1 << id_bits) - 1)).to(values.dtype)
        edges = (torch.arange(num_tables + 1, device=device, dtype=torch.int64) << id_bits).to(
            key_dtype
        )
        cuts = torch.searchsorted(unique_keys, edges)
    else:
        sorted_values, perm_by_id = torch.sort(values, stable=True)
        table_by_id = table_of[perm_by_id]
        del table_of
        sorted_table, perm_by_table = torch.sort(table_by_id, stable=True)
        del table_by_id
        perm = perm_by_id[perm_by_table]
        sorted_values = sorted_values[perm_by_table]
        del perm_by_id, perm_by_table
        is_start = torch.ones(n, dtype=torch.bool, device=device)
        torch.ne(sorted_values[1:], sorted_values[:-1], out=is_start[1:])
        is_start[1:] |= sorted_table[1:] != sorted_table[:-1]
        starts = torch.nonzero(is_start).squeeze(1)  # sync: the output size is data dependent
        unique_values = sorted_values[starts]
        cuts = torch.searchsorted(sorted_table[starts], _table_edges(num_tables, device))
    counts = cuts[1:] - cuts[:-1]
    inverse: torch.Tensor | None = None
    first: torch.Tensor | None = None
    if return_inverse:
        run = torch.cumsum(is_start, 0, dtype=torch.int64) - 1
        inverse = torch.empty(n, dtype=torch.int64, device=device)
        inverse.scatter_(0, perm, run)
    if return_first:
        first = perm[starts]
    return _Result(unique_values, counts, inverse, first)


def _table_edges(num_tables: int, device: torch.device) -> torch.Tensor:
    """``[0, 1, ..., num_tables]``: the boundaries ``searchsorted`` needs to count per table."""
    return torch.arange(num_tables + 1, device=device, dtype=torch.int64)


def _first_positions(inverse: torch.Tensor, num_unique: int) -> torch.Tensor:
    """For each unique index, the smallest input position mapping to it (``amin`` is exact)."""
    n = inverse.numel()
    positions = torch.arange(n, dtype=torch.int64, device=inverse.device)
    first = torch.full((num_unique,), n, dtype=torch.int64, device=inverse.device)
    return first.scatter_reduce_(0, inverse, positions, reduce="amin", include_self=True)
