"""Damaged checkpoints on a real 2-rank DMP run: restore names the damaged file and step;
``restore(allow_fallback=True)`` quarantines it and restores the newest older step that has a
valid chain, bitwise; a trainer whose last chain was broken takes a new full next."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import deck
from deck.cli import main as deck_cli
from deck.demo import (
    ModelSpec,
    TrainState,
    build_model,
    capture_state,
    diff_states,
    train_step,
    train_with_checkpoints,
)
from deck.errors import CorruptCheckpointError, StorageError
from deck.format.commit_log import LOG_ROOT, listed_seqs
from deck.merge.policy import FullPolicy, MergeConfig
from deck.merge.worker import MergeWorker
from deck.ops.export import StepState
from deck.ops.retention import RetentionPolicy, collect_garbage
from deck.read.catalog import read_manifests
from deck.read.indexed import compact
from deck.read.lineage import latest_checked, latest_confirmed
from deck.storage import LocalStorage, open_storage
from deck.storage.wrapper import StorageWrapper
from deck.testing.dist_harness import run_ranks
from deck.testing.synth import SynthTrainer

pytestmark = pytest.mark.slow
SPEC = ModelSpec(num_tables=3, rows=600, dim=8, batch=32)


def _restore(config: deck.DeckConfig, step: int | None, **kw: bool) -> tuple[int | None, object]:
    model, opt = build_model(SPEC, seed=99)
    user = TrainState()
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
        got = ck.restore(step, **kw)
        return got, (ck.last_restore, capture_state(model, opt, user))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A
    path.write_bytes(bytes(data))


def _job(rank: int, world_size: int, root: str) -> None:
    uri = f"{root}/ck"
    config = deck.DeckConfig(uri=uri, delta_every_steps=5, lease_ttl_s=None)
    # Nothing committed yet: no fallback is offered (a break-it finding: it was)
    with pytest.raises(deck.CheckpointNotFoundError) as empty:
        _restore(config, 6)
    assert str(empty.value).endswith(f"; nothing is committed at {uri}"), empty.value
    model, opt = build_model(SPEC)
    user = TrainState()
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
        live = train_with_checkpoints(ck, model, opt, SPEC, user, 20)

        # Damage one chunk of the delta of step 15 (rank 0 does it; every rank then restores).
        chunk = sorted((Path(uri) / "step-000000000015").rglob("*.chunk"))[0]
        if rank == 0:
            _flip(chunk)
        dist.barrier()

        # A plain restore of the latest step fails on every rank, each naming the file (the
        # rank that read it, or the others quoting it: rank 0's log is the one read) and what
        # to do (a break-it finding: the others said "see their errors", nothing to do)
        with pytest.raises(CorruptCheckpointError) as info:
            _restore(config, None)
        said = str(info.value)
        assert chunk.name in said and "step 15" in said, said
        assert "restore(allow_fallback=True) restores the newest valid step" in said, said

        # With fallback: steps 20 and 15 need the damaged delta; step 10 is the newest valid one.
        got, (stats, state) = _restore(config, None, allow_fallback=True)
        assert got == 10
        assert stats.fallback and "instead of step 20" in stats.fallback, stats.fallback
        if rank == 0:
            assert chunk.name in stats.fallback, stats.fallback
        bad = diff_states(live[10], state)
        assert not bad, f"rank {rank}: {bad[:5]}"
        manifests = read_manifests(open_storage(uri))
        assert list(manifests.quarantined) == [manifests[15].id]
        # A plain restore goes around the quarantine, and its stats say so on rank 0 (a
        # break-it finding: only a warning did, which code cannot see)
        got, (stats, _) = _restore(config, None)
        assert got == 10
        if rank == 0:
            assert stats.fallback and "passed by steps [15, 20]" in stats.fallback, stats

        # The trainer was at step 20, a delta of 15: its next checkpoint must be a full.
        for step in range(21, 26):
            train_step(model, opt, SPEC, step)
            user.step = step
        stats25 = ck.step(25)
        assert stats25 is not None and stats25.kind == "full", stats25
        live[25] = capture_state(model, opt, user)
        ck.flush()

    got, (_, state) = _restore(config, None)
    assert got == 25
    assert not diff_states(live[25], state)

    # Step 10 removed (as retention would): a fallback from it goes to an older step, never to
    # a newer one (25 is committed and valid, yet newer than asked).
    if rank == 0:
        shutil.rmtree(Path(uri) / "step-000000000010")
    dist.barrier()
    got, (stats, state) = _restore(config, 10, allow_fallback=True)
    assert got == 5, got
    assert stats.fallback and "instead of step 10" in stats.fallback, stats.fallback
    assert not diff_states(live[5], state)

    # A commit record lost after step 25 (step 30's: a sync that missed it). Step 35 builds on
    # it: a plain restore of the latest refuses on every rank, naming the steps it would give
    # up and the record to put back (a break-it finding: a restarted job restored step 25 with
    # a warning and saved steps 30 and 35 again over what the record's return restores).
    model, opt = build_model(SPEC)
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
        assert ck.restore() == 25
        for step in range(26, 36):
            train_step(model, opt, SPEC, step)
            user.step = step
            ck.step(step)
        live[35] = capture_state(model, opt, user)
        assert ck.flush()
    record = Path(uri) / "step-000000000030" / "manifest.json"
    kept = record.read_bytes()
    dist.barrier()
    if rank == 0:
        record.unlink()
    dist.barrier()
    with pytest.raises(CorruptCheckpointError) as lost:
        _restore(config, None)
    said = str(lost.value)
    assert "steps [35]" in said and "after step 25" in said, said
    assert "step-000000000030/manifest.json was lost" in said, said
    assert "allow_fallback=True) restores step 25" in said, said
    if rank:
        assert "on rank 0" in said, said
    got, (_, state) = _restore(config, None, allow_fallback=True)
    assert got == 25 and not diff_states(live[25], state)
    dist.barrier()
    if rank == 0:
        record.write_bytes(kept)
    dist.barrier()
    got, (_, state) = _restore(config, None)
    assert got == 35 and not diff_states(live[35], state)


def test_fallback_and_new_full(tmp_path: Path) -> None:
    run_ranks(_job, str(tmp_path))


def _eight_steps(
    root: str,
) -> tuple[str, deck.DeckConfig, TrainState, dict[int, dict[str, torch.Tensor]]]:
    """Steps 0..8 of a job checkpointing every 2nd step at ``root``/ck: its URI, config, user
    state and live states."""
    uri = f"{root}/ck"
    config = deck.DeckConfig(uri=uri, delta_every_steps=2, lease_ttl_s=None)
    model, opt = build_model(SPEC)
    user = TrainState()
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
        live = train_with_checkpoints(ck, model, opt, SPEC, user, 8)
    return uri, config, user, live


def _roll_back_to_4(config: deck.DeckConfig, user: TrainState) -> None:
    """A rollback: restore step 4 of the eight-step job, train on and save steps 5 and 6 (step
    6: a full, the new epoch's first save)."""
    model, opt = build_model(SPEC)
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
        assert ck.restore(4) == 4
        for step in (5, 6):
            train_step(model, opt, SPEC, step)
            user.step = step
            ck.step(step)
        assert ck.flush()


def _rollback_job(rank: int, world_size: int, root: str) -> None:
    uri, config, user, live = _eight_steps(root)
    folder = Path(uri) / "step-000000000006"
    old = (folder / "manifest.json").read_bytes()  # a backup taken before the rollback
    _roll_back_to_4(config, user)
    new = (folder / "manifest.json").read_bytes()
    attempt = folder / json.loads(new)["id"]
    (folder / "manifest.json").unlink()  # the rollback's first record is lost

    # GC keeps the attempt folder of the epoch no record holds (before: deleted as an
    # uncommitted checkpoint older than step 8, a step of the timeline the rollback left)
    collect_garbage(open_storage(uri), RetentionPolicy(grace_s=0), whole=True)
    assert attempt.is_dir()

    # The pre-rollback record put back: step 8 of the timeline left is restorable again, and a
    # plain restore refuses to resume it, naming the epoch the witness says began at step 6
    (folder / "manifest.json").write_bytes(old)
    with pytest.raises(CorruptCheckpointError) as info:
        _restore(config, None)
    said = str(info.value)
    assert "epoch 1 began at step 6" in said and "Step 8" in said, said
    assert "allow_fallback=True) restores step 4" in said, said
    # An export of the latest refuses it too (it exported an older step, exit 0), and verify
    # says so (it passed)
    with pytest.raises(CorruptCheckpointError, match=r"epoch 1 began at step 6.*--step N"):
        StepState(open_storage(uri))
    assert deck_cli(["verify", uri, "--all"]) == 1
    got, (stats, state) = _restore(config, None, allow_fallback=True)
    assert got == 4 and not diff_states(live[4], state)
    assert stats.fallback and "epoch 1 began at step 6" in stats.fallback, stats.fallback

    # The rollback's own record back: its full restores
    (folder / "manifest.json").write_bytes(new)
    got, _ = _restore(config, None)
    assert got == 6


def test_a_rollback_whose_first_record_is_lost_is_not_undone(tmp_path: Path) -> None:
    """Break-it findings: after a rollback from step 8 to 4 whose first save (a full at step 6)
    lost its commit record, GC deleted that full's files, and putting back the record a backup
    from before the rollback held made a plain restore resume the timeline the rollback left."""
    run_ranks(_rollback_job, str(tmp_path), world_size=1)


def _newest_record_lost_job(rank: int, world_size: int, root: str) -> None:
    uri, config, user, live = _eight_steps(root)
    record = Path(uri) / "step-000000000008" / "manifest.json"
    kept = record.read_bytes()
    record.unlink()  # the newest step's record lost: nothing builds on it

    with pytest.raises(CorruptCheckpointError) as info:
        _restore(config, None)
    said = str(info.value)
    assert "step 8" in said and "after step 6" in said, said
    assert "commit log announced" in said and "step-000000000008/manifest.json" in said, said
    assert "allow_fallback=True) restores step 6" in said, said
    with pytest.raises(CorruptCheckpointError, match=r"step 8 .*--step N"):
        StepState(open_storage(uri))
    assert deck_cli(["verify", uri]) == 1
    # A follower serves the step before it, saying why (it said nothing)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: said.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("deck").addHandler(handler)
    try:
        assert deck_cli(["follow", uri, "--out", f"{root}/followed", "--once"]) == 0
    finally:
        logging.getLogger("deck").removeHandler(handler)
    assert any("step 8" in m and "serving step 6" in m for m in said), said
    got, (stats, state) = _restore(config, None, allow_fallback=True)
    assert got == 6 and not diff_states(live[6], state)
    assert stats.fallback and "step 8" in stats.fallback, stats.fallback

    record.write_bytes(kept)  # put back: step 8 restores, and nothing is said
    got, (stats, state) = _restore(config, None)
    assert got == 8 and not diff_states(live[8], state) and not stats.fallback
    assert deck_cli(["verify", uri]) == 0

    # Lost again, then a rollback to step 4 saves step 6 again on a new timeline: step 8's
    # record was announced before the new step 6's, on the timeline left: nothing is refused
    record.unlink()
    _roll_back_to_4(config, user)
    got, (stats, _) = _restore(config, None)
    assert got == 6 and not stats.fallback


def test_the_newest_steps_lost_record_is_not_passed_by(tmp_path: Path) -> None:
    """A break-it finding: with the newest step's commit record lost (nothing builds on it),
    a plain restore took the step before it without a word, and training on saved the lost
    step again. The commit log announced that record: a plain restore, an export of the latest
    and ``deck verify`` refuse it, naming the record, until it is put back."""
    run_ranks(_newest_record_lost_job, str(tmp_path), world_size=1)


class _LogUnreadable(StorageWrapper):
    """The store, with every read of a commit-log entry failing (a transient error)."""

    def get(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        if path.startswith(f"{LOG_ROOT}/"):
            raise StorageError(f"{self.describe(path)}: read failed (injected)")
        return self.inner.get(path, start, end)


def test_the_announcement_check_over_a_damaged_or_unreadable_log(tmp_path: Path) -> None:
    """The commit log is an index: a damaged entry stops the look back (what was read after
    it still counts), never the restore; an entry that cannot be read now is an error of the
    restore naming it, not an entry that is absent."""
    storage = LocalStorage(tmp_path / "ck")
    tr = SynthTrainer(storage)
    tr.save("full")
    tr.save_deltas(4)
    (tmp_path / "ck" / "step-000000000004" / "manifest.json").unlink()
    manifests = read_manifests(storage)
    check = latest_checked(storage, manifests, 3)
    assert check.gives_up is not None and "step 4" in check.gives_up, check
    seqs = listed_seqs(storage, LOG_ROOT)
    (tmp_path / "ck" / LOG_ROOT / f"{seqs[-1]:020d}.json").write_bytes(b"damaged")
    assert latest_checked(storage, manifests, 3).gives_up is None  # (its announcement gone)
    with pytest.raises(StorageError, match="read failed"):
        latest_checked(_LogUnreadable(storage), manifests, 3)


def _latest_given_up(storage: LocalStorage) -> str | None:
    """What a plain restore of the latest step would refuse, as it reads the store."""
    checked, latest = latest_confirmed(storage, read_manifests(storage))
    assert latest == 7, latest
    return latest_checked(storage, checked, latest).gives_up


def test_the_newest_lost_record_after_the_log_was_pruned(tmp_path: Path) -> None:
    """With the newest step's commit log entry pruned (catalogs written after it), its lost
    record was passed by without a word. A merger checkpoint built on it, or the catalog's
    copy of it, vouches for it as the log did; a forged catalog naming a checkpoint whose
    parts are not there refuses nothing."""
    root = tmp_path / "ck"
    storage = LocalStorage(root)
    tr = SynthTrainer(storage)
    tr.save("full")
    tr.save_deltas(8)
    worker = MergeWorker(storage, MergeConfig(stride=2, full=FullPolicy(max_live_fraction=None)))
    while worker.run_pass().progressed:  # each pass's commits, then a catalog: the log pruned
        compact(storage, read_manifests(storage).index, force=True)  # type: ignore[arg-type]
    assert len(listed_seqs(storage, "_catalog")) == 2 and len(listed_seqs(storage, LOG_ROOT)) < 3
    record = root / "step-000000000008" / "manifest.json"
    kept = record.read_bytes()
    record.unlink()

    said = _latest_given_up(storage)  # (before: None, the latest step 7 taken silently)
    assert said is not None and "step 8" in said and "merger checkpoint merged/" in said, said
    assert "step-000000000008/manifest.json is not there" in said, said
    assert deck_cli(["verify", str(root)]) == 1

    # The merger checkpoints built on step 8 gone too (deleted behind the log's back): the
    # catalog's copy of its record vouches for it
    for folder in (root / "merged").glob("*-000000000008-*"):
        shutil.rmtree(folder)
    said = _latest_given_up(storage)
    assert said is not None and "step 8" in said and "the catalog held it" in said, said

    # Its parts gone as well (a catalog naming a checkpoint that is not there: forged, or
    # deleted whole): nothing to put back, nothing refused
    parts = root / "step-000000000008" / json.loads(kept)["id"]
    shutil.move(parts, tmp_path / "parts")
    assert _latest_given_up(storage) is None
    shutil.move(tmp_path / "parts", parts)
    record.write_bytes(kept)  # put back: step 8 is the latest again
    checked, latest = latest_confirmed(storage, read_manifests(storage))
    assert latest == 8 and latest_checked(storage, checked, latest).gives_up is None
