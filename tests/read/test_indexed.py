"""Reading the commit records through the catalog and the log gives what reading every record
gives: a state machine of writers (commits, saves again, quarantine records, GC's deletions and
abandons, crashes between a hint and its change, changes landing late) and catalog writers,
checked after every step against a read of every record; damaged, forged and missing catalogs
and log entries cost a whole read, never a wrong answer."""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

import deck.read.indexed
import deck.read.window
from deck import cli
from deck.format import commit_log
from deck.format.commit_log import (
    CATALOG_ROOT,
    LOG_ROOT,
    Hint,
    append_hints,
    catalog_key,
    listed_seqs,
    log_key,
    put_record,
)
from deck.format.manifest import FORMAT_VERSION, MANIFEST, QuarantineRecord, dump_model, step_dir
from deck.merge.policy import FullPolicy, MergeConfig
from deck.ops.retention import RetentionPolicy, collect_garbage
from deck.read.catalog import (
    ManifestSet,
    manifest_keys,
    quarantine,
    read_manifests,
    refresh_catalog,
)
from deck.read.indexed import CATALOG_EVERY, IndexedRead, compact
from deck.read.lineage import chain_for, confirmed, latest_confirmed, latest_restorable
from deck.read.window import read_window
from deck.storage import LocalStorage, Storage
from deck.testing.lineage_checks import check_all_restore, merge_all
from deck.testing.synth import SynthTrainer, snapshot
from deck.testing.synth_lineage import LineageSim

EXAMPLES = int(os.environ.get("DECK_INDEX_EXAMPLES", "40"))


def _pool() -> list[tuple[str, str, bytes]]:
    """(key, id, record bytes) of a small job's records: trainer saves with a rollback (a step
    saved twice), merger checkpoints, and quarantine records of some of them."""
    sim = LineageSim(world_size=1, seed=7)
    full = sim.save("full")
    sim.merge_blocks(full, stride=2, full_every=4, lag=0)
    records = [(f"{full.folder}/{MANIFEST}", full.id, dump_model(full))]
    for i in range(1, 10):
        sim.train()
        m = sim.save("delta")
        sim.merge_blocks(m, stride=2, full_every=4, lag=0)
        records.append((f"{m.folder}/{MANIFEST}", m.id, dump_model(m)))
        if i == 6:
            sim.rollback(3)
    records += [(f"{m.folder}/{MANIFEST}", m.id, dump_model(m)) for m in sim.merged.values()]
    for key, cid, _ in list(records[:3]):
        q = QuarantineRecord(
            format_version=FORMAT_VERSION,
            id=cid,
            folder=key.rpartition("/")[0],
            reason="test",
            created_unix=1.0,
        )
        records.append((f"quarantine/{cid}.json", cid, dump_model(q)))
    return records


POOL = _pool()


def whole(storage: Storage) -> ManifestSet:
    return read_manifests(storage, manifest_keys(storage))


def same(a: ManifestSet, b: ManifestSet) -> None:
    assert dict(a) == dict(b)
    assert a.merged == b.merged
    assert a.quarantined == b.quarantined
    assert set(a.damaged) == set(b.damaged)
    assert set(a.damaged_merged) == set(b.damaged_merged)


class IndexMachine(RuleBasedStateMachine):
    def __init__(self, root: Path) -> None:
        super().__init__()
        self.storage = LocalStorage(str(root / uuid.uuid4().hex))
        # Each record of the pool is one attempt's: hinted, committed (once, or put again as a
        # retried put does), announced for deletion, then gone; or hinted and abandoned. An id
        # is never committed again once its deletion or abandon is announced.
        self.intents: set[int] = set()  # hinted commits whose record is not written yet
        self.committed: set[int] = set()
        self.deleting: set[int] = set()  # hinted deletions not done yet
        self.gone: set[int] = set()  # deleted or abandoned
        self.last: ManifestSet | None = None

    def _fresh(self, i: int) -> bool:
        return not {i} & (self.intents | self.deleting | self.gone)

    @rule(i=st.integers(0, len(POOL) - 1))
    def commit(self, i: int) -> None:
        key, cid, data = POOL[i]
        if self._fresh(i):
            put_record(self.storage, key, cid, data)
            self.committed.add(i)

    @rule(i=st.integers(0, len(POOL) - 1))
    def hint_then_crash(self, i: int) -> None:
        key, cid, _ = POOL[i]
        if self._fresh(i) and i not in self.committed:
            append_hints(self.storage, [Hint(key=key, op="commit", id=cid)])
            self.intents.add(i)

    @rule(data=st.data())
    def late_commit(self, data: st.DataObject) -> None:
        """A commit whose hint was written long ago lands now (a slow writer)."""
        if self.intents:
            i = data.draw(st.sampled_from(sorted(self.intents)))
            self.intents.discard(i)
            self.committed.add(i)
            key, _, record = POOL[i]
            self.storage.put(key, record)

    @rule(data=st.data(), now=st.booleans())
    def delete(self, data: st.DataObject, now: bool) -> None:
        """GC announces deleting a record whose commit was announced (it read the record, or
        a catalog holding it; the commit may still be landing), then deletes it now or
        later."""
        candidates = sorted((self.committed | self.intents) - self.deleting)
        if not candidates:
            return
        i = data.draw(st.sampled_from(candidates))
        key, cid, _ = POOL[i]
        append_hints(self.storage, [Hint(key=key, op="delete", id=cid)])
        self.deleting.add(i)
        if now:
            self._delete(i)

    def _delete(self, i: int) -> None:
        """As GC deletes: only the record of the id it announced (a step saved again since
        names another, and stays; a commit still landing then stays too)."""
        key, _, record = POOL[i]
        if self.storage.get_or_none(key) == record:
            self.storage.delete(key)
        self.deleting.discard(i)
        self.committed.discard(i)
        self.gone.add(i)

    @rule(data=st.data())
    def late_delete(self, data: st.DataObject) -> None:
        if self.deleting:
            self._delete(data.draw(st.sampled_from(sorted(self.deleting))))

    @rule(data=st.data())
    def abandon(self, data: st.DataObject) -> None:
        """GC reaps a crashed attempt: its commit never comes."""
        candidates = sorted(self.intents - self.deleting - self.gone)
        if candidates:
            i = data.draw(st.sampled_from(candidates))
            self.intents.discard(i)
            self.gone.add(i)
            key, cid, _ = POOL[i]
            append_hints(self.storage, [Hint(key=key, op="abandon", id=cid)])

    @rule(force=st.booleans())
    def write_catalog(self, force: bool) -> None:
        index = read_manifests(self.storage).index
        if index is not None:
            compact(self.storage, index, force=force)

    @rule()
    def damage_newest_catalog(self) -> None:
        seqs = listed_seqs(self.storage, CATALOG_ROOT)
        if seqs:
            self.storage.put(catalog_key(seqs[-1]), b"not a catalog")

    @rule(data=st.data())
    def damage_a_segment(self, data: st.DataObject) -> None:
        names = sorted(commit_log.listed_segments(self.storage))
        if names:
            name = data.draw(st.sampled_from(names))
            self.storage.put(commit_log.segment_key(name), b"not a segment")

    @invariant()
    def reads_agree(self) -> None:
        truth = whole(self.storage)
        same(read_manifests(self.storage), truth)
        # A poller's read taken up from its last one (and that one's parses) agrees too.
        self.last = read_manifests(self.storage, previous=self.last)
        same(self.last, truth)

    @invariant()
    def windows_plan_what_every_record_plans(self) -> None:
        """A windowed read, where it answers, picks the latest step and the chains that every
        record's read picks."""
        truth = whole(self.storage)
        latest = latest_restorable(truth)
        for step in [None, *sorted(truth)]:
            got = read_window(self.storage, step)
            if got is None:
                continue
            event("a window answered" + ("" if got.window is None else " (partial)"))
            assert latest_restorable(got) == latest
            if step is not None:
                assert [m.id for m in chain_for(got, step)] == [
                    m.id for m in chain_for(truth, step)
                ]


def test_reads_through_the_catalog_equal_reading_every_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.ERROR, logger="deck")
    # A segment per step, and windows over most of them: in a history of ten steps, windows
    # that leave some out
    monkeypatch.setattr(deck.read.indexed, "SEGMENT_STEPS", 1)
    monkeypatch.setattr(deck.read.window, "_MOST", 0.9)
    run_state_machine_as_test(
        lambda: IndexMachine(tmp_path),
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=30,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        ),
    )


# ---- pinned cases -------------------------------------------------------------------------------


@pytest.fixture()
def store(tmp_path: Path) -> LocalStorage:
    return LocalStorage(str(tmp_path / "uri"))


def _catalog_now(storage: Storage) -> int | None:
    index = read_manifests(storage).index
    assert index is not None
    return compact(storage, index, force=True)


def _read_counting(store: LocalStorage) -> tuple[ManifestSet, list[str]]:
    """``read_manifests(store)`` and the keys it read, in order."""
    reads: list[str] = []
    get = store.get

    def counting(path: str, start: int = 0, end: int | None = None) -> bytes:
        reads.append(path)
        return get(path, start, end)

    store.get = counting  # type: ignore[method-assign]
    try:
        return read_manifests(store), reads
    finally:
        store.get = get  # type: ignore[method-assign]


def _commit_all(storage: Storage, n: int) -> None:
    for key, cid, data in POOL[:n]:
        put_record(storage, key, cid, data)


def test_a_catalog_then_only_new_records_are_read(store: LocalStorage) -> None:
    _commit_all(store, 6)
    assert _catalog_now(store) is not None  # the first catalog: from a whole read
    _commit_all(store, 8)  # two saved again (the same records) and two new ones
    got, reads = _read_counting(store)
    same(got, whole(store))
    records = [r for r in reads if r.endswith(MANIFEST)]
    assert sorted(records) == sorted({k for k, _, _ in POOL[:8]})  # the hinted ones only
    assert got.index is not None and got.index.since == 8


def test_a_delete_hinted_before_its_late_commit_landed_is_read_again_until_done(
    store: LocalStorage,
) -> None:
    """A commit hinted, then a delete of the same record hinted while the record was not
    there yet; the slow commit lands, then the delete: a reader taking up its last read
    (and one through a catalog of the early state) sees the record go (found by the state
    machine: the poller kept it)."""
    key, cid, record = POOL[0]
    append_hints(store, [Hint(key=key, op="commit", id=cid)])
    assert _catalog_now(store) is not None
    append_hints(store, [Hint(key=key, op="delete", id=cid)])
    last = read_manifests(store)
    same(last, whole(store))
    store.put(key, record)  # the late commit
    last = read_manifests(store, previous=last)
    same(last, whole(store))
    store.delete(key)  # the late delete
    same(read_manifests(store, previous=last), whole(store))
    same(read_manifests(store), whole(store))


def test_a_damaged_catalog_costs_a_whole_read_and_says_so(
    store: LocalStorage, caplog: pytest.LogCaptureFixture
) -> None:
    _commit_all(store, 6)
    seq = _catalog_now(store)
    assert seq is not None
    store.put(catalog_key(seq), b"\x78\x9c garbage")
    with caplog.at_level(logging.WARNING):
        got = read_manifests(store)
    same(got, whole(store))
    assert got.index is None
    assert any(catalog_key(seq) in r.getMessage() for r in caplog.records)


def test_a_forged_catalog_cannot_hide_a_hinted_commit(store: LocalStorage) -> None:
    """A catalog written by someone else with a valid checksum but records that are not
    there: every key hinted after it is read again, and keys it names that no record holds
    are what it says (so a reader still sees them) -- the restore re-checks its chain."""
    _commit_all(store, 4)
    assert _catalog_now(store) is not None
    _commit_all(store, 5)
    same(read_manifests(store), whole(store))


def test_a_gap_in_the_log_costs_a_whole_read(store: LocalStorage) -> None:
    _commit_all(store, 3)
    seq = _catalog_now(store)
    assert seq is not None
    _commit_all(store, 6)
    store.delete(log_key(seq + 2))
    got = read_manifests(store)
    assert got.index is None
    same(got, whole(store))


def test_a_segment_ends_at_the_step_bound_where_no_hash_cut_falls(
    store: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The newest segment, which every routine reader reads, is bounded in steps whatever the
    # hash says: here no hash cut falls, and the segments end one below multiples of 4
    monkeypatch.setattr(deck.read.indexed, "SEGMENT_STEPS", 2**62)
    monkeypatch.setattr(deck.read.indexed, "SEGMENT_MAX_STEPS", 4)
    _commit_all(store, len(POOL))
    assert _catalog_now(store) is not None
    index = read_manifests(store).index
    assert index is not None and len(index.segments) >= 2
    for ref in index.segments:
        assert ref.first // 4 == ref.last // 4, ref
    assert [r.last % 4 for r in index.segments[:-1]] == [3] * (len(index.segments) - 1)
    same(read_manifests(store), whole(store))


def test_log_entries_and_catalogs_are_pruned_behind_the_last_two(store: LocalStorage) -> None:
    for round_ in range(4):
        _commit_all(store, 3 + round_)
        index = read_manifests(store).index
        assert index is not None
        compact(store, index, force=True)
    catalogs = listed_seqs(store, CATALOG_ROOT)
    assert len(catalogs) == 2
    assert min(listed_seqs(store, LOG_ROOT)) > catalogs[0]
    same(read_manifests(store), whole(store))


def test_a_step_whose_chain_a_quarantine_broke_is_read_again_without_a_warning(
    store: LocalStorage, caplog: pytest.LogCaptureFixture
) -> None:
    """A break-it finding: after `deck verify --quarantine`, every export of a step whose chain
    the quarantine broke warned that the catalog "does not agree with the commit records" (it
    agrees): the records are still read to confirm there is no chain, said at INFO."""
    _commit_all(store, 6)
    manifests = read_manifests(store)
    quarantine(store, manifests[2], "damaged (test)")
    manifests = read_manifests(store)
    assert manifests.index is not None and manifests[2].id in manifests.quarantined
    with caplog.at_level(logging.INFO, logger="deck.read.lineage"):
        got = confirmed(store, manifests, 3)
    assert got.index is None  # every record read
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "deck.read.lineage"]
    assert not any(level >= logging.WARNING for level, _ in said), said
    assert any("step 3 has no valid chain by the catalog" in m for _, m in said), said


def test_an_append_never_lands_behind_a_catalog(store: LocalStorage) -> None:
    """A writer slow enough that catalogs passed its sequence number: a catalog at 5 exists
    while the log ends at 2 (pruned) -- the next entry is numbered after the catalog."""
    _commit_all(store, 2)
    index = read_manifests(store).index
    assert index is not None
    store.put(catalog_key(5), store.get(catalog_key(compact(store, index, force=True) or 0)))
    assert append_hints(store, [Hint(key=POOL[2][0], op="commit", id=POOL[2][1])]) == 6


def test_a_log_with_no_number_left_is_an_error_naming_its_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A break-it finding: one entry numbered MAX_SEQ (forged: deck numbers from 1, one after
    another) made every later commit fail with a pydantic validation error that named no file,
    and `deck merge` stop with a traceback. It is a DeckError naming the entry and what to do,
    at the commit and in the merger's warning."""
    from deck.errors import CorruptCheckpointError
    from deck.format.commit_log import MAX_SEQ, LogEntry

    storage = LocalStorage(tmp_path / "ck")
    tr = _trained(storage, 4)
    forged = LogEntry(
        format_version=FORMAT_VERSION,
        seq=MAX_SEQ,
        hints=(Hint(key=POOL[0][0], op="commit", id=POOL[0][1]),),
    )
    storage.put(log_key(MAX_SEQ), dump_model(forged))
    tr.train()
    monkeypatch.setattr(commit_log, "_last_seq", {})  # (a new process: it lists the log)
    with pytest.raises(CorruptCheckpointError, match=f"no number left after {log_key(MAX_SEQ)}"):
        tr.save()
    with caplog.at_level(logging.WARNING):
        assert cli.main(["merge", storage.root, "--once", "--stride", "2"]) == 1  # (work left)
    assert f"no number left after {log_key(MAX_SEQ)}" in caplog.text


def test_a_catalog_that_disagrees_with_a_chain_record_is_not_restored_from(
    store: LocalStorage, caplog: pytest.LogCaptureFixture
) -> None:
    """A record changed without a hint (a writer that keeps no log, or a forged catalog):
    the chain a restore would load is checked against the records and read again."""
    _commit_all(store, 6)
    assert _catalog_now(store) is not None
    key, _, data = POOL[3]  # step 3's record, rewritten behind the log's back
    store.put(key, data.replace(b'"created_unix":', b'"created_unix":1'))
    manifests = read_manifests(store)
    assert manifests.index is not None
    with caplog.at_level(logging.WARNING):
        got = confirmed(store, manifests, 5)
    assert got.index is None
    assert "does not agree" in caplog.text
    assert confirmed(store, read_manifests(store), 2).index is not None  # (its chain agrees)


def test_a_damaged_log_entry_costs_a_whole_read_and_names_it(
    store: LocalStorage, caplog: pytest.LogCaptureFixture
) -> None:
    _commit_all(store, 3)
    seq = _catalog_now(store)
    assert seq is not None
    _commit_all(store, 5)
    store.put(log_key(seq + 1), b"{}")
    with caplog.at_level(logging.WARNING):
        got = read_manifests(store)
    assert got.index is None
    same(got, whole(store))
    assert log_key(seq + 1) in caplog.text


def test_writers_of_history_write_a_catalog_once_enough_entries_follow(store: LocalStorage) -> None:
    for _ in range(CATALOG_EVERY // len(POOL)):
        _commit_all(store, len(POOL))
    assert refresh_catalog(store) is None  # fewer entries than CATALOG_EVERY: not yet
    _commit_all(store, len(POOL))
    first = refresh_catalog(store)
    assert first is not None and refresh_catalog(store) is None
    same(read_manifests(store), whole(store))


def test_a_damaged_newest_catalog_is_passed_by_for_the_one_before(
    store: LocalStorage, caplog: pytest.LogCaptureFixture
) -> None:
    _commit_all(store, 3)
    _catalog_now(store)
    _commit_all(store, 6)
    newest = _catalog_now(store)
    assert newest is not None
    _commit_all(store, 8)
    store.put(catalog_key(newest), b"damaged")
    with caplog.at_level(logging.WARNING):
        got = read_manifests(store)
    assert got.index is not None  # (through the catalog before it)
    assert catalog_key(newest) in caplog.text
    same(got, whole(store))
    replaced = compact(store, got.index, force=True)  # the next catalog takes its place
    assert replaced is not None and replaced > newest
    same(read_manifests(store), whole(store))


def test_gc_and_the_merger_keep_reads_through_the_catalog_right(tmp_path: Path) -> None:
    """The real writers: a trainer saving (a rollback included), merger passes writing
    catalogs, GC deleting checkpoints, orphans and quarantine records; after each, the read
    through the catalog equals reading every record, and every step restores bitwise."""
    storage = LocalStorage(str(tmp_path / "uri"))
    tr = SynthTrainer(storage)
    tr.save("full")
    history = {tr.saved[0].id: tr.saved[0].state}
    cfg = MergeConfig(stride=2, full=FullPolicy(every=4, max_live_fraction=None))
    bounded = RetentionPolicy(keep_last_fulls=1, keep_all_steps=False, grace_s=0)
    wrote = 0
    for i in range(30):
        tr.train()
        history[tr.save().id] = snapshot(tr.shards)
        merge_all(storage, cfg)
        if i == 12:
            tr.rollback(6)  # steps 7.. saved again
        if i % 5 == 4:
            read = read_manifests(storage).index
            assert read is not None
            wrote += compact(storage, read, force=True) is not None
            quarantine(storage, read_manifests(storage)[tr.step - 1], "test")
            collect_garbage(storage, bounded)
        same(read_manifests(storage), whole(storage))
    assert wrote >= 5 and read_manifests(storage).index is not None
    check_all_restore(storage, history)


def test_gc_deletes_stray_files_among_quarantine_records(store: LocalStorage) -> None:
    """Files in quarantine/ that are no records (nested, another suffix) go as orphans without
    a log hint (a hint names records only): GC neither fails nor leaves the catalog behind."""
    tr = SynthTrainer(store)
    tr.save("full")
    for name in ("quarantine/notes.txt", "quarantine/sub/0123456789abcdef.json"):
        store.put(name, b"stray")
    report = collect_garbage(store, RetentionPolicy(grace_s=0))
    assert not report.errors
    assert not store.list("quarantine/")
    # said as what they are (an operator's run: "quarantine record of a deleted checkpoint")
    assert {why for _, why in report.orphans} == {"not a quarantine record (a stray file)"}
    same(read_manifests(store), whole(store))


def test_gc_leaves_an_object_named_like_the_quarantine_folder(tmp_path: Path) -> None:
    """A break-it finding (on S3): an object whose key is ``quarantine`` itself, beside the
    folder, was deleted as "a stray file" of deck's quarantine folder. It is not in it."""
    store = LocalStorage(tmp_path / "ck")
    tr = SynthTrainer(store)
    tr.save("full")
    store.put("quarantine", b"someone else's")
    report = collect_garbage(store, RetentionPolicy(grace_s=0))
    assert not report.errors and not report.orphans, report
    assert store.get("quarantine") == b"someone else's"


# ---- what a break-it run found (each one pinned) -------------------------------------------------


def _trained(store: LocalStorage, steps: int) -> SynthTrainer:
    tr = SynthTrainer(store)
    tr.save("full")
    for _ in range(steps):
        tr.train()
        tr.save()
    return tr


def _latest_as_a_restore_picks(store: LocalStorage) -> int | None:
    return latest_confirmed(store, read_window(store) or read_manifests(store))[1]


def test_a_log_deleted_by_hand_neither_hides_steps_nor_stays_wrong(store: LocalStorage) -> None:
    """`_log/` deleted with the writers stopped, the catalog kept, writers started again: the
    entries the catalog's writer kept are missing, so readers read every record (a restarted
    writer numbering after the catalog made the log look whole); a restore of the latest picks
    the records' latest; GC then writes a catalog from every record, and reads through it agree."""
    tr = _trained(store, 3)
    _catalog_now(store)
    tr.train()
    tr.save()
    tr.train()
    tr.save()  # steps 4, 5: only in the log
    shutil.rmtree(Path(store.local_path(LOG_ROOT) or ""))
    commit_log._last_seq.clear()  # (new processes)
    for _ in range(3):
        tr.train()
        tr.save()
    assert read_manifests(store).index is None  # not taken for a log with nothing new
    same(read_manifests(store), whole(store))
    assert _latest_as_a_restore_picks(store) == 8
    collect_garbage(store, RetentionPolicy(grace_s=0))
    got = read_manifests(store)
    assert got.index is not None
    same(got, whole(store))


def test_a_forged_catalog_cannot_choose_the_step_or_hide_a_quarantine(
    store: LocalStorage,
) -> None:
    """A catalog with a valid checksum that leaves out the newest step, or a quarantine
    record: what a restore of the latest step loads is still the records' answer."""
    _trained(store, 5)
    read = read_manifests(store).index
    assert read is not None
    for hidden in ("step-000000000005/manifest.json", None):
        records = {k: v for k, v in read.records.items() if k != hidden}
        if hidden is None:  # a quarantine record of step 5 that the catalog leaves out
            quarantine(store, read_manifests(store, manifest_keys(store))[5], "test")
            records = dict(read.records)
        seq = listed_seqs(store, LOG_ROOT)[-1]
        forged = IndexedRead(seq=seq, records=records, log_from=seq + 1)
        compact(store, forged, force=True)
        truth = whole(store)
        assert _latest_as_a_restore_picks(store) == latest_restorable(truth)
        assert latest_restorable(truth) == (5 if hidden else 4)


def test_a_forged_catalog_breaking_the_newest_chain_is_not_said_to_the_operator(
    store: LocalStorage, caplog: pytest.LogCaptureFixture
) -> None:
    """A break-it finding: a catalog with valid checksums whose copies make the newest steps'
    chain broken (a full turned into a delta, a record left out) made `deck ls` and every
    restore warn that they could not be restored ("restore an older step or take a new full
    checkpoint"), then restore them: the records decide, and only what they say is said."""
    from deck.format.manifest import CheckpointManifest, Kind, load_model

    tr = _trained(store, 3)
    tr.train()
    tr.save("full")
    for _ in range(3):
        tr.train()
        tr.save()
    read = read_manifests(store).index
    assert read is not None
    full_key = f"{step_dir(4)}/{MANIFEST}"
    full = load_model(CheckpointManifest, read.records[full_key], full_key)
    as_delta = full.model_copy(
        update={"kind": Kind.DELTA, "parent": 3, "parent_id": tr.saved[3].id}
    )
    records = {k: v for k, v in read.records.items() if k != f"{step_dir(2)}/{MANIFEST}"}
    records[full_key] = dump_model(as_delta)
    seq = listed_seqs(store, LOG_ROOT)[-1]
    compact(store, IndexedRead(seq=seq, records=records, log_from=seq + 1), force=True)
    with caplog.at_level(logging.INFO):
        assert _latest_as_a_restore_picks(store) == 7
        assert cli.main(["ls", store.root]) == 0
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in said if "skipping" in m or "cannot be restored" in m], said


def test_damage_after_the_catalog_is_found_by_verify_and_gc_repairs_the_catalog(
    store: LocalStorage,
) -> None:
    _trained(store, 4)
    _catalog_now(store)
    path = Path(store.local_path("step-000000000004/manifest.json") or "")
    path.write_bytes(path.read_bytes().replace(b'"step":4', b'"step":9'))
    assert cli.main(["verify", store.uri]) == 1  # every record read: the damage is found
    collect_garbage(store, RetentionPolicy(grace_s=0), dry_run=False)
    got = read_manifests(store)
    assert got.index is not None and 4 in got.damaged
    same(got, whole(store))


def test_a_poll_that_finds_nothing_new_is_the_last_read_itself(store: LocalStorage) -> None:
    """A merger or follower polling a long history pays for what is new: with nothing logged
    since its last read, that read (not a copy parsed again) comes back, still the truth."""
    tr = _trained(store, 3)
    _catalog_now(store)
    last = read_manifests(store, previous=read_manifests(store))
    again = read_manifests(store, previous=last)
    assert again is last
    same(again, whole(store))
    tr.train()
    tr.save()
    after = read_manifests(store, previous=again)
    assert after is not again and max(after) == max(again) + 1
    same(after, whole(store))


def test_a_record_changed_behind_the_log_reaches_a_poller_after_gc_repairs_the_catalog(
    store: LocalStorage,
) -> None:
    """A poller goes on from its last log entry, never from a catalog: the repair of a whole
    GC run announces the records it found changed (``reread`` hints), so a poller sees the
    damage as a fresh reader does (it kept the record as valid forever before)."""
    _trained(store, 4)
    _catalog_now(store)
    last = read_manifests(store)
    record = Path(store.local_path(f"{step_dir(4)}/{MANIFEST}") or "")
    data = bytearray(record.read_bytes())
    data[20] ^= 1
    record.write_bytes(bytes(data))
    collect_garbage(store, RetentionPolicy(grace_s=0), whole=True)
    got = read_manifests(store, previous=last)
    assert 4 in got.damaged and 4 not in got
    same(got, whole(store))


def test_a_poller_does_not_go_on_from_a_log_started_again(store: LocalStorage) -> None:
    tr = _trained(store, 3)
    _catalog_now(store)
    last = read_manifests(store)
    for root in (LOG_ROOT, CATALOG_ROOT):
        shutil.rmtree(Path(store.local_path(root) or ""))
    commit_log._last_seq.clear()
    for _ in range(4):
        tr.train()
        tr.save()
    _catalog_now(store)
    same(read_manifests(store, previous=last), whole(store))


@pytest.mark.parametrize(
    "name",
    [
        "00000000000000000009.json.z\n",
        "\u0660" * 19 + "\u0669.json.z",
        "99999999999999999999.json.z",
        "00000000000000000009.json.z.tmp",
    ],
)
def test_names_that_are_not_a_catalogs_are_ignored(store: LocalStorage, name: str) -> None:
    _trained(store, 2)
    _catalog_now(store)
    Path(store.local_path(CATALOG_ROOT) or "", name).write_bytes(b"junk")
    same(read_manifests(store), whole(store))
    tr = SynthTrainer(store)  # (a writer numbers its entries past the real ones only)
    tr.save("full")
    assert listed_seqs(store, LOG_ROOT)[-1] < 10
    same(read_manifests(store), whole(store))


def test_a_blocked_log_entry_costs_reads_until_gc_writes_a_catalog_past_it(
    store: LocalStorage,
) -> None:
    tr = _trained(store, 2)
    _catalog_now(store)
    for _ in range(2):
        tr.train()
        tr.save()
    entry = Path(store.local_path(log_key(listed_seqs(store, LOG_ROOT)[-2])) or "")
    entry.unlink()
    os.mkfifo(entry)  # a FIFO where an entry was: not listed, a gap (never "nothing there")
    assert read_manifests(store).index is None
    same(read_manifests(store), whole(store))
    entry.unlink()
    collect_garbage(store, RetentionPolicy(grace_s=0))
    tr.train()
    tr.save()
    got = read_manifests(store)
    assert got.index is not None
    same(got, whole(store))


def test_a_reader_without_a_catalog_reads_no_log_entry(store: LocalStorage) -> None:
    """Before any catalog (a job without merger or GC), a read reads the records only: the log
    entries' hints are read when a catalog is written of it."""
    _commit_all(store, 6)
    got, reads = _read_counting(store)
    assert got.index is not None and not [r for r in reads if r.startswith(f"{LOG_ROOT}/")]
    assert compact(store, got.index, force=True) is not None  # (reads them now)
    same(read_manifests(store), whole(store))


def test_a_repair_after_a_writer_pruned_the_log_keeps_what_that_writer_committed(
    store: LocalStorage,
) -> None:
    """Found by ``make fuzz-ops OPS_EXAMPLES=300 FUZZ_SEED=4271791481``: GC read every record,
    then (while it ran) the merger committed a pass's checkpoints and wrote two catalogs,
    pruning the log entries that announced them. GC's check of the catalog saw records it had
    not read and no hint explaining them, took the catalog for wrong, and wrote one from its
    older read: readers through it no longer saw the merger's checkpoints."""
    from deck.read.indexed import repair

    _commit_all(store, 4)
    _catalog_now(store)
    # GC's read: the store listed and every record read, the log as it was then
    listing = store.list("")
    truth = {k: store.get(k) for k in manifest_keys(store)}
    logged = commit_log.seqs_in(listing, LOG_ROOT)
    # Meanwhile a writer commits and writes catalogs until the log after GC's listing is pruned
    for key, cid, data in POOL[4:12]:
        put_record(store, key, cid, data)
        _catalog_now(store)
    assert listed_seqs(store, LOG_ROOT)[0] > logged[-1] + 1
    read_keys = lambda ks: ((k, store.get_or_none(k)) for k in ks)  # noqa: E731
    assert repair(store, truth, logged, [], read_keys) is None  # not GC's to judge now
    same(read_manifests(store), whole(store))


def test_a_damaged_or_forged_segment_costs_a_read_never_a_wrong_answer(
    store: LocalStorage, caplog: pytest.LogCaptureFixture
) -> None:
    """A segment is checked against its name (the checksum of its content) and against what
    its catalog says of it: damaged, replaced by another segment's valid content, or gone, its
    catalog is passed by (logged) and the records read another way."""
    _commit_all(store, len(POOL))
    _catalog_now(store)
    names = sorted(commit_log.listed_segments(store))
    assert names
    truth = whole(store)
    victim = commit_log.segment_key(names[0])
    good = store.get(victim)
    forged = commit_log.encode_segment(
        commit_log.Segment(
            format_version=FORMAT_VERSION, records=((POOL[0][0], POOL[0][2].decode()),)
        )
    )[1]
    for bad in (b"not zlib", forged, None):
        if bad is None:
            store.delete(victim)
        else:
            store.put(victim, bad)
        with caplog.at_level(logging.WARNING, logger="deck"):
            same(read_manifests(store), truth)
        assert read_window(store) is None
        store.put(victim, good)


def test_a_new_catalog_encodes_only_the_segments_that_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A catalog over a long history names its unchanged segments again without encoding
    them; what it names is what a catalog encoded from scratch names."""
    monkeypatch.setattr(deck.read.indexed, "SEGMENT_STEPS", 8)
    sim = LineageSim(world_size=1, seed=7)
    sim.save("full")
    for _ in range(200):
        sim.train()
        sim.save("full" if sim.step % 50 == 0 else "delta")
    storage = LocalStorage(str(tmp_path / "uri"))
    sim.write(storage, durable=False)
    sim.write_log(storage, 5)
    before = read_manifests(storage).index
    assert before is not None and len(before.segments) > 10
    sim.train()
    sim.save("delta")  # one more commit: the newest segment changes
    sim.write(storage, durable=False)
    order = sorted(sim.committed_at, key=lambda i: sim.committed_at[i])
    m = sim.trainer[sim.step]
    assert order[-1] == m.id
    commit_log.append_hints(storage, [Hint(key=f"{m.folder}/{MANIFEST}", op="commit", id=m.id)])
    encoded: list[str] = []
    real = commit_log.encode_segment

    def counting(segment: commit_log.Segment) -> tuple[str, bytes]:
        name, packed = real(segment)
        encoded.append(name)
        return name, packed

    # The same compaction encoding every segment (as one from a read of every record does)
    copy = LocalStorage(str(tmp_path / "copy"))
    shutil.copytree(tmp_path / "uri", tmp_path / "copy", symlinks=True)
    whole = read_manifests(copy).index
    assert whole is not None
    whole.origin.clear()
    seq = compact(copy, whole, force=True)
    assert seq is not None
    from_scratch = [r.name for r in commit_log.read_catalog(copy, seq).segments]

    monkeypatch.setattr(deck.read.indexed, "encode_segment", counting)
    index = read_manifests(storage).index
    assert index is not None
    assert compact(storage, index, force=True) == seq
    again = [r.name for r in commit_log.read_catalog(storage, seq).segments]
    assert 1 <= len(encoded) <= 2 < len(again)  # the changed segment (and a new one)
    assert again == from_scratch
    assert reads_agree_with_every_record(storage)


def reads_agree_with_every_record(storage: Storage) -> bool:
    got = read_manifests(storage)
    truth = read_manifests(storage, manifest_keys(storage))
    return dict(got) == dict(truth) and got.merged == truth.merged


def test_a_catalog_written_beside_another_keeps_the_log_the_newest_needs(
    store: LocalStorage,
) -> None:
    """From an operator's break-it run (two merger workers and GC, killed and restarted): a
    writer's catalog from an older read, written after another writer's newer one, pruned the
    log up to itself, entries the newer catalog says its log holds: every reader then found a
    gap and read every record, and no later catalog could be written through it."""

    def commit(first: int, last: int) -> None:
        for key, cid, data in POOL[first:last]:
            put_record(store, key, cid, data)

    commit(0, 4)
    assert _catalog_now(store) == 4
    commit(4, 8)
    older = read_manifests(store).index  # writer A reads through catalog 4 (seq 8)
    assert older is not None and older.seq == 8
    commit(8, 10)
    assert _catalog_now(store) == 10  # writer B: its catalog holds the log from entry 5
    assert compact(store, older, force=True) == 8  # A's, written after B's
    assert listed_seqs(store, commit_log.CATALOG_ROOT) == [8, 10]
    got = read_manifests(store)
    assert got.index is not None and got.index.catalog == 10  # no gap: through the catalog
    same(got, whole(store))


def test_a_garbage_catalog_numbered_past_the_log_is_replaced_by_gc_over_the_whole_store(
    store: LocalStorage, caplog: pytest.LogCaptureFixture
) -> None:
    """From an operator's break-it run: garbage put at _catalog/<9999> made every read a read
    of every record, and GC over the whole store left it there (it took the number for a
    writer that had pruned the log since its listing)."""
    _trained(store, 4)
    seq = _catalog_now(store)
    assert seq is not None
    store.put(catalog_key(9999), b"\x78\x9c garbage")
    assert read_manifests(store).index is None
    with caplog.at_level(logging.WARNING):
        collect_garbage(store, RetentionPolicy(grace_s=0), dry_run=False, whole=True)
    assert 9999 not in listed_seqs(store, commit_log.CATALOG_ROOT)
    got = read_manifests(store)
    assert got.index is not None
    same(got, whole(store))


def test_a_commit_announced_before_gc_listed_and_landing_after_its_read_is_no_disagreement(
    store: LocalStorage, caplog: pytest.LogCaptureFixture
) -> None:
    """A break-it finding: a whole-store GC beside a trainer took the newest step's commit --
    announced in the log before GC listed it, its record written after GC read every record --
    for a catalog that disagrees with the records, and replaced every catalog (a third of its
    runs, each with a warning). A record a hint after the catalog names is read again by every
    reader: no disagreement. A repair leaves no segment no catalog names."""
    from deck.format.commit_log import SEGMENT_ROOT, listed_segments, read_catalog
    from deck.read.indexed import repair

    _commit_all(store, 4)
    _catalog_now(store)
    key, cid, data = POOL[4]
    append_hints(store, [Hint(key=key, op="commit", id=cid)])  # announced ...
    listing = store.list("")
    truth = {k: store.get(k) for k in manifest_keys(store)}  # ... GC reads every record ...
    logged = commit_log.seqs_in(listing, LOG_ROOT)
    store.put(key, data)  # ... and the record lands
    read_keys = lambda ks: ((k, store.get_or_none(k)) for k in ks)  # noqa: E731
    with caplog.at_level(logging.WARNING):
        assert repair(store, truth, logged, [], read_keys) is None
    assert not [r for r in caplog.records if "did not agree" in r.getMessage()]
    same(read_manifests(store), whole(store))
    # A record changed behind the log's back is one: repaired, and the segments of the
    # catalogs it replaced (and any an earlier repair left) go with them
    store.put(f"{SEGMENT_ROOT}/{'0' * 16}.json.z", b"left by an earlier repair")
    path = Path(store.local_path(POOL[1][0]) or "")
    path.write_bytes(path.read_bytes() + b" ")
    truth = {k: store.get(k) for k in manifest_keys(store)}
    logged = listed_seqs(store, LOG_ROOT)
    assert repair(store, truth, logged, [], read_keys) is not None
    catalogs = listed_seqs(store, CATALOG_ROOT)
    assert len(catalogs) == 1
    named = {ref.name for ref in read_catalog(store, catalogs[0]).segments}
    assert listed_segments(store) == named
    same(read_manifests(store), whole(store))


def test_a_catalog_is_written_again_after_the_catalogs_of_a_pruned_log_are_deleted(
    store: LocalStorage, caplog: pytest.LogCaptureFixture
) -> None:
    """A break-it finding: `_catalog/` deleted on a long-running job whose log was pruned behind
    its catalogs: no catalog was ever written again (a first one needs the log from entry 1),
    so every reader read every record for good, the log grew without end, and nothing said so.
    The next GC over the whole store writes one, says so, and reads through it are right."""
    _commit_all(store, 4)
    _catalog_now(store)
    _commit_all(store, 8)
    _catalog_now(store)
    _commit_all(store, 10)
    _catalog_now(store)
    assert listed_seqs(store, LOG_ROOT)[0] > 1  # pruned behind the catalogs
    shutil.rmtree(Path(store.local_path(CATALOG_ROOT) or ""))
    _commit_all(store, 12)
    with caplog.at_level(logging.WARNING):
        collect_garbage(store, RetentionPolicy(grace_s=0), whole=True)
    assert listed_seqs(store, CATALOG_ROOT)
    said = [r.getMessage() for r in caplog.records if "no catalog at" in r.getMessage()]
    assert len(said) == 1 and "pruned behind catalogs that are gone" in said[0], said
    got = read_manifests(store)
    assert got.index is not None and got.index.catalog is not None
    same(got, whole(store))
