"""Planning a restore from the newest segments of a long history gives what reading every
record gives: the same latest step and the same chain of every step, or no window at all."""

from __future__ import annotations

from pathlib import Path

import pytest

import deck.read.indexed
from deck.format.manifest import MANIFEST
from deck.read.catalog import manifest_keys, read_manifests
from deck.read.indexed import IndexedRead, compact
from deck.read.lineage import chain_for, confirmed, latest_restorable
from deck.read.window import read_window
from deck.storage import LocalStorage
from deck.testing.synth_lineage import LineageSim


def _history(
    root: Path, steps: int, full_every: int, rollback_at: int | None, seed: int
) -> LocalStorage:
    sim = LineageSim(world_size=1, seed=seed)
    last = sim.save("full")
    sim.merge_blocks(last, stride=4, full_every=16, lag=3)
    for i in range(1, steps):
        if rollback_at is not None and i == rollback_at:
            sim.rollback(sim.step - 20)
        sim.train()
        last = sim.save("full" if sim.step % full_every == 0 else "delta")
        sim.merge_blocks(last, stride=4, full_every=16, lag=3)
    storage = LocalStorage(str(root))
    sim.write(storage, durable=False)
    sim.write_log(storage, 10)
    return storage


@pytest.mark.parametrize(
    ("steps", "full_every", "rollback_at", "seed"),
    [(300, 50, None, 1), (300, 1000, 250, 2), (200, 37, 120, 3)],
)
def test_a_window_plans_what_every_record_plans(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    steps: int,
    full_every: int,
    rollback_at: int | None,
    seed: int,
) -> None:
    monkeypatch.setattr(deck.read.indexed, "SEGMENT_STEPS", 8)
    storage = _history(tmp_path / "uri", steps, full_every, rollback_at, seed)
    truth = read_manifests(storage, manifest_keys(storage))
    latest = latest_restorable(truth)
    got = read_window(storage)
    assert got is not None and got.window is not None and got.window.floor > 0  # a part only
    assert len(got) + len(got.merged) < (len(truth) + len(truth.merged)) / 2
    assert latest_restorable(got) == latest
    answered = 0
    for step in sorted(truth):
        got = read_window(storage, step)
        if got is None:
            continue
        answered += 1
        assert latest_restorable(got) == latest
        assert [m.id for m in chain_for(got, step)] == [m.id for m in chain_for(truth, step)]
    assert answered > 0  # (the steps near the newest: older ones need most of the history)


@pytest.mark.parametrize("how", ["omit", "stale"])
def test_a_forged_catalog_costs_a_read_never_another_chain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A catalog with valid checksums whose segments leave out a merged checkpoint of the
    cheapest chain of the latest step (or hold its record as another one's: a stale copy):
    the planned chain is checked against the records of every step it was chosen among, so a
    restore plans the records' chain, not the next cheapest one the catalog still holds."""
    monkeypatch.setattr(deck.read.indexed, "SEGMENT_STEPS", 8)
    storage = _history(tmp_path / "uri", 200, 1000, None, 4)
    truth = read_manifests(storage, manifest_keys(storage))
    latest = latest_restorable(truth)
    assert latest is not None
    want = [m.id for m in chain_for(truth, latest)]
    merged = [m for m in chain_for(truth, latest) if m.is_merged]
    assert merged
    victim = f"{merged[-1].folder}/{MANIFEST}"
    index = read_manifests(storage).index
    assert index is not None
    records = dict(index.records)
    if how == "omit":
        del records[victim]
    else:  # the record of another merged checkpoint of the same steps' range, renamed
        records[victim] = records[victim].replace(merged[-1].id.encode(), b"0" * 16)
    forged = IndexedRead(
        seq=index.seq, records=records, recheck=list(index.recheck), log_from=index.log_from
    )
    compact(storage, forged, force=True)
    through = read_manifests(storage)
    assert through.index is not None and through.index.catalog is not None
    if how == "omit":
        assert through.merged != truth.merged  # (the catalog is forged)
    else:  # (a record that does not match its folder is read from its own file)
        assert through.merged == truth.merged and not through.damaged_merged
    for step in (None, latest):
        got = read_window(storage, step)
        assert got is not None
        target = latest_restorable(got) if step is None else step
        checked = confirmed(storage, got, target, latest=step is None)
        assert latest_restorable(checked) == latest
        assert [m.id for m in chain_for(confirmed(storage, checked, latest), latest)] == want


def test_a_window_whose_newest_step_is_quarantined_names_it_without_reading_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by ``make fuzz-ops OPS_EXAMPLES=300 FUZZ_SEED=2086196343``: a window whose newest
    step restores no more (its checkpoint quarantined) answered the latest, then raised
    OutsideWindow from the warning about the step it passed (the reason needs every record)."""
    monkeypatch.setattr(deck.read.indexed, "SEGMENT_STEPS", 8)
    sim = LineageSim(world_size=1, seed=5)
    sim.save("full")
    for _ in range(1, 120):
        sim.train()
        last = sim.save("full" if sim.step % 50 == 0 else "delta")
    sim.quarantine(last.id)
    storage = LocalStorage(str(tmp_path / "uri"))
    sim.write(storage, durable=False)
    sim.write_log(storage, 10)
    truth = read_manifests(storage, manifest_keys(storage))
    got = read_window(storage)
    assert got is not None and got.window is not None
    assert latest_restorable(got) == latest_restorable(truth) == sim.step - 1
