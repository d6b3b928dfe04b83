"""The rows a published checkpoint (or a chain of them) sets, read and checked whole before
anything is written: what a live apply makes visible as one version.

Guarantees: every chunk is size- and checksum-verified and its ids checked against its shard
(:func:`deck.format.chunks.decode_chunk`), every record names a served table with the served
shape, and every row comes with all of its columns (a column-sharded publisher writes each
row's columns in every column shard that looked it up). Damage and foreign records raise
:class:`RefusedUpdateError` naming the file and step; a store that cannot be read raises its
:class:`deck.errors.StorageError`. Either way the caller has changed nothing yet.
Only the ``weight`` state is kept (optimizer states are not served).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deck.errors import CorruptCheckpointError, DeckError, IncompatibleModelError, NotFoundError
from deck.format.chunk_io import read_chunks
from deck.format.chunks import decode_chunk
from deck.format.manifest import CheckpointManifest, RankManifest, ShardRecord
from deck.read.catalog import checkpoint_label, read_rank_manifests
from deck.storage import Storage


class RefusedUpdateError(DeckError):
    """A published checkpoint a live apply cannot use: damaged (a file fails its checksum, is
    missing or is not deck's) or foreign (its tables are not the served model's). The message
    names the file and step; ``checkpoint`` is the one refused. Nothing was written.
    ``repairable``: damage a later read may find gone (a file still being copied, or repaired),
    not another model's tables."""

    def __init__(
        self, message: str, checkpoint: CheckpointManifest, *, repairable: bool = False
    ) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint
        self.repairable = repairable


@dataclass
class TableRows:
    """Rows of one table: ``ids`` ascending and unique, ``values`` (len(ids) x num_cols)."""

    ids: torch.Tensor
    values: torch.Tensor


@dataclass
class ChainRows:
    """What reading a chain segment gave: rows by table key, and the bytes read."""

    tables: dict[str, TableRows] = field(default_factory=dict)
    bytes_read: int = 0
    parts: list[RankManifest] = field(default_factory=list)  # the last checkpoint's

    @property
    def rows(self) -> int:
        return sum(int(t.ids.numel()) for t in self.tables.values())


def last_wins(ids: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique ``ids`` ascending with, for an id given several times, its last row."""
    if ids.numel() == 0:
        return ids, values
    order = torch.sort(ids, stable=True).indices
    s = ids.index_select(0, order)
    last = torch.ones_like(s, dtype=torch.bool)
    last[:-1] = s[1:] != s[:-1]
    keep = order[last]
    return ids.index_select(0, keep), values.index_select(0, keep)


def read_rows(
    storage: Storage,
    chain: list[CheckpointManifest],
    shapes: dict[str, tuple[int, int]],
    *,
    whole: bool,
    allow_quantized: bool = False,
) -> ChainRows:
    """The rows ``chain`` (oldest first; a later row wins) sets in the served tables ``shapes``.

    ``whole``: the chain starts with a full, which must hold every served table and each of its
    rows (so the result is the complete state of the chain's step)."""
    out = ChainRows()
    pieces: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    prev: CheckpointManifest | None = None
    for m in chain:
        try:
            parts = read_rank_manifests(storage, m)
            out.parts = parts
            if prev is not None and m.state == prev.state:
                continue  # the trainer checkpoint a merger checkpoint reproduced: no new rows
            prev = m
            if m.encoding is not None and not allow_quantized:
                raise IncompatibleModelError(
                    f"{checkpoint_label(m)} at {storage.uri} holds {m.encoding}-quantised "
                    "weights; serving them live needs allow_quantized=True (they are "
                    "dequantised first)"
                )
            for table, rows in _checkpoint_rows(storage, m, parts, shapes, out).items():
                pieces.setdefault(table, []).append((rows.ids, rows.values))
            if whole and m is chain[0]:
                stored = {rec.table for part in parts for rec in part.shards}
                _check_full(storage, m, shapes, pieces, stored)
        except (CorruptCheckpointError, IncompatibleModelError) as e:
            raise RefusedUpdateError(
                str(e), m, repairable=isinstance(e, CorruptCheckpointError)
            ) from e
    for table, got in pieces.items():
        ids = torch.cat([i for i, _ in got])
        values = torch.cat([v for _, v in got])
        i, v = last_wins(ids, values)
        out.tables[table] = TableRows(i, v)
    return out


def _check_full(
    storage: Storage,
    m: CheckpointManifest,
    shapes: dict[str, tuple[int, int]],
    pieces: dict[str, list[tuple[torch.Tensor, torch.Tensor]]],
    stored: set[str],
) -> None:
    """The full a whole version starts from sets every row of every served table (``stored``:
    the tables it holds)."""
    for table, (num_rows, _) in shapes.items():
        got = pieces.get(table, [])
        n = int(got[0][0].numel()) if got else 0
        if table not in stored:
            raise IncompatibleModelError(
                f"full {checkpoint_label(m)} at {storage.uri} holds no table {table} (it holds "
                f"{', '.join(sorted(stored)[:4]) or 'none'}{', ...' if len(stored) > 4 else ''}): "
                "the served model's tables are named by their module path in it; build "
                "LiveModel with prefix= the path of the trained model's collections; a "
                "data_parallel table is published with the dense state and is not served live"
            )
        if n != num_rows:
            raise IncompatibleModelError(
                f"full {checkpoint_label(m)} at {storage.uri} holds {n} of the {num_rows} rows "
                f"of served table {table}; it is not this model's (data_parallel tables are "
                "published with the dense state and are not served live)"
            )


def _checkpoint_rows(
    storage: Storage,
    m: CheckpointManifest,
    parts: list[RankManifest],
    shapes: dict[str, tuple[int, int]],
    out: ChainRows,
) -> dict[str, TableRows]:
    """Whole rows of checkpoint ``m`` by served table (column shards joined)."""
    by_cols: dict[str, dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]]] = {}
    for part in parts:
        for rec in part.shards:
            where = f"rank {part.rank} part of {checkpoint_label(m)} at {storage.uri}"
            if rec.table not in shapes:
                continue  # a table this serving model does not serve
            if shapes[rec.table] != (rec.num_rows, rec.num_cols):
                raise IncompatibleModelError(
                    f"{where}: table {rec.table} is ({rec.num_rows}, {rec.num_cols}), the served "
                    f"table is {shapes[rec.table]}; serve a model built with the same tables"
                )
            for ids, w in _shard_rows(storage, m, rec, out):
                by_cols.setdefault(rec.table, {}).setdefault((rec.col_offset, rec.cols), []).append(
                    (ids, w)
                )
    rows: dict[str, TableRows] = {}
    for table, ranges in by_cols.items():
        num_cols = shapes[table][1]
        spans = sorted(ranges)
        edges = [c0 for c0, _ in spans] + [num_cols]
        if edges[0] != 0 or any(c0 + n != edges[i + 1] for i, (c0, n) in enumerate(spans)):
            raise CorruptCheckpointError(
                f"{checkpoint_label(m)} at {storage.uri}: table {table}'s shards hold columns "
                f"{spans}, not a split of its {num_cols} columns"
            )
        cols = []
        ids0: torch.Tensor | None = None
        for span in spans:
            ids = torch.cat([i for i, _ in ranges[span]])
            vals = torch.cat([v for _, v in ranges[span]])
            order = torch.argsort(ids)
            ids, vals = ids.index_select(0, order), vals.index_select(0, order)
            if ids.numel() > 1 and bool((ids[1:] == ids[:-1]).any()):
                raise CorruptCheckpointError(
                    f"{checkpoint_label(m)} at {storage.uri}: table {table} holds a row twice"
                )
            if ids0 is not None and not torch.equal(ids, ids0):
                raise IncompatibleModelError(
                    f"{checkpoint_label(m)} at {storage.uri}: table {table} has rows with only "
                    "some of their columns; a row is served (and quantised) whole"
                )
            ids0 = ids
            cols.append(vals.reshape(vals.shape[0], -1))
        assert ids0 is not None
        rows[table] = TableRows(ids0, torch.cat(cols, dim=1) if len(cols) > 1 else cols[0])
    return rows


def _shard_rows(
    storage: Storage, m: CheckpointManifest, rec: ShardRecord, out: ChainRows
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    got = []
    try:
        for chunk, at, data in read_chunks(storage, m.folder, rec.chunks, zero_copy=False):
            where = f"{at} (table {rec.table}, {checkpoint_label(m)})"
            arrays = decode_chunk(data, chunk, where, allow_quantized=True, shard=rec)
            if "weight" not in arrays:
                raise CorruptCheckpointError(f"{where}: no weight segment")
            w = arrays["weight"]
            if w.dim() != 2 or w.shape[1] != rec.cols or not w.is_floating_point():
                raise CorruptCheckpointError(
                    f"{where}: weight rows of {tuple(w.shape[1:])} {w.dtype}, its shard has "
                    f"{rec.cols} columns"
                )
            out.bytes_read += len(data)
            # Copies: the data is a read buffer the next chunk replaces.
            got.append((arrays["ids"].clone(), w.clone()))
    except NotFoundError as e:
        raise CorruptCheckpointError(
            f"{e} (table {rec.table}, {checkpoint_label(m)}): a file of this committed "
            "checkpoint is missing"
        ) from None
    return got
