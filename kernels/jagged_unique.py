"""Multi-table ("jagged") unique in one pass: validation, dispatch and the CPU kernels.

``values`` holds the ids of T tables back to back and ``lengths`` how many belong to each table;
:func:`jagged_unique` returns each table's distinct ids in ascending order, back to back, with
their counts. DECK uses it to compact the shard-local row ids the tracker recorded into the set of
rows a delta checkpoint must save.

Algorithms (``method``):

- ``"bitmap"``: table ``t`` owns rows ``[sum(bound[:t]), sum(bound[:t+1]))`` of one byte map;
  every id marks its row and one scan of the map yields all tables' ids, sorted and grouped. Cost
  O(n + rows), no sort. The bound of a table is ``num_rows[t]`` when given (tracked ids are
  shard-local row ids, bounded by the shard's local rows), else its largest id plus one.
- ``"sort"``: one stable sort of a composite key (table index in the high bits, id in the low
  bits) when the ids leave room for the table index, else a stable sort by id then by table.
  O(n log n), independent of how large the ids are.
- ``"auto"`` (default): bitmap when its map has at most ``BITMAP_ROWS_PER_ID`` rows per input id
  (then scanning the map costs less than sorting the ids), sort otherwise.

On CPU the bitmap path's mark-and-scan is native C (``kernels/_jagged.c``, built at install: one
bit per row, one pass marks a table's ids, one word-at-a-time scan emits and clears its set rows),
with a numpy fallback (one byte per row) when no compiler built it; the rest is numpy. Fancy-index
assignment, ``take`` and the native call are tight loops that release the GIL, so disjoint groups
of tables run on worker threads (as many as ``torch.get_num_threads()``), and numpy's large
allocations are huge-page backed, which makes the first touch of a big temporary cheap. Other
devices use the torch-only code in :mod:`deck.kernels.gpu`. :func:`unique_per_table` runs the
native kernel straight on per-table lists of id tensors.
"""

from __future__ import annotations

import concurrent.futures
import functools
import importlib
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, TypeVar, overload

import numpy as np
import torch

from deck.errors import DeckError

from . import gpu

try:  # the native CPU kernel (kernels/_jagged.c), built at install when a C compiler is there
    _native: Any = importlib.import_module("deck.kernels._jagged")
except ImportError:  # pragma: no cover - depends on the install
    _native = None

__all__ = [
    "BITMAP_ROWS_PER_ID",
    "KernelInputError",
    "Method",
    "concat_jagged",
    "free_cached_buffers",
    "jagged_unique",
    "unique_per_table",
]

Method = Literal["auto", "bitmap", "sort"]

# "auto" takes the bitmap path while the map has at most this many rows per input id. On the
# project's 2-core CPU machines (Zipf ids, 8 tables) the bitmap and the sort break even at 16-32
# rows per id for 0.1M-1M ids, and past 64 for 4M ids (a sort's cost per id grows with n, the
# map's does not); 16 is on the safe side and keeps the map (one byte per row) within twice the
# size of the int64 input.
BITMAP_ROWS_PER_ID = 16
# Below this many rows the map is cheap whatever the number of ids.
_BITMAP_FREE_ROWS = 1 << 16
# A map this large (bytes) is a mistake (huge ids without num_rows), not a workload.
_BITMAP_MAX_ROWS = 1 << 40
# Below this much work (ids + rows / 8) a thread handoff costs more than it saves.
_PARALLEL_MIN_WORK = 1 << 18
# The CPU bitmap kernel keeps its (zeroed) map between calls up to this size; see _ZeroedBytes.
_CACHED_MAP_MAX_BYTES = 1 << 30

_VALUE_DTYPES = (torch.int64, torch.int32)
_LENGTH_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_METHODS = ("auto", "bitmap", "sort")
_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32}


class KernelInputError(DeckError, ValueError):
    """The input to a deck kernel is malformed (dtype, shape, negative or out-of-range ids)."""


class _Unique(NamedTuple):
    """Result of one algorithm before conversion to the caller's dtypes."""

    values: torch.Tensor
    lengths: torch.Tensor | list[int]
    inverse: torch.Tensor | None
    first: torch.Tensor | None


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------


@overload
def jagged_unique(
    values: torch.Tensor,
    lengths: torch.Tensor,
    num_rows: torch.Tensor | Sequence[int] | None = ...,
    *,
    return_inverse: Literal[False] = ...,
    return_first: Literal[False] = ...,
    method: Method = ...,
    validate: bool = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def jagged_unique(
    values: torch.Tensor,
    lengths: torch.Tensor,
    num_rows: torch.Tensor | Sequence[int] | None = ...,
    *,
    return_inverse: Literal[True],
    return_first: Literal[False] = ...,
    method: Method = ...,
    validate: bool = ...,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
@overload
def jagged_unique(
    values: torch.Tensor,
    lengths: torch.Tensor,
    num_rows: torch.Tensor | Sequence[int] | None = ...,
    *,
    return_inverse: Literal[False] = ...,
    return_first: Literal[True],
    method: Method = ...,
    validate: bool = ...,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
@overload
def jagged_unique(
    values: torch.Tensor,
    lengths: torch.Tensor,
    num_rows: torch.Tensor | Sequence[int] | None = ...,
    *,
    return_inverse: Literal[True],
    return_first: Literal[True],
    method: Method = ...,
    validate: bool = ...,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]: ...
@overload
def jagged_unique(
    values: torch.Tensor,
    lengths: torch.Tensor,
    num_rows: torch.Tensor | Sequence[int] | None = ...,
    *,
    return_inverse: bool = ...,
    return_first: bool = ...,
    method: Method = ...,
    validate: bool = ...,
) -> tuple[torch.Tensor, ...]: ...


def jagged_unique(
    values: torch.Tensor,
    lengths: torch.Tensor,
    num_rows: torch.Tensor | Sequence[int] | None = None,
    *,
    return_inverse: bool = False,
    return_first: bool = False,
    method: Method = "auto",
    validate: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Each table's distinct ids, in ascending order, for T tables held back to back.

    Args:
        values: 1-D int64 or int32 tensor of non-negative ids (up to ``2**63 - 1``): table 0's
            ids, then table 1's, ... in any order within a table.
        lengths: 1-D integer tensor (T,), on the CPU or on ``values.device``: how many ids belong
            to each table. Must sum to ``values.numel()``; zeros (and T = 0) are fine.
        num_rows: optional per-table bound (T,): every id of table ``t`` is ``< num_rows[t]``
            (shard-local row ids are bounded by the shard's local rows). Enables the bitmap path
            with a known size. Host ints avoid a device sync on GPU.
        return_inverse: also return ``inverse`` (int64, one per input id) with
            ``unique_values[inverse[i]] == values[i]``; ``inverse[i]`` points into the part of
            the output that belongs to the table of position ``i``.
        return_first: also return ``first`` (int64, one per unique id): the position in
            ``values`` of the id's first occurrence within its own table's segment.
        method: ``"auto"``, ``"bitmap"`` or ``"sort"`` (see the module docstring). Every method
            returns the same result; only the cost differs.
        validate: check ids against 0 and ``num_rows``, and ``lengths`` against the number of
            ids (O(n); on GPU one device->host sync). With ``False`` dtypes and shapes are still
            checked, and so are ``lengths`` held on the CPU (free there); invalid ids then give
            undefined results.

    Returns:
        ``(unique_values, unique_lengths[, inverse][, first])``: ``unique_values`` has the dtype
        of ``values``; ``unique_lengths`` (T,) has the dtype of ``lengths`` and sums to
        ``unique_values.numel()``. All outputs are on ``values.device``. The result does not
        depend on the method, the device or the number of threads.

    Raises:
        KernelInputError: wrong dtype or dimensions, ``lengths`` not summing to the number of ids,
            negative ids, or (``num_rows`` given) an id ``>= num_rows`` of its table.

    Device->host syncs on CUDA: one to fetch the ids' range, made when ``validate`` is set or
    ``num_rows`` is absent (then the host needs the largest ids to size the map or the key), and
    one that is unavoidable, since the number of distinct ids decides the output's size (see
    :mod:`deck.kernels.gpu`). ``num_rows`` as host ints with ``validate=False`` leaves only the
    latter.
    """
    _check_static(values, lengths, method)
    bounds = _normalize_num_rows(num_rows, lengths.numel())
    dispatch = _cpu_dispatch if values.device.type == "cpu" else _device_dispatch
    result = dispatch(values, lengths, bounds, method, validate, return_inverse, return_first)
    if isinstance(result.lengths, list):
        unique_lengths = torch.tensor(result.lengths, dtype=lengths.dtype).reshape(lengths.numel())
    else:
        unique_lengths = result.lengths.to(lengths.dtype)
    out: list[torch.Tensor] = [result.values, unique_lengths.to(values.device)]
    if return_inverse:
        assert result.inverse is not None
        out.append(result.inverse)
    if return_first:
        assert result.first is not None
        out.append(result.first)
    return tuple(out)


def _cpu_dispatch(
    values: torch.Tensor,
    lengths: torch.Tensor,
    bounds: list[int] | None,
    method: Method,
    validate: bool,
    return_inverse: bool,
    return_first: bool,
) -> _Unique:
    n = values.numel()
    num_tables = lengths.numel()
    # Host ints already: checking them is free, and the kernels slice by them.
    counts = [int(x) for x in lengths.tolist()]
    _check_lengths(counts, n)
    map_bounds = [m + 1 for m in _cpu_table_max(values, counts)] if bounds is None else bounds
    chosen = _choose_method(method, n, map_bounds)
    if chosen == "bitmap":
        _check_map_size(map_bounds)
        # The bitmap kernel validates ids as it goes (see _cpu_bitmap): no separate passes.
        return _cpu_bitmap(
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
        _check_min_id(int(values.contiguous().numpy().min()))
        if bounds is not None:
            _check_within_bounds(_cpu_table_max(values, counts), bounds)
    max_id = max(map_bounds, default=0) - 1
    id_bits = _composite_id_bits(num_tables, max_id)
    if id_bits is None:
        return _Unique(
            *gpu.sort_unique(
                values.contiguous(),
                lengths.to(torch.int64),
                num_tables,
                id_bits=None,
                return_inverse=return_inverse,
                return_first=return_first,
            )
        )
    return _cpu_sort(
        values, counts, id_bits, return_inverse=return_inverse, return_first=return_first
    )


def _device_dispatch(
    values: torch.Tensor,
    lengths: torch.Tensor,
    bounds: list[int] | None,
    method: Method,
    validate: bool,
    return_inverse: bool,
    return_first: bool,
) -> _Unique:
    device = values.device
    n = values.numel()
    num_tables = lengths.numel()
    table_max: list[int] | None = None
    # Only what the host must know is fetched, in at most one sync: the ids' range when
    # validating or when no num_rows tells it.
    if validate or bounds is None:
        stats = gpu.device_stats(values, lengths, table_max=True)
        _check_lengths(stats.lengths, n)
        table_max = stats.table_max
        if validate and stats.min_id is not None:
            _check_min_id(stats.min_id)
        if validate and bounds is not None:
            assert table_max is not None
            _check_within_bounds(table_max, bounds)
    elif lengths.device.type == "cpu":
        # Wrong lengths would make the device kernels size buffers wrongly; on the host the check
        # costs no sync, so it is done even without validate.
        _check_lengths([int(x) for x in lengths.tolist()], n)
    if bounds is not None:
        map_bounds = bounds
    else:
        assert table_max is not None
        map_bounds = [m + 1 for m in table_max]
    chosen = _choose_method(method, n, map_bounds)
    lengths_dev = lengths.to(dtype=torch.int64)
    if lengths_dev.device.type == "cpu" and device.type == "cuda":
        # Pinned, so the copy is asynchronous instead of waiting for the stream.
        lengths_dev = lengths_dev.pin_memory()
    lengths_dev = lengths_dev.to(device, non_blocking=True)
    if chosen == "bitmap":
        _check_map_size(map_bounds)
        return _Unique(
            *gpu.bitmap_unique(
                values.contiguous(),
                lengths_dev,
                map_bounds,
                return_inverse=return_inverse,
                return_first=return_first,
            )
        )
    return _Unique(
        *gpu.sort_unique(
            values.contiguous(),
            lengths_dev,
            num_tables,
            id_bits=_composite_id_bits(num_tables, max(map_bounds, default=0) - 1),
            return_inverse=return_inverse,
            return_first=return_first,
        )
    )


def concat_jagged(
    per_table: Sequence[Sequence[torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay out per-table lists of 1-D id tensors (say, one per batch) as ``(values, lengths)``.

    ``values`` holds table 0's tensors in order, then table 1's, ...; ``lengths`` (int64, always
    on the CPU so that :func:`jagged_unique` needs no sync to read it) the ids per table. All
    tensors must share one dtype and device. On CPU the output is a numpy allocation, which the
    kernel's memory is too: huge-page backed, so a large copy does not pay a page fault per 4 KiB
    as a fresh torch CPU allocation does.
    """
    flat = [x for table in per_table for x in table]
    lengths = torch.tensor(
        [sum(x.numel() for x in table) for table in per_table], dtype=torch.int64
    ).reshape(len(per_table))
    if not flat:
        return torch.empty(0, dtype=torch.int64), lengths
    first = _check_pieces("concat_jagged", flat)
    if first.device.type != "cpu":
        return torch.cat(flat), lengths
    out = np.empty(int(lengths.sum()), dtype=_NUMPY_DTYPES[first.dtype])
    np.concatenate([x.numpy() for x in flat], out=out)
    return torch.from_numpy(out), lengths


def unique_per_table(
    per_table: Sequence[Sequence[torch.Tensor]],
    num_rows: torch.Tensor | Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``jagged_unique(*concat_jagged(per_table), num_rows)`` without building the jagged tensor.

    A tracker that keeps each table's ids as a list of per-batch tensors (as TorchRec's
    DeltaStore does) compacts them here in one pass: on CPU with ``num_rows`` the native kernel
    marks every id straight from the batch tensors, which skips copying them all into one tensor
    first (about as costly as the kernel itself at 10M ids). Elsewhere this is exactly the
    concatenate-then-``jagged_unique`` path. The result, dtypes and errors are those of
    :func:`jagged_unique` (``unique_lengths`` is int64); ids are always checked against
    ``num_rows``.
    """
    flat = [x for table in per_table for x in table]
    if not flat or _native is None or num_rows is None:
        return jagged_unique(*concat_jagged(per_table), num_rows)
    first = _check_pieces("unique_per_table", flat)
    if first.device.type != "cpu" or first.dtype not in _VALUE_DTYPES:
        return jagged_unique(*concat_jagged(per_table), num_rows)
    bounds = _normalize_num_rows(num_rows, len(per_table))
    assert bounds is not None
    _check_map_size(bounds)
    # Non-contiguous pieces (strided views) are copied; ``keep`` holds them for the call.
    keep = [x if x.is_contiguous() else x.contiguous() for x in flat]
    lens = [x.numel() for x in keep]
    pieces = [0, *itertools.accumulate(len(table) for table in per_table)]
    _, scanned = _native_scan_groups(
        [x.data_ptr() for x in keep],
        lens,
        pieces,
        first.element_size(),
        bounds,
        lambda t: torch.cat(keep[pieces[t] : pieces[t + 1]]).numpy(),
    )
    values = np.concatenate([ids for ids, _ in scanned]).astype(
        _NUMPY_DTYPES[first.dtype], copy=False
    )
    counts = [c for _, cuts in scanned for c in np.diff(cuts).tolist()]
    return torch.from_numpy(values), torch.tensor(counts, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _check_pieces(what: str, flat: Sequence[torch.Tensor]) -> torch.Tensor:
    """Every tensor of ``flat`` (non-empty) is 1-D with the first's dtype and device; returns it."""
    first = flat[0]
    for x in flat:
        if x.dim() != 1 or x.dtype != first.dtype or x.device != first.device:
            raise KernelInputError(
                f"{what} needs 1-D tensors of one dtype on one device, got "
                f"{x.dtype} {tuple(x.shape)} on {x.device} next to {first.dtype} on {first.device}"
            )
    return first


def _check_static(values: object, lengths: object, method: str) -> None:
    """Checks that need no data: types, dtypes, dimensions, devices, method name."""
    if not isinstance(values, torch.Tensor):
        raise KernelInputError(f"values must be a torch.Tensor, got {type(values).__name__}")
    if not isinstance(lengths, torch.Tensor):
        raise KernelInputError(
            f"lengths must be a torch.Tensor of per-table counts, got {type(lengths).__name__}"
        )
    if values.dtype not in _VALUE_DTYPES:
        raise KernelInputError(f"values must be int64 or int32 ids, got dtype {values.dtype}")
    if values.dim() != 1:
        raise KernelInputError(
            f"values must be 1-D (all tables back to back), got shape {tuple(values.shape)}"
        )
    if lengths.dtype not in _LENGTH_DTYPES:
        raise KernelInputError(f"lengths must be an integer tensor, got dtype {lengths.dtype}")
    if lengths.dim() != 1:
        raise KernelInputError(
            f"lengths must be 1-D (one count per table), got shape {tuple(lengths.shape)}"
        )
    if lengths.device != values.device and lengths.device.type != "cpu":
        raise KernelInputError(
            f"lengths is on {lengths.device} but values on {values.device}; "
            "put lengths on the CPU or on the same device"
        )
    if method not in _METHODS:
        raise KernelInputError(f"method must be one of {_METHODS}, got {method!r}")


def _normalize_num_rows(
    num_rows: torch.Tensor | Sequence[int] | None, num_tables: int
) -> list[int] | None:
    """``num_rows`` as host ints, checked for length, integrality and sign."""
    if num_rows is None:
        return None
    if isinstance(num_rows, torch.Tensor):
        if num_rows.dtype not in _LENGTH_DTYPES or num_rows.dim() != 1:
            raise KernelInputError(
                "num_rows must be a 1-D integer tensor (one bound per table), got "
                f"dtype {num_rows.dtype} shape {tuple(num_rows.shape)}"
            )
        bounds = [int(x) for x in num_rows.tolist()]  # a sync if num_rows lives on a GPU
    else:
        bounds = list(num_rows)
        for b in bounds:
            # bool is an int subclass; a True bound is almost surely a bug.
            if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
                raise KernelInputError(
                    f"num_rows must hold ints (per-table row counts), got {type(b).__name__}"
                )
        bounds = [int(b) for b in bounds]
    if len(bounds) != num_tables:
        raise KernelInputError(
            f"num_rows has {len(bounds)} entries but lengths has {num_tables} tables"
        )
    for t, b in enumerate(bounds):
        if b < 0:
            raise KernelInputError(f"num_rows[{t}] is negative ({b})")
    return bounds


def _check_lengths(lengths: list[int], n: int) -> None:
    for t, count in enumerate(lengths):
        if count < 0:
            raise KernelInputError(f"lengths[{t}] is negative ({count})")
    total = sum(lengths)
    if total != n:
        raise KernelInputError(
            f"lengths sum to {total} but values holds {n} ids; lengths[t] must be the number of "
            "ids of table t"
        )


def _check_within_bounds(table_max: list[int], bounds: list[int]) -> None:
    for t, (top, bound) in enumerate(zip(table_max, bounds, strict=True)):
        if top >= bound:
            raise KernelInputError(
                f"table {t} holds id {top} but num_rows[{t}] is {bound}; ids must be "
                "shard-local row ids below the table's local row count"
            )


def _check_min_id(min_id: int) -> None:
    if min_id < 0:
        raise KernelInputError(
            f"values holds a negative id ({min_id}); ids must be non-negative row ids"
        )


def _check_map_size(bounds: list[int]) -> None:
    rows = sum(bounds)
    if rows > _BITMAP_MAX_ROWS:
        raise KernelInputError(
            f"method='bitmap' would need a {rows}-row map (ids up to {max(bounds) - 1}); "
            "pass num_rows, or use method='sort' for ids this large"
        )


def _composite_id_bits(num_tables: int, max_id: int) -> int | None:
    """Bits for the id part of a (table, id) int64 key, or None when both do not fit in 63."""
    id_bits = max(max_id, 0).bit_length()
    return id_bits if num_tables.bit_length() + id_bits <= 63 else None


def _choose_method(method: Method, n: int, bounds: list[int]) -> Literal["bitmap", "sort"]:
    if method != "auto":
        return method
    rows = sum(bounds)
    return "bitmap" if rows <= BITMAP_ROWS_PER_ID * n + _BITMAP_FREE_ROWS else "sort"


# ---------------------------------------------------------------------------------------------
# CPU kernels
# ---------------------------------------------------------------------------------------------

_T = TypeVar("_T")
_pool_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None


class _ZeroedBytes:
    """One all-zero byte buffer kept between calls of the CPU bitmap kernel.

    Compaction runs again and again with about the same number of rows. A fresh map costs a page
    fault per page, and under memory pressure (a page cache full of training data) each fault
    may first reclaim or compact memory: measured here at up to 200 ms of system time for a
    128 MB map. A kept map costs none of that: its user clears just the bytes it set (O(distinct
    ids)) and gives it back. Holds at most one buffer of at most ``_CACHED_MAP_MAX_BYTES``; a
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
        if buffer.nbytes > _CACHED_MAP_MAX_BYTES:
            return
        with self._lock:
            if self._buffer is None or self._buffer.size < buffer.size:
                self._buffer = buffer

    def clear(self) -> None:
        with self._lock:
            self._buffer = None


_zeroed_bytes = _ZeroedBytes()


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


def _run_all(tasks: Sequence[Callable[[], _T]]) -> list[_T]:
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


def _split_tables(costs: Sequence[int], parts: int) -> list[tuple[int, int]]:
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


def _workers(work: int, num_tables: int) -> int:
    if work < _PARALLEL_MIN_WORK:
        return 1
    return max(1, min(torch.get_num_threads(), num_tables))


def _cpu_table_max(values: torch.Tensor, lengths: list[int]) -> list[int]:
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


def _cpu_bitmap(
    values: torch.Tensor,
    lengths: list[int],
    bounds: list[int],
    *,
    check_ids: bool,
    return_inverse: bool,
    return_first: bool,
) -> _Unique:
    """Bitmap jagged unique on CPU; ids must satisfy ``0 <= id < bounds[table]``.

    With ``check_ids`` that is verified on the way, at no extra pass over the ids for the upper
    bound (numpy's fancy assignment raises on an index past the table's slice of the map) and one
    per worker for the sign (numpy would silently wrap a negative index).
    """
    v = values.contiguous().numpy()
    n = v.size
    num_tables = len(lengths)
    starts = [0, *itertools.accumulate(lengths)]
    if _native is not None:
        groups, scanned = _native_scan_groups(
            [v.ctypes.data + start * v.itemsize for start in starts[:-1]],
            lengths,
            list(range(num_tables + 1)),
            v.itemsize,
            bounds,
            lambda t: v[starts[t] : starts[t + 1]],
        )
    else:
        groups, scanned = _numpy_scan_groups(v, starts, lengths, bounds, check_ids)

    counts: list[int] = []
    for _, cuts in scanned:
        counts.extend(np.diff(cuts).tolist())
    bases = [0, *itertools.accumulate(rows.size for rows, _ in scanned)]
    num_unique = bases[-1]
    unique_values = np.empty(num_unique, dtype=v.dtype)
    want_index = return_inverse or return_first
    inverse = np.empty(n, dtype=np.int64) if want_index else None
    first = np.empty(num_unique, dtype=np.int64) if return_first else None
    rank_dtype = np.int32 if num_unique < 2**31 else np.int64

    def emit(g: int) -> None:
        lo, hi = groups[g]
        rows, cuts = scanned[g]
        base = bases[g]
        unique_values[base : base + rows.size] = rows
        if inverse is None:
            return
        # One rank map the size of the group's largest table, reused table after table: it stays
        # cache-resident where a map over all the group's rows would not, and int32 halves it.
        rank = np.empty(max(bounds[lo:hi], default=0), dtype=rank_dtype)
        for i, t in enumerate(range(lo, hi)):
            a, b = base + int(cuts[i]), base + int(cuts[i + 1])
            # Entries left over from the previous table are never read: only this table's ids
            # are looked up, and each of them was just written.
            rank[unique_values[a:b]] = np.arange(a, b, dtype=rank_dtype)
            # mode="clip" skips numpy's bounds-checking ("raise") path; ids are in range here.
            inverse[starts[t] : starts[t + 1]] = np.take(
                rank, v[starts[t] : starts[t + 1]], mode="clip"
            )
        del rank
        if first is not None:
            # The groups own disjoint slices of `first`, so their scatter-min calls cannot race.
            first[base : base + rows.size] = n
            np.minimum.at(
                first,
                inverse[starts[lo] : starts[hi]],
                np.arange(starts[lo], starts[hi], dtype=np.int64),
            )

    _run_all([functools.partial(emit, g) for g in range(len(groups))])
    return _Unique(
        values=torch.from_numpy(unique_values),
        lengths=counts,
        inverse=torch.from_numpy(inverse) if return_inverse and inverse is not None else None,
        first=torch.from_numpy(first) if first is not None else None,
    )


def _numpy_scan_groups(
    v: np.ndarray, starts: list[int], lengths: list[int], bounds: list[int], check_ids: bool
) -> tuple[list[tuple[int, int]], list[tuple[np.ndarray, np.ndarray]]]:
    """Mark and scan with numpy (one byte per row): the groups of tables, and per group its
    distinct ids (table-local, ascending per table) with per-table cuts."""
    num_tables = len(lengths)
    row_starts = [0, *itertools.accumulate(bounds)]
    # Marking an id is a random byte write; zeroing and scanning a row is a sequential pass that
    # costs several times less, hence rows weigh 1/8 in the split.
    costs = [count + rows // 8 for count, rows in zip(lengths, bounds, strict=True)]
    groups = _split_tables(costs, _workers(sum(costs), num_tables))
    whole_map = _zeroed_bytes.take(row_starts[-1])

    def mark_and_scan(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        if check_ids and starts[hi] > starts[lo]:
            _check_min_id(int(v[starts[lo] : starts[hi]].min()))
        base_row = row_starts[lo]
        bitmap = whole_map[base_row : row_starts[hi]]
        for t in range(lo, hi):
            if not lengths[t]:
                continue
            ids = v[starts[t] : starts[t + 1]]
            try:
                bitmap[row_starts[t] - base_row : row_starts[t + 1] - base_row][ids] = True
            except IndexError:
                raise _out_of_range(t, ids, bounds) from None
        rows = np.flatnonzero(bitmap)
        bitmap[rows] = False  # all zero again, ready for the next call
        cuts = np.searchsorted(rows, np.asarray(row_starts[lo : hi + 1], dtype=np.int64) - base_row)
        for t in range(lo, hi):  # map rows -> table-local ids
            rows[cuts[t - lo] : cuts[t - lo + 1]] -= row_starts[t] - base_row
        return rows, cuts

    # On an error some marks may be left: the map is then dropped, not given back.
    scanned = _run_all([functools.partial(mark_and_scan, lo, hi) for lo, hi in groups])
    _zeroed_bytes.give_back(whole_map)
    return groups, scanned


def _native_scan_groups(
    ptrs: list[int],
    lens: list[int],
    pieces: list[int],
    itemsize: int,
    bounds: list[int],
    ids_of: Callable[[int], np.ndarray],
) -> tuple[list[tuple[int, int]], list[tuple[np.ndarray, np.ndarray]]]:
    """:func:`_numpy_scan_groups` by the native kernel, from id arrays given by address.

    Piece ``p`` is ``lens[p]`` ids of ``itemsize`` bytes at ``ptrs[p]``; table ``t`` owns pieces
    ``[pieces[t], pieces[t + 1])``. The caller keeps the arrays alive. ``ids_of(t)`` gives table
    ``t``'s ids to name one out of range in the error.
    """
    assert _native is not None
    num_tables = len(bounds)
    lengths = [sum(lens[pieces[t] : pieces[t + 1]]) for t in range(num_tables)]
    # One bit per row in 64-bit words, a whole number of words per table (so that groups of
    # tables on different threads never share a word).
    words = [-(-b // 64) for b in bounds]
    word_starts = [0, *itertools.accumulate(words)]
    # Marking an id is a random write; scanning a word is a sequential load of 8 bytes.
    costs = [count + w for count, w in zip(lengths, words, strict=True)]
    groups = _split_tables(costs, _workers(sum(costs), num_tables))
    buffer = _zeroed_bytes.take(word_starts[-1] * 8)
    bits = buffer[: word_starts[-1] * 8].view(np.uint64)
    ptr_array = np.asarray(ptrs, dtype=np.int64)
    len_array = np.asarray(lens, dtype=np.int64)
    bound_array = np.asarray(bounds, dtype=np.int64)
    piece_array = np.asarray(pieces, dtype=np.int64)

    def mark_and_scan(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        out = np.empty(sum(lengths[lo:hi]), dtype=np.int64)
        counts = np.empty(hi - lo, dtype=np.int64)
        written, bad = _native.mark_scan(
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
            raise _out_of_range(lo + bad, ids_of(lo + bad), bounds)
        cuts = np.zeros(hi - lo + 1, dtype=np.int64)
        np.cumsum(counts, out=cuts[1:])
        return out[:written], cuts

    scanned = _run_all([functools.partial(mark_and_scan, lo, hi) for lo, hi in groups])
    _zeroed_bytes.give_back(buffer)
    return groups, scanned


def _out_of_range(t: int, ids: np.ndarray, bounds: list[int]) -> KernelInputError:
    """The error for table ``t`` whose ``ids`` are not all in ``[0, bounds[t])``."""
    if int(ids.min()) < 0:
        return KernelInputError(
            f"values holds a negative id ({int(ids.min())}); ids must be non-negative row ids"
        )
    return KernelInputError(
        f"table {t} holds id {int(ids.max())} but num_rows[{t}] is {bounds[t]}; ids "
        "must be shard-local row ids below the table's local row count"
    )


def _cpu_sort(
    values: torch.Tensor,
    lengths: list[int],
    id_bits: int,
    *,
    return_inverse: bool,
    return_first: bool,
) -> _Unique:
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
    return _Unique(
        values=torch.from_numpy(np.ascontiguousarray(unique_values)),
        lengths=counts,
        inverse=torch.from_numpy(inverse) if inverse is not None else None,
        first=torch.from_numpy(first) if first is not None else None,
    )
