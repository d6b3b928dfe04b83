"""Tracker store: which rows each consumer (tenant) has not saved yet.

One int32 "last touched generation" per tracked row, shared by every consumer, plus one integer
mark per consumer. A read by consumer ``c`` returns the rows whose generation is newer than
``c``'s mark; committing the read moves the mark. So K tenants at different intervals cost
4 bytes per row in total (the bitmap equivalent, independent of K), a read never destroys
another tenant's delta, and a failed checkpoint loses nothing: its mark does not move.

Hot path: :meth:`record` only appends a tensor (no device->host sync); :meth:`compact` scatters
pending ids into the generation array and is called from the post-output-dist hook so that it
overlaps the embedding AllToAll.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from deck.errors import ConfigError


@dataclass(frozen=True)
class ReadToken:
    """An uncommitted read: rows touched after generation ``since`` belong to it."""

    consumer: str
    since: int
    upto: int


class TrackerStore:
    """Touched-row state for a flat space of ``num_rows`` rows (all tracked shards back to back)."""

    def __init__(
        self, num_rows: int, consumers: tuple[str, ...], device: torch.device | None = None
    ):
        self._last = torch.zeros(num_rows, dtype=torch.int32, device=device)
        self._generation = 1
        self._marks = dict.fromkeys(consumers, 0)
        self._pending: list[torch.Tensor] = []
        self._lock = threading.Lock()

    @property
    def num_rows(self) -> int:
        return int(self._last.numel())

    @property
    def consumers(self) -> tuple[str, ...]:
        return tuple(self._marks)

    def nbytes(self) -> int:
        """Memory held by the tracking state (excluding not yet compacted ids)."""
        return self._last.numel() * self._last.element_size()

    def record(self, positions: torch.Tensor) -> None:
        """Remember that rows ``positions`` (int64, any order, duplicates allowed) were looked up."""
        with self._lock:
            self._pending.append(positions)

    def compact(self) -> None:
        """Fold recorded ids into the generation array; cheap to call when nothing is pending."""
        with self._lock:
            pending, self._pending = self._pending, []
            for pos in pending:
                self._last.index_fill_(0, pos, self._generation)

    def begin_read(self, consumer: str) -> ReadToken:
        """Start a read for ``consumer``: rows touched since its last committed read."""
        if consumer not in self._marks:
            raise ConfigError(
                f"unknown tracking consumer {consumer!r}; configured: {list(self._marks)}"
            )
        self.compact()
        with self._lock:
            token = ReadToken(consumer, self._marks[consumer], self._generation)
            # Rows touched from now on get a newer generation than this read's upto.
            self._generation += 1
        return token

    def touched(self, token: ReadToken, start: int, stop: int) -> torch.Tensor:
        """Ascending positions in ``[start, stop)`` (relative to ``start``) touched for ``token``."""
        return torch.nonzero(self._last[start:stop] > token.since).view(-1)

    def commit(self, token: ReadToken) -> None:
        """The read was saved durably: the consumer's next read starts after it."""
        with self._lock:
            self._marks[token.consumer] = max(self._marks[token.consumer], token.upto)

    def reset(self) -> None:
        """Forget everything (after a restore the model equals a checkpoint: nothing is dirty)."""
        with self._lock:
            self._pending = []
            self._last.zero_()
            self._generation = 1
            for c in self._marks:
                self._marks[c] = 0
