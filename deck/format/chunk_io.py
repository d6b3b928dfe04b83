"""Reading chunk files' bytes and checking them against their records (size, checksum,
layout): no torch, so that what checks stored bytes without decoding them (``deck gc``'s check
of the checkpoints that take over a deleted one's steps) starts without it.
:mod:`deck.format.chunks` decodes what this reads."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from deck.errors import CorruptCheckpointError, NotFoundError
from deck.format.checksum import checksum
from deck.format.manifest import ChunkRecord
from deck.storage import Storage

# Bytes per element of each format dtype name (:data:`deck.format.chunks.DTYPES` maps the same
# names to torch dtypes)
ITEMSIZE: dict[str, int] = {
    "int64": 8,
    "int32": 4,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "uint8": 1,
    "int8": 1,
}


def check_chunk(data: bytes | bytearray | memoryview, record: ChunkRecord, where: str) -> None:
    """Raise :class:`CorruptCheckpointError` naming ``where`` unless ``data`` has ``record``'s
    size and checksum and ``record`` describes a valid layout (:func:`check_layout`)."""
    if len(data) != record.nbytes:
        raise CorruptCheckpointError(
            f"{where}: size {len(data)} bytes, manifest says {record.nbytes} (truncated or replaced file)"
        )
    if checksum(data) != record.checksum:
        raise CorruptCheckpointError(f"{where}: checksum mismatch (file is corrupt)")
    check_layout(record, where)


def check_layout(record: ChunkRecord, where: str) -> None:
    """Every segment of ``record`` has a known dtype, ``rows`` as its first dimension, exactly
    its shape's bytes, and lies inside the chunk without overlapping another."""
    end = 0
    for seg in sorted(record.segments, key=lambda s: (s.offset, s.nbytes)):
        itemsize = ITEMSIZE.get(seg.dtype)
        if itemsize is None:
            raise CorruptCheckpointError(
                f"{where}: unknown dtype {seg.dtype!r} in segment {seg.name}"
            )
        if (
            not seg.shape
            or seg.shape[0] != record.rows
            or math.prod(seg.shape) * itemsize != seg.nbytes
            or seg.offset + seg.nbytes > record.nbytes
        ):
            raise CorruptCheckpointError(f"{where}: segment {seg.name} does not fit its chunk")
        if seg.nbytes and seg.offset < end:
            raise CorruptCheckpointError(f"{where}: segment {seg.name} overlaps another segment")
        end = max(end, seg.offset + seg.nbytes)


# Files whose reading the kernel starts ahead of the one being copied (zero-copy path).
_PREFETCH_FILES = 2


def _reads(
    folder: str, chunks: Sequence[ChunkRecord]
) -> list[tuple[str, int | None, int, list[ChunkRecord]]]:
    """Group ``chunks`` (in order) into reads: (key, start, end, chunks). A chunk file of its own
    is one whole-file read (start None); adjacent byte ranges of one bundle coalesce into one."""
    out: list[tuple[str, int | None, int, list[ChunkRecord]]] = []
    for c in chunks:
        key = f"{folder}/{c.path}"
        if c.offset is None:
            out.append((key, None, c.nbytes, [c]))
            continue
        if out and out[-1][0] == key and out[-1][1] is not None and out[-1][2] == c.offset:
            prev = out[-1]
            out[-1] = (key, prev[1], c.offset + c.nbytes, [*prev[3], c])
        else:
            out.append((key, c.offset, c.offset + c.nbytes, [c]))
    return out


def chunk_where(storage: Storage, folder: str, c: ChunkRecord) -> str:
    """How errors name chunk ``c``: its file's URI, and for a bundled chunk its byte range."""
    where = storage.describe(f"{folder}/{c.path}")
    if c.offset is not None:
        where += f" [bundled chunk, bytes {c.offset}..{c.offset + c.nbytes}]"
    return where


def _check_size(storage: Storage, folder: str, c: ChunkRecord, size: int) -> None:
    """Before a chunk file is mapped: it is exactly as long as its record says."""
    if size != c.nbytes:
        raise CorruptCheckpointError(
            f"{chunk_where(storage, folder, c)}: size {size} bytes, manifest says {c.nbytes} "
            "(truncated or replaced file)"
        )


def read_chunks(
    storage: Storage, folder: str, chunks: Sequence[ChunkRecord], zero_copy: bool = False
) -> Iterator[tuple[ChunkRecord, str, bytes | memoryview]]:
    """The bytes of each of ``chunks`` (records of files under ``folder``), in order, as
    ``(chunk, where, data)``; ``where`` names the file (and byte range of a bundled chunk) for
    errors. Every reader of chunk bytes goes through here, so bundled and unbundled chunks read
    alike: adjacent chunks of one bundle come from one ranged read, sliced without copying.

    With ``zero_copy`` and a local directory each file is memory-mapped once (a bundle too) and
    chunks are views of the mapping, while the kernel reads the next files ahead. ``data`` is
    not verified: pass it to :func:`deck.format.chunks.decode_chunk`. A truncated bundle gives a short ``data``
    (the check reports the size); a missing file raises :class:`deck.errors.NotFoundError`.
    """
    reads = _reads(folder, chunks)
    if zero_copy and storage.local_path() is not None:
        keys = list(dict.fromkeys(r[0] for r in reads))
        pos = {k: i for i, k in enumerate(keys)}
        for key in keys[:_PREFETCH_FILES]:
            storage.prefetch(key)
        mapped_key, mapped = "", memoryview(b"")
        for key, start, _end, group in reads:
            if key != mapped_key:
                i = pos[key]
                if i + _PREFETCH_FILES < len(keys):
                    storage.prefetch(keys[i + _PREFETCH_FILES])
                # Drop the previous mapping first: one file mapped at a time.
                mapped_key, mapped = "", memoryview(b"")
                if start is None:  # a chunk's own file: its size is known, map nothing else
                    _check_size(storage, folder, group[0], storage.size(key))
                mapped_key, mapped = key, storage.map_file(key)
            for c in group:
                data = mapped if start is None else mapped[c.offset : (c.offset or 0) + c.nbytes]
                yield c, chunk_where(storage, folder, c), data
        return
    i = 0
    while i < len(reads):
        # Runs of whole chunk files go through iter_get (backends overlap those requests).
        j = i
        while j < len(reads) and reads[j][1] is None:
            j += 1
        if j > i:
            run = reads[i:j]
            if storage.local_path() is not None:
                # Local files may be anything (sparse, endless): read what the record says, +1
                # byte to see a longer file (the check reports the size). Local reads gain
                # nothing from iter_get's overlapping.
                for key, _start, end, (c,) in run:
                    yield c, chunk_where(storage, folder, c), storage.get(key, 0, end + 1)
            else:
                # Requests overlap; none reads more than the largest record says (+1 byte to
                # see a longer object), so a huge object is refused, not downloaded.
                limit = max(r[2] for r in run) + 1
                for (key, whole), r in zip(
                    storage.get_many([r[0] for r in run], limit=limit), run, strict=True
                ):
                    if whole is None:
                        raise NotFoundError(f"{storage.describe(key)} does not exist")
                    c = r[3][0]
                    yield c, chunk_where(storage, folder, c), whole
            i = j
            continue
        key, start, end, group = reads[i]
        assert start is not None
        view = memoryview(storage.get(key, start, end))
        for c in group:
            off = (c.offset or 0) - start
            yield c, chunk_where(storage, folder, c), view[off : off + c.nbytes]
        i += 1
