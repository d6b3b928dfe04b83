"""The tracker's claim: which rows a consumer has not saved yet, taken in one pass.

:class:`deck.trainer.tracker.TrackerStore` keeps one byte per row, one bit per consumer. A
checkpoint claims consumer ``c``'s rows: the ascending positions whose byte has bit ``c``, and
clears that bit. It runs on the training thread inside the checkpoint stall, over every tracked
row (millions), while a delta touches a few percent of them: the native kernel
(``claim_bit`` in ``kernels/_jagged.c``) tests eight rows per load and writes only the hits; the
torch fallback (same result) makes a masked copy of the map, ``nonzero`` and an ``index_put``.
"""

from __future__ import annotations

import torch

from . import native


def claim_rows(dirty: torch.Tensor, bit: int) -> torch.Tensor:
    """Positions (int64, ascending) of the rows of ``dirty`` (a contiguous uint8 CPU map) whose
    byte has ``bit``; that bit is cleared in them, every other bit is left as it was."""
    kernel = native._native
    if kernel is None or dirty.device.type != "cpu" or not dirty.is_contiguous():
        rows = torch.nonzero(dirty & bit).view(-1)
        dirty.index_put_((rows,), dirty[rows] & (~bit & 0xFF))
        return rows
    raw = dirty.numpy()
    while True:  # count, then take; again if rows were marked in between (the caller's lock
        # normally rules that out)
        rows = torch.empty(kernel.claim_bit(raw, bit, bytearray()), dtype=torch.int64)
        if not rows.numel() or kernel.claim_bit(raw, bit, rows.numpy()) >= 0:
            return rows
