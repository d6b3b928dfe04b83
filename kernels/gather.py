"""The snapshot's copy: selected rows of a table's states into a chunk buffer.

A delta's rows lie pages apart in tables far larger than the cache, so the copy is a string of
cache and TLB misses. ``gather_rows`` in ``kernels/_jagged.c`` prefetches the rows a few places
ahead of the one it copies, overlapping those misses (torch's ``index_select`` copies them one
after another), and copies every state of a row in the same pass (a rowwise optimizer state's
misses overlap the weight's instead of costing a second pass). It runs on contiguous CPU
tensors when the native extension is built; ``index_select`` does the same copy everywhere else.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import native

MAX_STATES = 16  # GATHER_STATES in _jagged.c: states copied in one pass


def gather_rows(rows: torch.Tensor, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """For every ``(src, out)`` in ``pairs``: ``out[i] = src[rows[i]]`` for every ``i``
    (``rows``: int64 indices into dim 0 of every ``src``; ``out``: ``(len(rows),
    *src.shape[1:])`` of ``src``'s dtype). Raises IndexError when an index is outside a
    ``src``; then nothing is copied where the native kernel runs. Same result as
    ``torch.index_select`` per pair."""
    kernel = native.native_module()
    fast = (
        kernel is not None
        and rows.dtype == torch.int64
        and rows.device.type == "cpu"
        and len(pairs) <= MAX_STATES
        and all(_flat_rows(src, out, rows) for src, out in pairs)
    )
    if not fast:
        for src, out in pairs:
            torch.index_select(src, 0, rows, out=out)
        return
    states = [(_bytes(src), src[0].numel() * src.element_size(), _bytes(out)) for src, out in pairs]
    kernel.gather_rows(rows.contiguous().numpy(), states)


def _flat_rows(src: torch.Tensor, out: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether ``src`` and ``out`` are CPU row arrays the kernel can copy bytes between."""
    return (
        src.device.type == "cpu"
        and out.device.type == "cpu"
        and src.dtype == out.dtype
        and src.is_contiguous()
        and out.is_contiguous()
        and src.dim() >= 1
        and src.shape[1:] == out.shape[1:]
        and out.shape[0] == rows.numel()
        and src.numel() > 0
    )


def _bytes(t: torch.Tensor) -> np.ndarray:
    # A flat byte view of a contiguous CPU tensor (any dtype; no grad tracking is involved).
    return t.detach().view(-1).view(torch.uint8).numpy()
