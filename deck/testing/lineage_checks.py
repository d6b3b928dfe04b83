"""Helpers shared by the lineage / merger tests (tests/merge/test_lineage_merger.py) and the retention
tests (tests/ops/test_retention.py): a fresh in-memory store, merger workers run to a fixed
point in this process, and a bitwise check of every restorable step."""

from __future__ import annotations

import os
import uuid
from datetime import datetime, timezone

from deck.format.manifest import MANIFEST, PARTS_DIR, CheckpointManifest, Kind
from deck.merge.policy import MergeConfig
from deck.merge.worker import MergeWorker
from deck.read.catalog import read_manifests, read_rank_manifests
from deck.read.lineage import build_graph, chain_for
from deck.storage import FsspecStorage, Storage
from deck.storage.wrapper import StorageWrapper
from deck.testing.synth import State, restore_state, same
from deck.trainer.lease import LEASE_DIR


def mem() -> FsspecStorage:
    """A fresh, empty in-memory store."""
    return FsspecStorage(f"memory://deck-lineage-{uuid.uuid4().hex}")


def merge_all(storage: Storage, config: MergeConfig, workers: int = 1) -> int:
    """Run ``workers`` workers round-robin in this process until none makes progress."""
    ws = [
        MergeWorker(
            storage,
            MergeConfig(
                stride=config.stride,
                full=config.full,
                chunk_bytes=config.chunk_bytes,
                worker_index=i,
                num_workers=workers,
            ),
        )
        for i in range(workers)
    ]
    committed = 0
    while True:
        progressed = False
        for w in ws:
            r = w.run_pass()
            committed += r.stats.items_committed
            progressed = progressed or r.progressed
            assert not r.stats.failed and not w.failures, w.failures
        if not progressed:
            return committed


def check_all_restore(
    storage: Storage, history: dict[str, State], seen: set[tuple[str, ...]] | None = None
) -> list[int]:
    """Every restorable step restores bitwise-equal to what the trainer saved under that id.

    ``seen``: chains already checked (committed files never change, so a chain that restored
    correctly once still does)."""
    manifests = read_manifests(storage)
    graph = build_graph(manifests)
    steps = graph.restorable_steps()
    for step in steps:
        chain = chain_for(manifests, step)
        key = tuple(m.id for m in chain)
        if seen is not None and key in seen:
            continue
        assert chain[0].kind is Kind.FULL and not chain[-1].is_merged
        assert chain[-1].step == step
        got, user = restore_state(storage, chain)
        bad = same(got, history[chain[-1].id])
        assert not bad, f"step {step} via {[m.folder for m in chain]}: {bad[:4]}"
        assert user == step
        if seen is not None:
            seen.add(key)
    return steps


def chain_files(storage: Storage, chain: list[CheckpointManifest]) -> list[str]:
    """The keys a restore of ``chain`` reads once it has chosen it: each trainer record and
    the files of each checkpoint (a step folder's other attempts, a merger folder's partition
    records and the files of builds its record does not name are leftovers GC may delete once
    old: a fuzz finding, seed 1876252891, counted a crashed build's files as read). A merger
    checkpoint's record is read as the restore chooses; GC may retire it then
    (deck.ops.retention.gc.GC_RETIRED: its files stay)."""
    out = []
    for m in chain:
        if m.is_merged:
            out += [f"{m.folder}/{r.path}" for r in m.ranks]
            for part in read_rank_manifests(storage, m):
                out += [f"{m.folder}/{c.path}" for rec in part.shards for c in rec.chunks]
                out += [f"{m.folder}/{f.path}" for f in (part.dense, part.extra) if f is not None]
        else:
            out += [f"{m.folder}/{MANIFEST}", *storage.list(f"{m.folder}/{m.id}/")]
    return [k for k in dict.fromkeys(out) if f"/{PARTS_DIR}/" not in k]


def age_commits(storage: Storage, seconds: float) -> None:
    """Let ``seconds`` pass for GC's grace period: every object at ``storage`` becomes that much
    older on the store's clock (its file time, which GC ages commits by: a record's and its
    attempt's files'), but the writer lease, which the trainer renews meanwhile."""
    for key, stamp in storage.list_modified():
        if stamp is not None and not key.startswith(f"{LEASE_DIR}/"):
            set_store_time(storage, key, stamp - seconds)


def set_store_time(storage: Storage, key: str, when: float) -> None:
    """Set the time the store reports for object ``key`` (a local file's mtime, an in-memory
    file's creation time): how tests move a file in the store's own clock."""
    path = storage.local_path(key)
    if path is not None:
        os.utime(path, (when, when))
        return
    if isinstance(storage, StorageWrapper):  # a test's wrapper
        set_store_time(storage.inner, key, when)
    elif isinstance(storage, FsspecStorage) and "memory" in storage.fs.protocol:
        name = storage.fs.info(storage.describe(key))["name"]
        storage.fs.store[name].created = datetime.fromtimestamp(when, timezone.utc)
    else:
        raise TypeError(f"cannot set file times on {storage.uri}")
