"""``deck export --format parquet``: the full tables of a step as Parquet row files, one per
table (layout: :mod:`deck.format.parquet`)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch

from deck.format.parquet import FORMAT, TableFile, TableLayout, layouts, table_file_name
from deck.ops.export.layout import StepState
from deck.ops.export.run import ExportReport, Progress, writing_out_dir


def export_parquet(
    state: StepState,
    out_dir: str,
    progress: Progress | None = None,
    compression: str = "none",
) -> ExportReport:
    """Write the tables of ``state`` into ``out_dir`` (new or empty), one Parquet file per table
    (module doc: layout and metadata).

    Guarantee: each file holds every row of its table once, ascending, with the values (weight
    and every fused optimizer state) that ``DeltaCheckpointer.restore(step)`` loads, bitwise.
    The dense state is not rows and is left out (reported in ``skipped``: export it with
    ``--format dcp`` or ``safetensors``). Streams one *row block* at a time (the shards of a
    table that hold the same rows: one shard of a row-wise or table-wise table, every column
    shard of a column-wise one). Each file appears atomically.
    """
    with writing_out_dir(out_dir) as work:
        report = _write_tables(state, work, progress, compression)
    report.path = out_dir
    return report


def _write_tables(
    state: StepState, out_dir: str, progress: Progress | None, compression: str
) -> ExportReport:
    report = ExportReport(step=state.step, chain=[m.folder for m in state.chain], path=out_dir)
    report.skipped.append(
        "dense state and dense optimizer state, data_parallel tables among them (saved with "
        "the dense state; the dcp and safetensors exports hold them)"
    )
    by_table = layouts(
        (state.shards[p.shard], p.state, p.fqn, p.size, p.dtype) for p in state.pieces
    )
    meta = {
        "format": FORMAT,
        "kind": "full",
        "uri": state.storage.uri,
        "step": str(state.step),
        "checkpoint": state.last.state[1],
        "chain": json.dumps(report.chain),
    }
    for table, layout in sorted(by_table.items()):
        path = os.path.join(out_dir, table_file_name(table))
        with TableFile(path, layout, meta, compression) as f:
            for rows, block in _row_blocks(state, layout):
                held = sum(t.numel() * t.element_size() for t in block.values())
                report.max_held_bytes = max(report.max_held_bytes, held)
                f.write(rows, block)
                report.bytes_written += held
                if progress:
                    progress(held)
                del block  # before the next block is read
        report.tensors += len(layout.columns)
    report.bytes_read = state.read_bytes
    return report


def _row_blocks(
    state: StepState, layout: TableLayout
) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """The rows of ``layout``'s table, block by block in row order: the shards holding the same
    rows, read and put side by side (columns; a row-wise state's column shard)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, s in enumerate(state.shards):
        if s.table == layout.table:
            groups.setdefault((s.row_offset, s.rows), []).append(i)
    for (r0, n), ids in sorted(groups.items()):
        block = {
            c.name: torch.empty((n, c.width) if c.width else (n,), dtype=c.dtype)
            for c in layout.columns
        }
        for i in ids:
            s = state.shards[i]
            data = state.read_shard(i)
            for c in layout.columns:
                if not c.rowwise:
                    block[c.name][:, s.col_offset : s.col_offset + s.cols] = data[c.name]
                elif c.width:
                    block[c.name][:, layout.col_offsets.index(s.col_offset)] = data[c.name]
                else:
                    block[c.name][:] = data[c.name]
            del data
        yield torch.arange(r0, r0 + n, dtype=torch.int64), block
