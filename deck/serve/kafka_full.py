"""Loader fulls: the Kafka loading service's periodic deck full checkpoint (``--full-uri``).

A loader full is an ordinary deck full checkpoint (docs/format.md) at ``full_uri``: the step's
commit record, one part manifest per rank of the publisher, chunks holding every row of every
table shard (from the loader's materialised state), and the publisher's own dense and extra files
of that step (copied, checksums checked). It keeps the publisher's layout (world size, each rank's
shards) and id, so

- ``deck verify`` checks it like any checkpoint;
- ``deck.enable(model, ..., DeckConfig(uri=full_uri)).restore()`` restores it, bitwise, into a
  DMP of any world size (rows are stored by global id; docs/format.md "Restoring into another
  layout"), RNG and rank-local buffers included when the world size is the publisher's;
- its state ``(step, id)`` is the publisher's, so the next delta of the stream applies onto it.

Beside it, ``stream/<step:012d>-<id>.json`` records the stream offsets after the step (per
partition, the first message not covered) and the state URI: a loader started on an empty
``--out`` materialises the newest full that has one and reads the stream from those offsets.
Write order: chunks, dense/extra, part manifests, the stream record, then ``manifest.json`` (the
commit, last): a crash at any point leaves no full or a complete one.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from deck.errors import CorruptCheckpointError, DeckError, NotFoundError
from deck.failpoints import failpoint
from deck.format.checksum import checksum
from deck.format.commit import commit_record, rank_ref
from deck.format.commit_log import put_record
from deck.format.jsonio import load_json
from deck.format.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    CheckpointManifest,
    FileRecord,
    Kind,
    RankManifest,
    ShardRecord,
    dump_model,
    rank_dir,
    rank_manifest_name,
    step_dir,
    table_dir,
)
from deck.merge.stream import ChunkOut
from deck.model import TableShard
from deck.read.catalog import read_manifests
from deck.storage import Storage

logger = logging.getLogger(__name__)

STREAM_RECORDS = "stream"
FULL_CHUNK_BYTES = 4 * 2**20


def stream_record_path(step: int, ckpt_id: str) -> str:
    """Where the stream offsets of the loader full ``(step, ckpt_id)`` are, under ``full_uri``."""
    return f"{STREAM_RECORDS}/{step:012d}-{ckpt_id}.json"


def _row_bytes(states: dict[str, torch.Tensor]) -> int:
    return 8 + sum(t[0].numel() * t.element_size() for t in states.values() if t.shape[0])


def _write_shard(
    store: Storage, folder: str, rel_dir: str, rec: ShardRecord, shard: TableShard, chunk_bytes: int
) -> ShardRecord:
    """Every row of ``shard`` (views of the loader's tensors) as chunks; its full record."""
    states = {k: shard.states[k] for k in rec.states}
    out = ChunkOut(store, folder, rel_dir, rec, _row_bytes(states), chunk_bytes)
    for start in range(0, rec.rows, out.per_chunk):
        stop = min(rec.rows, start + out.per_chunk)
        ids = torch.arange(rec.row_offset + start, rec.row_offset + stop, dtype=torch.int64)
        out.add(ids, {k: v[start:stop].contiguous() for k, v in states.items()})
    out.close()
    return rec.model_copy(update={"full": True, "chunks": tuple(out.chunks)})


def _copy_file(
    state: Storage, src: CheckpointManifest, store: Storage, rec: FileRecord | None
) -> FileRecord | None:
    """The publisher's dense / extra file of ``src``, checked and copied to the same path."""
    if rec is None:
        return None
    key = f"{src.folder}/{rec.path}"
    try:
        data = state.get(key)
    except NotFoundError as e:
        raise CorruptCheckpointError(
            f"{state.describe(key)}: missing; the loader full of step {src.step} needs it"
        ) from e
    if len(data) != rec.nbytes or checksum(data) != rec.checksum:
        raise CorruptCheckpointError(f"{state.describe(key)}: size or checksum mismatch")
    store.put(f"{step_dir(src.step)}/{rec.path}", data)
    return rec


def write_loader_full(
    store: Storage,
    state: Storage,
    m: CheckpointManifest,
    parts: list[RankManifest],
    targets: list[TableShard],
    stream: dict[str, Any],
    chunk_bytes: int = FULL_CHUNK_BYTES,
) -> str:
    """Write the state the loader holds (``targets``: its table shards, at step ``m`` of the
    publisher, whose rank manifests are ``parts`` at ``state``) as a deck full of ``m.step`` with
    ``m``'s id at ``store``, and its stream record ``stream``. Returns the full's folder.

    Guarantee: once ``manifest.json`` is there, every file it names is complete and checked,
    the stream record is there, and a restore of the full gives the publisher's state of
    ``m.step`` bitwise (tables from the loader, dense and extra state as published)."""
    places = {(t.table, t.row_offset, t.col_offset): t for t in targets}
    folder = step_dir(m.step)
    refs = []
    for part in parts:
        shards = []
        for rec in part.shards:
            held = places.get((rec.table, rec.row_offset, rec.col_offset))
            if held is None or (held.rows, held.cols) != (rec.rows, rec.cols):
                raise DeckError(
                    f"step {m.step}: rank {part.rank}'s shard of {rec.table} (rows "
                    f"{rec.row_offset}+{rec.rows}, cols {rec.col_offset}+{rec.cols}) is not one "
                    "the loader holds; it was resharded: no loader full until its next full"
                )
            rel_dir = f"{m.id}/{rank_dir(part.rank)}/{table_dir(rec.table)}"
            shards.append(_write_shard(store, folder, rel_dir, rec, held, chunk_bytes))
        out = RankManifest(
            format_version=FORMAT_VERSION,
            step=m.step,
            ckpt_id=m.id,
            rank=part.rank,
            world_size=m.world_size,
            shards=tuple(shards),
            dense=_copy_file(state, m, store, part.dense),
            extra=_copy_file(state, m, store, part.extra),  # type: ignore[arg-type]
        )
        data = dump_model(out)
        rel = f"{m.id}/{rank_manifest_name(part.rank)}"
        store.put(f"{folder}/{rel}", data)
        refs.append(rank_ref(part.rank, out, rel, data))
    store.put(stream_record_path(m.step, m.id), json.dumps(stream, sort_keys=True).encode())
    failpoint("kafka_follow.full.before_commit")
    record = commit_record(
        refs,
        id=m.id,
        step=m.step,
        kind=Kind.FULL,
        parent=None,
        parent_id=None,
        base=m.step,
        epoch=m.epoch,
        world_size=m.world_size,
    )
    put_record(store, f"{folder}/{MANIFEST}", m.id, dump_model(record))
    return folder


def newest_loader_full(store: Storage) -> tuple[CheckpointManifest, dict[str, Any]] | None:
    """The newest committed full at ``store`` that has a stream record, with that record."""
    found = read_manifests(store)
    for step in sorted(found, reverse=True):
        m = found[step]
        if m.kind is not Kind.FULL:
            continue
        try:
            raw = store.get(stream_record_path(m.step, m.id))
        except NotFoundError:
            continue  # a full written by someone else: no offsets to resume from
        where = store.describe(stream_record_path(m.step, m.id))
        try:
            rec = load_json(raw, where, "loader full stream record")
        except CorruptCheckpointError as e:
            rec = e
        if not isinstance(rec, dict):  # untrusted storage: an older full may still serve
            logger.warning("deck follow: %s is damaged (%s): passed over", where, rec)
            continue
        return m, rec
    return None
