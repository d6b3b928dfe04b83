"""Tracker store: which rows each consumer (tenant) has not saved yet.

A bool-bitmap per row with one bit per consumer (up to 8 consumers share one byte per row: one
bit per row per tenant). A lookup sets every consumer's bit of the rows it touched. A read by
consumer ``c`` claims the rows whose bit ``c`` is set (clearing that bit) and holds them as one
int64 array until the read is committed (dropped) or aborted (bits set again), so a failed
checkpoint loses nothing, a read never consumes another tenant's rows, and each tenant holds at
most one extra copy of its delta (DECK fig. 8).

A summary byte per block of 64 rows (:data:`deck.kernels.claim.BLOCK_SHIFT`) has every bit some
row of the block has, so a claim reads only the touched blocks plus the summary (1/64 of the map):
its cost follows the delta, not the table. Memory: 1 + 1/64 bytes per row whatever the number of
consumers (up to 8): 8.125 bits per row with one consumer, 1.016 bits per row per consumer with 8.

Hot path: :meth:`record` only appends a tensor (no device->host sync); :meth:`compact` scatters
pending ids into the bitmap and is called from the post-output-dist hook so that it overlaps the
embedding AllToAll.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from deck.errors import ConfigError
from deck.kernels.claim import block_count, block_of, claim_marked_rows

MAX_CONSUMERS = 8


@dataclass(frozen=True)
class ReadToken:
    """An open read: ``rows`` are the claimed flat positions (ascending)."""

    consumer: str
    rows: torch.Tensor


class TrackerStore:
    """Touched-row state for a flat space of ``num_rows`` rows (all tracked shards back to back)."""

    def __init__(
        self, num_rows: int, consumers: tuple[str, ...], device: torch.device | None = None
    ):
        if not consumers or len(consumers) > MAX_CONSUMERS:
            raise ConfigError(
                f"the tracker supports 1 to {MAX_CONSUMERS} consumers, got {list(consumers)}"
            )
        self._bits = {c: 1 << i for i, c in enumerate(consumers)}
        self._all = (1 << len(consumers)) - 1
        self._dirty = torch.zeros(num_rows, dtype=torch.uint8, device=device)
        self._blocks = torch.zeros(block_count(num_rows), dtype=torch.uint8, device=device)
        self._pending: list[torch.Tensor] = []
        self._lock = threading.Lock()

    @property
    def num_rows(self) -> int:
        return int(self._dirty.numel())

    @property
    def consumers(self) -> tuple[str, ...]:
        return tuple(self._bits)

    def nbytes(self) -> int:
        """Memory held by the tracking state (excluding ids not yet compacted and open reads)."""
        return sum(m.numel() * m.element_size() for m in (self._dirty, self._blocks))

    def record(self, positions: torch.Tensor) -> None:
        """Remember that rows ``positions`` (int64, any order, duplicates allowed) were looked up."""
        with self._lock:
            self._pending.append(positions)

    def compact(self) -> None:
        """Fold recorded ids into the bitmap; cheap to call when nothing is pending."""
        with self._lock:
            pending, self._pending = self._pending, []
            for pos in pending:
                # A touched row is dirty for every consumer: setting all bits is the OR.
                self._dirty.index_fill_(0, pos, self._all)
                self._blocks.index_fill_(0, block_of(pos), self._all)

    def begin_read(self, consumer: str) -> ReadToken:
        """Claim the rows touched since ``consumer``'s last committed read."""
        bit = self._bits.get(consumer)
        if bit is None:
            raise ConfigError(
                f"unknown tracking consumer {consumer!r}; configured: {list(self._bits)}"
            )
        self.compact()
        with self._lock:
            rows = claim_marked_rows(self._dirty, self._blocks, bit)
        return ReadToken(consumer, rows)

    def touched(self, token: ReadToken, start: int, stop: int) -> torch.Tensor:
        """Ascending claimed positions in ``[start, stop)``, relative to ``start``."""
        lo, hi = torch.searchsorted(
            token.rows, torch.tensor([start, stop], device=token.rows.device)
        ).tolist()
        return token.rows[lo:hi] - start

    def commit(self, token: ReadToken) -> None:
        """The read was saved durably: its rows are no longer pending for its consumer."""

    def abort(self, token: ReadToken) -> None:
        """The read was not saved: its rows are pending again for its consumer."""
        bit = self._bits[token.consumer]
        with self._lock:
            self._dirty.index_put_((token.rows,), self._dirty[token.rows] | bit)
            blocks = block_of(token.rows)
            self._blocks.index_put_((blocks,), self._blocks[blocks] | bit)

    def reset(self) -> None:
        """Forget everything (after a restore the model equals a checkpoint: nothing is dirty)."""
        with self._lock:
            self._pending = []
            self._dirty.zero_()
            self._blocks.zero_()
