"""The Parquet row files deck writes for data pipelines (feature stores, Spark, pandas): their
layout, schema and metadata, the writer and the reader. Written by ``deck export --format
parquet`` (:mod:`deck.ops.export.parquet`: the full tables of a step) and ``deck follow --format
parquet`` (:mod:`deck.serve.parquet_output`: per applied step, a delta holding only the rows that
step changed). pyarrow is imported only when one of them runs.

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
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from deck.errors import UnsupportedError
from deck.format.chunks import dtype_name
from deck.storage.atomic import atomic_file

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
