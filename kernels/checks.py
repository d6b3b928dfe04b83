"""Input validation for the jagged-unique kernels: every check raises :class:`KernelInputError`
with a message that names the offending table, id or argument."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .common import LENGTH_DTYPES, METHODS, VALUE_DTYPES, KernelInputError

__all__ = [
    "BITMAP_MAX_ROWS",
    "check_lengths",
    "check_map_size",
    "check_min_id",
    "check_pieces",
    "check_static",
    "check_within_bounds",
    "normalize_num_rows",
    "out_of_range",
]

# A map this large (bytes) is a mistake (huge ids without num_rows), not a workload.
BITMAP_MAX_ROWS = 1 << 40


def check_pieces(what: str, flat: Sequence[torch.Tensor]) -> torch.Tensor:
    """Every tensor of ``flat`` (non-empty) is 1-D with the first's dtype and device; returns it."""
    first = flat[0]
    for x in flat:
        if x.dim() != 1 or x.dtype != first.dtype or x.device != first.device:
            raise KernelInputError(
                f"{what} needs 1-D tensors of one dtype on one device, got "
                f"{x.dtype} {tuple(x.shape)} on {x.device} next to {first.dtype} on {first.device}"
            )
    return first


def check_static(values: object, lengths: object, method: str) -> None:
    """Checks that need no data: types, dtypes, dimensions, devices, method name."""
    if not isinstance(values, torch.Tensor):
        raise KernelInputError(f"values must be a torch.Tensor, got {type(values).__name__}")
    if not isinstance(lengths, torch.Tensor):
        raise KernelInputError(
            f"lengths must be a torch.Tensor of per-table counts, got {type(lengths).__name__}"
        )
    if values.dtype not in VALUE_DTYPES:
        raise KernelInputError(f"values must be int64 or int32 ids, got dtype {values.dtype}")
    if values.dim() != 1:
        raise KernelInputError(
            f"values must be 1-D (all tables back to back), got shape {tuple(values.shape)}"
        )
    if lengths.dtype not in LENGTH_DTYPES:
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
    if method not in METHODS:
        raise KernelInputError(f"method must be one of {METHODS}, got {method!r}")


def normalize_num_rows(
    num_rows: torch.Tensor | Sequence[int] | None, num_tables: int
) -> list[int] | None:
    """``num_rows`` as host ints, checked for length, integrality and sign."""
    if num_rows is None:
        return None
    if isinstance(num_rows, torch.Tensor):
        if num_rows.dtype not in LENGTH_DTYPES or num_rows.dim() != 1:
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


def check_lengths(lengths: list[int], n: int) -> None:
    for t, count in enumerate(lengths):
        if count < 0:
            raise KernelInputError(f"lengths[{t}] is negative ({count})")
    total = sum(lengths)
    if total != n:
        raise KernelInputError(
            f"lengths sum to {total} but values holds {n} ids; lengths[t] must be the number of "
            "ids of table t"
        )


def check_within_bounds(table_max: list[int], bounds: list[int]) -> None:
    for t, (top, bound) in enumerate(zip(table_max, bounds, strict=True)):
        if top >= bound:
            raise KernelInputError(
                f"table {t} holds id {top} but num_rows[{t}] is {bound}; ids must be "
                "shard-local row ids below the table's local row count"
            )


def check_min_id(min_id: int) -> None:
    if min_id < 0:
        raise KernelInputError(
            f"values holds a negative id ({min_id}); ids must be non-negative row ids"
        )


def check_map_size(bounds: list[int]) -> None:
    rows = sum(bounds)
    if rows > BITMAP_MAX_ROWS:
        raise KernelInputError(
            f"method='bitmap' would need a {rows}-row map (ids up to {max(bounds) - 1}); "
            "pass num_rows, or use method='sort' for ids this large"
        )


def out_of_range(t: int, ids: np.ndarray, bounds: list[int]) -> KernelInputError:
    """The error for table ``t`` whose ``ids`` are not all in ``[0, bounds[t])``."""
    if int(ids.min()) < 0:
        return KernelInputError(
            f"values holds a negative id ({int(ids.min())}); ids must be non-negative row ids"
        )
    return KernelInputError(
        f"table {t} holds id {int(ids.max())} but num_rows[{t}] is {bounds[t]}; ids "
        "must be shard-local row ids below the table's local row count"
    )
