"""Applying a chain of checkpoints to this rank's live table shards and state."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from deck import treecodec
from deck.adapters.base import TableShard
from deck.catalog import describe, read_rank_manifests
from deck.chunks import checksum, decode_chunk
from deck.errors import CorruptCheckpointError, IncompatibleModelError, NotFoundError
from deck.format import CheckpointManifest, FileRecord, RankManifest, ShardRecord, step_dir
from deck.storage import Storage

logger = logging.getLogger(__name__)


@dataclass
class RestoreStats:
    """What a restore read on this rank."""

    checkpoints: int = 0
    chunks: int = 0
    bytes: int = 0
    rows: int = 0


def _match(
    rec: ShardRecord, shards_by_table: dict[str, list[TableShard]], where: str
) -> list[TableShard]:
    """Local shards that hold rows of ``rec``; raises when the model cannot hold them."""
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
        if (rec.col_offset, rec.cols) != (shard.col_offset, shard.cols):
            continue
        if (
            rec.row_offset >= shard.row_offset + shard.rows
            or shard.row_offset >= rec.row_offset + rec.rows
        ):
            continue
        if set(rec.states) != set(shard.states):
            raise IncompatibleModelError(
                f"table {rec.table}: checkpoint {where} has states {sorted(rec.states)}, the model's "
                f"optimizer has {sorted(shard.states)}; use the same fused optimizer"
            )
        out.append(shard)
    return out


def apply_chain(
    storage: Storage,
    chain: list[CheckpointManifest],
    shards: list[TableShard],
    tables: dict[str, tuple[int, int]],
) -> tuple[RestoreStats, list[RankManifest]]:
    """Write the rows of ``chain`` (full first, then deltas / merged deltas in order; newest row
    wins) into ``shards``. Returns read statistics and the rank manifests of the last checkpoint.

    Each checkpoint's files are read from its own folder (``m.folder``: a trainer step folder or
    a merger folder). A checkpoint reproducing the same state as the one before it (``m.state``)
    adds no rows and is not read again. A failure part-way leaves the shards half-written; applying another chain
    afterwards is safe, since every chain starts with a full that rewrites every row.

    ``tables`` are the model's tables (all ranks) with their shapes: the full must hold exactly
    these, with the same shapes, and cover every local shard; every chunk is checksum-verified.
    """
    stats = RestoreStats()
    by_table: dict[str, list[TableShard]] = {}
    for s in shards:
        by_table.setdefault(s.table, []).append(s)
    parts: list[RankManifest] = []
    for i, m in enumerate(chain):
        parts = read_rank_manifests(storage, m)
        stats.checkpoints += 1
        if i and m.state == chain[i - 1].state:
            # The same training state as the checkpoint just applied (a trainer checkpoint
            # reached through a merger checkpoint of its step): its rows are there already;
            # only its records (dense / extra state) are needed.
            continue
        covered: set[tuple[str, int, int]] = set()
        saved = {rec.table: (rec.num_rows, rec.num_cols) for p in parts for rec in p.shards}
        if i == 0:
            _check_tables(saved, tables, f"checkpoint {describe(m)} at {storage.uri}")
        for part in parts:
            for rec in part.shards:
                targets = _match(rec, by_table, describe(m))
                if not targets:
                    continue
                _apply_shard(storage, m, rec, targets, stats)
                covered.update((t.table, t.row_offset, t.col_offset) for t in targets)
        if i == 0:
            uncovered = [
                s.table for s in shards if (s.table, s.row_offset, s.col_offset) not in covered
            ]
            if uncovered:
                raise IncompatibleModelError(
                    f"checkpoint {describe(m)} at {storage.uri} holds tables {sorted(set(uncovered))} with a "
                    "different column sharding than the model; build the model with the same plan"
                )
    return stats, parts


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


def _apply_shard(
    storage: Storage,
    m: CheckpointManifest,
    rec: ShardRecord,
    targets: list[TableShard],
    stats: RestoreStats,
) -> None:
    root = m.folder
    keys = [f"{root}/{c.path}" for c in rec.chunks]
    for (key, data), chunk in zip(storage.iter_get(keys), rec.chunks, strict=True):
        where = f"{storage.describe(key)} (table {rec.table}, {describe(m)})"
        arrays = decode_chunk(data, chunk, where)
        ids = arrays["ids"]
        if ids.numel() and (
            int(ids[0]) < rec.row_offset or int(ids[-1]) >= rec.row_offset + rec.rows
        ):
            raise CorruptCheckpointError(f"{where}: row ids outside the shard's range")
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
                    if src.shape[1:] != view.shape[1:] or src.dtype != view.dtype:
                        raise IncompatibleModelError(
                            f"{where}: state {name} rows are {tuple(src.shape[1:])} {src.dtype}, the model "
                            f"has {tuple(view.shape[1:])} {view.dtype}"
                        )
                    view.index_copy_(0, local, src)


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
        data = storage.get(key)
    except NotFoundError:
        raise CorruptCheckpointError(f"{where}: file is missing") from None
    if len(data) != rec.nbytes or checksum(data) != rec.checksum:
        raise CorruptCheckpointError(f"{where}: size or checksum mismatch (file is corrupt)")
    return treecodec.decode(data, where)


def load_optimizer(opt: torch.optim.Optimizer, saved: dict[str, Any], name: str) -> None:
    """Load a saved ``{"state_dict", "param_groups"}`` into ``opt`` exactly."""
    sd = saved["state_dict"]
    if not opt.state and sd.get("state"):
        # TorchRec's KeyedOptimizer refuses to load into an empty state; its init_state() runs a
        # zero-gradient step to create the tensors that load_state_dict then overwrites.
        init = getattr(opt, "init_state", None)
        if init is not None:
            init()
    try:
        opt.load_state_dict(sd)
    except (ValueError, KeyError, RuntimeError) as e:
        raise IncompatibleModelError(f"optimizer {name}: saved state does not fit ({e})") from None
    groups = saved.get("param_groups", [])
    if len(groups) != len(opt.param_groups):
        raise IncompatibleModelError(
            f"optimizer {name}: {len(groups)} param groups saved, {len(opt.param_groups)} in the model"
        )
    for live, hyper in zip(opt.param_groups, groups, strict=True):
        live.update(hyper)
