"""Tracker store: which rows each consumer (tenant) has not saved yet.

A bool-bitmap per row with one bit per consumer (up to 8 consumers share one byte per row: one
bit per row per tenant). A lookup sets every consumer's bit of the rows it touched. A read by
consumer ``c`` claims the rows whose bit ``c`` is set (clearing that bit) and holds them as one
array until the read is committed (dropped) or aborted (bits set again), so a failed
checkpoint loses nothing, a read never consumes another tenant's rows, and each tenant holds at
most one extra copy of its delta (DECK fig. 8).

A summary byte per block of 64 rows (:data:`deck.kernels.claim.BLOCK_SHIFT`) has every bit some
row of the block has, so a claim by reading the map reads only the touched blocks plus the summary
(1/64 of the map). Usually a claim reads neither: each consumer keeps a journal of the rows that
became pending for it (compaction returns them), and a claim sorts its journal, and the next
compaction clears those rows' bits before it marks anything (out of the checkpoint stall), so it
costs the delta's rows whatever the table's size. A journal holds at most
``journal_cap`` rows (default 1/8 of the rows, at least 65,536); a consumer whose delta grows
past it drops its journal and its next claim reads the map (then a journal starts again).
Memory: 1 + 1/64 bytes per row whatever the number of consumers (up to 8): 8.125 bits per row with
one consumer, 1.016 bits per row per consumer with 8; plus each journal's 4 bytes per pending row
(8 at 2**31 rows or more), at most 0.5 byte per row per consumer (a delta of 1-5% of the rows:
0.04-0.2 byte).

Hot path: :meth:`record` only appends a tensor (no device->host sync); :meth:`compact` scatters
pending ids into the bitmap and is called from the post-output-dist hook so that it overlaps the
embedding AllToAll.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass

import numpy as np
import torch

from deck.errors import ConfigError, DeckError
from deck.kernels.claim import (
    block_count,
    block_of,
    claim_marked_rows,
    clear_rows,
    fill_rows,
    journaling_available,
    mark_rows,
)

MAX_CONSUMERS = 8
JOURNAL_MIN_CAP = 1 << 16  # rows a journal may always hold, however small the map
# A journal holds at most 1/JOURNAL_FRACTION of the rows: near there sorting the journal costs
# what reading the map does (4M rows, cold caches: 2.9 vs 5.1 ms at 1/8, 6.8 vs 5.2 ms at 1/4; at
# 1/32 the journal is 4x cheaper, 0.65 vs 2.6 ms), and its memory stays under 1 byte per row.
JOURNAL_FRACTION = 8


class RowJournal:
    """The rows that became pending for one consumer since its last claim: each once, unsorted
    (exactly the rows whose byte has the consumer's bit), and how many lie in each span of the
    tracker (``starts``: each span's first position, ascending, from 0).

    One growing array of ``dtype`` (int32 below 2**31 rows: half the bytes to sort and clear),
    filled as compactions add rows; a claim takes it as it is, copying nothing.
    """

    def __init__(
        self, dtype: type[np.signedinteger], starts: np.ndarray, capacity: int = 1 << 12
    ) -> None:
        self._rows = np.empty(capacity, dtype)
        self.rows = 0
        self._starts = starts
        self._counts = np.zeros(len(starts), np.int64)

    def add(self, rows: np.ndarray) -> None:
        end = self.rows + len(rows)
        if end > len(self._rows):
            grown = np.empty(max(end, 2 * len(self._rows)), self._rows.dtype)
            grown[: self.rows] = self._rows[: self.rows]
            self._rows = grown
        self._rows[self.rows : end] = rows
        self.rows = end
        # Counted as they come (a few thousand rows a step), so a claim knows each span's rows
        # without sorting them in the checkpoint stall
        if len(self._starts) == 1:
            self._counts[0] += len(rows)
        else:
            spans = np.searchsorted(self._starts, rows, side="right") - 1
            self._counts += np.bincount(spans, minlength=len(self._starts))

    def nbytes(self) -> int:
        """Bytes of the journaled rows."""
        return self.rows * self._rows.itemsize

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """Every journaled row (unsorted) and the count per span; the journal is empty after,
        with room for as many rows again (its pages are faulted in by the compactions that fill
        it, not the claim)."""
        rows, counts = self._rows[: self.rows], self._counts
        self._rows = np.empty(max(len(rows) + len(rows) // 4, 1 << 12), rows.dtype)
        self.rows = 0
        self._counts = np.zeros(len(self._starts), np.int64)
        return rows, counts


class ReadToken:
    """An open read of ``consumer``: the claimed flat positions (int32 when claimed from a
    journal of a map under 2**31 rows, else int64).

    A claim from a journal is not sorted in the checkpoint stall: :attr:`rows` sorts a copy on
    first use, from whichever thread asks first (a copy-on-write snapshot asks from its
    background copy), and :meth:`counts_in` answers from the counts the journal kept.
    """

    def __init__(
        self,
        consumer: str,
        claimed: torch.Tensor,
        limit: int,
        span_counts: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        self.consumer = consumer
        self.claimed = claimed  # as claimed: ascending unless ``span_counts`` is given
        self._limit = limit  # the tracker's rows: every position lies below
        self._span_counts = span_counts  # (each span's first position, its claimed rows)
        self._sorted = None if span_counts is not None else claimed
        self._lock = threading.Lock()

    @property
    def rows(self) -> torch.Tensor:
        """The claimed positions, ascending (sorted once, on first use; never in place, so the
        tracker may clear or journal :attr:`claimed` again meanwhile)."""
        if self._sorted is None:
            with self._lock:
                if self._sorted is None:
                    self._sorted = torch.from_numpy(np.sort(self.claimed.numpy()))
        return self._sorted

    def rows_as_ready(self) -> np.ndarray:
        """The claimed positions as they are now: ascending once :attr:`rows` sorted them (a
        sweep over the map then reads it in order), else as claimed."""
        done = self._sorted
        return (self.claimed if done is None else done).numpy()

    def rows_in(self, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
        """The claimed positions (ascending, not relative) in each ``(start, stop)`` of
        ``spans``: views of :attr:`rows` (one search for all), copying nothing, so a snapshot
        reads them in place."""
        if not spans:
            return []
        rows = self.rows
        bounds = [min(b, self._limit) for span in spans for b in span]  # rows lie below
        if rows.device.type == "cpu":  # numpy: a fraction of torch's per-call cost (in the stall)
            flat = rows.numpy()
            # Bounds of the rows' own dtype: others would make numpy search a converted copy
            cut = np.searchsorted(flat, np.array(bounds, dtype=flat.dtype)).tolist()
        else:
            cut = torch.searchsorted(rows, torch.tensor(bounds, device=rows.device)).tolist()
        return [rows[cut[2 * i] : cut[2 * i + 1]] for i in range(len(spans))]

    def counts_in(self, spans: list[tuple[int, int]]) -> list[int]:
        """How many claimed positions lie in each ``(start, stop)`` of ``spans``: from the
        journal's counts when every span is a run of the tracker's spans (without sorting),
        else by :meth:`rows_in`."""
        if self._span_counts is not None:
            starts, counts = self._span_counts
            # Span k of the tracker is [starts[k], starts[k + 1]); ``below[k]``: rows before it
            at = {e: k for k, e in enumerate([*starts.tolist(), self._limit])}
            below = [0, *np.cumsum(counts).tolist()]
            out = []
            for a, b in spans:
                b = min(b, self._limit)
                if a >= b:
                    out.append(0)
                elif a in at and b in at:
                    out.append(below[at[b]] - below[at[a]])
                else:
                    break
            else:
                return out
        return [int(r.numel()) for r in self.rows_in(spans)]


@dataclass(frozen=True)
class ClaimedSpan:
    """The positions a read claimed in ``[start, stop)``: how many is known at once
    (:meth:`ReadToken.counts_in`); which, on first use of :meth:`rows` (sorting the claim then)."""

    token: ReadToken
    start: int
    stop: int
    count: int

    def rows(self) -> torch.Tensor:
        """The claimed positions in the span, ascending (a view of the sorted claim)."""
        return self.token.rows_in([(self.start, self.stop)])[0]


class _BackwardWatch:
    """The gradient hook on one tracked lookup's output: takes itself out of ``awaiting`` when
    the gradient arrives, or when it is freed -- it lives as long as the autograd graph (or
    the output) holding it, so a graph freed without a backward takes it out too.

    Autograd runs it before the output's gradient reaches the backward node behind it, where
    the fused optimizer writes the rows: so the first backward waits here for the snapshots
    that guard the rows on threads of their own (``guarded``; their error is the backward's).
    A graph kept for another backward (``retain_graph=True``) writes the rows again each time,
    with no lookup before it: each backward after the first calls ``again`` with the rows
    (guarded and recorded again), so a checkpoint taken in between neither misses the update
    nor saves it into a snapshot it came after."""

    __slots__ = ("again", "awaiting", "guarded", "positions", "ran")

    def __init__(
        self,
        awaiting: set[int],
        again: Callable[[torch.Tensor], None],
        positions: torch.Tensor,
        guarded: list[Future[None]],
    ) -> None:
        self.awaiting = awaiting
        self.again = again
        self.positions = positions
        self.guarded = guarded
        self.ran = False
        awaiting.add(id(self))

    def __call__(self, grad: torch.Tensor) -> None:
        if self.ran:
            self.again(self.positions)
        self.ran = True
        self.awaiting.discard(id(self))
        guarded, self.guarded = self.guarded, []
        for f in guarded:
            f.result()

    def __del__(self) -> None:
        self.awaiting.discard(id(self))


class TrackerStore:
    """Touched-row state for a flat space of ``num_rows`` rows (all tracked shards back to back)."""

    def __init__(
        self,
        num_rows: int,
        consumers: tuple[str, ...],
        device: torch.device | None = None,
        journal_cap: int | None = None,
        starts: list[int] | None = None,
    ):
        """``starts``: the first position of each span the checkpoints ask about (the tracked
        shards, back to back; default one span): each journal counts its rows per span."""
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
        self._journaling = journaling_available(self._dirty)
        # (A span starting at or past the end is empty: counts_in answers it without counts)
        self._starts = np.array(sorted({0, *(x for x in starts or () if 0 < x < num_rows)}))
        self._journal_cap = (
            max(JOURNAL_MIN_CAP, num_rows // JOURNAL_FRACTION)
            if journal_cap is None
            else journal_cap
        )
        # None: no journal (too many rows, or no native kernel): the next claim reads the map.
        self._journals: dict[str, RowJournal | None] = {c: self._new_journal() for c in consumers}
        # Reads claimed from a journal whose rows still have their consumer's bit: cleared by the
        # next compaction (before it marks anything), out of the checkpoint stall.
        self._uncleared: dict[str, ReadToken] = {}
        # Copy-on-write snapshots whose rows are not all copied yet (deck.trainer.cow)
        self._guards: list[tuple[Callable[[torch.Tensor], None], Executor | None]] = []
        # Tracked lookups whose backward (where the fused optimizer writes their rows) has not
        # run: their watches' ids, added by the training thread, taken by an autograd thread or
        # the GC.
        self._awaiting: set[int] = set()

    @property
    def num_rows(self) -> int:
        return int(self._dirty.numel())

    @property
    def consumers(self) -> tuple[str, ...]:
        return tuple(self._bits)

    def nbytes(self) -> int:
        """Memory held by the tracking state: map, summary and journals (excluding ids not yet
        compacted and open reads)."""
        journaled = sum(j.nbytes() for j in self._journals.values() if j is not None)
        return journaled + sum(m.numel() * m.element_size() for m in (self._dirty, self._blocks))

    def _new_journal(self) -> RowJournal | None:
        if not self._journaling:
            return None
        return RowJournal(
            np.int32 if self.num_rows <= np.iinfo(np.int32).max else np.int64, self._starts
        )

    def _journal(self, consumer: str, rows: np.ndarray) -> None:
        """Add ``rows`` (newly pending for ``consumer``) to its journal, or drop the journal
        when it would grow past the cap."""
        journal = self._journals[consumer]
        if journal is None:
            return
        journal.add(rows)
        if journal.rows > self._journal_cap:
            self._journals[consumer] = None

    @property
    def guarding(self) -> bool:
        """Whether a copy-on-write snapshot still guards rows (see :meth:`guard`)."""
        return bool(self._guards)

    def guard(self, positions: torch.Tensor, in_background: bool = False) -> list[Future[None]]:
        """Before rows ``positions`` are updated: every guarding snapshot copies those of them it
        still has pending (:meth:`deck.trainer.cow.DeferredCopy.protect`).

        ``in_background`` (a backward is to come, :meth:`await_backward` waits for it): a
        snapshot guarding on a thread of its own does it there, beside the rest of the step;
        the futures returned are those. Otherwise every guard is done here."""
        later: list[Future[None]] = []
        for protect, runner in self._guards:
            if in_background and runner is not None:
                later.append(runner.submit(protect, positions))
            else:
                protect(positions)
        return later

    def add_guard(
        self, protect: Callable[[torch.Tensor], None], runner: Executor | None = None
    ) -> None:
        """Call ``protect`` before every update from now on, until :meth:`remove_guard`; on
        ``runner`` when the update is a backward still to come (:meth:`guard`)."""
        self._guards = [*self._guards, (protect, runner)]

    def remove_guard(self, protect: Callable[[torch.Tensor], None]) -> None:
        self._guards = [g for g in self._guards if g[0] is not protect]

    def await_backward(
        self, output: torch.Tensor, positions: torch.Tensor, guarded: list[Future[None]]
    ) -> None:
        """A tracked lookup of rows ``positions`` produced ``output``, whose backward will
        update them: counted by :meth:`awaiting_backward` until its gradient is computed (the
        update runs in the same ``backward()``) or its graph is freed without one (a forward
        never backpropagated: nothing will update its rows). That backward waits for
        ``guarded`` (:meth:`guard` in the background) before it writes the rows; a later one
        through the same graph guards and records them again (:class:`_BackwardWatch`)."""
        watch = _BackwardWatch(self._awaiting, self._written_again, positions, guarded)
        output.register_hook(watch)

    def _written_again(self, positions: torch.Tensor) -> None:
        """Rows ``positions`` are about to be updated by another backward through a kept graph."""
        self.guard(positions)
        self.record(positions)

    def awaiting_backward(self) -> int:
        """How many tracked lookups still wait for their backward (:meth:`await_backward`)."""
        return len(self._awaiting)

    def record(self, positions: torch.Tensor) -> None:
        """Remember that rows ``positions`` (int64, any order, duplicates allowed) were looked up."""
        with self._lock:
            self._pending.append(positions)

    def compact(self) -> None:
        """Fold recorded ids into the bitmap; cheap to call when nothing is pending."""
        with self._lock:
            if self._uncleared:
                self._clear_claimed()
            pending, self._pending = self._pending, []
            for pos in pending:
                # A touched row is dirty for every consumer: setting all bits is the OR.
                if not self._journaling:
                    fill_rows(self._dirty, self._blocks, pos, self._all)
                    continue
                new, old = mark_rows(self._dirty, self._blocks, pos, self._all)
                for consumer, bit in self._bits.items():
                    self._journal(consumer, new if bit == self._all else new[(old & bit) == 0])

    def begin_read(self, consumer: str) -> ReadToken:
        """Claim the rows touched since ``consumer``'s last committed read."""
        bit = self._bits.get(consumer)
        if bit is None:
            raise ConfigError(
                f"unknown tracking consumer {consumer!r}; configured: {list(self._bits)}"
            )
        self.compact()
        with self._lock:
            journal = self._journals[consumer]
            if journal is None:
                rows = claim_marked_rows(self._dirty, self._blocks, bit)
                self._journals[consumer] = self._new_journal()  # no row has the bit now
                return ReadToken(consumer, rows, self.num_rows)
            # The rows' bits are cleared by the next compaction (nothing marks or reads the map
            # before it): 0.2-0.3 ms of random writes out of the stall. Nor are they sorted here
            # (0.4-1 ms for a delta of 80-250k rows): ReadToken.rows does that when first asked.
            rows, counts = journal.take()
            token = ReadToken(
                consumer, torch.from_numpy(rows), self.num_rows, (self._starts, counts)
            )
            self._uncleared[consumer] = token
        return token

    def clear_claimed(self) -> None:
        """Clear the bits of the reads claimed from journals now, from any thread (a background
        one, right after the checkpoint stall: 0.3-1 ms of scattered writes the training thread's
        next compaction does otherwise)."""
        with self._lock:
            if self._uncleared:
                self._clear_claimed()

    def _clear_claimed(self) -> None:
        """Clear the consumer's bit of every row of the reads claimed from journals (under the
        lock, before anything marks the map)."""
        reads, self._uncleared = self._uncleared, {}
        for token in reads.values():
            lacking = clear_rows(
                self._dirty, self._blocks, token.rows_as_ready(), self._bits[token.consumer]
            )
            if lacking:
                raise DeckError(
                    f"internal: the tracker's journal of {token.consumer!r} names {lacking} rows "
                    "that were not pending; please report this"
                )

    def touched(self, token: ReadToken, start: int, stop: int) -> torch.Tensor:
        """Ascending claimed positions in ``[start, stop)``, relative to ``start`` (int64)."""
        return self.claimed_in(token, [(start, stop)])[0].long() - start

    def claimed_in(self, token: ReadToken, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
        """The claimed positions (ascending, not relative) in each ``(start, stop)`` of
        ``spans``: :meth:`ReadToken.rows_in`."""
        return token.rows_in(spans)

    def commit(self, token: ReadToken) -> None:
        """The read was saved durably: its rows are no longer pending for its consumer."""

    def abort(self, token: ReadToken) -> None:
        """The read was not saved: its rows are pending again for its consumer."""
        bit = self._bits[token.consumer]
        with self._lock:
            if self._uncleared.get(token.consumer) is token:
                # Its rows still have the bit and are in no journal: journal them again.
                del self._uncleared[token.consumer]
                self._journal(token.consumer, token.claimed.numpy())
                return
            if self._journaling:
                # Rows touched again since the claim are journaled already.
                lacked, _ = mark_rows(self._dirty, self._blocks, token.claimed, bit)
                self._journal(token.consumer, lacked)
                return
            rows = token.claimed
            self._dirty.index_put_((rows,), self._dirty[rows] | bit)
            blocks = block_of(rows)
            self._blocks.index_put_((blocks,), self._blocks[blocks] | bit)

    def reset(self) -> None:
        """Forget everything (after a restore the model equals a checkpoint: nothing is dirty)."""
        with self._lock:
            self._pending = []
            self._uncleared = {}
            self._dirty.zero_()
            self._blocks.zero_()
            self._journals = {c: self._new_journal() for c in self._bits}
