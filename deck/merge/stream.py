"""The streaming merge of one partition's rows: newest wins, one chunk per input in memory.

:class:`ShardStream` reads one input's shard chunk by chunk (verified, ascending row ids);
:func:`merge_rows` merges such streams newest-wins into ascending rows; :class:`ChunkOut` cuts
the result into chunks like the trainer's writer and writes them. A file of an input that fails
verification raises :class:`InputDamaged` (the worker may quarantine that input).
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable, Sequence

import torch

from deck.errors import CorruptCheckpointError, DeckError, NotFoundError
from deck.failpoints import failpoint
from deck.format.chunk_io import chunk_where, read_chunks
from deck.format.chunks import ChunkLayout, aligned_buffer, decode_chunk, encode_chunk
from deck.format.manifest import CheckpointManifest, ChunkRecord, ShardRecord
from deck.format.rowindex import build_index
from deck.storage import Storage

Rows = tuple[torch.Tensor, dict[str, torch.Tensor]]  # (ascending ids, state name -> rows)


class InputDamaged(Exception):
    """An input checkpoint's file failed verification (the input may need quarantine)."""

    def __init__(self, m: CheckpointManifest, error: DeckError):
        super().__init__(str(error))
        self.manifest = m
        self.error = error


class ShardStream:
    """The rows of one shard of one input, in ascending global id, one chunk in memory."""

    def __init__(self, storage: Storage, m: CheckpointManifest, rec: ShardRecord, order: int):
        self.storage = storage
        self.m = m
        self.rec = rec
        self.order = order
        self.i = 0
        self.pos = 0
        self.last = -1
        self.ids = torch.empty(0, dtype=torch.int64)
        self.arrays: dict[str, torch.Tensor] = {}
        self.bytes_read = 0
        self.done = False
        self._load()

    def _load(self) -> None:
        while self.i < len(self.rec.chunks):
            c = self.rec.chunks[self.i]
            self.i += 1
            where = f"{chunk_where(self.storage, self.m.folder, c)} (table {self.rec.table})"
            try:
                # One chunk at a time (a ranged read of a bundled one): every input stream holds
                # a single chunk in memory, whatever the bundle size.
                _c, _at, data = next(read_chunks(self.storage, self.m.folder, [c]))
                arrays = decode_chunk(data, c, where)
            except NotFoundError as e:
                raise InputDamaged(self.m, CorruptCheckpointError(f"{where}: missing")) from e
            except CorruptCheckpointError as e:
                raise InputDamaged(self.m, e) from e
            self.bytes_read += len(data)
            ids = arrays["ids"]
            if ids.numel() == 0:
                continue
            self._check(ids, arrays, where)
            self.ids, self.arrays, self.pos = ids, arrays, 0
            self.last = int(ids[-1])
            return
        self.done = True
        self.ids, self.arrays = torch.empty(0, dtype=torch.int64), {}

    def _check(self, ids: torch.Tensor, arrays: dict[str, torch.Tensor], where: str) -> None:
        """A chunk's ids ascend past the previous chunk's, inside the shard; every state is in."""
        if (
            int(ids[0]) <= self.last
            or (ids.numel() > 1 and not bool(torch.all(ids[1:] > ids[:-1])))
            or int(ids[0]) < self.rec.row_offset
            or int(ids[-1]) >= self.rec.row_offset + self.rec.rows
        ):
            raise InputDamaged(
                self.m,
                CorruptCheckpointError(
                    f"{where}: row ids are not ascending within the shard's range"
                ),
            )
        missing = [n for n in self.rec.states if n not in arrays]
        if missing:
            raise InputDamaged(self.m, CorruptCheckpointError(f"{where}: no segment(s) {missing}"))

    @property
    def head(self) -> int:
        """The id of the next row (the stream is not done)."""
        return int(self.ids[self.pos])

    def take_upto(self, cutoff: int) -> Rows:
        """Rows with id <= ``cutoff`` from the current chunk (moving on when it is used up)."""
        rest = self.ids[self.pos :]
        n = int(torch.searchsorted(rest, torch.tensor([cutoff]), right=True)[0])
        lo, hi = self.pos, self.pos + n
        out = (self.ids[lo:hi], {k: self.arrays[k][lo:hi] for k in self.rec.states})
        self.pos = hi
        if self.pos >= self.ids.numel():
            self._load()
        return out


_thread_buffers = threading.local()


def _chunk_buffer(size: int) -> memoryview:
    """This thread's page-aligned chunk buffer of at least ``size`` bytes, reused by every output
    shard: fresh pages cost a fault each (as much as the write itself on the project's VMs), and
    aligned chunks are written with O_DIRECT to local storage."""
    buf: memoryview | None = getattr(_thread_buffers, "buf", None)
    if buf is None or len(buf) < size:
        buf = _thread_buffers.buf = aligned_buffer(size)
    return buf


class ChunkOut:
    """Cuts merged rows into chunks like the trainer's writer and writes them (through this
    thread's chunk buffer: one ChunkOut at a time per thread)."""

    def __init__(
        self,
        storage: Storage,
        folder: str,
        rel_dir: str,
        rec: ShardRecord,
        row_bytes: int,
        chunk_bytes: int,
    ):
        self.storage = storage
        self.folder = folder
        self.rel_dir = rel_dir
        self.rec = rec
        overhead = ChunkLayout.overhead(1 + len(rec.states))
        self.per_chunk = max(1, (chunk_bytes - overhead) // max(1, row_bytes))
        self.pending: list[Rows] = []
        self.pending_rows = 0
        self.chunks: list[ChunkRecord] = []
        self.rows = 0
        self.bytes_written = 0
        self._buf = _chunk_buffer(chunk_bytes)

    def add(self, ids: torch.Tensor, states: dict[str, torch.Tensor]) -> None:
        if ids.numel() == 0:
            return
        self.pending.append((ids, states))
        self.pending_rows += int(ids.numel())
        while self.pending_rows >= self.per_chunk:
            self._flush(self.per_chunk)

    def close(self) -> None:
        if self.pending_rows:
            self._flush(self.pending_rows)

    def _flush(self, n: int) -> None:
        if len(self.pending) == 1:  # the common case: no copy before encoding
            ids, states = self.pending[0]
        else:
            ids = torch.cat([p[0] for p in self.pending])
            states = {k: torch.cat([p[1][k] for p in self.pending]) for k in self.rec.states}
        rel = (
            f"{self.rel_dir}/c{self.rec.col_offset}-r{self.rec.row_offset}-{len(self.chunks):06d}"
            ".chunk"
        )
        arrays = [("ids", ids[:n]), *((k, states[k][:n]) for k in self.rec.states)]
        buf, chunk = encode_chunk(rel, arrays, out=self._buf)
        chunk = chunk.model_copy(update={"index": build_index(ids[:n])})
        self.storage.put(f"{self.folder}/{rel}", buf)
        failpoint("merger.chunk.after_put")
        self.chunks.append(chunk)
        self.rows += n
        self.bytes_written += len(buf)
        rest = self.pending_rows - n
        self.pending = [(ids[n:], {k: v[n:] for k, v in states.items()})] if rest else []
        self.pending_rows = rest


def merge_rows(
    streams: Sequence[ShardStream], out: Callable[[torch.Tensor, dict[str, torch.Tensor]], None]
) -> None:
    """Merge ascending row streams (oldest first) newest-wins, emitting ascending rows.

    Each round takes, from every stream, the rows up to the smallest "last id of the current
    chunk" among them, so at least one chunk is used up per round and memory stays at one chunk
    per stream plus one round's output. When the oldest stream holds every row of the shard (the
    full of a new full), newer rows are scattered over a copy of its rows instead of sorted.

    A round only visits the streams that have a row up to its cutoff (two heaps: next row id,
    last id of the current chunk). A merger full made across many skipped fulls has one input
    per delta: visiting every stream in every round was quadratic in their number.
    """
    dense_first = bool(streams) and streams[0].rec.full
    # (next row id, input) of every stream with rows left, and (last id of its current chunk,
    # input); an entry of the second heap whose stream moved past that chunk is dropped lazily.
    heads = [(st.head, i) for i, st in enumerate(streams) if not st.done]
    lasts = [(st.last, i) for i, st in enumerate(streams) if not st.done]
    heapq.heapify(heads)
    heapq.heapify(lasts)
    while heads:
        while streams[lasts[0][1]].done or streams[lasts[0][1]].last != lasts[0][0]:
            heapq.heappop(lasts)
        cutoff = lasts[0][0]
        # Streams whose next row is past the cutoff have nothing for this round.
        taking = []
        while heads and heads[0][0] <= cutoff:
            taking.append(heapq.heappop(heads)[1])
        taking.sort()  # oldest first: newest wins
        pieces = []
        for i in taking:
            st = streams[i]
            was = st.last
            pieces.append((st, *st.take_upto(cutoff)))
            if not st.done:
                heapq.heappush(heads, (st.head, i))
                if st.last != was:  # moved on to its next chunk
                    heapq.heappush(lasts, (st.last, i))
        if len(pieces) == 1:
            _, ids, states = pieces[0]
            out(ids, states)
        elif pieces and dense_first and pieces[0][0] is streams[0]:
            out(*_onto_full(streams[0], pieces[0][1:], [p[1:] for p in pieces[1:]]))
        elif pieces:
            out(*_newest_wins([p[1:] for p in pieces]))


def _onto_full(full: ShardStream, base: Rows, newer: list[Rows]) -> Rows:
    """``newer`` rows (oldest first) scattered over a copy of ``base``, the rows of a stream that
    holds every row of the shard: every newer id has its slot in ``base``."""
    ids, states = base
    merged = {k: v.clone() for k, v in states.items()}
    for newer_ids, newer_states in newer:
        # Every id in (previous cutoff, cutoff] is in the full's piece: find its slot.
        pos = torch.searchsorted(ids, newer_ids)
        if pos.numel() and (
            int(pos[-1]) >= ids.numel() or not bool(torch.equal(ids[pos], newer_ids))
        ):
            raise CorruptCheckpointError(
                f"{full.storage.describe(full.m.folder)}: table "
                f"{full.rec.table} is marked full but misses rows of a newer input"
            )
        for k, v in merged.items():
            v.index_copy_(0, pos, newer_states[k])
    return ids, merged


def _newest_wins(pieces: list[Rows]) -> Rows:
    """The union of ``pieces`` (oldest first), ascending, the newest version of each row."""
    ids = torch.cat([p[0] for p in pieces])
    # Stable sort keeps equal ids in stream order (oldest first): the last of each run of equal
    # ids is the newest version of that row.
    sorted_ids, order = torch.sort(ids, stable=True)
    keep = torch.ones_like(sorted_ids, dtype=torch.bool)
    keep[:-1] = sorted_ids[1:] != sorted_ids[:-1]
    idx = order[keep]
    names = list(pieces[0][1])
    return (
        ids.index_select(0, idx),
        {k: torch.cat([p[1][k] for p in pieces]).index_select(0, idx) for k in names},
    )


def row_bytes(rec: ShardRecord) -> int:
    """Bytes one row of this shard takes on disk (id + every state), from its chunk layout."""
    for c in rec.chunks:
        if c.rows:
            return 8 + sum(seg.nbytes // c.rows for seg in c.segments if seg.name != "ids")
    return 0
