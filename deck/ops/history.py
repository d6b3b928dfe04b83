"""Point queries over history (IncrCP): one row's value at every retained step.

``row_history(uri, table, row)`` walks the cheapest chain (:mod:`deck.read.lineage`) of every
restorable trainer step newest checkpoint first and stops at the first chunk holding the row, as
a restore would end up with it ("newest row wins"). It reads only chunks whose row index
(:class:`deck.format.manifest.RowIndex`: id range and bloom filter) says they may hold the row, and each
chunk at most once across all steps; checkpoints written before chunks had an index are read
like any chunk whose range contains the row.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from deck.errors import CheckpointNotFoundError, CorruptCheckpointError, IncompatibleModelError
from deck.format.chunk_io import read_chunks
from deck.format.chunks import decode_chunk
from deck.format.manifest import CheckpointManifest, ChunkRecord, RankManifest, ShardRecord
from deck.format.rowindex import may_contain
from deck.read.catalog import checkpoint_label, read_every_record, read_rank_manifests
from deck.read.lineage import LineageGraph, cheapest_chain
from deck.storage import Storage

Columns = tuple[int, int]  # (col_offset, cols) of a column shard


@dataclass
class RowAt:
    """The row at one step: ``values[state]`` is the row of a per-column state (``weight``,
    Adam / exact Adagrad momenta) over all columns, or one value per column shard for per-row
    states (rowwise Adagrad's ``momentum1``), in ``columns`` order. ``sources``: the folder of
    the checkpoint each column shard's row came from."""

    step: int
    values: dict[str, list[float]]
    columns: list[Columns]
    sources: list[str]
    epoch: int | None = None  # the timeline of the step's trainer checkpoint

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "values": self.values,
            "columns": [list(c) for c in self.columns],
            "sources": self.sources,
        }


@dataclass
class RowHistory:
    """What :func:`row_history` found, and what it cost.

    ``chunks_present``: distinct chunks of the table in the checkpoints of all the chains (what
    restoring every step would read of it); ``chunks_read``: those actually read;
    ``skipped_range`` / ``skipped_bloom``: chunks passed over by the id range / the bloom filter.
    A read chunk not holding the row is a bloom false positive (``false_positives``), or one
    read on the way to an older checkpoint without an index.
    """

    uri: str
    table: str
    row: int
    steps: list[RowAt] = field(default_factory=list)
    # Steps whose commit record could not be read (step -> problem): missing from ``steps``, as
    # are the steps whose chain may need them
    damaged: dict[int, str] = field(default_factory=dict)
    chunks_present: int = 0
    chunks_read: int = 0
    skipped_range: int = 0
    skipped_bloom: int = 0
    false_positives: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (``deck history --json``)."""
        return {
            "uri": self.uri,
            "table": self.table,
            "row": self.row,
            "chunks_present": self.chunks_present,
            "chunks_read": self.chunks_read,
            "skipped_range": self.skipped_range,
            "skipped_bloom": self.skipped_bloom,
            "false_positives": self.false_positives,
            "steps": [s.to_dict() for s in self.steps],
        }


class _Reader:
    """Reads a row out of chunks, each chunk at most once, counting what it reads and skips."""

    def __init__(self, storage: Storage, out: RowHistory):
        self.storage = storage
        self.out = out
        self.parts: dict[str, list[RankManifest]] = {}
        self.seen: dict[str, dict[str, torch.Tensor] | None] = {}  # chunk key -> row or None

    def records(self, m: CheckpointManifest, any_row: bool = False) -> list[ShardRecord]:
        """Shard records of the table in ``m`` whose rows include the row (``any_row``: all)."""
        if m.id not in self.parts:
            self.parts[m.id] = read_rank_manifests(self.storage, m)
        row = self.out.row
        return [
            rec
            for part in self.parts[m.id]
            for rec in part.shards
            if rec.table == self.out.table
            and (any_row or rec.row_offset <= row < rec.row_offset + rec.rows)
        ]

    def row_in(self, m: CheckpointManifest, chunk: ChunkRecord) -> dict[str, torch.Tensor] | None:
        key = _chunk_key(m, chunk)
        if key in self.seen:
            return self.seen[key]
        row = self.out.row
        self.out.chunks_present += 1
        found: dict[str, torch.Tensor] | None = None
        if chunk.index is not None and not chunk.index.min_id <= row <= chunk.index.max_id:
            self.out.skipped_range += 1
        elif not may_contain(chunk.index, row):
            self.out.skipped_bloom += 1
        else:
            _c, at, data = next(read_chunks(self.storage, m.folder, [chunk]))
            arrays = decode_chunk(
                data, chunk, f"{at} (table {self.out.table}, {checkpoint_label(m)})"
            )
            self.out.chunks_read += 1
            ids = arrays["ids"]
            pos = int(torch.searchsorted(ids, torch.tensor([row], dtype=torch.int64))[0])
            if pos < ids.numel() and int(ids[pos]) == row:
                found = {k: v[pos].clone() for k, v in arrays.items() if k != "ids"}
            elif chunk.index is not None:
                self.out.false_positives += 1
        self.seen[key] = found
        return found

    def count_unseen(self, m: CheckpointManifest) -> None:
        """Count chunks of the table in ``m`` (any shard) that the query did not look at."""
        for rec in self.records(m, any_row=True):
            for c in rec.chunks:
                key = _chunk_key(m, c)
                if key not in self.seen:
                    self.seen[key] = None
                    self.out.chunks_present += 1


def _chunk_key(m: CheckpointManifest, c: ChunkRecord) -> str:
    # Chunks of one bundle share a file: the offset tells them apart.
    return f"{m.folder}/{c.path}" if c.offset is None else f"{m.folder}/{c.path}@{c.offset}"


def _value_at(reader: _Reader, chain: list[CheckpointManifest], step: int) -> RowAt:
    # Checkpoints that reproduce the state of the one before add no rows (restore skips them).
    eff = [m for i, m in enumerate(chain) if not (i and m.state == chain[i - 1].state)]
    cols = sorted({(r.col_offset, r.cols) for r in reader.records(eff[0])})
    if not cols:
        raise CorruptCheckpointError(
            f"step {step}: the full {checkpoint_label(eff[0])} holds no shard of table "
            f"{reader.out.table} with row {reader.out.row}; run deck verify"
        )
    got: dict[Columns, tuple[dict[str, torch.Tensor], str]] = {}
    for m in reversed(eff):
        recs = reader.records(m)
        for rec in recs:
            c = (rec.col_offset, rec.cols)
            if c not in cols:
                raise IncompatibleModelError(
                    f"table {reader.out.table}: {checkpoint_label(m)} has columns {list(c)}, "
                    f"its chain's full has {[list(x) for x in cols]}; deck history needs one column split "
                    "per chain: restore the step instead"
                )
            if c in got:
                continue
            for chunk in rec.chunks:
                hit = reader.row_in(m, chunk)
                if hit is not None:
                    got[c] = (hit, m.folder)
                    break
        if len(got) == len(cols):
            break
    for m in eff:
        reader.count_unseen(m)
    missing = [c for c in cols if c not in got]
    if missing:
        raise CorruptCheckpointError(
            f"step {step}: no chunk of its chain holds row {reader.out.row} of table "
            f"{reader.out.table} (columns {missing}); the full {checkpoint_label(eff[0])} is "
            "incomplete: run deck verify"
        )
    values: dict[str, list[float]] = {}
    for c in cols:
        for name, v in got[c][0].items():
            values.setdefault(name, []).extend(v.reshape(-1).tolist())
    return RowAt(step, values, cols, [got[c][1] for c in cols])


def row_history(
    storage: Storage,
    table: str,
    row: int,
    steps: list[int] | None = None,
) -> RowHistory:
    """Global row ``row`` of ``table`` at every restorable trainer step of ``storage`` (or ``steps``),
    ascending: bitwise the values a restore of that step puts in the row, for weights and every
    optimizer state, read from the cheapest chain of each step.

    Reads only the chunks whose row index allows the row (see the module docstring). Raises
    :class:`CheckpointNotFoundError` naming the URI when there is no restorable step, or the
    table or row is not in it, and :class:`CorruptCheckpointError` naming the file on damage.
    """
    graph = LineageGraph(read_every_record(storage), storage.uri)
    out = RowHistory(uri=storage.uri, table=table, row=row, damaged=dict(graph.damaged))
    todo = graph.restorable_steps() if steps is None else sorted(steps)
    if not todo:
        raise CheckpointNotFoundError(f"no restorable checkpoints at {storage.uri}")
    reader = _Reader(storage, out)
    for step in todo:
        chain = cheapest_chain(graph, step)
        if step == todo[0]:
            _check_table(reader, chain[0], storage.uri)
        at = _value_at(reader, chain, step)
        node = graph.trainer.get(step)
        at.epoch = node.epoch if node is not None else None
        out.steps.append(at)
    return out


def resolve_table(name: str, tables: Iterable[str], uri: str, where: str) -> str:
    """The key in ``tables`` (checkpoint table keys: module FQN + table + ``.weight``, e.g.
    ``sparse_arch.embedding_bag_collection.embedding_bags.t0.weight``) that ``name`` means:
    the key itself, or the table name given in TorchRec's ``EmbeddingBagConfig`` /
    ``EmbeddingConfig`` (``t0``), or any dotted suffix of the key (``embedding_bags.t0``).
    Raises :class:`CheckpointNotFoundError` naming ``uri``, ``where`` and the keys when no key
    or more than one matches."""
    keys = sorted(tables)
    if name in keys:
        return name
    matches = [k for k in keys if f".{k}".endswith((f".{name}", f".{name}.weight"))]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise CheckpointNotFoundError(
            f"{uri}: table name {name!r} matches {len(matches)} tables of {where} "
            f"({matches}); give the full key"
        )
    raise CheckpointNotFoundError(
        f"{uri}: no table {name!r} in {where}; tables: {keys} (a data_parallel table is "
        "saved with the dense state, not by rows: `deck export` holds its values)"
    )


def _check_table(reader: _Reader, full: CheckpointManifest, uri: str) -> None:
    if full.id not in reader.parts:
        reader.parts[full.id] = read_rank_manifests(reader.storage, full)
    shapes = {r.table: r.num_rows for p in reader.parts[full.id] for r in p.shards}
    table = reader.out.table = resolve_table(reader.out.table, shapes, uri, checkpoint_label(full))
    row = reader.out.row
    if not 0 <= row < shapes[table]:
        raise CheckpointNotFoundError(
            f"{uri}: row {row} is outside table {table} (rows 0..{shapes[table] - 1})"
        )
