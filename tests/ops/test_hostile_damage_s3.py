"""Findings 4, 6 and 7 of the hostile-storage review on a real S3 server (SeaweedFS): the same damage as in
test_hostile_damage.py, through the object store (no rename, no local paths), library and CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest

from deck.errors import CorruptCheckpointError
from deck.format.manifest import MANIFEST, Kind, step_dir
from deck.ops.retention import RetentionPolicy, collect_garbage
from deck.read.catalog import read_manifests
from deck.read.lineage import build_graph, chain_for
from deck.storage import FsspecStorage
from deck.testing.lineage_checks import check_all_restore
from deck.testing.s3_server import SeaweedS3
from deck.testing.synth import State, SynthTrainer, restore_state

pytestmark = pytest.mark.slow

STEPS = [0, 3, 6, 9, 12]


def _written(storage: FsspecStorage) -> dict[str, State]:
    tr = SynthTrainer(storage)
    tr.save("full")
    for _ in range(4):
        tr.train(3, rows=40)
        tr.save()
    return {s.id: s.state for s in tr.saved.values()}


def _flip(storage: FsspecStorage, key: str) -> bytes:
    data = storage.get(key)
    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 0x5A
    storage.put(key, bytes(damaged))
    return data


def _deck(server: SeaweedS3, *args: str) -> subprocess.CompletedProcess[str]:
    opts = ["--storage-options", json.dumps(server.storage_options)]
    return subprocess.run(
        [sys.executable, "-m", "deck.cli", *opts, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def store(s3_server: SeaweedS3, s3_uri: str) -> Any:
    return FsspecStorage(s3_uri, s3_server.storage_options)


def test_unreadable_commit_record_keeps_later_steps_on_s3(
    s3_server: SeaweedS3, store: FsspecStorage
) -> None:
    history = _written(store)
    key = f"{step_dir(3)}/{MANIFEST}"
    original = _flip(store, key)
    before = sorted(store.list(""))
    rep = collect_garbage(store, RetentionPolicy(), now=time.time() + 7200)
    assert not rep.deleted and not rep.orphans and not rep.errors, rep
    assert any(f.startswith(step_dir(6)) and "may need step 3" in w for f, w in rep.kept), rep
    p = _deck(s3_server, "gc", store.uri, "--grace", "0")
    assert p.returncode == 1 and f"KEPT {step_dir(3)}/" in p.stdout, p.stdout + p.stderr
    assert sorted(store.list("")) == before
    store.put(key, original)
    assert check_all_restore(store, history) == STEPS


@pytest.mark.timeout(300)
def test_merge_once_returns_on_a_damaged_merger_record_on_s3(
    s3_server: SeaweedS3, store: FsspecStorage
) -> None:
    history = _written(store)
    args = ("--stride", "2", "--full-every", "4", "--full-live-fraction", "0")
    p = _deck(s3_server, "merge", store.uri, "--once", *args)
    assert p.returncode == 0, p.stdout + p.stderr
    graph = build_graph(read_manifests(store))
    top = max(
        (n for n in graph.nodes.values() if n.merged and n.kind is Kind.FULL),
        key=lambda n: (n.layer, n.step),
    )
    _flip(store, f"{top.folder}/{MANIFEST}")
    p = _deck(s3_server, "merge", store.uri, "--once", *args)
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stderr.count("commit record is unreadable") == 1, p.stderr
    assert check_all_restore(store, history) == STEPS


def test_missing_chunk_is_damage_naming_the_object_on_s3(store: FsspecStorage) -> None:
    _written(store)
    chain = chain_for(read_manifests(store), 12)
    chunk = sorted(k for k in store.list(step_dir(6)) if k.endswith(".chunk"))[0]
    store.delete(chunk)
    with pytest.raises(CorruptCheckpointError, match=chunk.rsplit("/", 1)[-1]) as info:
        restore_state(store, chain)
    assert "step 6" in str(info.value)
