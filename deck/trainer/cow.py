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
from dataclasses import dataclass, field

import numpy as np
import torch

from deck.failpoints import failpoint
from deck.format.chunks import Buffer
from deck.kernels.gather import RowSource, copy_once

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

    def fill(self, flags: np.ndarray) -> None:
        """Copy every row not copied yet (by a lookup) into the chunk's buffer."""
        assert self.ids is not None and self.outs is not None
        rows = self.positions()
        np.add(rows, self.id_offset, out=self.ids, dtype=np.int64)
        copy_once(rows, self.sources, self.outs, flags, self.slot0, base=self.base)
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

    def __init__(self, acquire: Callable[[], Buffer], release: Callable[[Buffer], None]) -> None:
        self._acquire = acquire  # a pool buffer (may wait for the part's own writes)
        self._release = release  # gives one back
        self._chunks: list[_Chunk] = []
        self.rows = 0
        self._flags = np.zeros(0, np.uint8)
        # A delta's rows per shard: (first position, last, its rows ascending, its first slot)
        self._claims: list[tuple[int, int, np.ndarray, int]] = []
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
        claims = []
        for source, slot0 in shards.values():
            rows = source()
            if len(rows):
                claims.append((int(rows[0]), int(rows[-1]), rows, slot0))
        self._claims = sorted(claims, key=lambda c: c[0])
        self._indexed = True

    # ---- after the stall ---------------------------------------------------------------------
    def _slots(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The part's slots of the positions in ``pos`` it holds (ascending, each once), and
        those positions."""
        found = []
        pos = np.sort(pos)  # each once, in order: the search then walks the index in order
        pos = pos[np.concatenate(([True], pos[1:] != pos[:-1]))] if len(pos) else pos
        for lowest, highest, rows, rows_slot0 in self._claims:
            lo, hi = np.searchsorted(pos, [lowest, highest + 1]).tolist()
            if lo == hi:
                continue
            sub = pos[lo:hi]  # within the shard's rows: found below its last, or not at all
            at = np.searchsorted(rows, sub.astype(rows.dtype, copy=False))
            hit = rows[at] == sub
            found.append(np.stack([rows_slot0 + at[hit], sub[hit]]))
        if len(self._spans):
            first, count, slot0 = self._spans.T
            k = np.searchsorted(first, pos, side="right") - 1
            ok = k >= 0
            ok[ok] &= pos[ok] < first[k[ok]] + count[k[ok]]
            found.append(np.stack([slot0[k[ok]] + pos[ok] - first[k[ok]], pos[ok]]))
        if not found:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        both = np.concatenate(found, axis=1)
        if (np.diff(both[0]) < 0).any():
            # By slot, so grouped by chunk (a delta's slots follow its positions when its
            # shards were written in the order of the tracker's positions: no sort then)
            both = both[:, np.argsort(both[0], kind="stable")]
        return both[0], both[1]

    def protect(self, positions: torch.Tensor) -> None:
        """Before the rows ``positions`` (tracker positions, int64, any order) are updated: every
        one of them this part still has pending is copied now (or its copy waited for)."""
        if not self._open or positions.device.type != "cpu":
            return
        if not self._indexed:
            with self._lock:
                if not self._indexed:
                    self._index()
        slots, pos = self._slots(positions.detach().numpy().astype(np.int64, copy=False))
        if not len(slots):
            return
        # Copied (2) or saved aside (3) already: nothing to do (most rows, once the copy ran)
        live = self._flags[slots]
        todo = live < 2
        if not todo.any():
            return
        slots, pos = slots[todo], pos[todo]
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
        """Copy every chunk: take its buffer, copy its rows not copied yet, hand it over.
        ``done()`` is called once no row can be written any more (the guard comes off). On
        failure the buffer taken and not handed over goes back, and it raises."""
        held: Buffer | None = None
        try:
            with self._lock:
                if not self._indexed:
                    self._index()
            if FILL_GATE is not None:
                FILL_GATE.wait()
            for i, chunk in enumerate(self._chunks):
                held = self._acquire()
                ids, outs = chunk.segments(held)
                with self._lock:
                    chunk.ids, chunk.outs = ids, outs
                    self._has_buffer[i] = True
                failpoint("writer.chunk.before_fill")  # the moments the copy in the stall has
                chunk.fill(self._flags)
                buf, held = held, None
                chunk.hand(buf)
                failpoint("writer.chunk.after_submit")
            self._close(done)
        except BaseException:
            self._close(done)
            if held is not None:
                self._release(held)
            raise

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
