"""Algorithm choice and dispatch by device for :func:`deck.kernels.jagged_unique`.

On CPU the lengths are read on the host (free) and the numpy kernels of :mod:`deck.kernels.cpu`
run; on other devices only what the host must know is fetched, in at most one sync, and the
torch-only kernels of :mod:`deck.kernels.gpu` run.
"""

from __future__ import annotations

from typing import Literal

import torch

from .checks import check_lengths, check_map_size, check_min_id, check_within_bounds
from .common import Method, Unique
from .cpu import cpu_bitmap, cpu_sort, cpu_table_max
from .gpu import bitmap_unique, device_stats, sort_unique

__all__ = [
    "BITMAP_ROWS_PER_ID",
    "choose_method",
    "composite_id_bits",
    "cpu_dispatch",
    "device_dispatch",
]

# "auto" takes the bitmap path while the map has at most this many rows per input id. On the
# project's 2-core CPU machines (Zipf ids, 8 tables) the bitmap and the sort break even at 16-32
# rows per id for 0.1M-1M ids, and past 64 for 4M ids (a sort's cost per id grows with n, the
# map's does not); 16 is on the safe side and keeps the map (one byte per row) within twice the
# size of the int64 input.
BITMAP_ROWS_PER_ID = 16
# Below this many rows the map is cheap whatever the number of ids.
BITMAP_FREE_ROWS = 1 << 16


def composite_id_bits(num_tables: int, max_id: int) -> int | None:
    """Bits for the id part of a (table, id) int64 key, or None when both do not fit in 63."""
    id_bits = max(max_id, 0).bit_length()
    return id_bits if num_tables.bit_length() + id_bits <= 63 else None


def choose_method(method: Method, n: int, bounds: list[int]) -> Literal["bitmap", "sort"]:
    """``method`` itself, or for ``"auto"`` the bitmap while its map is dense enough."""
    if method != "auto":
        return method
    rows = sum(bounds)
    return "bitmap" if rows <= BITMAP_ROWS_PER_ID * n + BITMAP_FREE_ROWS else "sort"


def cpu_dispatch(
    values: torch.Tensor,
    lengths: torch.Tensor,
    bounds: list[int] | None,
    method: Method,
    validate: bool,
    return_inverse: bool,
    return_first: bool,
) -> Unique:
    """:func:`deck.kernels.jagged_unique` for CPU tensors, before the output conversion."""
    n = values.numel()
    num_tables = lengths.numel()
    # Host ints already: checking them is free, and the kernels slice by them.
    counts = [int(x) for x in lengths.tolist()]
    check_lengths(counts, n)
    map_bounds = [m + 1 for m in cpu_table_max(values, counts)] if bounds is None else bounds
    chosen = choose_method(method, n, map_bounds)
    if chosen == "bitmap":
        check_map_size(map_bounds)
        # The bitmap kernel validates ids as it goes (see cpu_bitmap): no separate passes.
        return cpu_bitmap(
            values,
            counts,
            map_bounds,
            check_ids=validate,
            return_inverse=return_inverse,
            return_first=return_first,
        )
    if validate and n > 0:
        # numpy, not torch: a torch reduction would leave OpenMP workers spin-waiting on cores
        # this process's worker threads may need next.
        check_min_id(int(values.contiguous().numpy().min()))
        if bounds is not None:
            check_within_bounds(cpu_table_max(values, counts), bounds)
    max_id = max(map_bounds, default=0) - 1
    id_bits = composite_id_bits(num_tables, max_id)
    if id_bits is None:
        return Unique(
            *sort_unique(
                values.contiguous(),
                lengths.to(torch.int64),
                num_tables,
                id_bits=None,
                return_inverse=return_inverse,
                return_first=return_first,
            )
        )
    return cpu_sort(
        values, counts, id_bits, return_inverse=return_inverse, return_first=return_first
    )


def _device_map_bounds(
    values: torch.Tensor, lengths: torch.Tensor, bounds: list[int] | None, validate: bool
) -> list[int]:
    """The per-table map sizes for ids on a device, validating on the way when asked.

    Only what the host must know is fetched, in at most one sync: the ids' range when validating
    or when no ``bounds`` (num_rows) tells it.
    """
    n = values.numel()
    table_max: list[int] | None = None
    if validate or bounds is None:
        stats = device_stats(values, lengths, table_max=True)
        check_lengths(stats.lengths, n)
        table_max = stats.table_max
        if validate and stats.min_id is not None:
            check_min_id(stats.min_id)
        if validate and bounds is not None:
            assert table_max is not None
            check_within_bounds(table_max, bounds)
    elif lengths.device.type == "cpu":
        # Wrong lengths would make the device kernels size buffers wrongly; on the host the check
        # costs no sync, so it is done even without validate.
        check_lengths([int(x) for x in lengths.tolist()], n)
    if bounds is not None:
        return bounds
    assert table_max is not None
    return [m + 1 for m in table_max]


def device_dispatch(
    values: torch.Tensor,
    lengths: torch.Tensor,
    bounds: list[int] | None,
    method: Method,
    validate: bool,
    return_inverse: bool,
    return_first: bool,
) -> Unique:
    """:func:`deck.kernels.jagged_unique` for tensors on a device other than the CPU."""
    device = values.device
    num_tables = lengths.numel()
    map_bounds = _device_map_bounds(values, lengths, bounds, validate)
    chosen = choose_method(method, values.numel(), map_bounds)
    lengths_dev = lengths.to(dtype=torch.int64)
    if lengths_dev.device.type == "cpu" and device.type == "cuda":
        # Pinned, so the copy is asynchronous instead of waiting for the stream.
        lengths_dev = lengths_dev.pin_memory()
    lengths_dev = lengths_dev.to(device, non_blocking=True)
    if chosen == "bitmap":
        check_map_size(map_bounds)
        return Unique(
            *bitmap_unique(
                values.contiguous(),
                lengths_dev,
                map_bounds,
                return_inverse=return_inverse,
                return_first=return_first,
            )
        )
    return Unique(
        *sort_unique(
            values.contiguous(),
            lengths_dev,
            num_tables,
            id_bits=composite_id_bits(num_tables, max(map_bounds, default=0) - 1),
            return_inverse=return_inverse,
            return_first=return_first,
        )
    )
