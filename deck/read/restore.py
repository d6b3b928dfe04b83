"""Applying a chain of checkpoints to this rank's live table shards and state."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from deck.adapters.base import TableShard, load_hyperparameters, scalar_key
from deck.errors import CorruptCheckpointError, IncompatibleModelError, NotFoundError
from deck.format import treecodec
from deck.format.checksum import checksum
from deck.format.chunks import decode_chunk, read_chunks
from deck.format.manifest import (
    CheckpointManifest,
    ChunkRecord,
    FileRecord,
    RankManifest,
    ShardRecord,
    step_dir,
)
from deck.format.quantize import QuantizedStateError
from deck.read.catalog import describe, read_rank_manifests
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


def _span(a0: int, an: int, b0: int, bn: int) -> tuple[int, int]:
    """The intersection ``[lo, hi)`` of ``[a0, a0 + an)`` and ``[b0, b0 + bn)`` (empty: lo >= hi)."""
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
        r0, r1 = _span(rec.row_offset, rec.rows, shard.row_offset, shard.rows)
        c0, c1 = _span(rec.col_offset, rec.cols, shard.col_offset, shard.cols)
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
    """

    def __init__(self) -> None:
        self._acc: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def add(self, view: torch.Tensor, local: torch.Tensor, src: torch.Tensor, cols: int) -> None:
        if id(view) not in self._acc:
            zeros = torch.zeros(view.shape[0], dtype=torch.float64)
            self._acc[id(view)] = (view, zeros, zeros.clone())
        _, total, weight = self._acc[id(view)]
        total.index_add_(0, local, src.to(torch.float64) * cols)
        weight.index_add_(0, local, torch.full((local.numel(),), float(cols), dtype=torch.float64))

    def finish(self) -> None:
        with torch.no_grad():
            for view, total, weight in self._acc.values():
                rows = torch.nonzero(weight > 0).view(-1)
                mean = total.index_select(0, rows) / weight.index_select(0, rows)
                view.index_copy_(0, rows, mean.to(view.dtype))
        self._acc.clear()


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
    quantized = [m for m in chain if m.encoding is not None]
    if quantized and not allow_quantized:
        q = quantized[0]
        raise QuantizedStateError(
            f"checkpoint {describe(q)} at {storage.uri} holds {q.encoding}-quantised weights "
            f"({len(quantized)} of the chain's {len(chain)} checkpoints do); restoring it would "
            "not give the exact state: pass allow_quantized=True to accept that, or restore a "
            "chain of exact checkpoints"
        )
    stats = RestoreStats()
    by_table: dict[str, list[TableShard]] = {}
    for s in shards:
        by_table.setdefault(s.table, []).append(s)
    parts: list[RankManifest] = []
    for i, m in enumerate(chain):
        if rank_parts is not None and m.folder in rank_parts:
            parts = rank_parts[m.folder]
        else:
            parts = read_rank_manifests(storage, m)
        stats.checkpoints += 1
        if i and m.state == chain[i - 1].state:
            # The same training state as the checkpoint just applied (a trainer checkpoint
            # reached through a merger checkpoint of its step): its rows are there already;
            # only its records (dense / extra state) are needed.
            continue
        covered: dict[int, int] = {}  # id(shard) -> rows x cols the checkpoint's records cover
        saved = {rec.table: (rec.num_rows, rec.num_cols) for p in parts for rec in p.shards}
        if i == 0 and not onto:
            _check_tables(saved, tables, f"checkpoint {describe(m)} at {storage.uri}")
        joins = _Joins()
        for part in parts:
            for rec in part.shards:
                if tables.get(rec.table) != (rec.num_rows, rec.num_cols):
                    # The full's tables are the model's (checked above): a later record naming
                    # another table or shape contradicts its chain, and skipping its rows (or
                    # indexing by them) would be silent.
                    raise CorruptCheckpointError(
                        f"{part_where(storage, m, part.rank)}: table {rec.table!r} of shape "
                        f"({rec.num_rows}, {rec.num_cols}) is not one of the tables its chain "
                        f"restores ({tables.get(rec.table, 'no such table')}); the record is "
                        "damaged or was not written by deck: run deck verify, restore another step"
                    )
                targets = _match(rec, by_table, describe(m))
                if not targets:
                    continue
                _apply_shard(storage, m, rec, targets, stats, joins, zero_copy, allow_quantized)
                for t in targets:
                    r0, r1 = _span(rec.row_offset, rec.rows, t.row_offset, t.rows)
                    c0, c1 = _span(rec.col_offset, rec.cols, t.col_offset, t.cols)
                    covered[id(t)] = covered.get(id(t), 0) + (r1 - r0) * (c1 - c0)
                    stats.resharded |= not _same_extent(rec, t)
        joins.finish()
        if i == 0 and not onto:
            uncovered = [s.table for s in shards if covered.get(id(s), 0) != s.rows * s.cols]
            if uncovered:
                raise CorruptCheckpointError(
                    f"full checkpoint {describe(m)} at {storage.uri} does not hold every row and "
                    f"column of tables {sorted(set(uncovered))}; it is incomplete: run deck verify "
                    "and restore another step"
                )
    return stats, parts


def part_where(storage: Storage, m: CheckpointManifest, rank: int) -> str:
    """How errors name the rank ``rank`` part manifest of checkpoint ``m``: its file's URI."""
    ref = next((r for r in m.ranks if r.rank == rank), None)
    if ref is None:
        return f"rank {rank} part of {describe(m)} at {storage.uri}"
    return f"{storage.describe(f'{m.folder}/{ref.path}')} ({describe(m)})"


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
            f"{e} (table {rec.table}, {describe(m)}): a file of this committed checkpoint is "
            "missing; restore(allow_fallback=True) restores around it"
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
        where = f"{at} (table {rec.table}, {describe(m)})"
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
    c0, c1 = _span(rec.col_offset, rec.cols, shard.col_offset, shard.cols)
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
        else:
            joins.add(view, local, src, c1 - c0)
    else:
        raise IncompatibleModelError(
            f"{where}: state {name} (rows of {tuple(src.shape[1:])}) cannot move from columns "
            f"[{rec.col_offset}, {rec.col_offset + rec.cols}) to the model's "
            f"[{shard.col_offset}, {shard.col_offset + shard.cols}); restore with the writer's "
            "column sharding"
        )


def rank_part(parts: list[RankManifest], rank: int) -> RankManifest:
    """The part whose extra state (dense optimizers, user state) ``rank`` loads: its own, or
    rank 0's when the checkpoint was written by fewer ranks (dense optimizer state is replicated
    across ranks; user state of a rank the writer did not have starts as rank 0's)."""
    return parts[rank] if rank < len(parts) else parts[0]


def same_layout(parts: list[RankManifest], rank: int, shards: list[TableShard]) -> bool:
    """Whether ``shards`` are exactly the shards ``rank`` saved in ``parts``. When this is false
    on any rank the restore resharded, and the next checkpoint must be a full: deltas and merged
    deltas keep one layout from their full on (the merger never mixes layouts)."""
    if rank >= len(parts):
        return not shards
    saved = [(r.table, r.row_offset, r.rows, r.col_offset, r.cols) for r in parts[rank].shards]
    return saved == [(s.table, s.row_offset, s.rows, s.col_offset, s.cols) for s in shards]


def shard_scalars(
    storage: Storage,
    step: int,
    parts: list[RankManifest],
    own_extra: dict[str, Any],
    shards: list[TableShard],
) -> dict[int, dict[str, torch.Tensor]]:
    """The saved per-shard scalars (states without a row dimension) of each of ``shards`` (by
    ``id``): the shard's own entry in ``own_extra`` when the writer had the same shard, else the
    entry of a saved shard of the same table that overlaps it (read from that rank's extra
    file), since such scalars (e.g. an iteration count) are the table's. Raises
    :class:`IncompatibleModelError` when no saved shard of the table has them."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    extras: dict[int, dict[str, Any]] = {}
    for s in shards:
        if not s.scalars:
            continue
        found = own_extra.get("scalars", {}).get(scalar_key(s))
        for part in parts if found is None else ():
            for rec in part.shards:
                r0, r1 = _span(rec.row_offset, rec.rows, s.row_offset, s.rows)
                c0, c1 = _span(rec.col_offset, rec.cols, s.col_offset, s.cols)
                if rec.table != s.table or r0 >= r1 or c0 >= c1:
                    continue
                if part.rank not in extras:
                    extras[part.rank] = read_state_file(storage, step, part.extra)
                found = (
                    extras[part.rank]
                    .get("scalars", {})
                    .get(f"{rec.table}|{rec.row_offset}|{rec.col_offset}")
                )
                if found is not None:
                    break
            if found is not None:
                break
        if found is None:
            raise IncompatibleModelError(
                f"table {s.table}: step {step} at {storage.uri} has no saved {sorted(s.scalars)} for "
                f"rows {s.row_offset}+{s.rows}, columns {s.col_offset}+{s.cols}; use the same fused optimizer"
            )
        out[id(s)] = found
    return out


def read_state_file(storage: Storage, step: int | CheckpointManifest, rec: FileRecord) -> Any:
    """Read, verify and decode a dense / extra state file of a checkpoint: ``step`` is the
    trainer step (its step folder) or the checkpoint's record (its own folder; needed for the
    merger's checkpoints)."""
    if isinstance(step, CheckpointManifest):
        key = f"{step.folder}/{rec.path}"
        where = f"{storage.describe(key)} ({describe(step)})"
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


# Keys of an extra state file that hold a mapping whenever they are present (docs/format.md,
# "Dense and extra state"); readers index them by key.
_SCALAR_KEY = re.compile(r"^.+\|\d+\|\d+$")  # deck.adapters.base.scalar_key: table|row|col
_EXTRA_MAPPINGS = (
    "optimizers",
    "wrappers",
    "fused_hyperparameters",
    "scalars",
    "rank_local",
    "rng",
)


def _check_state_shape(tree: dict[str, Any], rec: FileRecord, where: str) -> None:
    """The top of a decoded state file is what its readers index: a dense file maps names to
    tensors; an extra file's mapping keys hold mappings (``scalars``: of tensors). Anything else
    is :class:`CorruptCheckpointError` naming the file, not a TypeError in a reader."""
    if rec.path.rsplit("/", 1)[-1] == "dense.safetensors":
        bad = [k for k, v in tree.items() if not isinstance(v, torch.Tensor)]
    else:
        bad = [k for k in _EXTRA_MAPPINGS if k in tree and not isinstance(tree[k], dict)]
        scalars = tree.get("scalars", {})
        if isinstance(scalars, dict):
            bad += [
                f"scalars.{k}"
                for k, v in scalars.items()
                if not _SCALAR_KEY.match(str(k))
                or not isinstance(v, dict)
                or not all(isinstance(t, torch.Tensor) for t in v.values())
            ]
    if bad:
        raise CorruptCheckpointError(
            f"{where}: state file entries {sorted(bad)[:5]} do not have the types deck writes; "
            "the file is damaged or was not written by deck"
        )


def load_optimizer(opt: torch.optim.Optimizer, saved: dict[str, Any], name: str) -> None:
    """Load a saved ``{"state_dict", "param_groups"}`` into ``opt`` exactly.

    Afterwards exactly the parameters that had optimizer state when it was saved have state,
    with the saved values: a parameter that never got a gradient (no state yet) has none after
    the load either, whatever ``opt`` held before. Plain torch optimizers do this themselves;
    a keyed optimizer (TorchRec's ``KeyedOptimizer``, whose strict load copies into existing
    state of the same parameters) is first given state for exactly the saved parameters.
    """
    sd = saved["state_dict"]
    params = getattr(opt, "params", None)
    init = getattr(opt, "init_state", None)
    if isinstance(params, Mapping) and init is not None:
        _match_keyed_state(opt, params, init, set(sd.get("state", {})), name)
    try:
        opt.load_state_dict(sd)
    except (ValueError, KeyError, RuntimeError) as e:
        raise IncompatibleModelError(f"optimizer {name}: saved state does not fit ({e})") from None
    load_hyperparameters(opt, saved.get("param_groups", []), f"optimizer {name}")


def _match_keyed_state(
    opt: torch.optim.Optimizer,
    params: Mapping[str, Any],
    init: Callable[[], None],
    saved_keys: set[str],
    name: str,
) -> None:
    """Give a keyed optimizer state for exactly the parameters in ``saved_keys``.

    TorchRec's strict load refuses a different number of states and only copies into tensors
    that exist. Optimizer state is created lazily by a step, so missing state is made by
    ``init_state()`` (a zero-gradient step over every parameter; the values it writes are all
    overwritten by the load and the dense parameters restored after it, and the gradients it
    sets are put back), then state of parameters the checkpoint had none for is dropped.
    """
    unknown = sorted(saved_keys - set(params))
    if unknown:
        raise IncompatibleModelError(
            f"optimizer {name}: saved state for parameters the model does not have: "
            f"{unknown[:5]}; restore into the model the checkpoint was written from"
        )
    state = opt.state
    if any(params[k] not in state for k in saved_keys):
        grads = {k: p.grad for k, p in params.items()}
        init()
        for k, p in params.items():
            p.grad = grads[k]
        missing = sorted(k for k in saved_keys if params[k] not in state)
        if missing:
            raise IncompatibleModelError(
                f"optimizer {name}: no state can be made for {missing[:5]} (does the parameter "
                "require grad?); restore into the model the checkpoint was written from"
            )
    for k, p in params.items():
        if k not in saved_keys and p in state:
            del state[p]  # no state when saved (never had a gradient): none now either


# ---- tables that are data_parallel on one side and sharded on the other ---------------------


@dataclass
class PlanMoves:
    """Tables that a checkpoint and the model keep differently.

    ``to_replicated``: sharded (row records) in the checkpoint, data_parallel in the model. Their
    rows are applied into ``staging`` shards (a whole-table weight, a copy of the live tensor)
    and then loaded with the dense state, after the dense optimizer (whose init may step).
    ``from_replicated``: data_parallel in the checkpoint (a tensor of its dense state), sharded in
    the model: their shards get the saved weight and fresh (zero) fused optimizer states.
    """

    to_replicated: dict[str, TableShard]
    from_replicated: list[str]

    @property
    def tables(self) -> set[str]:
        return set(self.to_replicated) | set(self.from_replicated)


def plan_moves(
    storage: Storage,
    chain: list[CheckpointManifest],
    tables: dict[str, tuple[int, int]],
    replicated: dict[str, torch.Tensor],
    saved_dense: dict[str, torch.Tensor],
) -> PlanMoves:
    """Which tables of the model change between data_parallel and sharded from ``chain``'s full
    (whose rank manifests say which tables it holds as rows) and the saved dense state."""
    saved = {rec.table for p in read_rank_manifests(storage, chain[0]) for rec in p.shards}
    staging = {}
    for key, live in replicated.items():
        if key in saved and key not in tables and live.dim() == 2:
            rows, cols = (int(x) for x in live.shape)
            staging[key] = TableShard(
                key,
                rows,
                cols,
                0,
                rows,
                0,
                cols,
                {"weight": live.detach().clone()},
                replicated=True,
            )
    from_dense = sorted(k for k in tables if k not in saved and k in saved_dense)
    return PlanMoves(staging, from_dense)


def fill_from_dense(
    moves: PlanMoves, shards: list[TableShard], saved_dense: dict[str, torch.Tensor], where: str
) -> None:
    """Write each ``from_replicated`` table's saved weight (popped from ``saved_dense``) into
    this rank's shards of it, and zero their other per-row states (as a new TBE starts them)."""
    for key in moves.from_replicated:
        full = saved_dense.pop(key)
        for s in (s for s in shards if s.table == key):
            if tuple(full.shape) != (s.num_rows, s.num_cols):
                raise IncompatibleModelError(
                    f"table {key}: {where} has shape {tuple(full.shape)}, the model has "
                    f"({s.num_rows}, {s.num_cols}); build the model with the same tables"
                )
            with torch.no_grad():
                for name, view in s.states.items():
                    if name == "weight":
                        part = full[s.row_offset : s.row_offset + s.rows]
                        view.copy_(part[:, s.col_offset : s.col_offset + s.cols].to(view.dtype))
                    else:
                        view.zero_()
        logger.warning(
            "deck: table %s was data_parallel in %s and is sharded in this model: its weights are "
            "restored exactly; its fused optimizer state starts fresh (zero), since the saved "
            "per-element state of the dense optimizer does not fit the fused per-row layout",
            key,
            where,
        )
    for key in moves.to_replicated:
        logger.warning(
            "deck: table %s was sharded in %s and is data_parallel in this model: its weights are "
            "restored exactly; its per-row fused optimizer state is not carried over (the dense "
            "optimizer keeps its own state for it, as it starts)",
            key,
            where,
        )


def reconcile_optimizer(
    opt: torch.optim.Optimizer, saved: dict[str, Any], moved: set[str]
) -> dict[str, Any]:
    """The saved state of a TorchRec KeyedOptimizer (``{"state_dict", "param_groups"}``), fitted
    to ``opt`` when the tables ``moved`` changed between data_parallel and sharded: saved states
    of moved tables the optimizer no longer has are dropped; moved tables it has now keep their
    live state. Other optimizers, or nothing moved: ``saved`` unchanged."""
    params = getattr(opt, "params", None)
    sd = saved["state_dict"]
    if not moved or not isinstance(params, dict) or "state" not in sd:
        return saved

    def is_moved(k: str) -> bool:
        return any(k == m or k.endswith("." + m) for m in moved)

    state = dict(sd["state"])
    dropped = {k for k in state if k not in params and is_moved(k)}
    added = [k for k in params if k not in state and is_moved(k)]
    if not dropped and not added:
        return saved
    for k in dropped:
        del state[k]
    if added and not opt.state:
        init = getattr(opt, "init_state", None)
        if init is not None:
            init()
    live = opt.state_dict()
    for k in added:
        if k in live["state"]:
            state[k] = live["state"][k]
    groups = [dict(g) for g in sd.get("param_groups", [])]
    for i, g in enumerate(groups):
        keep = [k for k in g.get("params", []) if k not in dropped]
        if i < len(live["param_groups"]):
            keep += [k for k in live["param_groups"][i]["params"] if k in added]
        g["params"] = keep
    return {**saved, "state_dict": {**sd, "state": state, "param_groups": groups}}
