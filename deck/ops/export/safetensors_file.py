"""``deck export --format safetensors``: one safetensors file of unsharded tensors, streamed
table by table."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from typing import IO

import torch

from deck.errors import ConfigError
from deck.failpoints import failpoint
from deck.format.safetensors import Layout, check_dtypes, preamble, write_tensor
from deck.ops.export.layout import Piece, StepState
from deck.ops.export.run import ExportReport, ExportRun, Progress
from deck.storage.atomic import TEMP_PREFIX, atomic_file

logger = logging.getLogger(__name__)


def export_safetensors(
    state: StepState, out_path: str, progress: Progress | None = None
) -> ExportReport:
    """Write ``state`` as one safetensors file of unsharded tensors (same names as the DCP
    export; a column-sharded table's row-wise optimizer state in TorchRec's layout), for
    inspection with any safetensors reader.

    Streams table by table: the header is computed from the manifests first, then each table
    is assembled from its shards and written (safetensors' own writer needs every tensor in
    memory at once, hence :mod:`deck.format.safetensors`). The file appears atomically
    (written under a temporary name, then renamed).
    """
    if os.path.exists(out_path):
        raise ConfigError(f"{out_path} exists; choose a new file name or remove it")
    run = ExportRun(state, out_path, progress)
    first: dict[str, Piece] = {}
    for p in state.pieces:
        first.setdefault(p.fqn, p)
    # Layout: tables in order, then the dense tensors.
    layout: Layout = [(f, p.size, p.dtype) for f, p in first.items()]
    layout += [(k, tuple(v.shape), v.dtype) for k, v in run.dense.items()]
    check_dtypes(layout)
    metadata = {
        "format": "deck-export",
        "uri": state.storage.uri,
        "step": str(state.step),
        "chain": json.dumps(run.report.chain),
    }
    head = preamble(metadata, layout)
    folder = os.path.dirname(os.path.abspath(out_path))
    made = not os.path.exists(folder)
    os.makedirs(folder, exist_ok=True)
    _remove_killed_exports(out_path)
    try:
        with atomic_file(out_path) as f:
            f.write(head)
            _write_tables(f, run, list(first))
            for v in run.dense.values():
                write_tensor(f, v)
            failpoint("export.before_publish")
    except BaseException:
        if made:  # a failed export leaves no folder of its own behind (rmdir: only if empty)
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        raise
    return run.finish()


def _remove_killed_exports(out_path: str) -> None:
    """Remove the temp files exports of ``out_path`` killed before their rename left beside it
    (a break-it finding: each kill left one as large as the export, which no rerun removed)."""
    folder, name = os.path.split(os.path.abspath(out_path))
    stale = re.compile(re.escape(f"{TEMP_PREFIX}{name}.") + "[0-9a-f]{32}")
    for entry in os.scandir(folder):
        if stale.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            logger.warning(
                "deck: removing %s, what an export killed before it finished left", entry.path
            )
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)


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
