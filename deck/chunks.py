"""Chunk files: raw little-endian arrays, 64-byte aligned, padded to a multiple of 4096 bytes.

A chunk holds ``rows`` rows of one table shard: segment ``ids`` (int64 global row ids, ascending)
and one segment per row state (``weight``, ``momentum1``, ...), each with ``rows`` as its first
dimension. Nothing but bytes and a manifest record describe it: loading never executes code.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
import xxhash

from deck.errors import CorruptCheckpointError
from deck.format import PAGE_ALIGN, ChunkRecord, Segment

_ALIGN = 64
_DTYPES: dict[str, torch.dtype] = {
    "int64": torch.int64,
    "int32": torch.int32,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "uint8": torch.uint8,
    "int8": torch.int8,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def checksum(data: bytes | bytearray | memoryview) -> str:
    """Checksum used for every file deck writes: xxh3-64, hex."""
    return xxhash.xxh3_64_hexdigest(data)


def dtype_name(dtype: torch.dtype) -> str:
    """Stable on-disk name of a tensor dtype; raises for dtypes the format does not store."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise CorruptCheckpointError(f"dtype {dtype} cannot be stored in a deck chunk") from None


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def encode_chunk(
    path: str, arrays: Sequence[tuple[str, torch.Tensor]]
) -> tuple[bytearray, ChunkRecord]:
    """Pack ``arrays`` (first is ``ids``) into one page-padded buffer and describe it.

    Guarantees: the buffer length is a multiple of 4096; each segment starts on a 64-byte
    boundary; the record's checksum covers the whole buffer, padding included.
    """
    rows = int(arrays[0][1].shape[0])
    layout: list[tuple[str, torch.Tensor, int, int]] = []
    off = 0
    for name, t in arrays:
        t = t.detach()
        if t.shape[0] != rows:
            raise ValueError(f"segment {name} has {t.shape[0]} rows, expected {rows}")
        nbytes = t.numel() * t.element_size()
        layout.append((name, t, off, nbytes))
        off = _round_up(off + nbytes, _ALIGN)
    total = max(_round_up(off, PAGE_ALIGN), PAGE_ALIGN)
    buf = bytearray(total)
    dst = torch.frombuffer(buf, dtype=torch.uint8)
    segments = []
    for name, t, seg_off, nbytes in layout:
        if nbytes:
            dst[seg_off : seg_off + nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
        segments.append(
            Segment(
                name=name,
                dtype=dtype_name(t.dtype),
                shape=tuple(t.shape),
                offset=seg_off,
                nbytes=nbytes,
            )
        )
    record = ChunkRecord(
        path=path, rows=rows, nbytes=total, checksum=checksum(buf), segments=tuple(segments)
    )
    return buf, record


def decode_chunk(
    data: bytes | bytearray | memoryview, record: ChunkRecord, where: str
) -> dict[str, torch.Tensor]:
    """Verify ``data`` against ``record`` and return its segments as read-only tensor views.

    Raises :class:`CorruptCheckpointError` naming ``where`` on a size or checksum mismatch or a
    record that does not describe a valid layout.
    """
    if len(data) != record.nbytes:
        raise CorruptCheckpointError(
            f"{where}: size {len(data)} bytes, manifest says {record.nbytes} (truncated or replaced file)"
        )
    if checksum(data) != record.checksum:
        raise CorruptCheckpointError(f"{where}: checksum mismatch (file is corrupt)")
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        # torch warns that views of an immutable bytes object are not writable; we only read.
        warnings.simplefilter("ignore", UserWarning)
        for seg in record.segments:
            dtype = _DTYPES.get(seg.dtype)
            if dtype is None:
                raise CorruptCheckpointError(
                    f"{where}: unknown dtype {seg.dtype!r} in segment {seg.name}"
                )
            itemsize = torch.empty((), dtype=dtype).element_size()
            count = math.prod(seg.shape)
            if (
                count * itemsize != seg.nbytes
                or seg.offset + seg.nbytes > len(data)
                or (seg.shape and seg.shape[0] != record.rows)
            ):
                raise CorruptCheckpointError(f"{where}: segment {seg.name} does not fit its chunk")
            if count == 0:
                out[seg.name] = torch.empty(seg.shape, dtype=dtype)
                continue
            flat = torch.frombuffer(data, dtype=dtype, count=count, offset=seg.offset)
            out[seg.name] = flat.view(seg.shape)
    if "ids" not in out or out["ids"].dtype != torch.int64 or out["ids"].dim() != 1:
        raise CorruptCheckpointError(f"{where}: chunk has no int64 'ids' segment")
    return out
