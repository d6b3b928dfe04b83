"""GC deleting a trainer checkpoint while a rollback saves the same step again, or stopped
after uncommitting an abandoned one."""

from __future__ import annotations

from pathlib import Path

import pytest

import deck.read.indexed
import tests.ops.test_operations_machine as machine
from deck import failpoints
from deck.ops.retention import RetentionPolicy, collect_garbage
from deck.ops.retention.gc import GC_DELETING
from deck.read.catalog import read_manifests
from deck.storage import LocalStorage
from deck.testing.lineage_checks import age_commits
from deck.testing.synth import SynthTrainer
from tests.ops.test_operations_machine import OperationsMachine


def test_a_save_of_the_step_gc_is_deleting_keeps_its_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by ``make fuzz-ops OPS_EXAMPLES=300 FUZZ_SEED=4271791481``: after a rollback to
    step 1, GC (grace 0) planned to delete the abandoned timeline's step 2. Between its re-read
    of step 2's record and the delete, the trainer committed step 2 again, and GC deleted the
    new record: a promised step lost. The record now goes only while it holds the bytes GC
    read (an atomic rename aside on a local disk)."""
    monkeypatch.setattr(deck.read.indexed, "CATALOG_EVERY", 3)
    monkeypatch.setattr(machine, "event", lambda *a, **k: None)
    m = OperationsMachine()
    try:
        m.setup(stride=2, every=None, grace=0.0, policy="budget", skews=(0.0, 0.0, 0.0))
        m.gc_while_others_work(n=6, pick=0, what="resave")
        m.gc_while_others_work(n=23, pick=0, what="save")  # the save lands before the delete
        assert 2 in m.promised
        m.promised_and_restorable_steps_restore_bitwise()
        m.reads_through_the_catalog_see_every_record()
    finally:
        m.teardown()


@pytest.mark.parametrize("grace", [0.0, 3600.0])
def test_a_gc_stopped_after_uncommitting_the_newest_abandoned_step_is_finished_by_the_next(
    tmp_path: Path, grace: float
) -> None:
    """A break-it finding: after a rollback, GC deletes the abandoned timeline's steps above the
    new timeline's newest; stopped right after one's commit record went, it left an attempt
    folder above every committed step, which every later run kept as a save still uploading
    (and ``deck ls`` showed as pending). GC marks such an attempt before uncommitting it, and a
    later run deletes a marked one as an orphan -- the next run, not one a grace period later
    (another break-it finding: the marker's own fresh time held it back)."""
    store = LocalStorage(tmp_path / "ck")
    tr = SynthTrainer(store)
    tr.save("full")
    for _ in range(4):
        tr.train()
        tr.save("delta")
    abandoned = tr.saved[4].id
    tr.rollback(2)
    tr.train()
    tr.save("delta")  # the new timeline's step 3: step 4 is above it
    age_commits(store, 2 * 86400)
    policy = RetentionPolicy(grace_s=grace)
    failpoints.configure("gc.checkpoint.after_uncommit:1:interrupt")
    try:
        with pytest.raises(KeyboardInterrupt):
            collect_garbage(store, policy)
    finally:
        failpoints.configure(None)
    assert not store.exists("step-000000000004/manifest.json")
    assert store.exists(f"step-000000000004/{abandoned}/{GC_DELETING}")
    rep = collect_garbage(store, policy)
    assert any("stopped part way" in why for _, why in rep.orphans), rep.orphans
    assert not store.list("step-000000000004/")
    assert [m.step for m in read_manifests(store).values()] == [0, 1, 2, 3]
