"""Per-chunk row index: the id range and a bloom filter of the global row ids a chunk holds.

Lets point queries over history (:mod:`deck.ops.history`) read only the chunks that may hold a row.
Hashing is deterministic across processes and versions (no Python ``hash``): ``k`` splitmix64
finalisers with different seeds, vectorised with numpy, each mapped onto ``bits`` with a
multiply-shift, so a filter written by one deck reads the same in any other.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable

import numpy as np
import torch

from deck.format.manifest import RowIndex

TARGET_FP = 0.01  # false positive rate the filter is sized for
K = 3  # hashes: few, so building stays cheap; ~12.4 bits per id for 1%
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def bits_for(n: int, fp: float = TARGET_FP, k: int = K) -> int:
    """Bits (a multiple of 8) a filter of ``k`` hashes needs for ``n`` ids at false positive
    rate ``fp``: ``p = (1 - e^(-k n / m))^k`` solved for ``m``."""
    m = math.ceil(-k * max(n, 1) / math.log(1.0 - fp ** (1.0 / k)))
    return max(8, (m + 7) // 8 * 8)


def _positions(ids: np.ndarray, bits: int, k: int) -> np.ndarray:
    """``(k, n)`` bit positions of ``ids`` (int64) in a filter of ``bits`` bits."""
    x = ids.astype(np.uint64, copy=False)
    out = np.empty((k, x.size), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(k):
            z = x + _GOLDEN * np.uint64(i + 1)
            z = (z ^ (z >> np.uint64(30))) * _M1
            z = (z ^ (z >> np.uint64(27))) * _M2
            z = z ^ (z >> np.uint64(31))
            # Top 32 bits scaled onto [0, bits): unbiased enough and no modulo.
            out[i] = ((z >> np.uint64(32)) * np.uint64(bits)) >> np.uint64(32)
    return out


# (ids, bits, k) -> (min, max, base64 of the packed filter or None when the ids are exactly
# [min, max]), or None when unavailable: a native implementation of the index
# (deck.kernels.bloom.bloom_fill)
Fill = Callable[[np.ndarray, int, int], "tuple[int, int, str | None] | None"]


def build_index(
    ids: torch.Tensor | np.ndarray, fp: float = TARGET_FP, k: int = K, fill: Fill | None = None
) -> RowIndex | None:
    """The index of a chunk's (ascending) int64 ``ids``; None for an empty chunk.

    Guarantees: every id lies in ``[min_id, max_id]`` and :func:`may_contain` is True for it.
    A chunk holding exactly its range (every full's chunk) gets no filter. ``fill`` computes the
    same index natively (it must match this module's hashing bit for bit); numpy when it is
    None or returns None.
    """
    arr = ids if isinstance(ids, np.ndarray) else ids.detach().cpu().numpy()
    n = int(arr.size)
    if n == 0:
        return None
    bits = bits_for(n, fp, k)
    got = None if fill is None else fill(arr, bits, k)
    if got is not None:
        lo, hi, bloom = got
    else:
        lo, hi = int(arr.min()), int(arr.max())
        bloom = None
        if hi - lo + 1 != n:
            mask = np.zeros(bits, dtype=np.uint8)
            mask[_positions(arr, bits, k).reshape(-1).astype(np.int64)] = 1
            bloom = base64.b64encode(np.packbits(mask, bitorder="little").tobytes()).decode()
    if bloom is None:
        return RowIndex(min_id=lo, max_id=hi)
    return RowIndex(min_id=lo, max_id=hi, bits=bits, k=k, bloom=bloom)


def may_contain(index: RowIndex | None, row: int) -> bool:
    """False only when the chunk cannot hold global row ``row``; True without an index."""
    if index is None:
        return True
    if not index.min_id <= row <= index.max_id:
        return False
    if index.bloom is None:
        return True
    packed = np.frombuffer(base64.b64decode(index.bloom), dtype=np.uint8)
    pos = _positions(np.array([row], dtype=np.int64), index.bits, index.k).reshape(-1)
    return all(packed[int(p) >> 3] >> (int(p) & 7) & 1 for p in pos)
