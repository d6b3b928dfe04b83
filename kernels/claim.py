"""The tracker's claim: which rows a consumer has not saved yet, taken in one pass.

:class:`deck.trainer.tracker.TrackerStore` keeps one byte per row, one bit per consumer. A
checkpoint claims consumer ``c``'s rows: the ascending positions whose byte has bit ``c``, and
clears that bit. It runs on the training thread inside the checkpoint stall, over every tracked
row (millions), while a delta touches a few percent of them: the native kernel
(``claim_bit`` in ``kernels/_native.c``) tests eight rows per load and writes only the hits; the
torch fallback (same result) makes a masked copy of the map, ``nonzero`` and an ``index_put``.

That pass still reads the whole map, so its cost grows with the table, not the delta. The tracker
therefore also keeps a summary: one byte per block of ``2**BLOCK_SHIFT`` rows with every bit some
row of the block has (set where the rows are set, at the cost of the ids). :func:`claim_marked_rows`
(``claim_blocks`` in C) tests eight summary bytes per load and reads only the marked blocks' rows:
a fixed term of one load per 512 rows plus a cache line per touched block (prefetched ahead);
when more than a quarter of the blocks are marked it reads the whole map in one pass instead (as
fast then). :func:`claim_rows`, the whole-map pass, stays as the baseline
(``benchmarks/bench_claim.py --sweep``).

Even the summary must be read, and at a few percent of rows touched nearly every block is marked.
So the tracker also journals: :func:`mark_rows` (its compaction) returns the rows that just became
pending, the tracker keeps them per consumer, and a claim sorts that journal and clears those rows
(:func:`clear_rows`) without reading the map: its cost is the delta's rows alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from . import native

# 64 rows per block: a marked block is one 64-byte cache line of the map, and the summary is
# 1/64 of the map (one bit per 64 rows per consumer).
BLOCK_SHIFT = 6


def block_count(num_rows: int) -> int:
    """Summary bytes for a map of ``num_rows`` rows: one per block of ``2**BLOCK_SHIFT`` rows."""
    return (num_rows + (1 << BLOCK_SHIFT) - 1) >> BLOCK_SHIFT


def block_of(rows: torch.Tensor) -> torch.Tensor:
    """The summary byte (block) of each row position."""
    return rows >> BLOCK_SHIFT


def _torch_claim(dirty: torch.Tensor, bit: int) -> torch.Tensor:
    # The native kernel's check, so that a caller's bad bit fails the same on every install
    if bit <= 0 or bit > 0x80 or bit & (bit - 1):
        raise ValueError("claim: bit must be one of 1, 2, 4, ..., 128")
    rows = torch.nonzero(dirty & bit).view(-1)
    dirty.index_put_((rows,), dirty[rows] & (~bit & 0xFF))
    return rows


def _count_then_take(take: Callable[[Any], int]) -> torch.Tensor:
    # Count, then take; again if rows were marked in between (the caller's lock normally rules
    # that out): a take with too little room changes nothing and answers -1.
    while True:
        rows = torch.empty(take(bytearray()), dtype=torch.int64)
        if not rows.numel() or take(rows.numpy()) >= 0:
            return rows


def claim_rows(dirty: torch.Tensor, bit: int) -> torch.Tensor:
    """Positions (int64, ascending) of the rows of ``dirty`` (a contiguous uint8 CPU map) whose
    byte has ``bit``; that bit is cleared in them, every other bit is left as it was. Reads the
    whole map (the baseline of :func:`claim_marked_rows`)."""
    kernel = native.native_module()
    if kernel is None or dirty.device.type != "cpu" or not dirty.is_contiguous():
        return _torch_claim(dirty, bit)
    raw = dirty.numpy()
    return _count_then_take(lambda out: kernel.claim_bit(raw, bit, out))


def claim_marked_rows(dirty: torch.Tensor, blocks: torch.Tensor, bit: int) -> torch.Tensor:
    """As :func:`claim_rows` (same rows, same ``dirty`` after), reading only the blocks whose
    summary byte in ``blocks`` (uint8, :func:`block_count` bytes, every bit of its rows set)
    has ``bit``; ``bit`` is cleared in every summary byte (no row has it any more)."""
    kernel = native.native_module()
    cpu = dirty.device.type == "cpu" and blocks.device.type == "cpu"
    if kernel is None or not cpu or not dirty.is_contiguous() or not blocks.is_contiguous():
        rows = _torch_claim(dirty, bit)
        blocks.bitwise_and_(~bit & 0xFF)
        return rows
    raw, summary = dirty.numpy(), blocks.numpy()
    rows = _count_then_take(lambda out: kernel.claim_blocks(raw, summary, BLOCK_SHIFT, bit, out))
    if not rows.numel():  # no take ran: clear the bit of blocks marked without such a row
        blocks.bitwise_and_(~bit & 0xFF)
    return rows


def journaling_available(dirty: torch.Tensor) -> bool:
    """Whether :func:`mark_rows` and :func:`clear_rows` run on this map (the native kernel, a
    contiguous CPU map); without them the tracker marks with torch and claims by reading the map."""
    return native.native_module() is not None and dirty.device.type == "cpu"


def _raw(t: torch.Tensor) -> np.ndarray:
    if not t.is_contiguous():
        raise ValueError("the tracker's map and summary must be contiguous")
    return t.numpy()


def fill_rows(dirty: torch.Tensor, blocks: torch.Tensor, rows: torch.Tensor, bits: int) -> None:
    """Set ``bits`` in the byte of every row of ``rows`` (int64, any order, duplicates allowed)
    and in its summary byte, without a journal: the tracker's compaction where
    :func:`journaling_available` is False (no native kernel, a map not on the CPU). Raises
    IndexError, changing nothing, when a row is outside the map, as :func:`mark_rows` does."""
    n = dirty.numel()
    # torch's index_fill_ would write the rows before a bad one, and take a negative row as
    # counted from the end: check them all first (two reductions, no copy of the rows).
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n):
        raise IndexError(f"tracked row positions outside the map of {n} rows")
    # An OR, as mark_rows: a fill would drop the bits of other consumers that ``bits`` lacks
    # (duplicate rows are fine: each writes the same byte).
    dirty.index_put_((rows,), dirty[rows] | bits)
    summary = block_of(rows)
    blocks.index_put_((summary,), blocks[summary] | bits)


def mark_rows(
    dirty: torch.Tensor, blocks: torch.Tensor, rows: torch.Tensor, bits: int
) -> tuple[np.ndarray, np.ndarray]:
    """Set ``bits`` in the byte of every row of ``rows`` (int64, any order, duplicates allowed)
    and in its summary byte. Returns the rows whose byte lacked one of ``bits``, each once in
    order of first appearance, and their bytes before. Raises IndexError, changing nothing, when
    a row is outside the map. Needs :func:`journaling_available`."""
    ids = np.ascontiguousarray(rows.detach().cpu().numpy(), dtype=np.int64)
    new = np.empty(len(ids), dtype=np.int64)
    old = np.empty(len(ids), dtype=np.uint8)
    k = native.native_module().mark_rows(
        _raw(dirty), _raw(blocks), BLOCK_SHIFT, bits, ids, new, old
    )
    if k < 0:
        raise IndexError(f"tracked row positions outside the map of {dirty.numel()} rows")
    # Copies: a journal keeps what it is given, and views would keep all ``len(rows)`` entries.
    return new[:k].copy(), old[:k].copy()


def clear_rows(dirty: torch.Tensor, blocks: torch.Tensor, rows: np.ndarray, bit: int) -> int:
    """Clear ``bit`` in the byte of every row of ``rows`` (int64, or int32: a journal's) and in
    its summary byte (the caller claims every row that has it). Returns how many of them did not
    have it (0 unless the caller's journal is out of step with the map). Raises IndexError,
    changing nothing, when a row is outside the map. Needs :func:`journaling_available`."""
    if rows.dtype not in (np.int32, np.int64):
        rows = rows.astype(np.int64)
    rows = np.ascontiguousarray(rows)
    lacking = native.native_module().clear_rows(
        _raw(dirty), _raw(blocks), BLOCK_SHIFT, bit, rows, rows.itemsize
    )
    if lacking < 0:
        raise IndexError(f"claimed row positions outside the map of {dirty.numel()} rows")
    return int(lacking)
