"""Parquet output for data pipelines (feature stores, Spark, pandas): ``deck export --format
parquet`` (the full tables of a step) and ``deck follow --format parquet`` (per applied step, a
delta holding only the rows that step changed). pyarrow is imported only here, when one of them
runs.

**Layout** (docs/operations.md, "Parquet layout"): one file per table, ``<table key>.parquet``
(the table's ``state_dict`` key, e.g. ``sparse_arch.embedding_bag_collection.embedding_bags.t0.
weight.parquet``), rows in ascending global row id, non-null columns:

- ``row``: int64, the global row id;
- ``weight``: ``fixed_size_list<dtype>[dim]`` (bfloat16 as its uint16 bit pattern, the field's
  ``deck.dtype`` metadata says so);
- one column per fused optimizer state, named as the state (``momentum1``, ...): a state with
  one value per row is a scalar column, one with a value per column (exact Adagrad, Adam) a
  ``fixed_size_list[dim]``. A row-wise state of a column-sharded table has one value per column
  shard (TorchRec keeps one per shard): a ``fixed_size_list[k]`` over the ``k`` column shards,
  in column order (``deck.column_offsets``).

The file's key-value metadata (keys ``deck.*``) names the kind (``full`` / ``delta``), URI,
step, checkpoint id, table and its shape; a delta names the step and checkpoint it applies onto
(``deck.parent_step`` / ``deck.parent_checkpoint``), so a consumer can check it holds every delta.
Arrow arrays wrap the tensors' memory (``FixedSizeListArray.from_arrays`` over a flat numpy
view): there is no per-row Python.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from deck.errors import ConfigError, UnsupportedError
from deck.format.chunks import decode_chunk, dtype_name, read_chunks
from deck.format.manifest import CheckpointManifest, RankManifest
from deck.ops.export import ExportReport, Progress, StepState, check_out_dir
from deck.read.catalog import checkpoint_label
from deck.storage import Storage
from deck.storage.atomic import TEMP_PREFIX, atomic_file, fsync_dir

if TYPE_CHECKING:
    import pyarrow as pa

ROW = "row"
FORMAT = "deck-parquet"
# Rows per Parquet row group: about this many bytes (readers hold a row group at a time).
_ROW_GROUP_BYTES = 64 * 2**20


@dataclass(frozen=True)
class StateColumn:
    """One state of a table as a column: ``width`` values per row (0: a scalar column);
    ``fqn`` is the tensor's name in the DCP / safetensors export."""

    name: str
    dtype: torch.dtype
    width: int
    fqn: str
    rowwise: bool


@dataclass(frozen=True)
class TableLayout:
    """The columns of one table's file, and its column shards (``col_offsets``, in order)."""

    table: str
    num_rows: int
    num_cols: int
    columns: tuple[StateColumn, ...]
    col_offsets: tuple[int, ...]

    def row_bytes(self) -> int:
        return 8 + sum(max(c.width, 1) * c.dtype.itemsize for c in self.columns)


# (table shard geometry, state name, tensor fqn, tensor size, dtype): what layouts are built from.
Entry = tuple[Any, str, str, tuple[int, ...], torch.dtype]


def layouts(entries: Iterable[Entry]) -> dict[str, TableLayout]:
    """The layout of every table that ``entries`` (one per state of each table shard) describe.
    A 2-D tensor is a per-column state (the weight's layout); a 1-D one holds one value per row
    and column shard (TorchRec's layout: one block of ``num_rows`` per column shard)."""
    cols: dict[str, dict[str, StateColumn]] = {}
    offsets: dict[str, set[int]] = {}
    shape: dict[str, tuple[int, int]] = {}
    for g, state, fqn, size, dtype in entries:
        shape[g.table] = (g.num_rows, g.num_cols)
        offsets.setdefault(g.table, set()).add(g.col_offset)
        rowwise = len(size) == 1
        width = g.num_cols if not rowwise else size[0] // g.num_rows
        col = StateColumn(state, dtype, width if not rowwise or width > 1 else 0, fqn, rowwise)
        cols.setdefault(g.table, {})[state] = col
    out = {}
    for table, by_name in cols.items():
        # weight first, then the optimizer states in their order
        ordered = sorted(by_name.values(), key=lambda c: c.name != "weight")
        out[table] = TableLayout(
            table, *shape[table], tuple(ordered), tuple(sorted(offsets[table]))
        )
    return out


def _arrow_type(dtype: torch.dtype) -> Any:
    import pyarrow as pa

    types = {
        torch.float32: pa.float32(),
        torch.float16: pa.float16(),
        torch.float64: pa.float64(),
        torch.bfloat16: pa.uint16(),  # no Arrow bfloat16: the bit pattern
        torch.int64: pa.int64(),
        torch.int32: pa.int32(),
        torch.int8: pa.int8(),
        torch.uint8: pa.uint8(),
    }
    if dtype not in types:
        raise UnsupportedError(f"dtype {dtype} has no Parquet column type in deck's layout")
    return types[dtype]


def schema(layout: TableLayout, metadata: dict[str, str]) -> pa.Schema:
    """The Arrow schema of ``layout``'s file, with ``metadata`` (``deck.`` is prefixed)."""
    import pyarrow as pa

    fields = [pa.field(ROW, pa.int64(), nullable=False)]
    for c in layout.columns:
        typ = _arrow_type(c.dtype)
        meta = {"deck.dtype": dtype_name(c.dtype), "deck.tensor": c.fqn}
        meta["deck.values"] = "per_column_shard" if c.rowwise else "per_column"
        fields.append(
            pa.field(c.name, pa.list_(typ, c.width) if c.width else typ, False, metadata=meta)
        )
    table_meta = {
        "table": layout.table,
        "num_rows": str(layout.num_rows),
        "num_cols": str(layout.num_cols),
        "column_offsets": json.dumps(list(layout.col_offsets)),
        **metadata,
    }
    return pa.schema(fields, metadata={f"deck.{k}": v for k, v in table_meta.items()})


def _arrow_values(t: torch.Tensor, width: int) -> Any:
    """``t`` (``n`` or ``n x width``) as an Arrow array over its memory (no copy when
    contiguous)."""
    import pyarrow as pa

    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)
        values = pa.array(flat.numpy().view("uint16"))
    else:
        values = pa.array(flat.numpy())
    return pa.FixedSizeListArray.from_arrays(values, width) if width else values


def record_batch(
    layout: TableLayout, sch: pa.Schema, rows: torch.Tensor, data: dict[str, torch.Tensor]
) -> pa.RecordBatch:
    """One batch of ``layout``'s file: global row ids ``rows`` and each column's values
    (``n`` or ``n x width``, by state name)."""
    import pyarrow as pa

    arrays = [_arrow_values(rows.to(torch.int64), 0)]
    arrays += [_arrow_values(data[c.name], c.width) for c in layout.columns]
    return pa.RecordBatch.from_arrays(arrays, schema=sch)


class TableFile:
    """A Parquet file of one table being written: batches go in as row groups of about
    :data:`_ROW_GROUP_BYTES`; the file appears atomically (temp file, fsync, rename) on
    :meth:`close` (or is removed when the ``with`` block raises)."""

    def __init__(self, path: str, layout: TableLayout, metadata: dict[str, str], compression: str):
        import pyarrow.parquet as pq

        self.layout = layout
        self.schema = schema(layout, metadata)
        self._file = atomic_file(path)
        f = self._file.__enter__()
        self._writer = pq.ParquetWriter(
            f,
            self.schema,
            compression=compression,
            # Embedding values are unique floats: dictionaries and min/max statistics cost
            # time and help no reader. Row ids keep statistics (row-range pruning).
            use_dictionary=False,
            write_statistics=[ROW],
        )
        self.rows_per_group = max(1, _ROW_GROUP_BYTES // layout.row_bytes())
        self.bytes = 0

    def write(self, rows: torch.Tensor, data: dict[str, torch.Tensor]) -> None:
        """Append rows ``rows`` (global ids, ascending after the previous ones)."""
        import pyarrow as pa

        batch = record_batch(self.layout, self.schema, rows, data)
        self._writer.write_table(pa.Table.from_batches([batch]), self.rows_per_group)
        self.bytes += rows.numel() * self.layout.row_bytes()

    def __enter__(self) -> TableFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._writer.close()
        self._file.__exit__(*exc)


def table_file_name(table: str) -> str:
    """The file of ``table`` (its state_dict key) in an export or follow directory."""
    if "/" in table or table.startswith("."):
        raise UnsupportedError(f"table key {table!r} cannot name a file")
    return f"{table}.parquet"


# ---- deck export --format parquet --------------------------------------------------------------


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
    check_out_dir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    report = ExportReport(step=state.step, chain=[m.folder for m in state.chain], path=out_dir)
    report.skipped.append(
        "dense state and dense optimizer state (the dcp and safetensors exports hold them)"
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


# ---- deck follow --format parquet --------------------------------------------------------------

PARQUET_DIR = "parquet"


def step_dir_name(step: int, kind: str) -> str:
    """The folder of one step's files under ``<follow dir>/parquet``: ``<step:012d>-<kind>``,
    so that a listing sorts by step."""
    return f"{step:012d}-{kind}"


def gather(
    layout: TableLayout, tensors: dict[str, torch.Tensor], rows: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Rows ``rows`` (None: all) of the table's unsharded tensors ``tensors`` (by fqn, in the
    export's layout) as the columns of its file."""
    out = {}
    for c in layout.columns:
        t = tensors[c.fqn]
        if c.rowwise:  # k blocks of num_rows, one per column shard -> num_rows x k
            t = t.view(max(c.width, 1), layout.num_rows).t()
            if not c.width:
                t = t.reshape(-1)
        out[c.name] = t if rows is None else t.index_select(0, rows)
    return out


def changed_rows(
    storage: Storage, m: CheckpointManifest, parts: list[RankManifest], allow_quantized: bool
) -> dict[str, torch.Tensor]:
    """The global row ids checkpoint ``m`` (rank manifests ``parts``) holds rows of, by table,
    ascending and unique: what applying it changes. Reads its chunks (checksum-verified; a
    local store maps them, so the pages ``apply_chain`` just read are reused)."""
    ids: dict[str, list[torch.Tensor]] = {}
    for part in parts:
        for rec in part.shards:
            for chunk, at, data in read_chunks(storage, m.folder, rec.chunks, zero_copy=True):
                where = f"{at} (table {rec.table}, {checkpoint_label(m)})"
                arrays = decode_chunk(data, chunk, where, allow_quantized, shard=rec)
                ids.setdefault(rec.table, []).append(arrays["ids"].to(torch.int64).clone())
    return {t: torch.unique(torch.cat(v)) for t, v in ids.items()}


class FollowParquet:
    """The Parquet output of ``deck follow``: ``<out>/parquet/<step>-full/`` when the state is
    materialised from a chain, ``<out>/parquet/<step>-delta/`` for each delta applied onto it
    (module doc: layout). Each step's folder is written under a temp name and renamed into
    place, so a reader listing the folder sees whole steps only."""

    def __init__(self, out_dir: str, uri: str, compression: str = "none"):
        self.root = os.path.join(out_dir, PARQUET_DIR)
        self.uri = uri
        self.compression = compression
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise ConfigError(f"{self.root} is not a directory; remove it or use another out_dir")
        os.makedirs(self.root, exist_ok=True)

    def full(self, follower: Any) -> str:
        """Write every row of the state ``follower`` (a :class:`deck.ops.follow.Follower`) holds,
        as step ``follower.state``."""
        return self.write("full", follower.state, None, self._layouts(follower), follower.tensors)

    def delta(
        self,
        follower: Any,
        m: CheckpointManifest,
        parent: tuple[int, str] | None,
        parts: list[RankManifest],
    ) -> str:
        """Write the rows checkpoint ``m`` (rank manifests ``parts``), just applied onto
        ``parent``, changed: their values in the state ``follower`` now holds."""
        rows = changed_rows(follower.storage, m, parts, follower.allow_quantized)
        tables = self._layouts(follower)
        return self.write("delta", m.state, parent, tables, follower.tensors, rows)

    @staticmethod
    def _layouts(follower: Any) -> dict[str, TableLayout]:
        t = follower.tensors
        return layouts(
            (s, p.state, p.fqn, tuple(t[p.fqn].shape), t[p.fqn].dtype)
            for s in follower.shards
            for p in s.pieces
        )

    def write(
        self,
        kind: str,
        state: tuple[int, str],
        parent: tuple[int, str] | None,
        tables: dict[str, TableLayout],
        tensors: dict[str, torch.Tensor],
        rows: dict[str, torch.Tensor] | None = None,
    ) -> str:
        """Write step ``state`` (step, checkpoint id): every row of each table (``rows`` None)
        or only ``rows[table]`` (a table missing from ``rows``: an empty file). Returns the
        folder. A folder of the same step and kind (a catch-up redone after a crash) is
        replaced."""
        step, ckpt = state
        meta = {"format": FORMAT, "kind": kind, "uri": self.uri}
        meta |= {"step": str(step), "checkpoint": ckpt}
        if parent is not None:
            meta |= {"parent_step": str(parent[0]), "parent_checkpoint": parent[1]}
        final = os.path.join(self.root, step_dir_name(step, kind))
        tmp = os.path.join(self.root, f"{TEMP_PREFIX}{step_dir_name(step, kind)}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        empty = torch.empty(0, dtype=torch.int64)
        for table, layout in sorted(tables.items()):
            ids = None if rows is None else rows.get(table, empty)
            rid = torch.arange(layout.num_rows) if ids is None else ids
            path = os.path.join(tmp, table_file_name(table))
            with TableFile(path, layout, meta, self.compression) as f:
                f.write(rid, gather(layout, tensors, ids))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(self.root)
        return final


def read_table(path: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """A table file back as ``(metadata without the deck. prefix, {column: tensor})``: ``row``
    1-D, list columns ``n x width`` (bfloat16 columns as bfloat16). For tests and examples."""
    import pyarrow.parquet as pq

    t = pq.read_table(path)
    meta = {
        k.decode()[5:]: v.decode()
        for k, v in (t.schema.metadata or {}).items()
        if k.startswith(b"deck.")
    }
    out = {}
    for name in t.column_names:
        col = t.column(name).combine_chunks()
        field = t.schema.field(name)
        width = getattr(field.type, "list_size", 0)
        flat = col.values.to_numpy() if width else col.to_numpy()
        v = torch.from_numpy(flat.copy())
        dtype = (field.metadata or {}).get(b"deck.dtype", b"").decode()
        if dtype == "bfloat16":
            v = v.view(torch.bfloat16)
        out[name] = v.reshape(-1, width) if width else v
    return meta, out
