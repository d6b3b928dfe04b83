"""The snapshot's copy: selected rows of a table's states into a chunk buffer.

A delta's rows lie pages apart in tables far larger than the cache, so the copy is a string of
cache and TLB misses. ``gather_rows`` in ``kernels/_native.c`` prefetches the rows a few places
ahead of the one it copies, overlapping those misses (torch's ``index_select`` copies them one
after another), and copies every state of a row in the same pass (a rowwise optimizer state's
misses overlap the weight's instead of costing a second pass). It runs on contiguous CPU
tensors when the native extension is built; ``index_select`` does the same copy everywhere else.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from . import native

MAX_STATES = 16  # GATHER_STATES in _native.c: states copied in one pass


RowSource = tuple[np.ndarray, int]  # a table state as flat bytes, and the bytes of one row
Out = bytearray | memoryview | np.ndarray  # writable bytes (a chunk buffer's segment)


def gather_rows(rows: torch.Tensor, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """For every ``(src, out)`` in ``pairs``: ``out[i] = src[rows[i]]`` for every ``i``
    (``rows``: int64 indices into dim 0 of every ``src``; ``out``: ``(len(rows),
    *src.shape[1:])`` of ``src``'s dtype). Raises IndexError, copying nothing, when an index
    is outside a ``src``. Same result as ``torch.index_select`` per pair."""
    sources = (
        row_sources([src for src, _ in pairs])
        if rows.dtype == torch.int64
        and rows.device.type == "cpu"
        and all(_fits(src, out, rows) for src, out in pairs)
        else None
    )
    if sources is None:
        # As the native kernel: a row outside any source raises before anything is copied
        # (index_select checks one source at a time, after copying the pairs before it).
        if rows.numel():
            lo, hi = int(rows.min()), int(rows.max())
            for src, _ in pairs:
                if lo < 0 or hi >= src.shape[0]:
                    raise IndexError(
                        f"gather_rows: row {lo if lo < 0 else hi} outside a state of "
                        f"{src.shape[0]} rows"
                    )
        for src, out in pairs:
            torch.index_select(src, 0, rows, out=out)
        return
    gather_into(rows.contiguous().numpy(), sources, [_bytes(out) for _, out in pairs])


def row_sources(srcs: Sequence[torch.Tensor]) -> list[RowSource] | None:
    """``srcs`` (table states with the same rows) ready for :func:`gather_into`, checked once
    for many copies (a snapshot checks a shard's states once, not per chunk); None where the
    native kernel cannot copy them (not built, more than ``MAX_STATES``, a tensor not on the
    CPU, not contiguous or empty): then copy with ``torch.index_select``."""
    if native.native_module() is None or len(srcs) > MAX_STATES:
        return None
    if not all(
        t.device.type == "cpu" and t.is_contiguous() and t.dim() >= 1 and t.numel() > 0
        for t in srcs
    ):
        return None
    return [(_bytes(t), math.prod(t.shape[1:]) * t.element_size()) for t in srcs]


def gather_into(
    rows: np.ndarray, sources: Sequence[RowSource], outs: Sequence[Out], base: int = 0
) -> None:
    """For every source ``j``: row ``i`` of ``outs[j]`` (bytes ``i * b .. (i + 1) * b``, ``b``
    its row bytes) = row ``rows[i] - base`` of ``sources[j]``, every state of a row in one
    native pass. ``rows``: contiguous int64 or int32 (``base``: e.g. a shard's offset among the
    tracker's positions, so a claim's positions are read in place). Raises IndexError (a row
    outside a source) or ValueError (an out shorter than ``len(rows)`` rows) before copying
    anything."""
    if rows.dtype not in (np.int32, np.int64) or not rows.flags.c_contiguous:
        raise ValueError(f"gather_into: rows must be contiguous int32 or int64, not {rows.dtype}")
    kernel = native.native_module()
    states = [(src, b, out) for (src, b), out in zip(sources, outs, strict=True)]
    kernel.gather_rows(rows, states, rows.itemsize, base)


def copy_once(
    rows: np.ndarray,
    sources: Sequence[RowSource],
    outs: Sequence[Out],
    flags: np.ndarray,
    slot0: int,
    slots: np.ndarray | None = None,
    base: int = 0,
) -> int:
    """A copy-on-write snapshot's copy (:mod:`deck.trainer.cow`): for each ``i``, the row's slot
    is ``slots[i]`` (int64), or ``slot0 + i`` without ``slots``; the first thread to claim
    ``flags[slot]`` (0 -> 1, atomically) copies row ``rows[i] - base`` of every source into row
    ``slot - slot0`` of its out and sets it to 2, any other waits for 2. Safe to call from two
    threads over the same rows at once: each row is copied exactly once, and on return every
    one of ``rows`` is in its out. Returns how many rows this call copied. Raises IndexError (a
    row outside a source, a slot outside ``flags`` or an out) before copying anything. Needs
    the native kernel."""
    kernel = native.native_module()
    if kernel is None:
        raise RuntimeError("copy-on-write snapshots need deck's native kernel (kernels/_native.c)")
    states = [(src, b, out) for (src, b), out in zip(sources, outs, strict=True)]
    empty = np.zeros(0, np.int64)
    picked = empty if slots is None else np.ascontiguousarray(slots, np.int64)
    return int(kernel.copy_once(rows, states, rows.itemsize, base, flags, picked, slot0))


class ChunkCopy(NamedTuple):
    """One chunk of :func:`copy_chunks`: rows ``rows - base`` of ``sources`` into ``outs``, in
    slots ``slot0 ..``, and their ids (``rows + id_offset``) into ``ids``."""

    rows: np.ndarray  # contiguous int64 or int32
    sources: Sequence[RowSource]
    outs: Sequence[Out]
    ids: np.ndarray  # the chunk's int64 ids segment (writable)
    id_offset: int
    slot0: int
    base: int


def copy_chunks(flags: np.ndarray, chunks: Sequence[ChunkCopy]) -> int:
    """:func:`copy_once` of several chunks of one snapshot (row ``i`` of a chunk in slot
    ``slot0 + i``), each chunk's ids segment written too, in one native call that releases the
    GIL once for them all: a background copy that takes the GIL back after each chunk lets the
    training thread find it taken each time. Same guarantees as :func:`copy_once`; every chunk
    is checked (IndexError, ValueError) before anything is written. Returns how many rows this
    call copied. Needs the native kernel."""
    kernel = native.native_module()
    if kernel is None:
        raise RuntimeError("copy-on-write snapshots need deck's native kernel (kernels/_native.c)")
    items = [
        (
            c.rows,
            [(src, b, out) for (src, b), out in zip(c.sources, c.outs, strict=True)],
            c.rows.itemsize,
            c.base,
            c.slot0,
            c.ids,
            c.id_offset,
        )
        for c in chunks
    ]
    return int(kernel.copy_chunks(flags, items))


def pending_slots(
    positions: np.ndarray,
    claims: Sequence[tuple[np.ndarray, int]],
    spans: np.ndarray,
    flags: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """A copy-on-write guard's lookup, in one native call that releases the GIL once: the
    slots of the snapshot's rows among ``positions`` (int64, any order, repeats allowed) whose
    flag is still below 2 (not copied, not saved aside), ascending and each once, and their
    positions. A delta's rows are in ``claims``, ``(rows, slot0)`` per shard by first row (rows
    ascending, int64 or int32; ``rows[i]`` is slot ``slot0 + i``); a full's in ``spans``, int64
    ``(S, 3)`` rows ``(first, count, slot0)`` by ``first``. Raises IndexError for a slot
    outside ``flags``. Needs the native kernel."""
    kernel = native.native_module()
    if kernel is None:
        raise RuntimeError("copy-on-write snapshots need deck's native kernel (kernels/_native.c)")
    pos = np.ascontiguousarray(positions, np.int64)
    out_slots, out_pos = np.empty(len(pos), np.int64), np.empty(len(pos), np.int64)
    items = [(rows, rows.itemsize, slot0) for rows, slot0 in claims]
    n = kernel.pending_slots(
        pos, items, np.ascontiguousarray(spans, np.int64), flags, out_slots, out_pos
    )
    return out_slots[:n], out_pos[:n]


def _fits(src: torch.Tensor, out: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether ``out`` is a CPU row array the kernel can copy ``src``'s rows into (``src``
    itself is checked by :func:`row_sources`)."""
    return (
        out.device.type == "cpu"
        and src.dtype == out.dtype
        and out.is_contiguous()
        and src.shape[1:] == out.shape[1:]
        and out.shape[0] == rows.numel()
    )


def _bytes(t: torch.Tensor) -> np.ndarray:
    # A flat byte view of a contiguous CPU tensor (any dtype; no grad tracking is involved).
    return t.detach().view(-1).view(torch.uint8).numpy()
