"""GC of a long history plans from the folders of the newest steps (down to a cut where that
decides as every record does: tests/ops/test_gc_window.py), and deletes there what a run over
the whole store deletes; below the cut it leaves everything to the whole run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import deck.read.indexed
from deck.cli import main
from deck.cli.maintain import gc_schedule
from deck.errors import ConfigError
from deck.format.manifest import parse_merged_dir, parse_step_dir
from deck.ops.retention import RetentionPolicy, collect_garbage
from deck.ops.retention.gc import GcReport
from deck.read.catalog import read_manifests
from deck.read.lineage import build_graph, cheapest_chain
from deck.read.window import read_window
from deck.storage import LocalStorage
from deck.testing.synth_lineage import CheckpointFiles, LineageSim, writer_checkpoint

POLICY = RetentionPolicy(grace_s=30.0)


@pytest.fixture(scope="module")
def files() -> CheckpointFiles:
    """The files of a checkpoint the real writer wrote (GC checks those it relies on)."""
    return writer_checkpoint(world_size=2)


def _history(
    root: Path, steps: int, files: CheckpointFiles, full_every: int = 25
) -> tuple[LocalStorage, float]:
    sim = LineageSim(seed=steps, files=files)
    last = sim.save("full")
    sim.merge_blocks(last, stride=4, full_every=16, lag=3)
    for _ in range(1, steps):
        sim.train()
        last = sim.save("full" if sim.step % full_every == 0 else "delta")
        sim.merge_blocks(last, stride=4, full_every=16, lag=3)
    storage = LocalStorage(str(root))
    sim.write(storage, durable=False)
    sim.write_log(storage, 10)
    return storage, sim.clock + 1.0


def label_step(label: str) -> int:
    """The step of a GC report's folder label (a step folder, or a merger folder)."""
    folder = label.split(" ")[0].rstrip("/")
    head, _, rest = folder.partition("/")
    step = parse_step_dir(head)
    if step is not None:
        return step
    parsed = parse_merged_dir(rest.partition("/")[0])
    assert parsed is not None, label
    return parsed[1]


def _abandoned(storage: LocalStorage, step: int, at: float) -> str:
    """An attempt folder of ``step`` no record names, its file written at ``at``."""
    (part,) = [k for k in storage.list("step-000000000000/") if k.endswith("rank-00000.json")]
    key = f"step-{step:012d}/00000000deadbeef/rank-00000.json"
    storage.put(key, storage.get(part))
    path = storage.local_path(key)
    assert path is not None
    os.utime(path, (at, at))
    return f"step-{step:012d}/00000000deadbeef/"


def _in_window(report: GcReport, floor: int) -> set[tuple[str, str]]:
    return {d for d in report.deleted if label_step(d[0]) >= floor}


def test_gc_of_the_newest_steps_deletes_what_the_whole_run_deletes_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: CheckpointFiles
) -> None:
    monkeypatch.setattr(deck.read.indexed, "SEGMENT_STEPS", 8)
    storage, now = _history(tmp_path / "uri", 400, files)
    old, new = _abandoned(storage, 3, now - 1000), _abandoned(storage, 396, now - 1000)
    # (a minute on: an attempt of a step committed again within the grace period waits)
    now += 60.0
    whole = collect_garbage(storage, POLICY, dry_run=True, now=now, whole=True)
    newest = collect_garbage(storage, POLICY, dry_run=True, now=now)
    assert whole.floor is None and newest.floor is not None and 0 < newest.floor < 396
    assert newest.deleted and set(newest.deleted) == _in_window(whole, newest.floor)
    assert len(whole.deleted) > len(newest.deleted)  # (older ones wait for a whole run)
    assert {o for o, _ in whole.orphans} == {old, new}
    assert [o for o, _ in newest.orphans] == [new]

    done = collect_garbage(storage, POLICY, now=now)
    assert done.floor == newest.floor and set(done.deleted) == set(newest.deleted)
    after = collect_garbage(storage, POLICY, dry_run=True, now=now, whole=True)
    assert not _in_window(after, newest.floor) and {o for o, _ in after.orphans} == {old}
    # what is left restores as before: the newest segments plan the chain every record plans
    got = read_window(storage)
    assert got is not None
    whole_graph = build_graph(read_manifests(storage))
    latest = whole_graph.latest()
    assert latest is not None and latest == build_graph(got).latest()
    assert [m.id for m in cheapest_chain(build_graph(got), latest)] == [
        m.id for m in cheapest_chain(whole_graph, latest)
    ]
    assert set(whole_graph.restorable_steps()) >= set(range(400))


def test_a_history_of_one_segment_is_collected_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: CheckpointFiles
) -> None:
    storage, now = _history(tmp_path / "uri", 60, files)
    assert collect_garbage(storage, POLICY, dry_run=True, now=now).floor is None


def test_a_grace_period_over_every_commit_reads_the_newest_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: CheckpointFiles
) -> None:
    """No checkpoint can go (each is in the grace period): the newest segment's folders are
    all the run looks at, for their orphans."""
    monkeypatch.setattr(deck.read.indexed, "SEGMENT_STEPS", 8)
    storage, now = _history(tmp_path / "uri", 200, files)
    new = _abandoned(storage, 199, now - 5)
    policy = RetentionPolicy(grace_s=now + 10.0)
    report = collect_garbage(storage, policy, dry_run=True, now=now)
    whole = collect_garbage(storage, policy, dry_run=True, now=now, whole=True)
    assert report.floor is not None and report.floor > 150
    assert not report.deleted and not whole.deleted and whole.grace_held > 0
    assert not report.orphans and not whole.orphans and report.grace_held_orphans == 1
    shorter = RetentionPolicy(grace_s=2.0)  # the orphan's file is older, and its step's record
    report = collect_garbage(storage, shorter, dry_run=True, now=now + 2.0)
    assert [o for o, _ in report.orphans] == [new]


def test_no_cut_reads_every_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: CheckpointFiles
) -> None:
    """One full in the whole history (no two fulls that could be rollback points above any
    step), and no grace period: the run reads the whole store."""
    monkeypatch.setattr(deck.read.indexed, "SEGMENT_STEPS", 8)
    storage, now = _history(tmp_path / "uri", 200, files, full_every=1000)
    policy = RetentionPolicy(grace_s=0.0)
    assert collect_garbage(storage, policy, dry_run=True, now=now).floor is None


def test_deck_gc_says_how_far_it_looked(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    files: CheckpointFiles,
) -> None:
    monkeypatch.setattr(deck.read.indexed, "SEGMENT_STEPS", 8)
    _history(tmp_path / "uri", 400, files)
    uri = str(tmp_path / "uri")
    # (the store's clock: the generated commit times are in the past; a grace period of 0)
    assert main(["gc", uri, "--dry-run", "--grace", "0"]) == 0
    out = capsys.readouterr().out
    assert "looked at the folders of steps " in out and f"`deck gc {uri} --whole`" in out
    assert main(["gc", uri, "--dry-run", "--grace", "0", "--whole"]) == 0
    whole = capsys.readouterr().out
    assert "looked at" not in whole
    assert len(whole.splitlines()) > len(out.splitlines())  # more to delete in the whole store
    # Run for real, each checkpoint is said on stderr as it goes (a killed run's log says what
    # it was deleting: a break-it finding found such logs empty), once for each one reported
    assert main(["gc", uri, "--grace", "0"]) == 0
    run = capsys.readouterr()
    said = [line for line in run.err.splitlines() if line.startswith("deck gc: deleting ")]
    assert said and len(said) == run.out.count("  deleted ") + run.out.count("  retired "), run


def test_deck_gc_when_the_newest_steps_are_all_in_the_grace_period(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    files: CheckpointFiles,
) -> None:
    monkeypatch.setattr(deck.read.indexed, "SEGMENT_STEPS", 8)
    _history(tmp_path / "uri", 200, files)
    uri = str(tmp_path / "uri")
    # (the generated commits are at the start of 1970 on the store's clock)
    assert main(["gc", uri, "--dry-run", "--grace", "1e12"]) == 0
    out = capsys.readouterr().out
    assert "and later is in the grace period" in out and "would delete 0 checkpoint(s)" in out


def test_merge_gc_schedule() -> None:
    """``deck merge --gc --gc-every 3 --gc-whole-every 2``: GC after passes 0, 3, 6, 9, ...,
    the first of those and every second over the whole store; 0 is refused."""
    now = gc_schedule(3, 2)
    assert [now() for _ in range(10)] == [
        True,
        None,
        None,
        False,
        None,
        None,
        True,
        None,
        None,
        False,
    ]
    with pytest.raises(ConfigError, match="--gc-every"):
        gc_schedule(0, 100)


def _compare(storage: LocalStorage, policy: RetentionPolicy, now: float) -> GcReport:
    """The default run, checked against the whole run: it deletes what the whole run deletes
    at its steps, nothing the whole run keeps, but what it keeps for want of a chain (said in
    ``left``); what it keeps for damage (a quarantine) the whole run keeps too."""
    whole = collect_garbage(storage, policy, dry_run=True, now=now, whole=True)
    newest = collect_garbage(storage, policy, dry_run=True, now=now)
    assert newest.floor is not None
    assert set(newest.deleted) <= _in_window(whole, newest.floor)
    missing = _in_window(whole, newest.floor) - set(newest.deleted)
    assert {m[0] for m in missing} == {k[0] for k in newest.left}
    assert {k[0] for k in newest.kept} <= {k[0] for k in whole.kept}
    return newest


@pytest.mark.parametrize("damaged_step", [5, 340])  # far below / just under the cut
def test_a_damaged_record_below_the_cut_keeps_what_lacks_a_chain_above(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: CheckpointFiles, damaged_step: int
) -> None:
    """Found by a break-it run: bit rot in an old step's commit record (after the catalog was
    written) makes the whole run keep every checkpoint after it without a complete chain (here
    epoch 0's steps 393..398, left by a rollback to 390); the run of the newest steps, which
    does not read that record, deleted them. It now keeps what lacks a chain above its cut,
    damage below or not (the whole run deletes it where there is none)."""
    monkeypatch.setattr(deck.read.indexed, "SEGMENT_STEPS", 8)
    sim = LineageSim(seed=1, files=files)
    last = sim.save("full")
    sim.merge_blocks(last, stride=4, full_every=16, lag=3)
    while sim.step < 398:
        sim.train()
        last = sim.save("full" if sim.step % 25 == 0 else "delta")
        if sim.step < 380:
            sim.merge_blocks(last, stride=4, full_every=16, lag=3)
    sim.rollback(390)
    for _ in range(2):
        sim.train()
        sim.save("delta")
    storage = LocalStorage(str(tmp_path / "uri"))
    sim.write(storage, durable=False)
    sim.write_log(storage, 10)
    now, policy = sim.clock + 1000.0, RetentionPolicy(grace_s=30.0)
    before = collect_garbage(storage, policy, dry_run=True, now=now)
    whole = collect_garbage(storage, policy, dry_run=True, now=now, whole=True)
    assert before.floor is not None
    chainless = {f"step-{s:012d}" for s in range(393, 399)}
    assert set(before.deleted) == {
        d for d in _in_window(whole, before.floor) if d[0].split(" ")[0] not in chainless
    }  # the whole run deletes those: no record it read is unreadable
    assert {k[0].split(" ")[0] for k in before.left} == chainless and not before.kept
    path = storage.local_path(f"step-{damaged_step:012d}/manifest.json")
    assert path is not None
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0x20
    t = os.stat(path).st_mtime
    Path(path).write_bytes(bytes(data))
    os.utime(path, (t, t))  # (bit rot keeps the file time)
    after = collect_garbage(storage, policy, dry_run=True, now=now)
    whole = collect_garbage(storage, policy, dry_run=True, now=now, whole=True)
    assert after.floor is not None
    assert set(after.deleted) <= set(whole.deleted)
    assert not any(d[0].startswith("step-00000000039") for d in after.deleted + whole.deleted)


def test_a_quarantine_record_keeps_the_run_to_the_newest_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: CheckpointFiles
) -> None:
    """Found by a break-it run: a quarantine record (the catalog keeps them beside its
    segments) was parsed as a trainer's commit record, failed, and made every run read the
    whole store. Quarantined checkpoints above the cut are planned around as in the whole run."""
    monkeypatch.setattr(deck.read.indexed, "SEGMENT_STEPS", 8)
    sim = LineageSim(seed=400, files=files)
    last = sim.save("full")
    sim.merge_blocks(last, stride=4, full_every=16, lag=3)
    for _ in range(1, 400):
        sim.train()
        last = sim.save("full" if sim.step % 25 == 0 else "delta")
        sim.merge_blocks(last, stride=4, full_every=16, lag=3)
        if sim.step in (120, 390):
            sim.quarantine(sim.trainer[sim.step - 19].id)
    storage = LocalStorage(str(tmp_path / "uri"))
    sim.write(storage, durable=False)
    sim.write_log(storage, 10)
    report = _compare(storage, RetentionPolicy(grace_s=30.0), sim.clock + 1.0)
    assert report.floor is not None and report.floor <= 371
    # (the quarantined delta and the steps only it restores: kept, by both runs)
    assert any(k[0].startswith("step-000000000371") for k in report.kept)
