"""Multi-table ("jagged") unique in one pass: the public entry points.

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

Where the rest lives: validation in :mod:`deck.kernels.checks`; algorithm choice and dispatch by
device in :mod:`deck.kernels.dispatch`; the CPU kernels in :mod:`deck.kernels.cpu`, whose bitmap
mark-and-scan is native C (:mod:`deck.kernels.native`, ``kernels/_jagged.c``, built at install)
with a numpy fallback (:mod:`deck.kernels.numpy_bitmap`) when no compiler built it, on worker
threads and a kept map (:mod:`deck.kernels.cpu_pool`); other devices use the torch-only code in
:mod:`deck.kernels.gpu`. :func:`unique_per_table` runs the native kernel straight on per-table
lists of id tensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Literal, overload

import numpy as np
import torch

from .checks import check_map_size, check_pieces, check_static, normalize_num_rows
from .common import NUMPY_DTYPES, VALUE_DTYPES, Method, Unique
from .dispatch import cpu_dispatch, device_dispatch
from .native import native_available, native_scan_groups

__all__ = ["concat_jagged", "jagged_unique", "unique_per_table"]


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
    check_static(values, lengths, method)
    bounds = normalize_num_rows(num_rows, lengths.numel())
    dispatch = cpu_dispatch if values.device.type == "cpu" else device_dispatch
    result = dispatch(values, lengths, bounds, method, validate, return_inverse, return_first)
    return _outputs(result, values, lengths, return_inverse, return_first)


def _outputs(
    result: Unique,
    values: torch.Tensor,
    lengths: torch.Tensor,
    return_inverse: bool,
    return_first: bool,
) -> tuple[torch.Tensor, ...]:
    """``result`` as :func:`jagged_unique` returns it: the caller's dtypes, on its device."""
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
    first = check_pieces("concat_jagged", flat)
    if first.device.type != "cpu":
        return torch.cat(flat), lengths
    out = np.empty(int(lengths.sum()), dtype=NUMPY_DTYPES[first.dtype])
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
    if not flat or not native_available() or num_rows is None:
        return jagged_unique(*concat_jagged(per_table), num_rows)
    first = check_pieces("unique_per_table", flat)
    if first.device.type != "cpu" or first.dtype not in VALUE_DTYPES:
        return jagged_unique(*concat_jagged(per_table), num_rows)
    bounds = normalize_num_rows(num_rows, len(per_table))
    assert bounds is not None
    check_map_size(bounds)
    # Non-contiguous pieces (strided views) are copied; ``keep`` holds them for the call.
    keep = [x if x.is_contiguous() else x.contiguous() for x in flat]
    lens = [x.numel() for x in keep]
    pieces = [0, *itertools.accumulate(len(table) for table in per_table)]
    _, scanned = native_scan_groups(
        [x.data_ptr() for x in keep],
        lens,
        pieces,
        first.element_size(),
        bounds,
        lambda t: torch.cat(keep[pieces[t] : pieces[t + 1]]).numpy(),
    )
    values = np.concatenate([ids for ids, _ in scanned]).astype(
        NUMPY_DTYPES[first.dtype], copy=False
    )
    counts = [c for _, cuts in scanned for c in np.diff(cuts).tolist()]
    return torch.from_numpy(values), torch.tensor(counts, dtype=torch.int64)
