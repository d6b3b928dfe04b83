"""The snapshot's copy: selected rows of a table state into a chunk buffer.

A delta's rows lie pages apart in tables far larger than the cache, so the copy is a string of
cache and TLB misses. ``gather_rows`` in ``kernels/_jagged.c`` prefetches the rows a few places
ahead of the one it copies, overlapping those misses (torch's ``index_select`` copies them one
after another); it runs on contiguous CPU tensors when the native extension is built, and
``index_select`` does the same copy everywhere else.
"""

from __future__ import annotations

import numpy as np
import torch

from . import native


def gather_rows(src: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = src[rows[i]]`` for every ``i`` (``rows``: int64 indices into dim 0 of ``src``;
    ``out``: ``(len(rows), *src.shape[1:])`` of ``src``'s dtype). Raises IndexError, copying
    nothing, when an index is outside ``src``. Same result as ``torch.index_select``."""
    kernel = native.native_module()
    fast = (
        kernel is not None
        and src.device.type == "cpu"
        and out.device.type == "cpu"
        and src.dtype == out.dtype
        and src.is_contiguous()
        and out.is_contiguous()
        and rows.dtype == torch.int64
        and rows.device.type == "cpu"
        and src.dim() >= 1
        and src.shape[1:] == out.shape[1:]
        and out.shape[0] == rows.numel()
        and src.numel() > 0
    )
    if not fast:
        torch.index_select(src, 0, rows, out=out)
        return
    row_bytes = src[0].numel() * src.element_size()
    if not row_bytes:
        return
    kernel.gather_rows(_bytes(src), row_bytes, rows.contiguous().numpy(), _bytes(out))


def _bytes(t: torch.Tensor) -> np.ndarray:
    # A flat byte view of a contiguous CPU tensor (any dtype; no grad tracking is involved).
    return t.detach().view(-1).view(torch.uint8).numpy()
