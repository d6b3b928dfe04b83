"""Applying a chain of checkpoints to table shards, and reading its dense / extra state files.

Any process uses it (the trainer's loader, ``deck export``, ``deck follow``, verification): it
writes only into the shards it is given. Fitting the rest of a checkpoint to a live model and
its optimizers is the trainer's (:mod:`deck.trainer.fitting`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from deck.errors import CorruptCheckpointError, IncompatibleModelError, NotFoundError
from deck.format import treecodec
from deck.format.checksum import checksum
from deck.format.chunk_io import read_chunks
from deck.format.chunks import DTYPES, decode_chunk
from deck.format.manifest import (
    CheckpointManifest,
    ChunkRecord,
    FileRecord,
    RankManifest,
    ShardRecord,
    step_dir,
)
from deck.format.quantize import QUANTIZED_ADVICE, QuantizedStateError
from deck.format.statefile import EXTRA_MAPPINGS, is_scalar_key
from deck.model import TableShard
from deck.read.catalog import checkpoint_label, part_where, read_rank_manifests
from deck.storage import Storage

logger = logging.getLogger(__name__)


@dataclass
class RestoreStats:
    """What a restore read on this rank."""

    checkpoints: int = 0
    chunks: int = 0
    bytes: int = 0
    rows: int = 0
    # Rows went into shards with other row / column ranges than the ones that saved them.
    resharded: bool = False
    # restore(allow_fallback=True) had to skip damaged checkpoints or steps: what and why.
    fallback: str | None = None
    # Rows of the restored state whose per-row state is the column-weighted mean of saved
    # column shards' values that differ, an approximation ("table state": rows).
    approximated: dict[str, int] = field(default_factory=dict)


def span(a0: int, an: int, b0: int, bn: int) -> tuple[int, int]:
    """Where a saved and a live shard overlap along one axis: the intersection ``[lo, hi)`` of
    ``[a0, a0 + an)`` and ``[b0, b0 + bn)`` (empty: lo >= hi)."""
    return max(a0, b0), min(a0 + an, b0 + bn)


def _match(
    rec: ShardRecord, shards_by_table: dict[str, list[TableShard]], where: str
) -> list[TableShard]:
    """Local shards that hold some of the rows x columns of ``rec``; raises when the model
    cannot hold them."""
    local = shards_by_table.get(rec.table)
    if local is None:
        return []
    out = []
    for shard in local:
        if (rec.num_rows, rec.num_cols) != (shard.num_rows, shard.num_cols):
            raise IncompatibleModelError(
                f"table {rec.table}: checkpoint {where} has shape ({rec.num_rows}, {rec.num_cols}), "
                f"the model has ({shard.num_rows}, {shard.num_cols}); build the model with the same tables"
            )
        r0, r1 = span(rec.row_offset, rec.rows, shard.row_offset, shard.rows)
        c0, c1 = span(rec.col_offset, rec.cols, shard.col_offset, shard.cols)
        if r0 >= r1 or c0 >= c1:
            continue
        partial = shard.replicated and set(shard.states) <= set(rec.states)
        if set(rec.states) != set(shard.states) and not partial:
            raise IncompatibleModelError(
                f"table {rec.table}: checkpoint {where} has states {sorted(rec.states)}, the model's "
                f"optimizer has {sorted(shard.states)}; use the same fused optimizer"
            )
        out.append(shard)
    return out


def _check_states(
    parts: list[RankManifest], by_table: dict[str, list[TableShard]], where: str
) -> None:
    """Before anything is written: every saved shard's states fit the local shards it lands in
    -- the same names (:func:`_match`), and rows of the same rank and dtype (a fused optimizer
    changed between save and restore, e.g. row-wise to element-wise Adagrad, was found only
    while writing, the tables written before it overwritten)."""
    for p in parts:
        for rec in p.shards:
            targets = _match(rec, by_table, where)
            saved = {seg.name: seg for c in rec.chunks[:1] for seg in c.segments}
            for shard in targets:
                for name, view in shard.states.items():
                    seg = saved.get(name)
                    if seg is None:
                        continue
                    dtype = DTYPES.get(seg.source_dtype or seg.dtype)
                    if len(seg.shape) != view.dim() or dtype != view.dtype:
                        raise IncompatibleModelError(
                            f"table {rec.table}: checkpoint {where} saved state {name} as "
                            f"{seg.source_dtype or seg.dtype} rows of shape {tuple(seg.shape[1:])}, "
                            f"the model has {str(view.dtype).removeprefix('torch.')} rows of shape "
                            f"{tuple(view.shape[1:])}; use the same fused optimizer and dtypes"
                        )


def _same_extent(rec: ShardRecord, shard: TableShard) -> bool:
    return (rec.row_offset, rec.rows, rec.col_offset, rec.cols) == (
        shard.row_offset,
        shard.rows,
        shard.col_offset,
        shard.cols,
    )


class _Joins:
    """Per-row states of target shards whose columns come from several saved column shards.

    Each saved shard adds its row values weighted by how many of the target's columns it holds;
    :meth:`finish` writes the weighted mean once a checkpoint's records are all read. The sums are
    float64, so equal values average to exactly that value (``v * a + v * b`` and its division by
    ``a + b`` are exact for float32 / bfloat16 / float16 values and column counts below 2**29).
    Rows whose saved values disagree get an approximation. One instance serves a whole chain:
    a row stays approximated until a later checkpoint writes it exactly, so :meth:`count` gives
    the rows approximated in the state restored, not in any one checkpoint.
    """

    def __init__(self) -> None:
        self._acc: dict[int, _Join] = {}
        # By id(view) (the shard's state tensor, alive for the whole chain): its name and which
        # of its rows hold a mean of values that differ.
        self._approx: dict[int, tuple[str, torch.Tensor]] = {}

    def add(
        self, view: torch.Tensor, local: torch.Tensor, src: torch.Tensor, cols: int, what: str
    ) -> None:
        if id(view) not in self._acc:
            self._acc[id(view)] = _Join(view, what)
        join = self._acc[id(view)]
        values = src.to(torch.float64)
        join.total.index_add_(0, local, values * cols)
        join.weight.index_add_(
            0, local, torch.full((local.numel(),), float(cols), dtype=torch.float64)
        )
        seen = join.first.index_select(0, local)
        fresh = torch.isnan(seen)
        join.first.index_copy_(0, local[fresh], values[fresh])
        join.differs.index_fill_(0, local[~fresh][values[~fresh] != seen[~fresh]], True)

    def exact(self, view: torch.Tensor, local: torch.Tensor) -> None:
        """Rows ``local`` of ``view`` were written whole from one saved shard."""
        held = self._approx.get(id(view))
        if held is not None:
            held[1].index_fill_(0, local, False)

    def finish(self) -> None:
        """Write the means of the checkpoint just read."""
        with torch.no_grad():
            for key, join in self._acc.items():
                rows = torch.nonzero(join.weight > 0).view(-1)
                mean = join.total.index_select(0, rows) / join.weight.index_select(0, rows)
                join.view.index_copy_(0, rows, mean.to(join.view.dtype))
                mask = self._approx.setdefault(
                    key, (join.what, torch.zeros(join.view.shape[0], dtype=torch.bool))
                )[1]
                mask.index_copy_(0, rows, join.differs.index_select(0, rows))
        self._acc.clear()

    def count(self) -> dict[str, int]:
        """Rows holding an approximation now, by ``"<table> <state>"`` (none: left out)."""
        out: dict[str, int] = {}
        for what, mask in self._approx.values():
            n = int(mask.sum())
            if n:
                out[what] = out.get(what, 0) + n
        return out


@dataclass
class _Join:
    """One target state's sums (float64), and which rows' saved values differ."""

    view: torch.Tensor
    what: str

    def __post_init__(self) -> None:
        n = self.view.shape[0]
        self.total = torch.zeros(n, dtype=torch.float64)
        self.weight = torch.zeros(n, dtype=torch.float64)
        self.first = torch.full((n,), float("nan"), dtype=torch.float64)
        self.differs = torch.zeros(n, dtype=torch.bool)


def apply_chain(
    storage: Storage,
    chain: list[CheckpointManifest],
    shards: list[TableShard],
    tables: dict[str, tuple[int, int]],
    zero_copy: bool = True,
    onto: bool = False,
    allow_quantized: bool = False,
    rank_parts: Mapping[str, list[RankManifest]] | None = None,
) -> tuple[RestoreStats, list[RankManifest]]:
    """Write the rows of ``chain`` (full first, then deltas / merged deltas in order; newest row
    wins) into ``shards``. Returns read statistics and the rank manifests of the last checkpoint.

    Each checkpoint's files are read from its own folder (``m.folder``: a trainer step folder or
    a merger folder). A checkpoint reproducing the same state as the one before it (``m.state``)
    adds no rows and is not read again. A failure part-way leaves the shards half-written; applying another chain
    afterwards is safe, since every chain starts with a full that rewrites every row.

    ``tables`` are the model's tables (all ranks) with their shapes: the full must hold exactly
    these, with the same shapes, and cover every local shard; every chunk is checksum-verified.

    The shards may be laid out differently from the writer's (another world size, row split or
    column split; even checkpoint by checkpoint): each saved row goes to every shard holding some
    of its rows and columns. Weights and states with one value per column (``rows x cols``, e.g.
    Adam / exact Adagrad momentum) move column by column, bitwise. States with one value per row
    (e.g. rowwise Adagrad's ``momentum1``, kept per column shard) go whole to every target shard
    whose columns lie inside the saved shard (a split, exact); a target whose columns span
    several saved shards gets the mean of their values weighted by the columns each contributes
    (a join: exact when the values agree, as after a split). Any other state shape must keep its
    column range, or :class:`IncompatibleModelError` names it.

    With ``zero_copy`` (the default) and a :class:`LocalStorage`, chunk files are memory-mapped
    and rows are copied straight from the mapping into the shards (Portus-style: no read into
    Python bytes, no deserialisation); the checksum is verified over the mapping all the same.
    Any other store, or ``zero_copy=False``, reads each file whole with ``iter_get``.

    ``onto``: the shards already hold the state ``chain[0]`` builds on (its parent), so the
    chain may start with a delta and only its rows are written (``deck follow``'s catch-up).

    A chain holding quantised checkpoints (written with ``quantize``, see deck.format.quantize) raises
    :class:`deck.format.quantize.QuantizedStateError` (an :class:`IncompatibleModelError`) before
    anything is changed, unless ``allow_quantized``: then their weights are dequantised, within
    the encoding's documented error bound, and every exact checkpoint still restores bitwise.

    ``rank_parts``: rank manifests already read with :func:`deck.read.catalog.read_rank_manifests`,
    by checkpoint folder (a caller applying one chain many times reads them once).
    """
    _refuse_quantized(storage, chain, allow_quantized)
    stats = RestoreStats()
    by_table: dict[str, list[TableShard]] = {}
    for s in shards:
        by_table.setdefault(s.table, []).append(s)
    parts: list[RankManifest] = []
    joins = _Joins()
    for i, m in enumerate(chain):
        parts = _rank_parts(storage, m, rank_parts)
        stats.checkpoints += 1
        if i and m.state == chain[i - 1].state:
            # The same training state as the checkpoint just applied (a trainer checkpoint
            # reached through a merger checkpoint of its step): its rows are there already;
            # only its records (dense / extra state) are needed.
            continue
        # The full a chain starts from (not a delta applied onto shards that hold its parent)
        # must hold exactly the model's tables (checked before it writes anything) and cover
        # every local shard.
        first_full = i == 0 and not onto
        if first_full:
            saved = {rec.table: (rec.num_rows, rec.num_cols) for p in parts for rec in p.shards}
            where = f"{checkpoint_label(m)} at {storage.uri}"
            if m is not chain[-1]:
                where += f" (the full step {chain[-1].step} is restored from)"
            _check_tables(saved, tables, f"checkpoint {where}")
            _check_states(parts, by_table, where)
        covered = _apply_checkpoint(
            storage, m, parts, by_table, tables, stats, joins, zero_copy, allow_quantized
        )
        if first_full:
            _check_covered(storage, m, shards, covered)
    stats.approximated = joins.count()
    if stats.approximated:
        logger.warning(
            "deck: restoring %s into another column split joined per-row optimizer state from "
            "column shards whose saved values differ: %s hold their column-weighted mean, an "
            "approximation (docs/format.md, 'Restoring into another layout'); restore with the "
            "writer's column sharding to get them bitwise",
            checkpoint_label(chain[-1]),
            ", ".join(f"{k} ({n} rows)" for k, n in sorted(stats.approximated.items())),
        )
    return stats, parts


def _refuse_quantized(
    storage: Storage, chain: list[CheckpointManifest], allow_quantized: bool
) -> None:
    """Quantised checkpoints restore only with the caller's opt-in, refused before anything is
    changed."""
    quantized = [m for m in chain if m.encoding is not None]
    if quantized and not allow_quantized:
        q = quantized[0]
        raise QuantizedStateError(
            f"checkpoint {checkpoint_label(q)} at {storage.uri} holds {q.encoding}-quantised "
            "weights "
            f"({len(quantized)} of the chain's {len(chain)} checkpoints do), not the exact "
            f"state {QUANTIZED_ADVICE}"
        )


def _rank_parts(
    storage: Storage,
    m: CheckpointManifest,
    rank_parts: Mapping[str, list[RankManifest]] | None,
) -> list[RankManifest]:
    """The rank manifests of ``m``: the caller's, read already, or read now."""
    if rank_parts is not None and m.folder in rank_parts:
        return rank_parts[m.folder]
    return read_rank_manifests(storage, m)


def _apply_checkpoint(
    storage: Storage,
    m: CheckpointManifest,
    parts: list[RankManifest],
    by_table: dict[str, list[TableShard]],
    tables: dict[str, tuple[int, int]],
    stats: RestoreStats,
    joins: _Joins,
    zero_copy: bool,
    allow_quantized: bool,
) -> dict[int, int]:
    """Write the rows of checkpoint ``m`` (its rank manifests ``parts``) into the local shards
    that hold some of them; joined per-row states are written once all its records are read.
    Returns, by ``id(shard)``, how many of the shard's rows x columns its records cover."""
    covered: dict[int, int] = {}
    for part in parts:
        for rec in part.shards:
            _check_chain_table(storage, m, part, rec, tables)
            targets = _match(rec, by_table, checkpoint_label(m))
            if not targets:
                continue
            _apply_shard(storage, m, rec, targets, stats, joins, zero_copy, allow_quantized)
            for t in targets:
                r0, r1 = span(rec.row_offset, rec.rows, t.row_offset, t.rows)
                c0, c1 = span(rec.col_offset, rec.cols, t.col_offset, t.cols)
                covered[id(t)] = covered.get(id(t), 0) + (r1 - r0) * (c1 - c0)
                stats.resharded |= not _same_extent(rec, t)
    joins.finish()
    return covered


def _check_chain_table(
    storage: Storage,
    m: CheckpointManifest,
    part: RankManifest,
    rec: ShardRecord,
    tables: dict[str, tuple[int, int]],
) -> None:
    """Every record of a chain names one of the tables it restores, with its shape."""
    if tables.get(rec.table) != (rec.num_rows, rec.num_cols):
        # The full's tables are the model's (checked first): a later record naming another
        # table or shape contradicts its chain, and skipping its rows (or indexing by them)
        # would be silent.
        raise CorruptCheckpointError(
            f"{part_where(storage, m, part.rank)}: table {rec.table!r} of shape "
            f"({rec.num_rows}, {rec.num_cols}) is not one of the tables its chain "
            f"restores ({tables.get(rec.table, 'no such table')}); the record is "
            "damaged or was not written by deck: run deck verify, restore another step"
        )


def _check_covered(
    storage: Storage, m: CheckpointManifest, shards: list[TableShard], covered: dict[int, int]
) -> None:
    """The full a chain starts from wrote every row and column of every local shard."""
    uncovered = [s.table for s in shards if covered.get(id(s), 0) != s.rows * s.cols]
    if uncovered:
        raise CorruptCheckpointError(
            f"full checkpoint {checkpoint_label(m)} at {storage.uri} does not hold every "
            f"row and column of tables {sorted(set(uncovered))}; it is incomplete: run deck verify "
            "and restore another step"
        )


def _check_tables(
    saved: dict[str, tuple[int, int]], model: dict[str, tuple[int, int]], where: str
) -> None:
    missing = sorted(set(model) - set(saved))
    extra = sorted(set(saved) - set(model))
    shapes = [
        f"{t}: {saved[t]} saved, {model[t]} in model"
        for t in sorted(set(saved) & set(model))
        if saved[t] != model[t]
    ]
    if missing or extra or shapes:
        parts = []
        if missing:
            parts.append(f"model tables missing from the checkpoint: {missing}")
        if extra:
            parts.append(f"checkpoint tables not in the model: {extra}")
        if shapes:
            parts.append(f"table shapes differ: {shapes}")
        raise IncompatibleModelError(
            f"{where} does not fit the model ({'; '.join(parts)}); build the model with the same tables"
        )


def _committed_chunks(
    storage: Storage, m: CheckpointManifest, rec: ShardRecord, zero_copy: bool
) -> Iterator[tuple[ChunkRecord, str, bytes | memoryview]]:
    """:func:`read_chunks` of committed checkpoint ``m``, where a missing file is damage like a
    wrong byte: :class:`CorruptCheckpointError` naming the file, so that
    ``restore(allow_fallback=True)`` goes around it (a plain NotFoundError would not)."""
    try:
        yield from read_chunks(storage, m.folder, rec.chunks, zero_copy)
    except NotFoundError as e:
        raise CorruptCheckpointError(
            f"{e} (table {rec.table}, {checkpoint_label(m)}): a file of this committed "
            "checkpoint is missing"
        ) from None


def _apply_shard(
    storage: Storage,
    m: CheckpointManifest,
    rec: ShardRecord,
    targets: list[TableShard],
    stats: RestoreStats,
    joins: _Joins,
    zero_copy: bool,
    allow_quantized: bool = False,
) -> None:
    for chunk, at, data in _committed_chunks(storage, m, rec, zero_copy):
        where = f"{at} (table {rec.table}, {checkpoint_label(m)})"
        # With the shard's record: ids ascending inside its rows, so every index below is in range.
        arrays = decode_chunk(data, chunk, where, allow_quantized, shard=rec)
        ids = arrays["ids"]
        stats.chunks += 1
        stats.bytes += len(data)
        stats.rows += int(ids.numel())
        for shard in targets:
            local = ids - shard.row_offset
            sel: torch.Tensor | None = None
            if rec.row_offset != shard.row_offset or rec.rows != shard.rows:
                keep = (local >= 0) & (local < shard.rows)
                sel = torch.nonzero(keep).view(-1)
                local = local.index_select(0, sel)
            with torch.no_grad():
                for name, view in shard.states.items():
                    src = arrays[name] if sel is None else arrays[name].index_select(0, sel)
                    _copy_state(rec, shard, name, view, src, local, joins, where)


def _copy_state(
    rec: ShardRecord,
    shard: TableShard,
    name: str,
    view: torch.Tensor,
    src: torch.Tensor,
    local: torch.Tensor,
    joins: _Joins,
    where: str,
) -> None:
    """Rows ``src`` of state ``name`` saved by ``rec`` into local rows ``local`` of ``view``."""
    c0, c1 = span(rec.col_offset, rec.cols, shard.col_offset, shard.cols)
    if src.dtype != view.dtype:
        raise IncompatibleModelError(
            f"{where}: state {name} is {src.dtype}, the model has {view.dtype}; "
            "use the same embedding and optimizer dtypes"
        )
    if (rec.col_offset, rec.cols) == (shard.col_offset, shard.cols):
        if src.shape[1:] != view.shape[1:]:
            raise IncompatibleModelError(
                f"{where}: state {name} rows are {tuple(src.shape[1:])}, the model has "
                f"{tuple(view.shape[1:])}; use the same fused optimizer"
            )
        view.index_copy_(0, local, src)
        joins.exact(view, local)
    elif (
        src.dim() == 2
        and view.dim() == 2
        and (src.shape[1], view.shape[1])
        == (
            rec.cols,
            shard.cols,
        )
    ):
        # One value per column (weight, exact Adagrad / Adam momentum): move the shared columns.
        view[:, c0 - shard.col_offset : c1 - shard.col_offset].index_copy_(
            0, local, src[:, c0 - rec.col_offset : c1 - rec.col_offset]
        )
    elif src.dim() == 1 and view.dim() == 1:
        # One value per row of a column shard (rowwise Adagrad): whole when the saved shard holds
        # all the target's columns, else the column-weighted mean of the saved shards (_Joins).
        if c0 == shard.col_offset and c1 == shard.col_offset + shard.cols:
            view.index_copy_(0, local, src)
            joins.exact(view, local)
        else:
            joins.add(view, local, src, c1 - c0, f"{rec.table} {name}")
    else:
        raise IncompatibleModelError(
            f"{where}: state {name} (rows of {tuple(src.shape[1:])}) cannot move from columns "
            f"[{rec.col_offset}, {rec.col_offset + rec.cols}) to the model's "
            f"[{shard.col_offset}, {shard.col_offset + shard.cols}); restore with the writer's "
            "column sharding"
        )


def read_state_file(storage: Storage, step: int | CheckpointManifest, rec: FileRecord) -> Any:
    """Read, verify and decode a dense / extra state file of a checkpoint: ``step`` is the
    trainer step (its step folder) or the checkpoint's record (its own folder; needed for the
    merger's checkpoints)."""
    if isinstance(step, CheckpointManifest):
        key = f"{step.folder}/{rec.path}"
        where = f"{storage.describe(key)} ({checkpoint_label(step)})"
    else:
        key = f"{step_dir(step)}/{rec.path}"
        where = f"{storage.describe(key)} (step {step})"
    try:
        data = storage.get(key, 0, rec.nbytes + 1)  # never more than the record says (+1)
    except NotFoundError:
        raise CorruptCheckpointError(f"{where}: file is missing") from None
    return decode_state_file(data, rec, where)


def decode_state_file(data: bytes, rec: FileRecord, where: str) -> dict[str, Any]:
    """The state tree of dense / extra state file ``rec`` (its bytes ``data``): size and
    checksum checked, decoded (bounded depth), and its top level of the types its readers
    index (:func:`_check_state_shape`); else :class:`CorruptCheckpointError` naming ``where``."""
    if len(data) != rec.nbytes or checksum(data) != rec.checksum:
        raise CorruptCheckpointError(f"{where}: size or checksum mismatch (file is corrupt)")
    tree: dict[str, Any] = treecodec.decode(data, where, expect=dict)
    _check_state_shape(tree, rec, where)
    return tree


def _check_state_shape(tree: dict[str, Any], rec: FileRecord, where: str) -> None:
    """The top of a decoded state file is what its readers index: a dense file maps names to
    tensors; an extra file's mapping keys hold mappings (``scalars``: of tensors). Anything else
    is :class:`CorruptCheckpointError` naming the file, not a TypeError in a reader."""
    if rec.path.rsplit("/", 1)[-1] == "dense.safetensors":
        bad = [k for k, v in tree.items() if not isinstance(v, torch.Tensor)]
    else:
        bad = [k for k in EXTRA_MAPPINGS if k in tree and not isinstance(tree[k], dict)]
        scalars = tree.get("scalars", {})
        if isinstance(scalars, dict):
            bad += [
                f"scalars.{k}"
                for k, v in scalars.items()
                if not is_scalar_key(k)
                or not isinstance(v, dict)
                or not all(isinstance(t, torch.Tensor) for t in v.values())
            ]
    if bad:
        raise CorruptCheckpointError(
            f"{where}: state file entries {sorted(bad)[:5]} do not have the types deck writes; "
            "the file is damaged or was not written by deck"
        )
