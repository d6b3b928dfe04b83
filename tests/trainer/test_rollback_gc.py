"""A trainer that rolled back, and a GC deleting the restored step (break-it findings): GC may
delete the restored step (a bounded policy does not retain an old step, and no plan kept it
within the grace period), either between the restore and the next checkpoint, or -- a run that
planned before the restore -- after the trainer committed on it. The trainer then committed a
whole new timeline on that deleted parent, silently, and none of it could be restored. Now a
restore of a step older than the newest committed one makes the next checkpoint a full: the new
timeline never depends on a chain GC may be deleting."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

import deck
from deck.demo import ModelSpec, build_model, train_step
from deck.format.epochs import EPOCH_ROOT, witness_key, witnesses_in
from deck.ops.retention import RetentionPolicy, collect_garbage
from deck.ops.retention.gc import GcReport
from deck.read.catalog import read_manifests
from deck.read.lineage import build_graph
from deck.storage import Storage, open_storage
from deck.storage.wrapper import StorageWrapper
from deck.testing.dist_harness import run_ranks

SPEC = ModelSpec(num_tables=2, rows=200, dim=8, batch=16)


def _rollback_then_gc(rank: int, world_size: int, uri: str) -> None:
    model, opt = build_model(SPEC)
    ck = deck.enable(
        model, [opt], deck.DeckConfig(uri=uri, delta_every_steps=1, full_every_steps=5)
    )
    try:
        for step in range(0, 9):
            train_step(model, opt, SPEC, step)
            ck.step(step)
        assert ck.flush()
        assert ck.restore(3) == 3
        if rank == 0:
            # Bounded retention, no grace: step 3 is neither in the window of the latest step
            # (8 back to the full at 5) nor a kept full, so GC deletes it now.
            rep = collect_garbage(
                open_storage(uri),
                RetentionPolicy(keep_all_steps=False, keep_last_fulls=1, grace_s=0),
            )
            assert any("step-000000000003" in f for f, _ in rep.deleted), rep.deleted
        for step in range(4, 8):
            train_step(model, opt, SPEC, step)
            ck.step(step)
        ck.flush()
        states = {e.step: (e.kind, e.state) for e in ck.history}
        latest = ck.restore()
    finally:
        ck.close()
    if rank != 0:
        return  # rank 0 commits: its history says what was committed
    # The rollback's first checkpoint is a full (and 5 one by the cadence): nothing of the new
    # timeline needs step 3
    assert [states[s] for s in range(4, 8)] == [
        ("full", "committed"),
        ("full", "committed"),
        ("delta", "committed"),
        ("delta", "committed"),
    ], states
    restorable = set(build_graph(read_manifests(open_storage(uri))).restorable_steps())
    assert {4, 5, 6, 7} <= restorable, restorable
    assert latest == 7
    # The epoch witnesses (deck.format.epochs): rank 0's commit thread put one before the
    # first record of each epoch that committed (the last restore's epoch committed none)
    storage = open_storage(uri)
    assert witnesses_in(storage.list(f"{EPOCH_ROOT}/")) == [0, 1]
    assert json.loads(storage.get(witness_key(1))) == {"epoch": 1, "step": 4}


class _PausedAtFirstDelete(StorageWrapper):
    """GC's view of the store: its first deletion waits until ``go`` is set (``paused`` says
    it got there), so the run's plan is from before whatever happens meanwhile."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.paused, self.go = threading.Event(), threading.Event()

    def _first(self) -> None:
        if not self.paused.is_set():
            self.paused.set()
            assert self.go.wait(120), "the test never let GC go on"

    def delete(self, path: str) -> None:
        self._first()
        super().delete(path)

    def delete_if(self, path: str, data: bytes) -> bool:
        self._first()
        return super().delete_if(path, data)


def _gc_planned_before_the_rollback(rank: int, world_size: int, uri: str) -> None:
    model, opt = build_model(SPEC)
    ck = deck.enable(
        model, [opt], deck.DeckConfig(uri=uri, delta_every_steps=1, full_every_steps=5)
    )
    gc_store = _PausedAtFirstDelete(open_storage(uri))
    reports: list[GcReport] = []
    gc = threading.Thread(
        target=lambda: reports.append(
            collect_garbage(
                gc_store, RetentionPolicy(keep_all_steps=False, keep_last_fulls=1, grace_s=0)
            )
        )
    )
    try:
        for step in range(0, 13):
            train_step(model, opt, SPEC, step)
            ck.step(step)
        assert ck.flush()
        if rank == 0:
            gc.start()  # plans (step 8 is retained by nothing: not in the window of 12) ...
            assert gc_store.paused.wait(120)  # ... and waits at its first deletion
        assert ck.restore(8) == 8
        train_step(model, opt, SPEC, 9)
        ck.step(9)  # committed before GC deletes step 8
        assert ck.flush()
        if rank == 0:
            gc_store.go.set()
            gc.join()
            assert any("step-000000000008" in f for f, _ in reports[0].deleted), reports
        for step in range(10, 14):
            train_step(model, opt, SPEC, step)
            ck.step(step)
        assert ck.flush()
        states = {e.step: (e.kind, e.state) for e in ck.history}
    finally:
        ck.close()
    if rank != 0:
        return
    assert states[9] == ("full", "committed"), states
    restorable = set(build_graph(read_manifests(open_storage(uri))).restorable_steps())
    assert set(range(9, 14)) <= restorable, restorable


@pytest.mark.slow
def test_a_rollback_starts_with_a_full_so_gc_deleting_its_step_loses_nothing(
    tmp_path: Path,
) -> None:
    run_ranks(_rollback_then_gc, str(tmp_path / "ck"))


@pytest.mark.slow
def test_a_gc_that_planned_before_the_rollback_deletes_nothing_the_new_timeline_needs(
    tmp_path: Path,
) -> None:
    """GC plans, the trainer rolls back to a step that plan retains nowhere and commits on it,
    then GC deletes that step: the new timeline (a full first) restores, every step of it."""
    run_ranks(_gc_planned_before_the_rollback, str(tmp_path / "ck"))
