"""Planning a restore from the newest segments of a long history gives what reading every
record gives: the same latest step and the same chain of every step, or no window at all."""

from __future__ import annotations

from pathlib import Path

import pytest

import deck.read.indexed
from deck.read.catalog import manifest_keys, read_manifests
from deck.read.lineage import chain_for, latest_restorable
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
