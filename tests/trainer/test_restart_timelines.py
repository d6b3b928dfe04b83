"""A restart must never commit what an earlier process left in its spool over a newer timeline.

A break-it finding: a job killed with a part pending in its spool (``release="first_tier"``),
restarted with another spool (another host, another config) that restored and committed the
same steps again, then restarted once more with the first spool: the first job's part was
"resumed" and its commit record replaced the newer timeline's, breaking every step after it and
restoring the old state silently. Parts of an epoch older than the newest at the URI are
discarded now."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.multiprocessing as mp

import deck
from deck import failpoints
from deck.demo import ModelSpec, build_model, train_step
from deck.errors import StorageError
from deck.format.epochs import EPOCH_ROOT
from deck.ops.retention import RetentionPolicy, collect_garbage
from deck.read.catalog import read_manifests
from deck.storage import open_storage
from deck.storage.wrapper import StorageWrapper
from deck.testing.dist_harness import run_ranks

pytestmark = pytest.mark.slow
SPEC = ModelSpec(num_tables=2, rows=200, dim=8, batch=16, sharding="table_wise")


def _job(rank: int, world_size: int, uri: str, spool: str, seed: int, point: str) -> None:
    if point:
        failpoints.configure(point)
    model, opt = build_model(SPEC)
    config = deck.DeckConfig(
        uri=uri,
        delta_every_steps=2,
        staging=deck.StagingConfig(release="first_tier", spool_dir=spool, tiers="cpu-ssd-remote"),
    )
    with deck.enable(model, [opt], config) as ck:
        start = ck.restore()
        first = 0 if start is None else start + 2
        for step in range(first, 3):
            if step:
                train_step(model, opt, SPEC, seed + step)
            ck.step(step)
            if step == 0:
                assert ck.flush()  # committed before step 2's part is staged
        assert ck.flush()
        if point == "" and seed == 0:  # the last restart: nothing was resumed
            assert ck.recovered == [], ck.recovered


def test_a_stale_spooled_part_never_replaces_a_newer_timeline(tmp_path: Path) -> None:
    uri, first, second = str(tmp_path / "ck"), str(tmp_path / "spool1"), str(tmp_path / "spool2")
    # Job A: step 0 committed, step 2 staged (step() returned) and killed before its commit
    with pytest.raises(mp.ProcessExitedException):
        run_ranks(_job, uri, first, 0, "stager.part_manifest.before_put:2", world_size=1)
    assert sorted(read_manifests(open_storage(uri))) == [0]
    assert list(Path(first).rglob("*.pending.json")), sorted(Path(first).rglob("*"))
    # Job B, another spool: restores step 0, trains other batches, commits step 2
    run_ranks(_job, uri, second, 100, "", world_size=1)
    newer = read_manifests(open_storage(uri))[2]
    # Job C, A's spool again: A's part of step 2 is of an older epoch, discarded
    run_ranks(_job, uri, first, 0, "", world_size=1)
    now = read_manifests(open_storage(uri))
    assert sorted(now) == [0, 2] and now[2].id == newer.id, (now[2].id, newer.id)
    assert not list(Path(first).rglob("*.pending.json"))


def _shrunk(rank: int, world_size: int, uri: str, spool: str) -> None:
    model, opt = build_model(SPEC)
    config = deck.DeckConfig(
        uri=uri,
        delta_every_steps=2,
        staging=deck.StagingConfig(
            release="first_tier", spool_dir=spool, tiers="cpu-ssd-remote", commit_timeout_s=3600
        ),
    )
    with deck.enable(model, [opt], config) as ck:  # waited commit_timeout_s for rank 1 before
        assert ck.recovered == [], ck.recovered
        assert ck.restore() == 0


def test_a_restart_on_fewer_ranks_drops_a_part_it_cannot_finish_at_once(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A break-it finding: a 2-rank job killed with step 2 staged on both ranks, restarted on 1
    rank with the same spool: the constructor waited commit_timeout_s (an hour) for rank 1's
    part, which no rank of the new job can upload. Dropped at once now (step 0 restores)."""
    uri, spool = str(tmp_path / "ck"), str(tmp_path / "spool")
    with pytest.raises((mp.ProcessExitedException, mp.ProcessRaisedException)):
        run_ranks(_job, uri, spool, 0, "stager.part_manifest.before_put:2")
    assert sorted(read_manifests(open_storage(uri))) == [0]
    assert len(list(Path(spool).rglob("*.pending.json"))) >= 1
    capfd.readouterr()
    run_ranks(_shrunk, uri, spool, world_size=1)
    # Why, said as it is (a break-it finding: "not in this job or never staged theirs", of a
    # part rank 1 had staged whole)
    assert "rank(s) [1] are not in this job of 1" in capfd.readouterr().err


def _staged(uri: str, spool: str) -> deck.DeckConfig:
    return deck.DeckConfig(
        uri=uri,
        delta_every_steps=2,
        staging=deck.StagingConfig(release="first_tier", spool_dir=spool, tiers="cpu-ssd-remote"),
    )


def _history(rank: int, world_size: int, uri: str, spool: str) -> None:
    model, opt = build_model(SPEC)
    with deck.enable(model, [opt], _staged(uri, spool)) as ck:
        for step in range(0, 9):
            if step:
                train_step(model, opt, SPEC, step)
            ck.step(step)
        assert ck.flush()


def _rollback_killed_at_its_first_record(rank: int, world_size: int, uri: str, spool: str) -> None:
    failpoints.configure("commit.after_witness:1")  # (this process's first commit: step 6)
    model, opt = build_model(SPEC)
    with deck.enable(model, [opt], _staged(uri, spool)) as ck:
        assert ck.restore(4) == 4
        for step in (5, 6):
            train_step(model, opt, SPEC, 100 + step)
            ck.step(step)
        ck.flush()


def _restarted(rank: int, world_size: int, uri: str, spool: str) -> None:
    model, opt = build_model(SPEC)
    with deck.enable(model, [opt], _staged(uri, spool)) as ck:
        assert [s.step for s in ck.recovered] == [6], ck.recovered
        assert ck.restore() == 6


def test_gc_keeps_a_rollbacks_first_save_killed_after_its_witness(tmp_path: Path) -> None:
    """A break-it finding: a rollback (restore(4) under steps up to 8) killed after its epoch
    witness and before the record of its first save (a full of step 6, over the old timeline's
    record of step 6): GC deleted that save's files as an attempt no record references, and the
    restart, which commits it from the spool otherwise, refused the latest (step 8, of the
    timeline the rollback left). GC keeps a witnessed epoch's attempts from where it began."""
    uri, spool = str(tmp_path / "ck"), str(tmp_path / "spool")
    run_ranks(_history, uri, spool, world_size=1)
    with pytest.raises(mp.ProcessExitedException):
        run_ranks(_rollback_killed_at_its_first_record, uri, spool, world_size=1)
    attempts = [p for p in (Path(uri) / "step-000000000006").iterdir() if p.is_dir()]
    assert len(attempts) == 2, attempts  # the old timeline's and the rollback's
    # A witness that cannot be read now is not a witness that is gone: every attempt is kept,
    # and the run says why.
    report = collect_garbage(
        _WitnessUnreadable(open_storage(uri)), RetentionPolicy(grace_s=0), whole=True
    )
    assert not report.orphans, report.orphans
    assert any("uncommitted attempts kept" in e and "epochs" in e for e in report.errors), (
        report.errors
    )
    report = collect_garbage(open_storage(uri), RetentionPolicy(grace_s=0), whole=True)
    assert not report.orphans, report.orphans
    assert all(p.is_dir() for p in attempts)
    run_ranks(_restarted, uri, spool, world_size=1)


class _WitnessUnreadable(StorageWrapper):
    """The store, with every read of an epoch witness failing (a transient error)."""

    def get(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        if path.startswith(f"{EPOCH_ROOT}/"):
            raise StorageError(f"{self.describe(path)}: read failed (injected)")
        return self.inner.get(path, start, end)
