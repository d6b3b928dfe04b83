"""What the trainer's background lineage check reads (``needs_new_full`` given the chain's
full): a quarantine of a checkpoint on no chain of the parent costs the listing and that record
once, never the commit records; one on the chain reads the lineage, which says whether a merged
checkpoint covers it. Real format (SynthTrainer), real merger, every request recorded."""

from __future__ import annotations

from pathlib import Path

import pytest

from deck.format.manifest import MANIFEST
from deck.merge.policy import FullPolicy, MergeConfig
from deck.read.catalog import quarantine, read_manifests
from deck.read.lineage import needs_new_full
from deck.storage import LocalStorage
from deck.testing.lineage_checks import merge_all
from deck.testing.recording_storage import RecordingStorage
from deck.testing.synth import SynthTrainer
from deck.trainer.chain import LineageWatch


def _requests(store: RecordingStorage) -> list[tuple[str, str]]:
    out = [(c.op, c.path) for c in store.calls]
    store.calls.clear()
    return out


def test_off_chain_quarantine_reads_its_record_once_and_no_commit_record(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "ck")
    tr = SynthTrainer(storage)
    tr.save("full")  # step 0
    for _ in range(2):
        tr.train()
        tr.save()  # 1, 2
    tr.train()
    tr.save("full")  # 3: the chain the trainer goes on with
    for _ in range(3):
        tr.train()
        tr.save()  # 4, 5, 6
    parent = tr.parent
    assert parent is not None and parent[0] == 6
    ms = read_manifests(storage)
    store = RecordingStorage(storage)
    known: dict[str, int | None] = {}

    assert needs_new_full(store, parent, base=3, known=known) is None
    assert _requests(store) == [("list", "quarantine/")]

    quarantine(storage, ms[1], "damaged (test)")  # on the chain of 0..2 only
    record = f"quarantine/{ms[1].id}.json"
    assert needs_new_full(store, parent, base=3, known=known) is None
    assert _requests(store) == [("list", "quarantine/"), ("get_or_none", record)]
    assert needs_new_full(store, parent, base=3, known=known) is None
    assert _requests(store) == [("list", "quarantine/")]  # a record is read once
    # Without the chain's full any record makes it read every commit record (the old cost)
    assert needs_new_full(store, parent) is None
    assert any(path.endswith(MANIFEST) for _, path in _requests(store))

    # On the chain: the lineage is read, and nothing covers step 5
    quarantine(storage, ms[5], "damaged (test)")
    why = needs_new_full(store, parent, base=3, known=known)
    assert why is not None and ms[5].id in why, why
    assert any(path.endswith(MANIFEST) for _, path in _requests(store))


def test_on_chain_quarantine_covered_by_a_merged_delta_is_no_break(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "ck")
    tr = SynthTrainer(storage)
    tr.save("full")
    for _ in range(6):
        tr.train()
        tr.save()  # 1..6
    merge_all(storage, MergeConfig(stride=3, full=FullPolicy(every=None, max_live_fraction=None)))
    ms = read_manifests(storage)
    assert any(m.covers == (4, 6) for m in ms.merged.values()), ms.merged
    parent = tr.parent
    assert parent is not None
    quarantine(storage, ms[5], "damaged (test)")
    # Step 6 is reached through the merged delta of 4..6: a delta of it is fine
    assert needs_new_full(storage, parent, base=0, known={}) is None
    # A delta of step 5 itself is not
    why = needs_new_full(storage, (5, ms[5].id), base=0, known={})
    assert why is not None and ms[5].id in why, why


def test_the_watch_warns_once_for_the_deltas_of_one_broken_chain(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Deltas committed before the trainer's watch learned of a quarantine follow the broken
    chain: each is broken (the next checkpoint a full) but they share the cause, so one
    warning, not one per commit; a new full's chain broken later warns again."""
    storage = LocalStorage(tmp_path / "ck")
    tr = SynthTrainer(storage)
    tr.save("full")  # 0
    saved = []
    for _ in range(4):
        tr.train()
        saved.append(tr.save())  # 1..4
    quarantine(storage, saved[0], "damaged (test)")
    watch = LineageWatch(storage, "checkpoint", 0)
    try:
        with caplog.at_level("WARNING", logger="deck.trainer.chain"):
            for m in saved[1:]:
                watch.committed((m.step, m.id), 0)
                assert watch.wait(60)
            assert watch.broken([(saved[-1].step, saved[-1].id)]) is not None
            tr.train()
            full = tr.save("full")  # 5
            tr.train()
            delta = tr.save()  # 6
            quarantine(storage, delta, "damaged (test)")
            tr.train()
            after = tr.save()  # 7
            watch.committed((after.step, after.id), full.step)
            assert watch.wait(60)
    finally:
        watch.close()
    lines = [r.getMessage() for r in caplog.records if "is broken" in r.getMessage()]
    assert len(lines) == 2, lines
    assert f"step {saved[1].step} " in lines[0] and f"step {after.step} " in lines[1], lines
