"""``deck ls``'s default view of a long history is read from the newest segments of the
catalog, and shows what a read of every record shows for the checkpoints it lists."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import deck.read.indexed
from deck.format.manifest import MANIFEST
from deck.ops.listing import list_recent_rows, list_rows
from deck.read.lineage import confirmed, latest_restorable
from deck.read.window import read_window
from deck.storage import LocalStorage, Storage
from deck.testing.synth_lineage import LineageSim


def _history(root: Path, steps: int, rollback_at: int | None = None) -> LocalStorage:
    sim = LineageSim(world_size=2, seed=steps)
    last = sim.save("full")
    sim.merge_blocks(last, stride=4, full_every=16, lag=3)
    for _ in range(1, steps):
        if sim.step == rollback_at:
            sim.rollback(sim.step - 3)
            rollback_at = None
        sim.train()
        last = sim.save("full" if sim.step % 25 == 0 else "delta")
        sim.merge_blocks(last, stride=4, full_every=16, lag=3)
    storage = LocalStorage(str(root))
    sim.write(storage, durable=False)
    sim.write_log(storage, 10)
    return storage


def _pending_attempt(storage: LocalStorage, step: int) -> None:
    """Rank parts of an attempt at ``step`` with no commit record (a save in progress)."""
    src = storage.local_path("step-000000000000")
    assert src is not None
    (part,) = [k for k in storage.list("step-000000000000/") if k.endswith("rank-00000.json")]
    storage.put(f"step-{step:012d}/00000000deadbeef/rank-00000.json", storage.get(part))


def test_the_recent_rows_are_those_of_every_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(deck.read.indexed, "SEGMENT_STEPS", 8)
    storage = _history(tmp_path / "uri", 300)
    _pending_attempt(storage, 300)
    recent = list_recent_rows(storage, 10)
    _, every = list_rows(storage)
    assert recent is not None and recent.floor > 0  # a part of the history only
    by_id = {(r.id, r.state): r for r in every}
    assert [by_id[(r.id, r.state)] for r in recent.rows] == recent.rows
    steps = sorted({r.step for r in every if r.state == "committed"})
    shown = {r.step for r in recent.rows if r.kind != "full"}
    assert shown == set(steps[-10:]) | {300}  # the newest 10 steps, and the pending one
    assert any(r.state == "pending" and r.step == 300 for r in recent.rows)
    assert {r.step for r in recent.rows if r.kind == "full"} >= {275}  # the newest full
    assert len(recent.rows) + recent.older == len(every)
    assert recent.graph.nodes.keys() < {r.id for r in every}  # (not every record read)


def test_a_recent_step_without_a_chain_takes_every_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Right after a rollback the newest steps are those it left: whether they are abandoned
    (or broken) takes every record, so the view is not taken from the window; once the new
    timeline is past them, it is again."""
    monkeypatch.setattr(deck.read.indexed, "SEGMENT_STEPS", 8)
    assert list_recent_rows(_history(tmp_path / "a", 300, rollback_at=298), 1) is None
    storage = _history(tmp_path / "b", 300, rollback_at=280)
    recent = list_recent_rows(storage, 20)
    assert recent is not None and all(r.state == "committed" for r in recent.rows if not r.merged)
    # The merger's work on the steps the rollback saved again is abandoned, as a listing of
    # every record says
    every = {r.id: r.state for r in list_rows(storage)[1]}
    assert {r.id: r.state for r in recent.rows} == {r.id: every[r.id] for r in recent.rows}
    assert "abandoned" in {r.state for r in recent.rows if r.merged}


def test_deck_ls_of_a_long_history(tmp_path: Path) -> None:
    """The command, on a history of several segments as the catalog cuts them by default: the
    newest 20 steps and the fulls of the part read, and how many more there are."""
    storage = _history(tmp_path / "uri", 6000)
    _, every = list_rows(storage)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    got = subprocess.run(
        [sys.executable, "-m", "deck.cli", "ls", str(tmp_path / "uri")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert got.returncode == 0, got.stderr
    lines = got.stdout.splitlines()
    rows = [line.split() for line in lines[1:-1]]
    steps = sorted({r.step for r in every})
    assert [int(r[1]) for r in rows if r[0] != "full"][-1] == steps[-1]
    assert {int(r[1]) for r in rows if r[0] != "full"} == set(steps[-20:])
    assert len(rows) < 200  # (not every full of the history)
    assert lines[-1] == (
        f"({len(every) - len(rows)} more checkpoint(s) not shown: --all lists every one, "
        "--since STEP or --last N others)"
    )
    assert f"{steps[0]}/{MANIFEST}" not in got.stdout


@pytest.mark.parametrize("damage", ["flip", "quarantine"])
def test_the_recent_rows_are_checked_against_the_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """Found by a user trying to break it: a full of the window (not among the newest steps)
    whose commit record was damaged after the catalog was written showed as committed, and the
    steps after it as restorable, where a read of every record says damaged and broken. The
    view's records (and their chains', and their quarantine records) are read, and any
    difference lists every record."""
    monkeypatch.setattr(deck.read.indexed, "SEGMENT_STEPS", 8)
    storage = _history(tmp_path / "uri", 300)
    recent = list_recent_rows(storage, 5)
    assert recent is not None
    fulls = [r for r in recent.rows if r.kind == "full" and not r.merged and r.step < 295]
    full = max(fulls, key=lambda r: r.step)
    key = f"{full.folder}/{MANIFEST}"
    if damage == "flip":
        data = bytearray(storage.get(key))
        data[len(data) // 2] ^= 0x01
        storage.put(key, bytes(data))
    else:  # a quarantine record the catalog does not know of
        storage.put(f"quarantine/{full.id}.json", b"{}")
    assert list_recent_rows(storage, 5) is None


def test_a_recent_record_the_catalog_does_not_hold_takes_every_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit record among the newest steps written without the log (by hand, by a deck
    without it): the catalog does not know it, so the view is not taken from the window."""
    monkeypatch.setattr(deck.read.indexed, "SEGMENT_STEPS", 8)
    storage = _history(tmp_path / "uri", 300)
    recent = list_recent_rows(storage, 5)
    assert recent is not None
    newest = max((r for r in recent.rows if not r.merged), key=lambda r: r.step)
    record = storage.get(f"{newest.folder}/{MANIFEST}")
    storage.put(f"step-{newest.step + 1:012d}/{MANIFEST}", record)  # (another step's: damaged)
    assert list_recent_rows(storage, 5) is None


class _OneLevelBackend(LocalStorage):
    """A backend written before ``Storage.list_dir_after`` existed: its one-level listing is
    its own, and it knows nothing of bounds."""

    def list_dir(self, prefix: str = "") -> list[str]:
        return super().list_dir(prefix)

    list_dir_after = Storage.list_dir_after


def test_a_backend_without_a_bounded_listing_lists_and_restores_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by trying to break the bounded listing: when the bound was a new argument of
    ``list_dir``, a backend overriding ``list_dir(prefix)`` alone failed ``deck ls`` and every
    restore with a TypeError. The bounded listing is a method of its own whose default lists
    the folder and drops the names below the bound."""
    monkeypatch.setattr(deck.read.indexed, "SEGMENT_STEPS", 8)
    made = _history(tmp_path / "uri", 120)
    _pending_attempt(made, 120)
    old = _OneLevelBackend(str(tmp_path / "uri"))
    recent, want = list_recent_rows(old, 5), list_recent_rows(made, 5)
    assert recent is not None and want is not None
    assert (recent.rows, recent.floor, recent.older) == (want.rows, want.floor, want.older)
    got = read_window(old, None)
    assert got is not None
    step = latest_restorable(got)
    assert confirmed(old, got, step, latest=True) is got  # the catalog agrees: no full read
