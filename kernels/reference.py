"""Reference jagged unique: a plain loop of ``torch.unique`` per table.

This is the oracle the tests compare the fast kernels against, so it is written to be obviously
correct rather than fast. It does no input validation beyond what torch itself does: call it only
with inputs :func:`deck.kernels.jagged_unique` would accept.
"""

from __future__ import annotations

import torch

__all__ = ["jagged_unique_reference"]


def jagged_unique_reference(
    values: torch.Tensor,
    lengths: torch.Tensor,
    *,
    return_inverse: bool = False,
    return_first: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Per-table distinct ids, by one ``torch.unique`` call per table.

    Args:
        values: 1-D int64/int32 tensor, the ids of table 0, then of table 1, ... back to back.
        lengths: (T,) integer tensor, how many ids belong to each table; sums to ``values.numel()``.
        return_inverse: also return, for every position ``i`` of ``values``, the index into the
            returned unique values of ``values[i]`` (an index into the whole output, not into the
            table's part of it).
        return_first: also return, for every returned unique value, the position in ``values`` of
            its first occurrence inside its own table's segment.

    Returns:
        ``(unique_values, unique_lengths[, inverse][, first])`` where ``unique_values`` holds each
        table's distinct ids in ascending order, back to back (dtype of ``values``), and
        ``unique_lengths`` (dtype of ``lengths``) how many belong to each table. ``inverse`` and
        ``first`` are int64. Everything is on ``values.device``.
    """
    device = values.device
    counts = [int(x) for x in lengths.tolist()]
    uniques: list[torch.Tensor] = []
    inverses: list[torch.Tensor] = []
    firsts: list[torch.Tensor] = []
    start = 0
    produced = 0
    for count in counts:
        segment = values[start : start + count]
        unique, inverse = torch.unique(segment, sorted=True, return_inverse=True)
        positions = torch.arange(start, start + count, device=device, dtype=torch.int64)
        first = torch.full((unique.numel(),), values.numel(), dtype=torch.int64, device=device)
        first.scatter_reduce_(0, inverse.to(torch.int64), positions, reduce="amin")
        uniques.append(unique)
        inverses.append(inverse.to(torch.int64) + produced)
        firsts.append(first)
        produced += unique.numel()
        start += count
    unique_values = (
        torch.cat(uniques) if uniques else torch.empty(0, dtype=values.dtype, device=device)
    )
    unique_lengths = torch.tensor(
        [u.numel() for u in uniques], dtype=lengths.dtype, device=device
    ).reshape(len(counts))
    out: list[torch.Tensor] = [unique_values, unique_lengths]
    if return_inverse:
        out.append(
            torch.cat(inverses) if inverses else torch.empty(0, dtype=torch.int64, device=device)
        )
    if return_first:
        out.append(
            torch.cat(firsts) if firsts else torch.empty(0, dtype=torch.int64, device=device)
        )
    return tuple(out)
