"""Copy-on-write snapshots: the stall fixes *what* a part saves; its rows are copied after it.

In the stall a checkpoint claims its rows, captures the dense and extra state, and the ranks
vote. With copy-on-write (``staging.copy_on_write``: deltas by default, or all) the rows' bytes are not
copied there: :class:`DeferredCopy` remembers, per chunk, which rows go where (a delta's claimed
rows, or a full's every row), and once the vote keeps the part a background thread takes each
chunk's buffer, copies its rows and hands it to the stager (:meth:`DeferredCopy.run`) while
training goes on.

A row must reach its chunk as it was at the checkpoint's step, so the next update of a row still
pending must wait for its copy. Every update of a tracked row comes after the lookup of the
same step (TorchRec's fused optimizer writes the rows in that step's backward), and the lookup
hook hands its rows to :meth:`DeferredCopy.protect` first: it copies the rows that are still
pending itself, or waits for the background's copy of a row it is copying. Each row has a flag,
0 (pending) -> 1 (being copied) -> 2 (copied), moved by whichever thread claims it first with
one atomic compare-and-swap in the native kernel (``copy_once`` in ``kernels/_native.c``), the
GIL released: each row is copied exactly once, before any write can reach it.

Pipelines that look rows up for a batch before the previous batch's update (TorchRec's
semi-sync and prefetch pipelines) break that order; a checkpoint under them is refused anyway
(:class:`deck.trainer.chain.ChainWriter`). The rows are copied in the stall as before (chosen per
checkpoint, logged once) with ``release="first_tier"``; so are the shards the writer cannot defer (tables off the CPU,
quantised states, ``full_only`` shards, bundles: :meth:`deck.trainer.writer.RankPartWriter`).
Memory: the chunk buffers are the pool's as before (``staging.snapshot_memory_bytes``), taken by
the background copy as it goes; plus the rows a lookup saved aside because their chunk had no
buffer yet (at most the rows the steps update while the part is copied, each once).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from deck.failpoints import failpoint
from deck.format.chunks import Buffer
from deck.kernels.gather import ChunkCopy, RowSource, copy_chunks, copy_once, pending_slots

# Chunks copied per native call at most: one GIL release for them all (a delta of the demo's
# DLRM is 8 chunks), while a full's writes start after its first 16 chunks (64 MiB at the
# default chunk_bytes), not its last.
COPY_BATCH = 16

# TEST HOOK: when set, the background copy waits for it before its first row, so a test can
# train steps while every row is still pending (only the lookups' copy-before-update runs).
FILL_GATE: threading.Event | None = None


@dataclass(frozen=True)
class RowSlice:
    """Rows ``[start, stop)`` of the ascending positions ``source()`` returns: a delta's claim,
    whose positions the copy finds after the stall (sorting them there, not in it)."""

    source: Callable[[], np.ndarray]
    start: int
    stop: int

    def get(self) -> np.ndarray:
        return self.source()[self.start : self.stop]


@dataclass
class _Chunk:
    """One chunk's deferred rows: ``rows`` (tracker positions, ascending: a delta's claim) or
    every position of ``(first, count)`` (a full's), of a shard whose first row is at position
    ``base``; their slots in the part are ``slot0 ..``."""

    slot0: int
    rows: RowSlice | tuple[int, int]
    base: int
    id_offset: int  # a row's id in the chunk: its position + id_offset
    sources: list[RowSource]
    segments: Callable[[Buffer], tuple[np.ndarray, list[memoryview]]]  # ids, state segments
    hand: Callable[[Buffer], None]  # the filled buffer to the sink
    outs: list[memoryview] | None = None  # once the copy took its buffer
    ids: np.ndarray | None = None
    # Rows lookups saved aside before the chunk had a buffer: (slots ascending, one array per
    # state), each possibly holding other chunks' rows too
    early: list[tuple[np.ndarray, list[np.ndarray]]] = field(default_factory=list)

    @property
    def count(self) -> int:
        if isinstance(self.rows, tuple):
            return self.rows[1]
        return self.rows.stop - self.rows.start

    def positions(self) -> np.ndarray:
        if isinstance(self.rows, tuple):
            first, count = self.rows
            return np.arange(first, first + count, dtype=np.int64)
        return self.rows.get()

    def copy(self) -> ChunkCopy:
        """What :func:`copy_chunks` copies of it: every row not copied yet (by a lookup), and
        its ids."""
        assert self.ids is not None and self.outs is not None
        rows = self.positions()
        return ChunkCopy(
            rows, self.sources, self.outs, self.ids, self.id_offset, self.slot0, self.base
        )

    def put_early(self) -> None:
        """Put the rows lookups saved aside (before it had a buffer) into the chunk's buffer."""
        assert self.outs is not None
        for slots, saved in self.early:
            lo, hi = np.searchsorted(slots, [self.slot0, self.slot0 + self.count])
            at = slots[lo:hi] - self.slot0
            for (_, nbytes), out, rows_bytes in zip(self.sources, self.outs, saved, strict=True):
                np.frombuffer(out, np.uint8).reshape(-1, nbytes)[at] = rows_bytes[lo:hi]
        self.early = []


class DeferredCopy:
    """The rows of one rank's part whose copy runs after the stall (see the module docstring).

    Filled by :class:`deck.trainer.writer.RankPartWriter` in the stall with :meth:`add_chunk`
    (what goes where, no buffer taken), then :meth:`seal`. Once the ranks' vote keeps the part,
    :meth:`run` on a background thread takes each chunk's buffer, copies its rows and hands it
    over, while :meth:`protect` guards the lookups; a part not kept is :meth:`drop`-ped.

    A lookup's row whose chunk has a buffer is copied into it (``copy_once``); one whose chunk
    has none yet is copied aside (its flag set to 3, so the background skips it) and put in the
    chunk when it gets its buffer. What is held aside is at most the rows the steps update while
    the part is copied (a full: at most its rows, once each); the buffers are the pool's, bounded
    by ``staging.snapshot_memory_bytes`` as before.
    """

    def __init__(
        self,
        acquire: Callable[[], Buffer],
        release: Callable[[Buffer], None],
        try_acquire: Callable[[], Buffer | None] | None = None,
        together: Callable[[], AbstractContextManager[None]] = nullcontext,
    ) -> None:
        self._acquire = acquire  # a pool buffer (may wait for the part's own writes)
        self._release = release  # gives one back
        # A free pool buffer at once or None (without it, one chunk is copied at a time)
        self._try_acquire = try_acquire
        self._together = together  # the hand-overs made inside go out together
        self._chunks: list[_Chunk] = []
        self.rows = 0
        self._flags = np.zeros(0, np.uint8)
        # A delta's rows per shard, by first position: (its rows ascending, its first slot)
        self._claim_rows: list[tuple[np.ndarray, int]] = []
        self._spans = np.zeros((0, 3), np.int64)  # a full's (first position, count, slot0)
        self._starts = np.zeros(0, np.int64)  # each chunk's first slot
        self._has_buffer = np.zeros(0, bool)  # each chunk's: set under the lock
        self._shard_of = np.zeros(0, np.int64)  # each chunk's shard (they share sources)
        # Held by protect() and by whatever gives a chunk its buffer or ends the copy: a lookup
        # sees a chunk with its buffer or without, and never writes into a buffer given back.
        self._lock = threading.Lock()
        self._open = False
        self._indexed = False

    # ---- the stall: what goes where ----------------------------------------------------------
    def add_chunk(
        self,
        rows: RowSlice | tuple[int, int],
        base: int,
        id_offset: int,
        sources: list[RowSource],
        segments: Callable[[Buffer], tuple[np.ndarray, list[memoryview]]],
        hand: Callable[[Buffer], None],
    ) -> None:
        """Rows ``rows`` (tracker positions, ascending, found when first needed; or
        ``(first, count)``: every position from ``first``) of a shard whose first row is at position ``base`` go
        to a buffer's ``segments(buf)`` after the stall, then ``hand(buf)``."""
        chunk = _Chunk(self.rows, rows, base, id_offset, sources, segments, hand)
        self._chunks.append(chunk)
        self.rows += chunk.count

    def seal(self) -> None:
        """Nothing more is added: the per-row flags. The position -> slot index is built by the
        first lookup that needs it, or by the copy (out of the stall)."""
        self._flags = np.zeros(self.rows, np.uint8)
        self._starts = np.array([c.slot0 for c in self._chunks], np.int64)
        self._has_buffer = np.zeros(len(self._chunks), bool)
        shards: dict[int, int] = {}  # chunks of one shard share its sources
        self._shard_of = np.array(
            [shards.setdefault(id(c.sources), len(shards)) for c in self._chunks], np.int64
        )
        spans = [(*c.rows, c.slot0) for c in self._chunks if isinstance(c.rows, tuple)]
        if spans:
            self._spans = np.array(spans, np.int64).reshape(-1, 3)
        self._indexed = not any(not isinstance(c.rows, tuple) for c in self._chunks)
        self._open = True

    def _index(self) -> None:
        """Find a delta's rows, shard by shard (under the lock, once): a shard's chunks are
        consecutive slices of one ascending ``source()``, so its slots follow its rows and the
        index is the rows themselves, nothing concatenated."""
        shards: dict[int, tuple[Callable[[], np.ndarray], int]] = {}
        for c in self._chunks:
            if isinstance(c.rows, RowSlice):
                shards.setdefault(id(c.rows.source), (c.rows.source, c.slot0 - c.rows.start))
        claims = [(source(), slot0) for source, slot0 in shards.values()]
        self._claim_rows = sorted(
            ((np.ascontiguousarray(rows), slot0) for rows, slot0 in claims if len(rows)),
            key=lambda c: int(c[0][0]),
        )
        self._indexed = True

    # ---- after the stall ---------------------------------------------------------------------
    def protect(self, positions: torch.Tensor) -> None:
        """Before the rows ``positions`` (tracker positions, int64, any order) are updated: every
        one of them this part still has pending is copied now (or its copy waited for)."""
        if not self._open or positions.device.type != "cpu":
            return
        if not self._indexed:
            with self._lock:
                if not self._indexed:
                    self._index()
        # Copied (2) or saved aside (3) already: nothing to do (most rows, once the copy ran);
        # found natively, the GIL given up once (numpy's searches give it up at every call)
        slots, pos = pending_slots(
            positions.detach().numpy(), self._claim_rows, self._spans, self._flags
        )
        if not len(slots):
            return
        # Ascending slots: the chunks (and their shards) come in runs, no grouping sort needed
        chunk_of = np.searchsorted(self._starts, slots, side="right") - 1
        with self._lock:
            if not self._open:
                return
            # Chunks with a buffer (the one being copied, few): copy_once, racing the copy
            has = self._has_buffer[chunk_of]
            at = np.flatnonzero(has)
            for c, lo, hi in _runs(chunk_of[at]):
                ch = self._chunks[c]
                mine = at[lo:hi]
                copy_once(
                    np.ascontiguousarray(pos[mine]),
                    ch.sources,
                    ch.outs or [],
                    self._flags,
                    ch.slot0,
                    slots[mine],
                    base=ch.base,
                )
            # No buffer yet (the copy touches no flag of such a chunk before it has one): saved
            # aside, one gather per shard for all its rows
            at = np.flatnonzero(~has)
            for _, lo, hi in _runs(self._shard_of[chunk_of[at]]):
                mine = at[lo:hi]
                first = self._chunks[int(chunk_of[mine[0]])]
                local = pos[mine] - first.base
                entry = (slots[mine], [src.reshape(-1, b)[local] for src, b in first.sources])
                for c, _, _ in _runs(chunk_of[mine]):
                    self._chunks[c].early.append(entry)
                self._flags[slots[mine]] = 3

    def run(self, done: Callable[[], None]) -> None:
        """Copy every chunk: take its buffer, copy its rows not copied yet, hand it over; in
        batches of the chunks whose buffers are free at once (up to :data:`COPY_BATCH`), each
        copied in one native call (the GIL given up once) and handed over together.
        ``done()`` is called once no row can be written any more (the guard comes off). On
        failure the buffers taken and not handed over go back, and it raises."""
        held: list[Buffer] = []  # taken, not handed over yet (in chunk order)
        try:
            with self._lock:
                if not self._indexed:
                    self._index()
            if FILL_GATE is not None:
                FILL_GATE.wait()
            first = 0
            while first < len(self._chunks):
                batch = self._take(first, held)
                for _ in batch:
                    failpoint("writer.chunk.before_fill")  # the moments the copy in the stall has
                copy_chunks(self._flags, [chunk.copy() for chunk in batch])
                with self._together():
                    for chunk in batch:
                        chunk.put_early()
                        chunk.hand(held.pop(0))
                        failpoint("writer.chunk.after_submit")
                first += len(batch)
            self._close(done)
        except BaseException:
            self._close(done)
            for buf in held:
                self._release(buf)
            raise

    def _take(self, first: int, held: list[Buffer]) -> list[_Chunk]:
        """Buffers for the chunks from ``first`` on, into ``held``: the first may wait, the
        others only those free now (never waiting while holding buffers not handed over: those
        come back only once handed). Returns the chunks that got one (lookups now copy their
        rows into it)."""
        held.append(self._acquire())
        wanted = min(COPY_BATCH, len(self._chunks) - first)
        while self._try_acquire is not None and len(held) < wanted:
            buf = self._try_acquire()
            if buf is None:
                break
            held.append(buf)
        batch = self._chunks[first : first + len(held)]
        views = [chunk.segments(buf) for chunk, buf in zip(batch, held, strict=True)]
        with self._lock:
            for chunk, (ids, outs) in zip(batch, views, strict=True):
                chunk.ids, chunk.outs = ids, outs
            self._has_buffer[first : first + len(batch)] = True
        return batch

    def drop(self) -> None:
        """The part will not be committed (nothing ran, no buffer was taken)."""
        self._open = False

    def _close(self, done: Callable[[], None]) -> None:
        with self._lock:
            was, self._open = self._open, False
        if was:
            done()


def _runs(keys: np.ndarray) -> list[tuple[int, int, int]]:
    """``(key, start, stop)`` of each run of equal values of ``keys`` (non-decreasing)."""
    if not len(keys):
        return []
    cut = (np.flatnonzero(keys[1:] != keys[:-1]) + 1).tolist()
    return [(int(keys[a]), a, b) for a, b in zip([0, *cut], [*cut, len(keys)], strict=True)]
