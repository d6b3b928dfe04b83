"""Epoch witnesses (deck.format.epochs, docs/format.md "Epoch witnesses"): one listing tells a
reader through the catalog the newest epoch, so that a catalog leaving out a rollback's new
timeline (forged with valid checksums) makes a restore read every record instead of picking
the old timeline's higher step, and a trainer's next epoch stays above it; a store without
witnesses (a deck before them) is read record by record there, and restores the same."""

from __future__ import annotations

import builtins
import shutil
import types
from pathlib import Path

import pytest

import deck.read.indexed
from deck.errors import StorageError
from deck.format.epochs import (
    EPOCH_ROOT,
    KEEP_WITNESSES,
    newest_witness,
    witness_key,
    witnesses_in,
)
from deck.format.manifest import MANIFEST
from deck.ops.retention import RetentionPolicy, collect_garbage
from deck.ops.retention.view import newest_view
from deck.read.catalog import ManifestSet, manifest_keys, read_manifests
from deck.read.indexed import IndexedRead, compact
from deck.read.lineage import confirmed, latest_restorable
from deck.read.window import read_window
from deck.storage import LocalStorage, Storage
from deck.storage.wrapper import StorageWrapper
from deck.testing.recording_storage import RecordingStorage
from deck.testing.synth import SynthTrainer
from deck.testing.synth_lineage import LineageSim
from deck.trainer.checkpointer import DeltaCheckpointer
from deck.trainer.loader import next_epoch


def _restore_latest(storage: Storage) -> int | None:
    """The step a trainer's restore of the latest step loads (StateLoader.restore, one rank):
    a windowed read or a read through the catalog, the choice checked against the records."""
    manifests = read_window(storage) or read_manifests(storage)
    chosen = latest_restorable(manifests)
    checked = confirmed(storage, manifests, chosen, latest=True)
    return chosen if checked is manifests else latest_restorable(checked)


def _trainer_epoch(storage: Storage) -> int:
    """The epoch a trainer starting at ``storage`` writes (DeltaCheckpointer._next_epoch on
    rank 0 of one)."""
    coord = types.SimpleNamespace(rank=0, broadcast_int=lambda v: v)
    return DeltaCheckpointer._next_epoch(types.SimpleNamespace(coord=coord, storage=None), storage)  # type: ignore[arg-type]


def _rolled_back(root: Path) -> LocalStorage:
    """Steps 0..299 (epoch 0, a full every 25), a rollback to step 250 and steps 251..260
    saved again (epoch 1, a full at 251): the latest step is 260, below the old timeline's
    299. The commit log and catalogs as a job's writers leave them."""
    sim = LineageSim(world_size=1, seed=5)
    sim.save("full")
    for _ in range(299):
        sim.train()
        sim.save("full" if sim.step % 25 == 0 else "delta")
    sim.rollback(250)
    for i in range(10):
        sim.train()
        sim.save("full" if i == 0 else "delta")
    storage = LocalStorage(str(root))
    sim.write(storage, durable=False)
    sim.write_log(storage, 5)
    return storage


def _forge_without_epoch(storage: LocalStorage, epoch: int) -> None:
    """A catalog whose segments pass every check but leave out every trainer record of
    ``epoch`` (and nothing says to look at them again)."""
    index = read_manifests(storage).index
    assert index is not None and index.catalog is not None
    truth = read_manifests(storage, manifest_keys(storage))
    hidden = {f"{m.folder}/{MANIFEST}" for m in truth.values() if m.epoch == epoch}
    forged = IndexedRead(
        seq=index.seq,
        records={k: v for k, v in index.records.items() if k not in hidden},
        recheck=[h for h in index.recheck if h.key not in hidden],
        unreadable=set(index.unreadable),
        log_from=index.log_from,
    )
    compact(storage, forged, force=True)


@pytest.fixture(autouse=True)
def _small_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deck.read.indexed, "SEGMENT_STEPS", 8)


def test_a_restore_after_a_rollback_with_a_forged_catalog_picks_the_newest_epoch(
    tmp_path: Path,
) -> None:
    storage = _rolled_back(tmp_path / "uri")
    truth = read_manifests(storage, manifest_keys(storage))
    assert latest_restorable(truth) == 260 and truth[260].epoch == 1 and truth[299].epoch == 0
    assert newest_witness(storage) == 1
    # Honest catalog: the window reaches down to the new timeline (an unread segment's newest)
    got = read_window(storage)
    assert got is not None and got.window is not None and latest_restorable(got) == 260
    assert _restore_latest(storage) == 260 and _trainer_epoch(storage) == 2

    _forge_without_epoch(storage, 1)
    forged = read_manifests(storage)
    assert latest_restorable(forged) == 299  # what the catalog alone says
    assert read_window(storage) is None  # witness 1, latest found of epoch 0: every record
    assert _restore_latest(storage) == 260
    assert _trainer_epoch(storage) == 2  # not 1: the new timeline's epoch is not reused
    assert next_epoch(forged, storage) == 2


def test_a_store_without_witnesses_restores_the_same(tmp_path: Path) -> None:
    """A store written by a deck before witnesses: the windowed read is not used, a restore
    of the latest step through the catalog reads every record (even through a forged one),
    and a GC run over the whole store puts the newest epoch's witness, after which the window
    is used again."""
    storage = _rolled_back(tmp_path / "uri")
    shutil.rmtree(tmp_path / "uri" / EPOCH_ROOT)
    assert newest_witness(storage) is None
    assert read_window(storage) is None
    assert _restore_latest(storage) == 260 and _trainer_epoch(storage) == 2
    assert (
        newest_view(storage, keep_last_fulls=2, keep_fulls_every=None, cutoff=None, now=None)
        is None
    )  # GC of the newest steps reads the whole store instead
    _forge_without_epoch(storage, 1)
    assert _restore_latest(storage) == 260 and _trainer_epoch(storage) == 2

    collect_garbage(storage, RetentionPolicy(keep_last_fulls=100, grace_s=0.0), whole=True)
    assert witnesses_in(storage.list(f"{EPOCH_ROOT}/")) == [1]
    got = read_window(storage)  # (the GC run repaired the catalog too)
    assert got is not None and latest_restorable(got) == 260
    assert _restore_latest(storage) == 260


def test_gc_of_the_newest_steps_with_a_forged_catalog_deletes_no_more(tmp_path: Path) -> None:
    """The catalog's segments hide the new timeline below the cut: GC of the newest steps
    counts the newest epoch witnessed there, and deletes nothing a plan of every record
    keeps."""
    storage = _rolled_back(tmp_path / "uri")
    policy = RetentionPolicy(keep_last_fulls=2, grace_s=0.0)
    whole = collect_garbage(storage, policy, dry_run=True, whole=True)
    _forge_without_epoch(storage, 1)
    newest = collect_garbage(storage, policy, dry_run=True)
    assert {f for f, _ in newest.deleted} <= {f for f, _ in whole.deleted}
    assert newest.latest in (None, 260)


def test_the_witness_goes_before_the_first_record_of_its_epoch(tmp_path: Path) -> None:
    store = RecordingStorage(LocalStorage(str(tmp_path / "uri")))
    tr = SynthTrainer(store, world_size=1)
    tr.save("full")
    tr.train()
    tr.save()
    tr.rollback(0)
    tr.train()
    tr.save("full")
    puts = [c.path for c in store.calls if c.op in ("put", "put_if_absent")]
    witnesses = [p for p in puts if p.startswith(f"{EPOCH_ROOT}/")]
    assert witnesses == [witness_key(0), witness_key(1)]  # one per epoch
    first = puts.index(witness_key(0))
    assert first < min(i for i, p in enumerate(puts) if p.endswith(MANIFEST) or "_log/" in p)
    again = puts.index(witness_key(1))
    record = [i for i, p in enumerate(puts) if p == f"step-{1:012d}/{MANIFEST}"][-1]
    assert again < record and store.inner.get(witness_key(1)) == b'{"epoch": 1, "step": 1}'


def test_writers_keep_the_newest_witnesses(tmp_path: Path) -> None:
    """A job with many sessions or rollbacks: the listing stays a few names."""
    storage = LocalStorage(str(tmp_path / "uri"))
    tr = SynthTrainer(storage, world_size=1)
    tr.save("full")
    for _ in range(10):
        tr.rollback(tr.step)
        tr.train()
        tr.save("full")
    got = witnesses_in(storage.list(f"{EPOCH_ROOT}/"))
    assert got == list(range(11 - KEEP_WITNESSES, 11)) and newest_witness(storage) == 10


def test_other_names_under_the_witness_folder_are_ignored(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path / "uri"))
    for name in ["x.json", "00000000000000000007.json.tmp", "0000000000000000007.json"]:
        storage.put(f"{EPOCH_ROOT}/{name}", b"{}")
    storage.put(f"{EPOCH_ROOT}/{'9' * 20}.json", b"{}")  # above the largest epoch
    assert newest_witness(storage) is None
    storage.put(witness_key(3), b"{}")
    assert newest_witness(storage) == 3


class _Unlistable(StorageWrapper):
    """A store whose listing of the witnesses fails (an outage, a permission)."""

    def list(self, prefix: str = "") -> builtins.list[str]:
        if prefix.startswith(EPOCH_ROOT):
            raise StorageError(f"{self.describe(prefix)}: listing refused (test)")
        return super().list(prefix)


def test_an_unreadable_witness_listing_is_an_error_not_absence(tmp_path: Path) -> None:
    storage = _rolled_back(tmp_path / "uri")
    broken = _Unlistable(storage)
    with pytest.raises(StorageError, match=EPOCH_ROOT):
        read_window(broken)
    with pytest.raises(StorageError, match=EPOCH_ROOT):
        _restore_latest(broken)
    with pytest.raises(StorageError, match=EPOCH_ROOT):
        next_epoch(ManifestSet(), broken)
