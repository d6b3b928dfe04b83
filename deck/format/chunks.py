"""Chunk files: raw little-endian arrays, 64-byte aligned, padded to a multiple of 4096 bytes.

A chunk holds ``rows`` rows of one table shard: segment ``ids`` (int64 global row ids, ascending)
and one segment per row state (``weight``, ``momentum1``, ...), each with ``rows`` as its first
dimension. Nothing but bytes and a manifest record describe it: loading never executes code.
"""

from __future__ import annotations

import math
import mmap
import warnings
from collections.abc import Mapping, Sequence

import torch

from deck.errors import CorruptCheckpointError
from deck.format.checksum import checksum
from deck.format.chunk_io import check_chunk
from deck.format.manifest import PAGE_ALIGN, ChunkRecord, Encoding, Segment, ShardRecord
from deck.format.quantize import (
    QUANTIZED_ADVICE,
    QuantizedStateError,
    decode_rows,
    scale_name,
)

_ALIGN = 64
Buffer = bytearray | memoryview  # a writable chunk buffer (memoryview: pinned host memory)
# Format dtype names (segments' ``dtype``) <-> torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "int64": torch.int64,
    "int32": torch.int32,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "uint8": torch.uint8,
    "int8": torch.int8,
}
_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Stable on-disk name of a tensor dtype; raises for dtypes the format does not store."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise CorruptCheckpointError(f"dtype {dtype} cannot be stored in a deck chunk") from None


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class ChunkLayout:
    """Where each segment of a chunk of ``rows`` rows goes: 64-byte aligned, page-padded."""

    def __init__(self, rows: int, segments: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]):
        self.rows = rows
        self.segments: list[tuple[str, torch.dtype, tuple[int, ...], int, int]] = []
        off = 0
        for name, dtype, row_shape in segments:
            shape = (rows, *row_shape)
            nbytes = math.prod(shape) * dtype.itemsize
            self.segments.append((name, dtype, shape, off, nbytes))
            off = _round_up(off + nbytes, _ALIGN)
        self.payload_end = off
        self.nbytes = max(_round_up(off, PAGE_ALIGN), PAGE_ALIGN)
        # The segments' records per encoding: every chunk of a layout shares them, so the spool
        # writer builds them once, not per chunk (their validation takes the GIL)
        self._records: dict[tuple[tuple[str, str, str], ...], tuple[Segment, ...]] = {}

    def segment_records(
        self, encoded: Mapping[str, tuple[Encoding, torch.dtype]]
    ) -> tuple[Segment, ...]:
        """The manifest records of this layout's segments (``encoded``: as :func:`build_chunk`);
        built once per encoding, the same objects after."""
        key = tuple(sorted((k, e, dtype_name(d)) for k, (e, d) in encoded.items()))
        got = self._records.get(key)
        if got is None:
            got = self._records[key] = tuple(
                Segment(
                    name=name,
                    dtype=dtype_name(dtype),
                    shape=shape,
                    offset=off,
                    nbytes=nbytes,
                    encoding=encoded[name][0] if name in encoded else None,
                    source_dtype=dtype_name(encoded[name][1]) if name in encoded else None,
                )
                for name, dtype, shape, off, nbytes in self.segments
            )
        return got

    @staticmethod
    def overhead(num_segments: int) -> int:
        """Upper bound of alignment bytes a chunk adds over its rows' payload."""
        return num_segments * _ALIGN


def build_chunk(
    buf: Buffer,
    path: str,
    layout: ChunkLayout,
    fill: Sequence[torch.Tensor | None],
    pad_to: int | None = None,
    encoded: Mapping[str, tuple[Encoding, torch.dtype]] | None = None,
) -> ChunkRecord:
    """Fill ``buf`` with one chunk and describe it; returns the record (bytes = ``buf[:nbytes]``).

    ``fill[i]`` is the data of segment i (``rows`` first); ``None`` means the caller already
    wrote that segment through :func:`segment_view`. Padding is zeroed, so the checksum is a
    function of the rows alone. ``pad_to`` (a multiple of 4096, at least the layout size) makes a
    non-final chunk exactly that long. ``encoded`` names the segments that hold a quantised
    encoding (deck.format.quantize) with the encoding and the dtype they decode to.
    """
    total = layout.nbytes if pad_to is None else max(pad_to, layout.nbytes)
    if len(buf) < total:
        raise ValueError(
            f"chunk buffer of {len(buf)} bytes is smaller than the chunk ({total} bytes)"
        )
    # Plain memoryview slices, not torch ops: zeroing the few gaps takes no dispatch and never
    # lets the GIL go and back (this runs on the spool writer thread beside training)
    view = memoryview(buf).cast("B")
    prev_end = 0
    for (name, _, _, off, nbytes), data in zip(layout.segments, fill, strict=True):
        view[prev_end:off] = bytes(off - prev_end)
        if data is not None and nbytes:
            segment_view(buf, layout, name).copy_(data)
        prev_end = off + nbytes
    view[prev_end:total] = bytes(total - prev_end)
    return ChunkRecord(
        path=path,
        rows=layout.rows,
        nbytes=total,
        checksum=checksum(view[:total]),
        segments=layout.segment_records(encoded or {}),
    )


def segment_view(buf: Buffer, layout: ChunkLayout, name: str) -> torch.Tensor:
    """A typed, writable tensor view of segment ``name`` inside ``buf``."""
    for seg_name, dtype, shape, off, nbytes in layout.segments:
        if seg_name == name:
            if nbytes == 0:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(buf, dtype=dtype, count=math.prod(shape), offset=off).view(
                shape
            )
    raise KeyError(name)


def aligned_buffer(size: int) -> memoryview:
    """A writable, zeroed, page-aligned buffer of ``size`` bytes (an anonymous mapping), so that
    chunks built in it can be written with O_DIRECT (deck.storage.local.write_new_file)."""
    return memoryview(mmap.mmap(-1, size))


def encode_chunk(
    path: str, arrays: Sequence[tuple[str, torch.Tensor]], out: Buffer | None = None
) -> tuple[memoryview, ChunkRecord]:
    """Pack ``arrays`` (first is ``ids``) into a page-padded chunk and describe it.

    The chunk is built in ``out`` when it is large enough (a buffer reused chunk after chunk),
    else in a new buffer; the returned view holds exactly the chunk's bytes and is valid until
    ``out`` is reused.
    """
    rows = int(arrays[0][1].shape[0])
    for name, t in arrays:
        if t.shape[0] != rows:
            raise ValueError(f"segment {name} has {t.shape[0]} rows, expected {rows}")
    layout = ChunkLayout(rows, [(name, t.dtype, tuple(t.shape[1:])) for name, t in arrays])
    buf = out if out is not None and len(out) >= layout.nbytes else bytearray(layout.nbytes)
    record = build_chunk(buf, path, layout, [t.detach() for _, t in arrays])
    return memoryview(buf)[: record.nbytes], record


def decode_chunk(
    data: bytes | bytearray | memoryview,
    record: ChunkRecord,
    where: str,
    allow_quantized: bool = False,
    shard: ShardRecord | None = None,
) -> dict[str, torch.Tensor]:
    """Verify ``data`` against ``record`` and return its segments as read-only tensor views.

    Raises :class:`CorruptCheckpointError` naming ``where`` on a size or checksum mismatch or a
    record that does not describe a valid layout (segments inside the chunk, not overlapping,
    ``rows`` first). With ``shard`` (the record of the table shard the chunk belongs to) its
    contents are checked against it too (:func:`check_rows`: ids strictly ascending, inside the
    shard's rows and the chunk's row index; every state of the shard present), so whatever the
    caller does with the ids cannot index outside the shard. A chunk with quantised segments raises
    :class:`deck.format.quantize.QuantizedStateError` (after those checks) unless ``allow_quantized``:
    then those segments come back dequantised to their source dtype (new tensors) and their
    scale segments are left out, so callers see the chunk's states by name either way.
    """
    check_chunk(data, record, where)
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        # torch warns that views of an immutable bytes object are not writable; we only read.
        warnings.simplefilter("ignore", UserWarning)
        for seg in record.segments:
            dtype = DTYPES[seg.dtype]
            count = math.prod(seg.shape)
            if count == 0:
                out[seg.name] = torch.empty(seg.shape, dtype=dtype)
                continue
            flat = torch.frombuffer(data, dtype=dtype, count=count, offset=seg.offset)
            out[seg.name] = flat.view(seg.shape)
    if "ids" not in out or out["ids"].dtype != torch.int64 or out["ids"].dim() != 1:
        raise CorruptCheckpointError(f"{where}: chunk has no int64 'ids' segment")
    if shard is not None:
        check_rows(out["ids"], record, shard, where)
        missing = [n for n in shard.states if n not in out]
        if missing:
            raise CorruptCheckpointError(f"{where}: no segment for state(s) {missing}")
    for seg in record.segments:
        if seg.encoding is None:
            continue
        if not allow_quantized:
            raise QuantizedStateError(
                f"{where}: segment {seg.name} holds {seg.encoding}-quantised values, not the "
                f"exact state {QUANTIZED_ADVICE}"
            )
        assert seg.source_dtype is not None  # the record's validator requires it
        scale = out.pop(scale_name(seg.name)) if seg.encoding == "int8" else None
        out[seg.name] = decode_rows(out[seg.name], scale, seg.encoding, DTYPES[seg.source_dtype])
    return out


def check_rows(ids: torch.Tensor, record: ChunkRecord, shard: ShardRecord, where: str) -> None:
    """Raise :class:`CorruptCheckpointError` naming ``where`` unless the chunk's ``ids`` (int64,
    1-D) are strictly ascending (no duplicates), inside ``shard``'s rows ``[row_offset,
    row_offset + rows)`` and inside the chunk's row index when it has one. One vectorised
    comparison over the ids: ascending ids lie between the first and the last."""
    n = ids.numel()
    if n == 0:
        return
    first, last = int(ids[0]), int(ids[-1])
    lo, hi = shard.row_offset, shard.row_offset + shard.rows
    if first < lo or last >= hi:
        raise CorruptCheckpointError(
            f"{where}: row ids {first}..{last} lie outside the shard's rows [{lo}, {hi})"
        )
    if n > 1 and not bool(torch.all(ids[1:] > ids[:-1])):
        raise CorruptCheckpointError(
            f"{where}: row ids are not strictly ascending (duplicate or unsorted ids)"
        )
    index = record.index
    if index is not None and (first < index.min_id or last > index.max_id):
        raise CorruptCheckpointError(
            f"{where}: row ids {first}..{last} lie outside the chunk's row index "
            f"[{index.min_id}, {index.max_id}]"
        )
