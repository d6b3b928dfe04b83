"""A trainer that rolled back, and a GC between the restore and its next checkpoint (a break-it
finding): GC may delete the restored step (a bounded policy does not retain an old step, and
no plan kept it within the grace period), and the trainer then committed a whole new timeline
on that deleted parent, silently; a restart's restore() went back to the abandoned timeline.
Now the first delta after a restore reads its parent's commit record before its own: a parent
GC deleted fails that checkpoint (the next is a full), and nothing unrestorable is committed."""

from __future__ import annotations

from pathlib import Path

import pytest

import deck
from deck.demo import ModelSpec, build_model, train_step
from deck.ops.retention import RetentionPolicy, collect_garbage
from deck.read.catalog import read_manifests
from deck.read.lineage import build_graph
from deck.storage import open_storage
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
        states = {e.step: e.state for e in ck.history}
        latest = ck.restore()
    finally:
        ck.close()
    if rank != 0:
        return  # rank 0 commits: its history says what was committed
    assert states[4] == "failed", states  # a delta of the deleted step 3: never committed
    graph = build_graph(read_manifests(open_storage(uri)))
    restorable = set(graph.restorable_steps())
    # What the new timeline committed restores (the full at 5 and the deltas after it)
    committed = [s for s in range(4, 8) if states.get(s) == "committed"]
    assert committed == [5, 6, 7] and set(committed) <= restorable, (committed, restorable)
    assert latest == 7


@pytest.mark.slow
def test_a_delta_on_a_parent_gc_deleted_after_a_restore_is_not_committed(tmp_path: Path) -> None:
    run_ranks(_rollback_then_gc, str(tmp_path / "ck"))
