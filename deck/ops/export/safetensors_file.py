"""``deck export --format safetensors``: one safetensors file of unsharded tensors, streamed
table by table."""

from __future__ import annotations

import json
import math
import os
import struct
from typing import IO, Any

import torch

from deck.errors import ConfigError, UnsupportedError
from deck.ops.export.layout import Piece, StepState
from deck.ops.export.run import ExportReport, ExportRun, Progress
from deck.storage.atomic import atomic_file

_SAFETENSORS_DTYPES = {
    torch.int64: "I64",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.bool: "BOOL",
}

# The tensors of a safetensors file, in order: name, shape, dtype.
_Layout = list[tuple[str, tuple[int, ...], torch.dtype]]


def export_safetensors(
    state: StepState, out_path: str, progress: Progress | None = None
) -> ExportReport:
    """Write ``state`` as one safetensors file of unsharded tensors (same names as the DCP
    export; a column-sharded table's row-wise optimizer state in TorchRec's layout), for
    inspection with any safetensors reader.

    Streams table by table: the header is computed from the manifests first, then each table
    is assembled from its shards and written (safetensors' own writer needs every tensor in
    memory at once, hence this writer of its documented format). The file appears atomically
    (written under a temporary name, then renamed).
    """
    if os.path.exists(out_path):
        raise ConfigError(f"--out {out_path} exists; choose a new file name or remove it")
    run = ExportRun(state, out_path, progress)
    first: dict[str, Piece] = {}
    for p in state.pieces:
        first.setdefault(p.fqn, p)
    # Layout: tables in order, then the dense tensors.
    layout: _Layout = [(f, p.size, p.dtype) for f, p in first.items()]
    layout += [(k, tuple(v.shape), v.dtype) for k, v in run.dense.items()]
    for name, _, dtype in layout:
        if dtype not in _SAFETENSORS_DTYPES:
            raise UnsupportedError(f"{name}: dtype {dtype} has no safetensors name")
    metadata = {
        "format": "deck-export",
        "uri": state.storage.uri,
        "step": str(state.step),
        "chain": json.dumps(run.report.chain),
    }
    preamble = safetensors_preamble(metadata, layout)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with atomic_file(out_path) as f:
        f.write(preamble)
        _write_tables(f, run, list(first))
        for v in run.dense.values():
            write_tensor(f, v)
    return run.finish()


def safetensors_preamble(metadata: dict[str, str], layout: _Layout) -> bytes:
    """What a safetensors file of ``layout``'s tensors (in that order) holds before their
    data: the header's length, then the header (``metadata`` and each tensor's dtype, shape
    and place)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    off = 0
    for name, size, dtype in layout:
        n = math.prod(size) * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(size),
            "data_offsets": [off, off + n],
        }
        off += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the reference writer pads the header to 8 bytes
    return struct.pack("<Q", len(head)) + head


def _write_tables(f: IO[bytes], run: ExportRun, fqns: list[str]) -> None:
    """Write the table tensors named ``fqns``, in that order, assembling one table at a time."""
    tables: dict[str, list[int]] = {}
    for i, s in enumerate(run.state.shards):
        tables.setdefault(s.table, []).append(i)
    for shard_ids in tables.values():
        full = _assemble(run.state, shard_ids)
        run.holding(full)
        for fqn in [f for f in fqns if f in full]:
            write_tensor(f, full[fqn])
            run.wrote(full[fqn])
        del full  # before the next table is assembled: at most one table is held


def _assemble(state: StepState, shard_ids: list[int]) -> dict[str, torch.Tensor]:
    """The unsharded tensors of one table, from its shards ``shard_ids``."""
    full: dict[str, torch.Tensor] = {}
    for i in shard_ids:
        data = state.read_shard(i)
        for p in state.pieces:
            if p.shard != i:
                continue
            t = full.setdefault(p.fqn, torch.empty(p.size, dtype=p.dtype))
            block = t[tuple(slice(o, o + n) for o, n in zip(p.offsets, p.sizes, strict=True))]
            block.copy_(data[p.state])
        del data  # before the next shard is read
    return full


def write_tensor(f: Any, t: torch.Tensor) -> None:
    # Little-endian raw bytes in C order, as safetensors stores them.
    f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
