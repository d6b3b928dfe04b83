"""Writing one rank's part of a checkpoint, and the commit record.

Order (DCP's lesson): data files first, then the rank part manifest, then -- once every rank's
part is durable -- the checkpoint manifest, by rank 0, as a single atomic put.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from deck import treecodec
from deck.adapters.base import TableShard
from deck.chunks import checksum, encode_chunk
from deck.format import (
    FORMAT_VERSION,
    MANIFEST,
    CheckpointManifest,
    FileRecord,
    Kind,
    RankManifest,
    RankRef,
    ShardRecord,
    dump_model,
    load_model,
    rank_dir,
    rank_manifest_name,
    step_dir,
    table_dir,
)
from deck.storage import Storage

DENSE_FILE = "dense.safetensors"
EXTRA_FILE = "extra.safetensors"


def scalar_key(shard: TableShard) -> str:
    """Key of a shard's scalar states inside the extra file."""
    return f"{shard.table}|{shard.row_offset}|{shard.col_offset}"


class RankPartWriter:
    """Writes the files of one rank for one checkpoint under ``<step>/<id>/rank-<r>/``."""

    def __init__(
        self,
        storage: Storage,
        step: int,
        ckpt_id: str,
        rank: int,
        world_size: int,
        chunk_bytes: int,
    ):
        self.storage = storage
        self.step = step
        self.ckpt_id = ckpt_id
        self.rank = rank
        self.world_size = world_size
        self.chunk_bytes = chunk_bytes
        self.root = step_dir(step)
        self.part = f"{ckpt_id}/{rank_dir(rank)}"
        self.bytes_written = 0
        self.chunks_written = 0
        self.rows_written = 0

    def _put(self, rel: str, data: bytes | bytearray) -> FileRecord:
        self.storage.put(f"{self.root}/{rel}", data)
        self.bytes_written += len(data)
        return FileRecord(path=rel, nbytes=len(data), checksum=checksum(data))

    def write_shard(self, shard: TableShard, rows: torch.Tensor | None, full: bool) -> ShardRecord:
        """Write ``rows`` (ascending local row indices; None = all rows) of ``shard`` as chunks.

        Each chunk is gathered, encoded and written before the next is gathered, so memory is one
        chunk whatever the table size.
        """
        n = shard.rows if rows is None else int(rows.numel())
        per_chunk = max(1, self.chunk_bytes // shard.row_bytes())
        chunks = []
        folder = f"{self.part}/{table_dir(shard.table)}"
        for i, start in enumerate(range(0, n, per_chunk)):
            stop = min(n, start + per_chunk)
            if rows is None:
                local = torch.arange(start, stop, dtype=torch.int64)
                arrays = [(name, t[start:stop]) for name, t in shard.states.items()]
            else:
                local = rows[start:stop]
                arrays = [(name, t.index_select(0, local)) for name, t in shard.states.items()]
            rel = f"{folder}/c{shard.col_offset}-r{shard.row_offset}-{i:06d}.chunk"
            buf, rec = encode_chunk(rel, [("ids", local + shard.row_offset), *arrays])
            self.storage.put(f"{self.root}/{rel}", buf)
            self.bytes_written += len(buf)
            self.chunks_written += 1
            chunks.append(rec)
        self.rows_written += n
        return ShardRecord(
            table=shard.table,
            num_rows=shard.num_rows,
            num_cols=shard.num_cols,
            row_offset=shard.row_offset,
            rows=shard.rows,
            col_offset=shard.col_offset,
            cols=shard.cols,
            full=full,
            states=tuple(shard.states),
            chunks=tuple(chunks),
        )

    def write_part(
        self,
        shards: list[TableShard],
        rows_for: Callable[[TableShard], torch.Tensor | None],
        dense: dict[str, torch.Tensor] | None,
        extra: dict[str, Any],
    ) -> RankManifest:
        """Write every shard, the dense (rank 0) and extra state, then the rank manifest (last)."""
        records = []
        for shard in shards:
            rows = rows_for(shard)
            records.append(self.write_shard(shard, rows, full=rows is None))
        dense_rec = (
            self._put(f"{self.part}/{DENSE_FILE}", treecodec.encode(dense, "dense state"))
            if dense is not None
            else None
        )
        extra_rec = self._put(
            f"{self.part}/{EXTRA_FILE}", treecodec.encode(extra, "optimizer/user state")
        )
        manifest = RankManifest(
            format_version=FORMAT_VERSION,
            step=self.step,
            rank=self.rank,
            world_size=self.world_size,
            shards=tuple(records),
            dense=dense_rec,
            extra=extra_rec,
        )
        self.storage.put(
            f"{self.root}/{self.ckpt_id}/{rank_manifest_name(self.rank)}", dump_model(manifest)
        )
        return manifest

    def discard(self) -> None:
        """Remove whatever this attempt wrote for this rank (no manifest references it)."""
        self.storage.delete_prefix(f"{self.root}/{self.part}/")
        self.storage.delete(f"{self.root}/{self.ckpt_id}/{rank_manifest_name(self.rank)}")


def commit(
    storage: Storage,
    *,
    step: int,
    ckpt_id: str,
    kind: Kind,
    parent: tuple[int, str] | None,
    base: int,
    epoch: int,
    world_size: int,
    deck_version: str,
) -> CheckpointManifest:
    """Rank 0, after every rank's part is durable: verify the parts and write the commit record."""
    root = step_dir(step)
    refs = []
    for rank in range(world_size):
        rel = f"{ckpt_id}/{rank_manifest_name(rank)}"
        data = storage.get(f"{root}/{rel}")
        part = load_model(RankManifest, data, storage.describe(f"{root}/{rel}"))
        files = [c.nbytes for s in part.shards for c in s.chunks] + [part.extra.nbytes]
        if part.dense is not None:
            files.append(part.dense.nbytes)
        refs.append(
            RankRef(
                rank=rank,
                path=rel,
                nbytes=len(data),
                checksum=checksum(data),
                data_bytes=sum(files),
            )
        )
    manifest = CheckpointManifest(
        format_version=FORMAT_VERSION,
        id=ckpt_id,
        step=step,
        kind=kind,
        parent=parent[0] if parent else None,
        parent_id=parent[1] if parent else None,
        base=base,
        epoch=epoch,
        world_size=world_size,
        ranks=tuple(refs),
        created_unix=time.time(),
        deck_version=deck_version,
    )
    storage.put(f"{root}/{MANIFEST}", dump_model(manifest))
    return manifest
