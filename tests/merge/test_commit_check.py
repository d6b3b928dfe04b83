"""The merger checks its files right before its commit record.

Between a merger's rank manifests and its ``manifest.json``, something else may delete in the
uncommitted folder: a GC whose clock was wrong took merger folders still being built for
abandoned ones, and the merger then committed checkpoints whose files were gone. The merger lists
its folder again right before the commit; a file gone (or of another size) means no commit: the
item's partition records are deleted, the failure is counted and logged, and a later pass builds
it again. Real files on a local store; the deletion lands where a racing deleter's would, right
after the merger wrote its rank manifests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deck.format.manifest import MANIFEST, PARTS_DIR
from deck.merge.plan import PlannedItem, plan
from deck.merge.policy import FullPolicy, MergeConfig
from deck.merge.worker import MergeWorker
from deck.ops.retention import RetentionPolicy, collect_garbage
from deck.read.catalog import read_manifests
from deck.read.lineage import build_graph, cheapest_chain
from deck.read.verify import verify_checkpoint
from deck.storage import LocalStorage
from deck.testing.lineage_checks import check_all_restore
from deck.testing.synth import State, SynthTrainer

CONFIG = MergeConfig(stride=2, full=FullPolicy(every=None, max_live_fraction=None))


class _DeletesBeforeCommit(LocalStorage):
    """A local store where ``deleter(folder)`` runs once, right after a merger wrote a rank
    manifest in ``folder`` (its commit under way, ``manifest.json`` not written yet)."""

    deleter: Callable[[str], None] | None = None

    def put(self, key: str, data: Any) -> None:
        super().put(key, data)
        if (
            self.deleter is not None
            and key.startswith("merged/")
            and key.endswith(".json")
            and "/rank-" in key
        ):
            deleter, self.deleter = self.deleter, None
            deleter(key.split("/")[0] + "/" + key.split("/")[1])


def _backlog(root: Path) -> tuple[dict[str, State], PlannedItem]:
    """A full and 4 deltas at ``root``; returns what the trainer saved and the first item a
    merger pass commits (the first ready one)."""
    tr = SynthTrainer(LocalStorage(root))
    tr.save("full")
    for _ in range(4):
        tr.train()
        tr.save()
    first = plan(build_graph(read_manifests(LocalStorage(root))), CONFIG).ready[0]
    return {s.id: s.state for s in tr.saved.values()}, first


def _rebuilt_and_restorable(root: Path, history: dict[str, State], item: PlannedItem) -> None:
    """Later passes (no deleter) build ``item`` and everything else: committed, intact, and
    every step restores bitwise, the newest through the merged checkpoints."""
    storage = LocalStorage(root)
    worker = MergeWorker(storage, CONFIG)
    _, left = worker.run_once(wait_s=0)
    assert left == 0 and not worker.failures
    graph = build_graph(read_manifests(storage))
    assert item.id in graph.nodes
    report = verify_checkpoint(storage, graph.nodes[item.id].manifest)
    assert not report.problems and not report.unreadable
    assert check_all_restore(storage, history) == [0, 1, 2, 3, 4]
    assert [m.layer for m in cheapest_chain(graph, 4)] == [0, 2, 0]


def test_a_chunk_deleted_before_the_commit_is_not_committed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ck"
    history, item = _backlog(root)
    gone: list[str] = []

    def delete_a_chunk(folder: str) -> None:
        chunk = next(k for k in LocalStorage(root).list(f"{folder}/") if k.endswith(".chunk"))
        LocalStorage(root).delete(chunk)
        gone.append(chunk)

    store = _DeletesBeforeCommit(root)
    store.deleter = delete_a_chunk
    worker = MergeWorker(store, CONFIG)
    with caplog.at_level(logging.WARNING, logger="deck.merge.worker"):
        r = worker.run_pass()

    assert store.deleter is None and gone and gone[0].startswith(f"{item.folder}/")
    assert not (root / item.folder / MANIFEST).exists()  # not committed
    assert item.id not in build_graph(read_manifests(LocalStorage(root))).nodes
    assert not list((root / item.folder / PARTS_DIR).glob("*.json"))  # built again next pass
    assert list(r.stats.failed) == [item.id] and worker.failures == {item.id: 1}
    why = r.stats.failed[item.id]
    assert item.folder in why and f"{gone[0]} is missing" in why
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert any(item.folder in w and gone[0] in w for w in warnings), warnings

    _rebuilt_and_restorable(root, history, item)


def test_a_gc_with_a_wrong_clock_deleting_the_folder_being_committed(tmp_path: Path) -> None:
    """The incident: a GC run whose clock is a month ahead finds the merger's folder old and
    uncommitted and deletes it while the merger commits. Nothing is committed over the gap."""
    root = tmp_path / "ck"
    history, item = _backlog(root)
    ahead = time.time() + 30 * 86400
    taken: list[str] = []

    def gc_a_month_ahead(folder: str) -> None:
        before = LocalStorage(root).list(f"{folder}/")
        collect_garbage(LocalStorage(root), RetentionPolicy(), now=ahead, local_clock=lambda: ahead)
        taken.extend(sorted(set(before) - set(LocalStorage(root).list(f"{folder}/"))))

    store = _DeletesBeforeCommit(root)
    store.deleter = gc_a_month_ahead
    worker = MergeWorker(store, CONFIG)
    r = worker.run_pass()

    # The GC did take the folder being committed: its chunks and partition records
    assert any(k.endswith(".chunk") for k in taken) and any(f"/{PARTS_DIR}/" in k for k in taken)
    assert not (root / item.folder / MANIFEST).exists()
    assert "is missing" in r.stats.failed[item.id] and item.folder in r.stats.failed[item.id]

    _rebuilt_and_restorable(root, history, item)
