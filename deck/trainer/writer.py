"""Writing one rank's part of a checkpoint, and the commit record.

Order (DCP's lesson): data files first, then the rank part manifest, then -- once every rank's
part is durable -- the checkpoint manifest, by rank 0, as a single atomic put.

The training thread only copies rows into the sink's buffers (the snapshot). What describes a
file -- checksums, the row index of a chunk, the records and the rank manifest built from them --
is computed by the thread that writes the file, right before it writes it, while the buffer is
still held (:class:`Sink`): training does not wait for it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch

from deck.errors import CheckpointError, ConfigError, DeckError
from deck.failpoints import failpoint
from deck.format import treecodec
from deck.format.checksum import checksum
from deck.format.chunks import DTYPES, Buffer, ChunkLayout, build_chunk, dtype_name, segment_view
from deck.format.commit import commit_record, first_missing_file, rank_ref
from deck.format.commit_log import put_record
from deck.format.epochs import EpochWitnesses
from deck.format.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    PAGE_ALIGN,
    CheckpointManifest,
    ChunkRecord,
    Encoding,
    FileRecord,
    Kind,
    RankManifest,
    ShardRecord,
    dump_model,
    load_model,
    rank_dir,
    rank_manifest_name,
    step_dir,
    table_dir,
)
from deck.format.quantize import (
    QUANTIZED_STATES,
    check_encoding,
    encode_rows,
    scale_name,
    stored_dtype,
)
from deck.format.rowindex import build_index
from deck.kernels.bloom import bloom_fill
from deck.kernels.gather import RowSource, gather_into, gather_rows, row_sources
from deck.model import TableShard
from deck.storage import Storage
from deck.trainer.cow import DeferredCopy, RowSlice
from deck.trainer.tracker import ClaimedSpan

DENSE_FILE = "dense.safetensors"
EXTRA_FILE = "extra.safetensors"


T = TypeVar("T")


class Later(Generic[T]):
    """A record computed by the thread that writes its file (:meth:`run`, before the write),
    read once the write is done (:meth:`get`)."""

    __slots__ = ("_make", "_value")

    def __init__(self, make: Callable[[], T]):
        self._make: Callable[[], T] | None = make
        self._value: T | None = None

    def run(self) -> None:
        if self._make is not None:
            self._value, self._make = self._make(), None

    def get(self) -> T:
        if self._value is None:
            # Its file was never handed to the writer: the checkpoint that staged the part was
            # cut short while it filled its chunks (a Ctrl-C in the training thread)
            raise DeckError(
                "a file record of this part was never made: the checkpoint that staged it was "
                "cut short (interrupted) before all its files were written, so the part is not "
                "committed; the next checkpoint is a full"
            )
        return self._value


@dataclasses.dataclass(frozen=True)
class ChunkSpec:
    """What the record of one chunk is made from besides its bytes (:func:`chunk_record`):
    plain data, so that another process (a staging process) can make it from a shared buffer.
    ``key``: the chunk's number in its part (:class:`ShardPlan` lists them)."""

    key: int
    rel: str
    rows: int
    segments: tuple[tuple[str, str, tuple[int, ...]], ...]  # name, dtype name, row shape
    pad_to: int | None
    encoded: tuple[tuple[str, str, str], ...]  # state, encoding, the dtype it decodes to
    offset: int | None  # in its bundle

    @staticmethod
    def of(
        key: int,
        rel: str,
        layout: ChunkLayout,
        segs: list[tuple[str, torch.dtype, tuple[int, ...]]],
        pad_to: int | None,
        encoded: dict[str, tuple[Encoding, torch.dtype]],
        offset: int | None,
    ) -> ChunkSpec:
        return ChunkSpec(
            key,
            rel,
            layout.rows,
            tuple((n, dtype_name(d), shape) for n, d, shape in segs),
            pad_to,
            tuple((n, e, dtype_name(d)) for n, (e, d) in sorted(encoded.items())),
            offset,
        )


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """A shard's record but for its chunks' records, which ``chunks`` names by key."""

    table: str
    num_rows: int
    num_cols: int
    row_offset: int
    rows: int
    col_offset: int
    cols: int
    full: bool
    states: tuple[str, ...]
    chunks: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class PartPlan:
    """How a rank manifest is built from its files' records, as plain data (:func:`build_part`)."""

    step: int
    ckpt_id: str
    rank: int
    world_size: int
    shards: tuple[ShardPlan, ...]
    dense: str | None  # the state files' paths
    extra: str
    encoding: str | None


_layouts: dict[tuple[int, tuple[tuple[str, str, tuple[int, ...]], ...]], ChunkLayout] = {}


def chunk_record(buf: Buffer, spec: ChunkSpec) -> ChunkRecord:
    """The record of the chunk ``spec`` describes, filled in ``buf`` (as the writing thread of
    a :class:`RankPartWriter` makes it: its padding zeroed, its checksum, its row index)."""
    key = (spec.rows, spec.segments)
    layout = _layouts.get(key)
    if layout is None:  # one per shape: a layout keeps its segments' records
        if len(_layouts) > 4096:
            _layouts.clear()
        segs = [(n, DTYPES[d], tuple(shape)) for n, d, shape in spec.segments]
        layout = _layouts[key] = ChunkLayout(spec.rows, segs)
    encoded: dict[str, tuple[Encoding, torch.dtype]] = {
        n: (e, DTYPES[d])  # type: ignore[misc]
        for n, e, d in spec.encoded
    }
    if spec.offset is not None:  # a chunk of a bundle: its bytes in the bundle's buffer
        size = layout.nbytes if spec.pad_to is None else max(spec.pad_to, layout.nbytes)
        buf = memoryview(buf)[spec.offset : spec.offset + size]
    return _chunk_record(buf, spec.rel, layout, spec.pad_to, encoded, spec.offset)


def build_part(
    plan: PartPlan, chunks: Mapping[int, ChunkRecord], files: Mapping[str, FileRecord]
) -> RankManifest:
    """The rank manifest of ``plan`` from its files' records (chunks by key, state files by
    path); :class:`DeckError` when one was never made (the part was cut short)."""
    try:
        shards = tuple(
            ShardRecord(
                table=sp.table,
                num_rows=sp.num_rows,
                num_cols=sp.num_cols,
                row_offset=sp.row_offset,
                rows=sp.rows,
                col_offset=sp.col_offset,
                cols=sp.cols,
                full=sp.full,
                states=sp.states,
                chunks=tuple(chunks[k] for k in sp.chunks),
            )
            for sp in plan.shards
        )
        dense = None if plan.dense is None else files[plan.dense]
        extra = files[plan.extra]
    except KeyError:
        raise DeckError(
            f"a file record of step {plan.step}'s part was never made: the checkpoint that "
            "staged it was cut short before all its files were written, so the part is not "
            "committed; the next checkpoint is a full"
        ) from None
    return RankManifest(
        format_version=FORMAT_VERSION,
        step=plan.step,
        ckpt_id=plan.ckpt_id,
        rank=plan.rank,
        world_size=plan.world_size,
        shards=shards,
        dense=dense,
        extra=extra,
        encoding=plan.encoding,  # type: ignore[arg-type]
    )


def _shard_plan(shard: TableShard, full: bool, keys: list[int]) -> ShardPlan:
    return ShardPlan(
        shard.table,
        shard.num_rows,
        shard.num_cols,
        shard.row_offset,
        shard.rows,
        shard.col_offset,
        shard.cols,
        full,
        tuple(shard.states),
        tuple(keys),
    )


def _run_all(items: list[Later[Any]]) -> Callable[[], None]:
    def run() -> None:
        for item in items:
            item.run()

    return run


class Sink(Protocol):
    """Where a :class:`RankPartWriter` sends files: storage directly, or the stager. Its buffers
    hold ``max(chunk_bytes, bundle_bytes)`` bytes (a chunk, or a bundle of chunks).

    Contract: ``make_record`` of a file runs before that file is written, on the writing thread,
    while ``buf`` is still the sink's; :meth:`finish_part`'s ``build`` runs after every file
    submitted before it was written (it reads their records). The same as plain data, for a
    sink that makes the records in another process: ``specs`` (a chunk file's chunks),
    ``state`` (a state file's captured tree) and ``plan`` (the rank manifest). ``wants_specs``:
    whether it reads ``specs`` (else the writer does not make them: per chunk, on the training
    thread)."""

    wants_specs: bool

    def buffer(self) -> Buffer: ...
    def submit(
        self,
        rel: str,
        buf: Buffer,
        nbytes: int,
        make_record: Callable[[], None],
        specs: tuple[ChunkSpec, ...] = (),
    ) -> None: ...
    def submit_bytes(
        self,
        rel: str,
        data: Callable[[], bytes],
        make_record: Callable[[], None],
        state: treecodec.CapturedTree | None = None,
    ) -> None: ...
    def finish_part(
        self, build: Callable[[], RankManifest], plan: PartPlan | None = None
    ) -> RankManifest | None: ...


class DirectSink:
    """Writes each file straight to storage on the calling thread (no staging): used by tools
    and tests. :meth:`finish_part` returns the rank manifest it wrote."""

    wants_specs = False

    def __init__(self, storage: Storage, step: int, buffer_bytes: int):
        self.storage = storage
        self.root = step_dir(step)
        self.buffer_bytes = buffer_bytes

    def buffer(self) -> Buffer:
        return bytearray(self.buffer_bytes)

    def submit(
        self,
        rel: str,
        buf: Buffer,
        nbytes: int,
        make_record: Callable[[], None],
        specs: tuple[ChunkSpec, ...] = (),
    ) -> None:
        make_record()
        self.storage.put(f"{self.root}/{rel}", memoryview(buf)[:nbytes])

    def submit_bytes(
        self,
        rel: str,
        data: Callable[[], bytes],
        make_record: Callable[[], None],
        state: treecodec.CapturedTree | None = None,
    ) -> None:
        make_record()
        self.storage.put(f"{self.root}/{rel}", data())

    def finish_part(
        self, build: Callable[[], RankManifest], plan: PartPlan | None = None
    ) -> RankManifest:
        part = build()
        self.storage.put(f"{self.root}/{part_manifest_path(part)}", dump_model(part))
        return part


def part_manifest_path(part: RankManifest) -> str:
    """Path of a rank part manifest relative to its step folder."""
    return f"{part.ckpt_id}/{rank_manifest_name(part.rank)}"


class RankPartWriter:
    """Writes the files of one rank for one checkpoint under ``<step>/<id>/rank-<r>/``.

    ``quantize`` (None = exact, the default and what checkpoints for recovery use) writes the
    float ``weight`` state of every chunk row-wise as ``fp16``, ``bf16`` or ``int8`` (per-row
    scale; bounds in deck.format.quantize); optimizer states stay exact. Chunk records and the rank
    manifest name the encoding, and :func:`commit` carries it into the commit record.

    ``bundle_bytes`` (0 = off) appends the chunks of this part, page-aligned and back to back,
    into bundle files ``bundle-<n:06d>.bin`` of at most that many bytes; each chunk record then
    names the bundle and its ``offset`` (readers go through :func:`deck.format.chunk_io.read_chunks`).
    A sink buffer holds one bundle, filled in place: bundling copies nothing extra.
    """

    def __init__(
        self,
        storage: Storage,
        step: int,
        ckpt_id: str,
        rank: int,
        world_size: int,
        chunk_bytes: int,
        sink: Sink | None = None,
        quantize: str | None = None,
        bundle_bytes: int = 0,
        deferred: DeferredCopy | None = None,
    ):
        if bundle_bytes and (bundle_bytes < chunk_bytes or bundle_bytes % PAGE_ALIGN):
            raise ConfigError(
                f"bundle_bytes={bundle_bytes} must be 0 or a multiple of {PAGE_ALIGN} of at least "
                f"chunk_bytes={chunk_bytes}"
            )
        self.bundle_bytes = bundle_bytes
        # Copy-on-write: the rows of CPU shards are copied after the stall, and every hand-over
        # to the sink waits for the copies before it (deck.trainer.cow).
        self.deferred = deferred
        self._bundle: Buffer | None = None
        self._bundle_fill = 0
        self._bundle_chunks: list[Later[ChunkRecord]] = []
        self._bundle_specs: list[ChunkSpec] = []
        self._bundles = 0
        self.quantize: Encoding | None = check_encoding(quantize)
        self.encoded_any = False
        self.step = step
        self.ckpt_id = ckpt_id
        self.rank = rank
        self.world_size = world_size
        self.chunk_bytes = chunk_bytes
        self.sink: Sink = sink or DirectSink(storage, step, max(chunk_bytes, bundle_bytes))
        self.part = f"{ckpt_id}/{rank_dir(rank)}"
        self.bytes_written = 0
        self.chunks_written = 0
        self.rows_written = 0
        self.plans: list[ShardPlan] = []  # the shards' records as plain data (PartPlan)

    def _spec(
        self,
        rel: str,
        layout: ChunkLayout,
        segs: list[tuple[str, torch.dtype, tuple[int, ...]]],
        pad_to: int | None,
        encoded: dict[str, tuple[Encoding, torch.dtype]],
        offset: int | None,
    ) -> tuple[ChunkSpec, ...]:
        """The next chunk's spec for a sink that reads them (none for the others)."""
        if not self.sink.wants_specs:
            return ()
        return (ChunkSpec.of(self.chunks_written, rel, layout, segs, pad_to, encoded, offset),)

    def _state_file(self, rel: str, state: treecodec.CapturedTree) -> Later[FileRecord]:
        # Encoded (safetensors + JSON) and checksummed by the thread that writes it: the capture
        # already copied the state, so the training thread only pays for that copy.
        encoded = functools.cache(state.encode)  # once: the record and the write share the bytes
        rec = Later(
            lambda: FileRecord(path=rel, nbytes=len(encoded()), checksum=checksum(encoded()))
        )
        self.sink.submit_bytes(rel, encoded, rec.run, state)
        self.bytes_written += state.nbytes
        return rec

    def write_shard(
        self,
        shard: TableShard,
        rows: torch.Tensor | ClaimedSpan | None,
        full: bool,
        base: int = 0,
    ) -> Callable[[], ShardRecord]:
        """Copy ``rows`` (ascending row indices plus ``base``, int64 or int32, or a claim's span
        of them; None = all rows) of ``shard`` into chunks.

        Rows are gathered straight into a sink buffer, one chunk at a time, so memory is the
        sink's buffers whatever the table size. Every chunk but the last is exactly
        ``chunk_bytes`` long; the last is padded to a multiple of 4096. Returns how to build the
        shard's record once its chunks are written (their records are made by the sink's
        writing thread).
        """
        encoded = self._encoded(shard)
        segs, per_chunk = self._chunking(shard, encoded)
        deferred = self._deferrable(shard, rows, encoded)
        if deferred is not None:
            return self._defer_shard(shard, rows, full, base, segs, per_chunk, deferred)
        keys: list[int] = []
        if isinstance(rows, ClaimedSpan):
            rows = rows.rows()  # copied now: its positions now
        n = shard.rows if rows is None else int(rows.numel())
        chunks: list[Later[ChunkRecord]] = []
        # A delta of CPU tables: the states are checked once here, each chunk is one native copy
        sources = (
            _row_sources(shard)
            if rows is not None
            and rows.device.type == "cpu"
            and rows.dtype in (torch.int32, torch.int64)
            and not encoded
            else None
        )
        picked = None if sources is None or rows is None else rows.numpy()
        for start, stop, layout, pad_to, nbytes, rel in self._chunks(shard, n, segs, per_chunk):
            offset = None
            buf: Buffer
            if self.bundle_bytes:
                rel, offset, buf = self._bundle_slot(nbytes)
            else:
                buf = self.sink.buffer()
            failpoint("writer.chunk.before_fill")
            if sources is not None and picked is not None:
                _gather_chunk(
                    buf, layout, picked[start:stop], shard.row_offset - base, base, sources
                )
            else:
                local = None if rows is None else rows[start:stop].long() - base
                _fill_chunk(buf, layout, shard, start, stop, local, encoded)
            rec: Later[ChunkRecord] = Later(
                functools.partial(_chunk_record, buf, rel, layout, pad_to, encoded, offset)
            )
            specs = self._spec(rel, layout, segs, pad_to, encoded, offset)
            keys.append(self.chunks_written)
            if offset is None:
                self.sink.submit(rel, buf, nbytes, rec.run, specs)
            else:
                self._bundle_fill += nbytes
                self._bundle_chunks.append(rec)
                self._bundle_specs += specs
            failpoint("writer.chunk.after_submit")
            self.bytes_written += nbytes
            self.chunks_written += 1
            chunks.append(rec)
        self.encoded_any |= bool(encoded) and n > 0
        self.rows_written += n
        self.plans.append(_shard_plan(shard, full, keys))
        return functools.partial(_shard_record, shard, full, chunks)

    def _chunks(
        self,
        shard: TableShard,
        n: int,
        segs: list[tuple[str, torch.dtype, tuple[int, ...]]],
        per_chunk: int,
    ) -> Iterator[tuple[int, int, ChunkLayout, int | None, int, str]]:
        """Each chunk of ``n`` rows of ``shard``: its rows ``[start, stop)``, layout, the size
        it is padded to (None: the last, padded to a page), its bytes and its path."""
        folder = f"{self.part}/{table_dir(shard.table)}"
        whole = ChunkLayout(per_chunk, segs)  # every chunk's but the last
        for i, start in enumerate(range(0, n, per_chunk)):
            stop = min(n, start + per_chunk)
            layout = whole if stop - start == per_chunk else ChunkLayout(stop - start, segs)
            pad_to = None if stop == n else self.chunk_bytes
            nbytes = layout.nbytes if pad_to is None else max(pad_to, layout.nbytes)
            rel = f"{folder}/c{shard.col_offset}-r{shard.row_offset}-{i:06d}.chunk"
            yield start, stop, layout, pad_to, nbytes, rel

    def _deferrable(
        self,
        shard: TableShard,
        rows: torch.Tensor | ClaimedSpan | None,
        encoded: dict[str, tuple[Encoding, torch.dtype]],
    ) -> list[RowSource] | None:
        """The checked states of ``shard`` when its rows are copied after the stall
        (:attr:`deferred`): rows the lookups guard (a tracked shard, not ``full_only``), of CPU
        tables the native kernel copies, unquantised, without bundles; else None."""
        if self.deferred is None or self.bundle_bytes or shard.full_only or encoded:
            return None
        if isinstance(rows, torch.Tensor) and (
            rows.device.type != "cpu" or rows.dtype not in (torch.int32, torch.int64)
        ):
            return None
        return _row_sources(shard)

    def _defer_shard(
        self,
        shard: TableShard,
        rows: torch.Tensor | ClaimedSpan | None,
        full: bool,
        base: int,
        segs: list[tuple[str, torch.dtype, tuple[int, ...]]],
        per_chunk: int,
        sources: list[RowSource],
    ) -> Callable[[], ShardRecord]:
        """:meth:`write_shard` of a shard whose rows the deferred copy fills: chunk by chunk,
        what goes where and how each is handed over once filled; no buffer is taken here (nor,
        for a claim's span, are its positions sorted here: the copy finds them)."""
        assert self.deferred is not None
        picked: Callable[[], np.ndarray] | None = None
        if isinstance(rows, ClaimedSpan):
            n, picked = rows.count, functools.cache(lambda: rows.rows().numpy())
        elif rows is not None:
            n, picked = int(rows.numel()), functools.partial(rows.numpy)
        else:
            n = shard.rows
        chunks: list[Later[ChunkRecord]] = []
        keys: list[int] = []
        for start, stop, layout, pad_to, nbytes, rel in self._chunks(shard, n, segs, per_chunk):
            filled: list[Buffer] = []  # the buffer, once the copy took one
            rec: Later[ChunkRecord] = Later(
                functools.partial(_filled_record, filled, rel, layout, pad_to)
            )
            specs = self._spec(rel, layout, segs, pad_to, {}, None)
            keys.append(self.chunks_written)
            self.deferred.add_chunk(
                RowSlice(picked, start, stop)
                if picked is not None
                else (base + start, stop - start),
                base,
                shard.row_offset - base,
                sources,
                functools.partial(_segments, layout=layout, rows=stop - start),
                functools.partial(_hand_over, self.sink, filled, rel, nbytes, rec, specs),
            )
            self.bytes_written += nbytes
            self.chunks_written += 1
            chunks.append(rec)
        self.rows_written += n
        self.plans.append(_shard_plan(shard, full, keys))
        return functools.partial(_shard_record, shard, full, chunks)

    def _chunking(
        self, shard: TableShard, encoded: dict[str, tuple[Encoding, torch.dtype]]
    ) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...]]], int]:
        """The segments of ``shard``'s chunks and how many rows one chunk holds (worked out once
        per shard object and configuration: it runs in the stall, twice per shard)."""
        key = ("chunking", self.chunk_bytes, self.quantize)
        if key not in shard.memo:
            shard.memo[key] = self._work_out_chunking(shard, encoded)
        return shard.memo[key]  # type: ignore[no-any-return]

    def _work_out_chunking(
        self, shard: TableShard, encoded: dict[str, tuple[Encoding, torch.dtype]]
    ) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...]]], int]:
        segs: list[tuple[str, torch.dtype, tuple[int, ...]]] = [("ids", torch.int64, ())]
        for k, t in shard.states.items():
            enc = encoded.get(k)
            segs.append((k, t.dtype if enc is None else stored_dtype(enc[0]), tuple(t.shape[1:])))
            if enc is not None and enc[0] == "int8":
                segs.append((scale_name(k), torch.float32, ()))
        row_bytes = sum(math.prod(shape) * dt.itemsize for _, dt, shape in segs)
        per_chunk = (self.chunk_bytes - ChunkLayout.overhead(len(segs))) // row_bytes
        if per_chunk < 1:
            raise ConfigError(
                f"table {shard.table}: one row takes {row_bytes} bytes, more than "
                f"staging.chunk_bytes={self.chunk_bytes}; raise chunk_bytes"
            )
        return segs, per_chunk

    def buffers_needed(self, shards: list[TableShard], counts: list[int]) -> int:
        """How many sink buffers :meth:`write_part` fills for ``counts[i]`` rows of
        ``shards[i]`` (one per chunk; with bundles, per bundle, counted generously)."""
        per_shard = [
            -(-n // self._chunking(sh, self._encoded(sh))[1])
            for sh, n in zip(shards, counts, strict=True)
        ]
        if not self.bundle_bytes:
            return sum(per_shard)
        return -(-sum(per_shard) * self.chunk_bytes // self.bundle_bytes) + 1

    def _bundle_slot(self, nbytes: int) -> tuple[str, int, memoryview]:
        """Room for a chunk of ``nbytes`` in the open bundle (a new one when it is full): the
        bundle's path, the chunk's offset in it and a view of those bytes to fill."""
        if self._bundle is not None and self._bundle_fill + nbytes > self.bundle_bytes:
            self.flush_bundle()
        if self._bundle is None:
            self._bundle = self.sink.buffer()
            self._bundle_fill = 0
        off = self._bundle_fill
        return self._bundle_path(), off, memoryview(self._bundle)[off : off + nbytes]

    def _bundle_path(self) -> str:
        return f"{self.part}/bundle-{self._bundles:06d}.bin"

    def flush_bundle(self) -> None:
        """Hand the open bundle (if any) to the sink as one file; :meth:`write_part` calls it
        after the last shard. Callers of :meth:`write_shard` alone must call it too."""
        if self._bundle is None:
            return
        make_record = _run_all(self._bundle_chunks)
        specs = tuple(self._bundle_specs)
        self.sink.submit(self._bundle_path(), self._bundle, self._bundle_fill, make_record, specs)
        self._bundle, self._bundle_chunks, self._bundle_specs = None, [], []
        self._bundles += 1

    def _encoded(self, shard: TableShard) -> dict[str, tuple[Encoding, torch.dtype]]:
        """The states of ``shard`` this writer quantises: (encoding, their dtype) by name."""
        if self.quantize is None:
            return {}
        return {
            k: (self.quantize, t.dtype)
            for k, t in shard.states.items()
            if k in QUANTIZED_STATES and t.dtype.is_floating_point and t.dim() == 2
        }

    def write_part(
        self,
        shards: list[TableShard],
        rows_for: Callable[[TableShard], torch.Tensor | ClaimedSpan | None],
        dense: dict[str, torch.Tensor] | None,
        extra: dict[str, Any],
        flat: bool = False,
    ) -> RankManifest | None:
        """Snapshot every shard, the dense (rank 0) and extra state into the sink, then hand it
        how to build the rank manifest (written after the data: directly, or once the stager has
        it all). ``rows_for(shard)``: its rows (None: all), as row indices, or with ``flat`` as
        the tracker's positions (``shard.track_base`` + row index: a claim's, read in place).
        Returns the manifest when the sink writes it at once (:class:`DirectSink`), None when it
        is completed in the background."""
        records = []
        for shard in shards:
            rows = rows_for(shard)
            base = shard.track_base if flat else 0
            records.append(self.write_shard(shard, rows, full=rows is None, base=base))
        self.flush_bundle()
        failpoint("writer.part.before_state_files")
        dense_rec = (
            self._state_file(f"{self.part}/{DENSE_FILE}", treecodec.capture(dense, "dense state"))
            if dense is not None
            else None
        )
        extra_rec = self._state_file(
            f"{self.part}/{EXTRA_FILE}", treecodec.capture(extra, "optimizer/user state")
        )
        encoding = self.quantize if self.encoded_any else None

        def build() -> RankManifest:
            return RankManifest(
                format_version=FORMAT_VERSION,
                step=self.step,
                ckpt_id=self.ckpt_id,
                rank=self.rank,
                world_size=self.world_size,
                shards=tuple(r() for r in records),
                dense=None if dense_rec is None else dense_rec.get(),
                extra=extra_rec.get(),
                encoding=encoding,
            )

        plan = PartPlan(
            self.step,
            self.ckpt_id,
            self.rank,
            self.world_size,
            tuple(self.plans),
            None if dense_rec is None else f"{self.part}/{DENSE_FILE}",
            f"{self.part}/{EXTRA_FILE}",
            encoding,
        )
        failpoint("writer.part.before_manifest")
        return self.sink.finish_part(build, plan)


def _row_sources(shard: TableShard) -> list[RowSource] | None:
    """:func:`row_sources` of ``shard``'s states, checked once per shard object (tens of
    microseconds per shard in every checkpoint stall otherwise)."""
    if "row_sources" not in shard.memo:
        shard.memo["row_sources"] = row_sources(list(shard.states.values()))
    return shard.memo["row_sources"]  # type: ignore[no-any-return]


def _chunk_record(
    buf: Buffer,
    rel: str,
    layout: ChunkLayout,
    pad_to: int | None,
    encoded: dict[str, tuple[Encoding, torch.dtype]],
    offset: int | None,
) -> ChunkRecord:
    """The record of a filled chunk (zeroes its padding): checksum, segments, row index. Runs on
    the spool writer beside training: the ids are read through numpy, not torch, whose every op
    gives the GIL back and takes it again (each take a chance to find the training thread in its
    Python and wait, slower each time: docs/benchmarks-history.md, "The steps after a delta,
    tenth pass")."""
    rec = build_chunk(buf, rel, layout, [None] * len(layout.segments), pad_to, encoded)
    return rec.model_copy(
        update={
            "index": build_index(_ids(buf, layout, layout.rows), fill=bloom_fill),
            "offset": offset,
        }
    )


_side_streams: dict[Any, Any] = {}


def _gather_chunk(
    buf: Buffer,
    layout: ChunkLayout,
    picked: np.ndarray,
    id_offset: int,
    base: int,
    sources: list[RowSource],
) -> None:
    """:func:`_fill_chunk` of selected rows (``picked - base``) of CPU tables whose states were
    checked once (:func:`row_sources`, in the layout's segment order after ``ids``): the ids
    (``picked + id_offset``), then every state's rows in one native pass straight into the
    buffer's segments."""
    ids, outs = _segments(buf, layout, len(picked))
    np.add(picked, id_offset, out=ids, dtype=np.int64)
    gather_into(picked, sources, outs, base)


def _shard_record(shard: TableShard, full: bool, chunks: list[Later[ChunkRecord]]) -> ShardRecord:
    return ShardRecord(
        table=shard.table,
        num_rows=shard.num_rows,
        num_cols=shard.num_cols,
        row_offset=shard.row_offset,
        rows=shard.rows,
        col_offset=shard.col_offset,
        cols=shard.cols,
        full=full,
        states=tuple(shard.states),
        chunks=tuple(c.get() for c in chunks),
    )


def _filled_record(
    filled: list[Buffer], rel: str, layout: ChunkLayout, pad_to: int | None
) -> ChunkRecord:
    return _chunk_record(filled[0], rel, layout, pad_to, {}, None)


def _hand_over(
    sink: Sink,
    filled: list[Buffer],
    rel: str,
    nbytes: int,
    rec: Later[ChunkRecord],
    specs: tuple[ChunkSpec, ...],
    buf: Buffer,
) -> None:
    """A deferred chunk is filled in ``buf``: its record is made from it, and the sink has it."""
    filled.append(buf)
    sink.submit(rel, buf, nbytes, rec.run, specs)


def _ids(buf: Buffer, layout: ChunkLayout, rows: int) -> np.ndarray:
    """The ids segment of a chunk of ``rows`` rows in ``buf`` (the layout's first)."""
    return np.frombuffer(buf, np.int64, rows, layout.segments[0][3])


def _segments(buf: Buffer, layout: ChunkLayout, rows: int) -> tuple[np.ndarray, list[memoryview]]:
    """The ids segment of a chunk of ``rows`` rows in ``buf`` and its state segments' bytes (in
    the layout's order after ``ids``)."""
    view = memoryview(buf)
    states = [view[at : at + nbytes] for _, _, _, at, nbytes in layout.segments[1:]]
    return _ids(buf, layout, rows), states


def _fill_chunk(
    buf: Buffer,
    layout: ChunkLayout,
    shard: TableShard,
    start: int,
    stop: int,
    local: torch.Tensor | None,
    encoded: dict[str, tuple[Encoding, torch.dtype]],
) -> None:
    """Gather rows ``[start, stop)`` of the selection (``local``; None = all rows) into ``buf``.

    CPU tables: one gather of every state straight into the buffer
    (:func:`deck.kernels.gather.gather_rows`, which prefetches the rows ahead). GPU tables: the
    gather runs on the table's device on a side stream that first waits for the training stream,
    then copies into the (pinned) buffer without blocking training kernels; one sync per chunk.
    States in ``encoded`` are gathered, then quantised (on the table's device) into the buffer.
    """
    ids = segment_view(buf, layout, "ids")
    if local is None:
        torch.arange(start + shard.row_offset, stop + shard.row_offset, out=ids)
    else:
        torch.add(local.cpu(), shard.row_offset, out=ids)
    device = next(iter(shard.states.values())).device
    if device.type == "cpu":
        plain = []
        for name, t in shard.states.items():
            if name in encoded:
                src = t[start:stop] if local is None else t.index_select(0, local)
                _put_encoded(buf, layout, name, src, encoded[name][0], shard.table)
            elif local is None:
                segment_view(buf, layout, name).copy_(t[start:stop])
            else:
                plain.append((t, segment_view(buf, layout, name)))
        if local is not None and plain:
            gather_rows(local, plain)  # every state of a row in one pass
        return
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        idx = None if local is None else local.to(device, non_blocking=True)
        for name, t in shard.states.items():
            src = t[start:stop] if idx is None else t.index_select(0, idx)
            if name in encoded:
                _put_encoded(buf, layout, name, src, encoded[name][0], shard.table)
            else:
                segment_view(buf, layout, name).copy_(src, non_blocking=True)
    stream.synchronize()


def _put_encoded(
    buf: Buffer, layout: ChunkLayout, name: str, src: torch.Tensor, enc: Encoding, table: str
) -> None:
    values, scale = encode_rows(src, enc, f"table {table}")
    segment_view(buf, layout, name).copy_(values)
    if scale is not None:
        segment_view(buf, layout, scale_name(name)).copy_(scale)


def commit(
    storage: Storage,
    *,
    step: int,
    ckpt_id: str,
    kind: Kind,
    parent: tuple[int, str] | None,
    base: int,
    epoch: int,
    world_size: int,
    deck_version: str,
    own: tuple[RankManifest, bytes] | None = None,
    fence: Callable[[], None] | None = None,
    read: Mapping[int, bytes] | None = None,
    witnesses: EpochWitnesses | None = None,
) -> CheckpointManifest:
    """Rank 0, after every rank's part is durable: verify the parts and write the commit record.
    ``own``: rank 0's part manifest and the bytes this process just wrote for it (not read
    back); every other rank's part is verified from the bytes in ``read`` (rank -> its part
    manifest as the caller read it from ``storage``) or read from ``storage``. ``fence`` (the
    writer lease's :meth:`~deck.trainer.lease.Lease.check`) runs right before the record is
    written and raises when this job may no longer commit. Before it, one listing of the step's
    folder checks that every file the parts name is there (:class:`CheckpointError` if not).
    ``witnesses``: the writer's epoch witnesses (:mod:`deck.format.epochs`): the witness of
    ``epoch`` is put before its first commit record (None: none, a store readers then read
    record by record where the newest epoch matters)."""
    root = step_dir(step)
    refs = []
    parts = []
    encodings: set[Encoding] = set()
    for rank in range(world_size):
        rel = f"{ckpt_id}/{rank_manifest_name(rank)}"
        if rank == 0 and own is not None:
            part, data = own
        else:
            data = read[rank] if read and rank in read else storage.get(f"{root}/{rel}")
            part = load_model(RankManifest, data, storage.describe(f"{root}/{rel}"))
        if part.encoding is not None:
            encodings.add(part.encoding)
        refs.append(rank_ref(rank, part, rel, data))
        parts.append((refs[-1], part))
    manifest = commit_record(
        refs,
        deck_version=deck_version,
        id=ckpt_id,
        step=step,
        kind=kind,
        parent=parent[0] if parent else None,
        parent_id=parent[1] if parent else None,
        base=base,
        epoch=epoch,
        world_size=world_size,
        # Quantised parts make the whole checkpoint quantised (ranks share one writer config).
        encoding=min(encodings) if encodings else None,
    )
    failpoint("commit.before_manifest")
    problem = first_missing_file(storage, root, parts, sizes=False)
    if problem is not None:
        raise CheckpointError(
            f"step {step} is not committed: {problem} (deleted before its commit record: "
            "a GC run with a grace period shorter than this save took it for abandoned); "
            "the next checkpoint will be a full"
        )
    if fence is not None:
        fence()
    if witnesses is not None:
        witnesses.before_commit(epoch, step)  # (once per epoch: this thread, not the stall)
    failpoint("commit.after_witness")
    put_record(storage, f"{root}/{MANIFEST}", ckpt_id, dump_model(manifest))
    failpoint("commit.after_manifest")
    return manifest
