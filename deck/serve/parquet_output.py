"""The Parquet output of the serving wing (``deck follow --format parquet``): beside the held
state, ``<out>/parquet/<step>-full/`` when a state is materialised and ``<step>-delta/`` with
the rows each applied checkpoint changed (layout: :mod:`deck.format.parquet`)."""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import torch

from deck.errors import ConfigError
from deck.format.chunk_io import read_chunks
from deck.format.chunks import decode_chunk
from deck.format.manifest import CheckpointManifest, RankManifest
from deck.format.parquet import (
    FORMAT,
    PARQUET_DIR,
    TableFile,
    TableLayout,
    gather,
    layouts,
    step_dir_name,
    table_file_name,
)
from deck.read.catalog import checkpoint_label
from deck.storage import Storage
from deck.storage.atomic import TEMP_PREFIX, fsync_dir

logger = logging.getLogger(__name__)

# Beside ``parquet/``: folders a publisher's rollback left behind, by the full that replaced them
ROLLED_BACK_DIR = "parquet-rolled-back"


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


def _checkpoint_of(folder: str) -> str | None:
    """The checkpoint id a step folder's files are of (one file says); None when there is
    none or it cannot be read."""
    import pyarrow.parquet as pq

    if not os.path.isdir(folder):
        return None
    for name in sorted(os.listdir(folder)):
        if name.endswith(".parquet"):
            try:
                meta = pq.read_schema(os.path.join(folder, name)).metadata or {}
            except (OSError, ValueError):  # pyarrow's errors are both: damaged
                return None
            found = meta.get(b"deck.checkpoint")
            return None if found is None else found.decode(errors="replace")
    return None


class ParquetOutput:
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

    def holds(self, state: tuple[int, str]) -> bool:
        """Whether a folder of ``state`` (step, checkpoint id) is here, full or delta: what
        a follower resumed on this directory applies its next deltas on. No (an earlier
        ``deck follow`` without ``--format parquet`` moved the state on, or nothing was
        written yet): the follower writes the state in full first."""
        step, ckpt = state
        return any(
            _checkpoint_of(os.path.join(self.root, step_dir_name(step, kind))) == ckpt
            for kind in ("full", "delta")
        )

    def full(self, follower: Any) -> str:
        """Write every row of the state ``follower`` (a :class:`deck.serve.follow.Follower`) holds,
        as step ``follower.state``. Folders of another timeline after it (the publisher rolled
        back: restored an older step and trained on) are moved out of ``parquet/`` first, so
        that the newest full and the deltas after it are always one timeline."""
        self._set_aside(follower.state)
        return self.write("full", follower.state, None, self._layouts(follower), follower.tensors)

    def _set_aside(self, state: tuple[int, str]) -> None:
        """Move the folders of steps after ``state`` (and a delta at its step of another
        checkpoint) to ``<out>/parquet-rolled-back/<step>-<id>/``: not deleted (a consumer may
        want what it read of them), not where a consumer of ``parquet/`` looks."""
        step, ckpt = state
        names = []
        for name in sorted(os.listdir(self.root)):
            at, _, kind = name.partition("-")
            if not at.isdigit() or kind not in ("full", "delta"):
                continue  # (temp folders, anything not ours)
            if int(at) > step or (
                int(at) == step
                and kind == "delta"
                and _checkpoint_of(os.path.join(self.root, name)) != ckpt
            ):
                names.append(name)
        if not names:
            return
        aside = os.path.join(os.path.dirname(self.root), ROLLED_BACK_DIR, f"{step:012d}-{ckpt}")
        os.makedirs(aside, exist_ok=True)
        for name in names:
            shutil.rmtree(os.path.join(aside, name), ignore_errors=True)  # (a redo's)
            os.rename(os.path.join(self.root, name), os.path.join(aside, name))
        fsync_dir(aside)
        fsync_dir(self.root)
        logger.warning(
            "deck follow: %s rolled back to step %d (%s): moved the Parquet folders of the "
            "timeline it left (%s) to %s",
            self.uri,
            step,
            ckpt,
            ", ".join(names),
            aside,
        )

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
