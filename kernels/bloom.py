"""A chunk's row index (:mod:`deck.format.rowindex`) in one native pass.

The spool writer builds one index per chunk on a background thread. numpy's version is some
twenty array operations per chunk, each taking the GIL back from the training thread when it
ends; the chunk records (this index with the record's other Python work) were about half of what
the steps after a delta lost (docs/benchmarks-history.md, "The stall, sixth pass").
``bloom_fill`` in ``kernels/_native.c`` takes the GIL once per chunk.
"""

from __future__ import annotations

import numpy as np

from . import native


def bloom_fill(ids: np.ndarray, bits: int, k: int) -> tuple[int, int, str | None] | None:
    """``(min, max, filter)`` of the non-empty int64 ``ids``: ``filter`` (the base64 of
    ``bits / 8`` bytes) is None when the ids are exactly ``[min, max]``, else the same as
    rowindex's numpy filter. None without the native kernel (the caller computes it with
    numpy)."""
    kernel = native.native_module()
    if kernel is None:
        return None
    ids = np.require(ids, np.int64, ["C_CONTIGUOUS", "ALIGNED"])  # the kernel reads int64 words
    b64 = bytearray(4 * ((bits // 8 + 2) // 3))
    lo, hi, filled = kernel.bloom_fill(ids, bytearray(bits // 8), bits, k, b64)
    return lo, hi, b64.decode("ascii") if filled else None
