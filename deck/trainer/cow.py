"""Copy-on-write snapshots: the stall fixes *what* a part saves; its rows are copied after it.

In the stall a checkpoint claims its rows, takes the chunk buffers they go to, captures the dense
and extra state, and the ranks vote. With copy-on-write (``staging.copy_on_write``, on by
default) the rows' bytes are not copied there: :class:`DeferredCopy` remembers, per chunk, which
rows go where, and once the vote commits the part a background thread copies them
(:meth:`DeferredCopy.run`) while training goes on.

A row must reach its chunk as it was at the checkpoint's step, so the next update of a row still
pending must wait for its copy. Every update of a tracked row comes after the lookup of the
same step (TorchRec's fused optimizer writes the rows in that step's backward), and the lookup
hook hands its rows to :meth:`DeferredCopy.protect` first: it copies the rows that are still
pending itself, or waits for the background's copy of a row it is copying. Each row has a flag,
0 (pending) -> 1 (being copied) -> 2 (copied), moved by whichever thread claims it first with
one atomic compare-and-swap in the native kernel (``copy_once`` in ``kernels/_native.c``), the
GIL released: each row is copied exactly once, before any write can reach it.

Where that order does not hold, the part is copied in the stall as before (chosen by
:func:`deck.trainer.chain.ChainWriter`, logged once): pipelines that look rows up for a batch
before the previous batch's update (TorchRec's semi-sync and prefetch pipelines), tables off the
CPU, quantised states, ``release="first_tier"``, and a part whose chunk buffers the pool cannot
hand out at once (a full, a first delta: the copy would have to wait for buffers that only its
own writes give back). Memory is unchanged: the part's chunk buffers, which the copy in the
stall filled too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from deck.failpoints import failpoint
from deck.format.chunks import Buffer
from deck.kernels.gather import RowSource, copy_once

# TEST HOOK: when set, the background copy waits for it before its first row, so a test can
# train steps while every row is still pending (only the lookups' copy-before-update runs).
FILL_GATE: threading.Event | None = None


@dataclass
class _Chunk:
    """One chunk's deferred rows: tracker positions ``rows`` (ascending) of a shard starting at
    tracker position ``base``, to slots ``slot0 ..`` of the part."""

    slot0: int
    rows: np.ndarray
    base: int
    id_offset: int  # a row's id in the chunk: its position + id_offset
    ids: np.ndarray  # the chunk's ids segment
    sources: list[RowSource]
    outs: list[memoryview]  # the chunk's state segments, in the sources' order

    def fill(self, flags: np.ndarray) -> None:
        np.add(self.rows, self.id_offset, out=self.ids, dtype=np.int64)
        copy_once(self.rows, self.sources, self.outs, flags, self.slot0, base=self.base)


class DeferredCopy:
    """The rows of one rank's part whose copy runs after the stall (see the module docstring).

    Filled by :class:`deck.trainer.writer.RankPartWriter` in the stall: :meth:`add_chunk` for
    each chunk of rows, :meth:`later` for each step that must follow the copies before it (a
    chunk's or a bundle's hand-over to the sink, with the buffer it gives away). Then
    :meth:`seal`, and on commit :meth:`run` on a background thread while :meth:`protect` guards
    the lookups; or :meth:`drop` when the part is not committed.
    """

    def __init__(self, release: Callable[[Buffer], None]) -> None:
        self._release = release  # gives a pool buffer back
        self._chunks: list[_Chunk] = []
        self._steps: list[tuple[int, Callable[[], None], Buffer | None]] = []  # after chunk i
        self._buffers: list[Buffer] = []  # every buffer the part holds, to give back on drop
        self.rows = 0
        self._flags = np.zeros(0, np.uint8)
        self._sorted = np.zeros(0, np.int64)  # every position, ascending
        self._slot_of = np.zeros(0, np.int64)  # ... and its slot
        self._starts = np.zeros(0, np.int64)  # each chunk's first slot
        # Held by protect() and by whoever ends the copy: a copy-before-update never writes
        # into a buffer given back after a failure.
        self._lock = threading.Lock()
        self._open = False

    # ---- the stall: what goes where ----------------------------------------------------------
    def add_chunk(
        self,
        rows: np.ndarray,
        base: int,
        id_offset: int,
        ids: np.ndarray,
        outs: list[memoryview],
        sources: list[RowSource],
    ) -> None:
        """Rows ``rows`` (tracker positions, ascending; a view is kept) of a shard whose first
        row is at position ``base`` go to ``outs`` (and their ids to ``ids``) after the stall."""
        self._chunks.append(_Chunk(self.rows, rows, base, id_offset, ids, sources, outs))
        self.rows += len(rows)

    def hold(self, buf: Buffer) -> None:
        """The part took pool buffer ``buf``: given back by :meth:`drop`, or by a step's
        hand-over."""
        self._buffers.append(buf)

    def later(self, step: Callable[[], None], gives: Buffer | None = None) -> None:
        """Run ``step`` once every chunk added so far is copied (``gives``: the buffer it hands
        over, which the part no longer gives back itself)."""
        self._steps.append((len(self._chunks), step, gives))

    def seal(self) -> None:
        """Nothing more is added: build the per-row flags and the position -> slot index."""
        self._flags = np.zeros(self.rows, np.uint8)
        self._starts = np.array([c.slot0 for c in self._chunks], np.int64)
        if self._chunks:
            positions = np.concatenate([c.rows.astype(np.int64, copy=False) for c in self._chunks])
            order = np.argsort(positions, kind="stable")
            self._sorted, self._slot_of = positions[order], order.astype(np.int64)
        self._open = True

    # ---- after the stall ---------------------------------------------------------------------
    def protect(self, positions: torch.Tensor) -> None:
        """Before the rows ``positions`` (tracker positions, int64, any order) are updated: every
        one of them this part still has pending is copied now (or its copy waited for)."""
        if not self._open or positions.device.type != "cpu" or not len(self._sorted):
            return
        pos = positions.detach().numpy()
        at = np.searchsorted(self._sorted, pos)
        at[at == len(self._sorted)] = 0
        hit = self._sorted[at] == pos
        if not hit.any():
            return
        slots = np.unique(self._slot_of[at[hit]])  # ascending: grouped by chunk
        chunk_of = np.searchsorted(self._starts, slots, side="right") - 1
        cuts = np.flatnonzero(np.diff(chunk_of)) + 1
        with self._lock:
            if not self._open:
                return
            for group in np.split(np.arange(len(slots)), cuts):
                c = self._chunks[int(chunk_of[group[0]])]
                mine = slots[group]
                rows = np.ascontiguousarray(c.rows[mine - c.slot0])
                copy_once(rows, c.sources, c.outs, self._flags, c.slot0, mine, base=c.base)

    def run(self, done: Callable[[], None]) -> None:
        """Copy every row not copied yet, running each :meth:`later` step once the chunks before
        it are copied; ``done()`` is called first once no row can be written any more (the
        guard comes off). On failure the buffers not handed over go back, and it raises."""
        steps = iter(self._steps)
        step = next(steps, None)
        handed = 0
        try:
            if FILL_GATE is not None:
                FILL_GATE.wait()
            for i, chunk in enumerate(self._chunks):
                while step is not None and step[0] <= i:
                    step[1]()
                    handed += 1
                    step = next(steps, None)
                failpoint("cow.fill.chunk")
                chunk.fill(self._flags)
            self._close(done)
            while step is not None:
                step[1]()
                handed += 1
                step = next(steps, None)
        except BaseException:
            self._close(done)
            given = {id(s[2]) for s in self._steps[:handed] if s[2] is not None}
            for buf in self._buffers:
                if id(buf) not in given:
                    self._release(buf)
            raise

    def drop(self) -> None:
        """The part will not be committed (nothing ran): every buffer it took goes back."""
        self._open = False
        for buf in self._buffers:
            self._release(buf)
        self._buffers = []

    def _close(self, done: Callable[[], None]) -> None:
        with self._lock:
            was, self._open = self._open, False
        if was:
            done()
