"""Retention and GC (deck.ops.retention): which steps stay restorable under each policy, that
GC never deletes what the grace period protects, and that policies are validated like
DeckConfig. Synthetic checkpoints in the exact on-disk format (deck/testing/synth.py), merged by real
merger workers in this process."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import pytest

from deck.errors import ConfigError
from deck.format.manifest import Kind
from deck.merge.policy import FullPolicy, MergeConfig
from deck.ops.retention import RetentionPolicy, collect_garbage, plan_retention
from deck.ops.retention.gc import GC_DELETING, RETIRE_MARK
from deck.read.catalog import read_manifests, read_rank_manifests
from deck.read.lineage import build_graph, chain_for, cheapest_chain, latest_restorable
from deck.read.verify import verify_checkpoint
from deck.storage import LocalStorage, Storage
from deck.storage.wrapper import StorageWrapper
from deck.testing.lineage_checks import (
    age_commits,
    chain_files,
    check_all_restore,
    mem,
    merge_all,
    set_store_time,
)
from deck.testing.synth import (
    State,
    SynthTrainer,
    restore_state,
    same,
    saved_chain,
    snapshot,
    zero_a_chunk,
)


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("keep_last_fulls", 0, "must be >= 1"),
        ("keep_fulls_every", 0, "must be >= 1"),
        ("chain_delta_budget", 0.0, "must be > 0"),
        ("grace_s", -1.0, "must be >= 0"),
        ("keep_last_full", 2, "not a field .* did you mean keep_last_fulls"),  # a typo never passes
    ],
)
def test_policy_is_validated_and_errors_name_the_field(
    field: str, value: object, allowed: str
) -> None:
    with pytest.raises(ConfigError, match=rf"RetentionPolicy\.{field}: .*{allowed}"):
        RetentionPolicy(**{field: value})
    policy = RetentionPolicy()
    with pytest.raises(Exception, match="frozen"):
        policy.grace_s = 0  # type: ignore[misc]
    assert policy == RetentionPolicy(keep_last_fulls=2, grace_s=3600)  # the documented defaults


@pytest.mark.parametrize("policy", ["every", "live"])
def test_merger_makes_fulls_and_retention_keeps_the_window(policy: str) -> None:
    storage = mem()
    tr = SynthTrainer(storage)
    tr.save("full")
    history = {}
    full = FullPolicy(every=6) if policy == "every" else FullPolicy(max_live_fraction=0.6)
    cfg = MergeConfig(stride=2, full=full)
    keep = RetentionPolicy(keep_last_fulls=2, keep_all_steps=False, grace_s=0)
    for _ in range(20):
        tr.train(3)
        m = tr.save()
        history[m.id] = snapshot(tr.shards)
        merge_all(storage, cfg)
        collect_garbage(storage, keep)
    history.update({s.id: s.state for s in tr.saved.values()})
    manifests = read_manifests(storage)
    graph = build_graph(manifests)
    merger_fulls = [n for n in graph.nodes.values() if n.merged and n.kind is Kind.FULL]
    assert merger_fulls, "the merger made no full"
    assert len(merger_fulls) <= 2  # older ones were collected (keep_last_fulls=2)
    latest = graph.latest()
    assert latest == tr.step
    chain = cheapest_chain(graph, latest)
    assert chain[0].is_merged and chain[0].kind is Kind.FULL  # the trainer never took another full
    steps = check_all_restore(storage, history)
    plan_now = plan_retention(manifests, keep)
    assert set(plan_now.window) <= set(steps) and latest in steps
    assert 0 not in manifests  # the trainer's first full is gone: two newer fulls exist
    # The live chain stayed bounded: never more than the newest full plus a few items.
    assert len(chain) <= 6


def test_retention_keeps_all_steps_by_default_and_rollback_fulls_when_bounded() -> None:
    storage = mem()
    tr = SynthTrainer(storage)
    tr.save("full")
    history = {tr.saved[0].id: tr.saved[0].state}
    cfg = MergeConfig(stride=2, full=FullPolicy(every=4, max_live_fraction=None))
    for _ in range(24):
        tr.train()
        history[tr.save().id] = snapshot(tr.shards)
        merge_all(storage, cfg)
    everything = build_graph(read_manifests(storage)).restorable_steps()
    coarse = RetentionPolicy(
        keep_last_fulls=1, keep_fulls_every=10, keep_all_steps=False, grace_s=0
    )
    # keep_all_steps is the default
    rep = collect_garbage(
        storage, RetentionPolicy(keep_last_fulls=1, keep_fulls_every=10, grace_s=0)
    )
    assert check_all_restore(storage, history) == everything
    assert rep.deleted  # superseded merged deltas went
    fulls = {
        n.step for n in build_graph(read_manifests(storage)).nodes.values() if n.kind is Kind.FULL
    }
    assert {0, 12, 20, 24} <= fulls  # one full per 10 steps (the oldest) + the newest
    rep = collect_garbage(storage, coarse)
    steps = check_all_restore(storage, history)
    assert {0, 12, 20, 24} <= set(steps)
    assert 5 not in steps and 13 not in steps
    assert sorted(rep.retained_steps) == steps


@pytest.mark.parametrize("budget", [None, 1.0])
def test_default_retention_bounds_old_steps_chains(budget: float | None) -> None:
    storage = mem()
    tr = SynthTrainer(storage)
    tr.save("full")
    history = {tr.saved[0].id: tr.saved[0].state}
    cfg = MergeConfig(stride=2, full=FullPolicy(every=3, max_live_fraction=None))
    keep = RetentionPolicy(chain_delta_budget=budget, grace_s=0)
    for _ in range(30):
        tr.train(1, rows=30)
        history[tr.save().id] = snapshot(tr.shards)
        merge_all(storage, cfg)
        collect_garbage(storage, keep)
    assert check_all_restore(storage, history) == sorted(tr.saved)  # every step, bitwise
    graph = build_graph(read_manifests(storage))
    full = graph.trainer[0].manifest.data_bytes
    worst = max(sum(m.data_bytes for m in graph.chain(s)) for s in tr.saved) / full
    if budget is None:
        assert worst > 3  # the oldest full plus most deltas
    else:
        # At most the budget in deltas after a full, plus the delta that passed it.
        biggest_delta = max(
            n.manifest.data_bytes for n in graph.trainer.values() if n.kind is Kind.DELTA
        )
        assert worst <= 1 + budget + biggest_delta / full, worst


def test_gc_removes_a_failed_attempts_empty_folders_in_one_run(tmp_path: Path) -> None:
    """A checkpoint that failed while staging leaves its folders empty (its files removed): one
    GC run past the grace period removes the whole tree, not one level per run; the committed
    checkpoints and a fresh empty folder (a writer about to fill it) stay."""
    storage = LocalStorage(tmp_path / "ck")
    tr = SynthTrainer(storage)
    tr.save("full")
    tr.train()
    tr.save()
    failed = tmp_path / "ck/step-000000000004/0123456789abcdef/rank-00000/t0"
    failed.mkdir(parents=True)
    fresh = tmp_path / "ck/step-000000000005/fedcba9876543210"
    fresh.mkdir(parents=True)
    old = time.time() - 2 * 86400
    for p in [failed, *failed.parents][:4]:
        os.utime(p, (old, old))
    files = sorted(p for p in (tmp_path / "ck").rglob("*") if p.is_file())
    collect_garbage(storage, RetentionPolicy(grace_s=3600))
    assert not (tmp_path / "ck/step-000000000004").exists()
    assert fresh.is_dir()
    assert sorted(p for p in (tmp_path / "ck").rglob("*") if p.is_file()) == files


def test_gc_removes_an_old_orphan_attempt_whole_in_one_run(tmp_path: Path) -> None:
    """Break-it finding (session 38): an old crashed attempt that still held files lost its
    files in one GC run but kept its emptied folders for another grace period (deleting the
    files touched them). One run past the grace period now removes the attempt whole, folders
    included. A crashed save's step folder it leaves empty was touched by that removal: it goes
    in a run a grace period later, like any folder left empty."""
    storage = LocalStorage(tmp_path / "ck")
    tr = SynthTrainer(storage)
    tr.save("full")
    tr.train(steps=2)  # step 1 is never saved: its crash below is older than the latest
    tr.save()
    # (saved days ago: an attempt of a step committed again within the grace period waits)
    age_commits(storage, 3 * 86400)
    committed = sorted((tmp_path / "ck").glob("step-*"))[-1]
    crashed = [
        committed / "0123456789abcdef" / "rank-00000" / "t0",  # in a committed step's folder
        tmp_path / "ck/step-000000000001/fedcba9876543210/rank-00000/t1",  # a crashed save
    ]
    for leaf in crashed:
        leaf.mkdir(parents=True)
        (leaf / "c0-r0-000000.chunk").write_bytes(b"x" * 4096)
    old = time.time() - 2 * 86400
    for leaf in crashed:
        for p in [leaf / "c0-r0-000000.chunk", leaf, leaf.parent, leaf.parent.parent]:
            os.utime(p, (old, old))
    rep = collect_garbage(storage, RetentionPolicy(grace_s=3600))
    assert len(rep.orphans) == 2 and not rep.errors
    assert not (committed / "0123456789abcdef").exists()
    step = tmp_path / "ck/step-000000000001"
    assert step.is_dir() and not any(step.iterdir())
    collect_garbage(storage, RetentionPolicy(grace_s=3600), now=time.time() + 3601)
    assert not step.exists()
    assert check_all_restore(storage, {s.id: s.state for s in tr.saved.values()})


def test_gc_grace_protects_recent_changes_and_orphans(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "ck")
    tr = SynthTrainer(storage)
    tr.save("full")
    tr.save_deltas(8)
    merge_all(storage, MergeConfig(stride=2, full=FullPolicy(every=4, max_live_fraction=None)))
    # Orphans: a crashed save (no manifest) at an older step, an unreferenced attempt folder of
    # a committed step, an uncommitted merger folder, and a crashed put's temp file.
    (tmp_path / "ck/step-000000000003/0123456789abcdef/rank-00000").mkdir(parents=True)
    (tmp_path / "ck/step-000000000003/0123456789abcdef/rank-00000/x.chunk").write_bytes(b"x")
    (tmp_path / "ck/step-000000000005/fedcba9876543210").mkdir(parents=True)
    (tmp_path / "ck/step-000000000005/fedcba9876543210/rank-00000.json").write_bytes(b"{}")
    crashed = tmp_path / "ck/merged/L01-000000000007-000000000008-00000000000000aa/parts"
    crashed.mkdir(parents=True)
    (crashed / "x.json").write_bytes(b"{}")
    (tmp_path / "ck/step-000000000008/.tmp-manifest.json.abc").write_bytes(b"x")
    # An in-progress save of the newest step must survive any grace period.
    (tmp_path / "ck/step-000000000009/1111111111111111").mkdir(parents=True)
    (tmp_path / "ck/step-000000000009/1111111111111111/rank-00000.json").write_bytes(b"{}")

    before = sorted(p for p in (tmp_path / "ck").rglob("*") if p.is_file())
    rep = collect_garbage(storage, RetentionPolicy(grace_s=3600))
    after = sorted(p for p in (tmp_path / "ck").rglob("*") if p.is_file())
    assert not rep.orphans and before == after  # everything is younger than the grace period
    bounded = RetentionPolicy(keep_last_fulls=1, keep_all_steps=False, grace_s=0)
    dry = collect_garbage(storage, bounded, dry_run=True)
    assert dry.deleted and dry.orphans
    assert after == sorted(p for p in (tmp_path / "ck").rglob("*") if p.is_file())
    rep = collect_garbage(storage, bounded)
    left = {
        str(p.relative_to(tmp_path / "ck")) for p in (tmp_path / "ck").rglob("*") if p.is_file()
    }
    assert not any("0123456789abcdef" in p or "fedcba9876543210" in p for p in left)
    assert not any("00000000000000aa" in p or ".tmp-" in p for p in left)
    assert any("1111111111111111" in p for p in left)
    assert {s for s, _ in [(o, 0) for o, _ in rep.orphans]}
    manifests = read_manifests(storage)
    assert latest_restorable(manifests) == 8
    for m in manifests.all():
        assert not verify_checkpoint(storage, m).problems


class _ResaveDuringGc(StorageWrapper):
    """A trainer that rolled back re-saves step ``step`` while GC runs: its parts appear right
    after GC's first listing, its commit record right after GC read the step's old record (the
    moment the old check-then-delete lost it)."""

    def __init__(self, inner: Storage, step_folder: str, files: dict[str, bytes], record: bytes):
        super().__init__(inner)
        self.man = f"{step_folder}/manifest.json"
        self.files = files
        self.record = record
        self.listed = False
        self.committed = False

    def list(self, prefix: str = "") -> list[str]:
        keys = self.inner.list(prefix)
        if not self.listed:
            self.listed = True
            for k, v in self.files.items():
                self.inner.put(k, v)
        return keys

    def get(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        data = self.inner.get(path, start, end)
        if path == self.man and self.listed and not self.committed:
            self.committed = True
            self.inner.put(self.man, self.record)
        return data


def test_gc_keeps_a_step_saved_again_while_it_deletes_the_old_save() -> None:
    """A long-job finding: GC read a step's record (an abandoned timeline's save, doomed) and
    deleted it in a separate call; a rollback's re-save of that step committed in between lost
    its commit record. Now the re-save's parts (written before its record) keep the old
    checkpoint whole for this run, and the re-save's record survives."""
    storage = mem()
    tr = SynthTrainer(storage)
    tr.save("full")
    tr.save_deltas(6)
    old6 = tr.saved[6].id
    old_record = storage.get("step-000000000006/manifest.json")
    tr.rollback(3)
    for _ in range(3):
        tr.train()
        m = tr.save()
    assert m.step == 6 and m.id != old6
    # Take the re-save away again, to replay it during GC.
    files = {k: storage.get(k) for k in storage.list(f"step-000000000006/{m.id}/")}
    record = storage.get("step-000000000006/manifest.json")
    storage.delete_prefix(f"step-000000000006/{m.id}/")
    storage.put("step-000000000006/manifest.json", old_record)
    history = {tr.saved[s].id: tr.saved[s].state for s in tr.saved}
    racing = _ResaveDuringGc(storage, "step-000000000006", files, record)
    policy = RetentionPolicy(keep_last_fulls=1, keep_all_steps=False, grace_s=0)
    # Step 5' is the latest when GC lists: the old timeline's 4-6 are doomed.
    rep = collect_garbage(racing, policy)
    assert racing.committed and not rep.errors
    manifests = read_manifests(storage)
    assert 6 in manifests and manifests[6].id == m.id  # the re-save's commit record survived
    assert any("a save of step 6 may have begun" in why for _, why in rep.busy), rep.busy
    assert latest_restorable(manifests) == 6
    check_all_restore(storage, history)
    # The next run deletes what the abandoned timeline left.
    collect_garbage(storage, policy)
    assert not storage.list(f"step-000000000006/{old6}/")
    check_all_restore(storage, history)


def test_gc_grace_keeps_every_chain_a_reader_may_be_reading() -> None:
    """A long-job finding: GC's grace period protected what its own plan kept, not the
    cheapest chains restores read (merged deltas a later merge made redundant). Every chain of
    a retained step that a restore could have picked within the grace period stays whole
    (here a save, a merge and a restore every 1000 s, a grace of 3600 s)."""
    storage = mem()
    tr = SynthTrainer(storage)
    cfg = MergeConfig(stride=2, full=FullPolicy(every=None, max_live_fraction=None))
    policy = RetentionPolicy(keep_last_fulls=1, keep_all_steps=False, grace_s=3600)
    history: dict[str, State] = {}
    readers: list[tuple[int, int, list[str], list[str]]] = []  # when, step, chain, files

    def save(kind: str = "delta") -> None:
        m = tr.save(kind)
        history[m.id] = snapshot(tr.shards)

    save("full")
    for now in range(16):
        tr.train()
        save("full" if now % 6 == 5 else "delta")
        merge_all(storage, cfg)
        # A restore starts now: it reads the cheapest chain of a retained step.
        manifests = read_manifests(storage)
        graph = build_graph(manifests)
        for step in plan_retention(manifests, policy).retained_steps:
            chain = cheapest_chain(graph, step)
            files = chain_files(storage, chain)
            readers.append((now, step, [m.folder for m in chain], files))
        age_commits(storage, 1000)
        collect_garbage(storage, policy)
        for then, step, chain, files in readers:
            if (now - then + 1) * 1000 >= policy.grace_s:
                continue  # a restore longer than the grace period: not promised
            missing = [k for k in files if not storage.exists(k)]
            assert not missing, f"a restore of step {step} via {chain} lost {missing[:3]}"
    check_all_restore(storage, history)


def test_gc_logs_each_problem_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A damaged delta makes later steps unrestorable; GC replays the lineage at every moment of
    its grace period, and still says each thing once."""
    import logging

    from deck.merge.worker import MergeWorker

    storage = LocalStorage(tmp_path / "ck")
    saved_chain(storage, 5)
    m = read_manifests(storage)[3]
    zero_a_chunk(storage, m)
    MergeWorker(storage, MergeConfig(stride=2, full=FullPolicy(every=None))).run_once(wait_s=0)
    assert m.id in read_manifests(storage).quarantined
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deck"):
        collect_garbage(storage, RetentionPolicy(grace_s=3600), dry_run=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings, "the unrestorable steps are worth a warning"
    assert len(warnings) == len(set(warnings)), warnings


def test_default_gc_keeps_the_merged_deltas_old_steps_restore_through() -> None:
    """A user's finding: `deck gc --grace 0` (default policy otherwise) deleted the merged delta
    on step 6's cheapest chain ("merged checkpoint in no retained step's chain"), so restoring
    step 6 read 6 checkpoints instead of 3. Merged deltas on a retained step's cheapest chain now
    stay; `keep_merged_deltas=False` trades that for storage."""
    storage = mem()
    tr = SynthTrainer(storage)
    history = {tr.save("full").id: snapshot(tr.shards)}
    for _ in range(13):
        tr.train()
        m = tr.save()
        history[m.id] = snapshot(tr.shards)
    merge_all(storage, MergeConfig(stride=2, full=FullPolicy(every=None, max_live_fraction=None)))

    def lengths() -> dict[int, int]:
        graph = build_graph(read_manifests(storage))
        return {s: len(cheapest_chain(graph, s)) for s in graph.restorable_steps()}

    before = lengths()
    assert before[6] < 6  # through merged deltas
    rep = collect_garbage(storage, RetentionPolicy(grace_s=0))
    assert not rep.errors
    assert lengths() == before
    check_all_restore(storage, history)
    lean = collect_garbage(storage, RetentionPolicy(grace_s=0, keep_merged_deltas=False))
    assert any(why.startswith("merged") or "no retained" in why for _, why in lean.deleted)
    after = lengths()
    assert set(after) == set(before) and any(after[s] > before[s] for s in before)
    check_all_restore(storage, history)


@pytest.mark.parametrize("stop_after", [1, 3, 7])
def test_a_gc_stopped_part_way_leaves_every_committed_step_restorable(stop_after: int) -> None:
    """Found by an operator trying to break it: a GC killed part way through its deletions left
    deltas whose parent it had deleted (it went oldest first), and `deck ls` / `verify --all`
    then reported broken steps, advising a new full. Newest first, what a stopped run leaves
    of what it meant to delete restores, every step of it bitwise; the next run finishes."""
    storage = mem()
    tr = SynthTrainer(storage)
    history = {}
    for step in range(30):
        if step:
            tr.train()
        history[tr.save("full" if step % 10 == 0 else "delta").id] = snapshot(tr.shards)
    cfg = MergeConfig(stride=2, full=FullPolicy(every=None, max_live_fraction=None))
    merge_all(storage, cfg)
    policy = RetentionPolicy(keep_last_fulls=1, keep_all_steps=False, grace_s=0)
    _gc_interrupted_at(storage, policy, f"gc.checkpoint.after_delete:{stop_after}")
    graph = build_graph(read_manifests(storage))
    assert not graph.unrestorable(), graph.unrestorable()
    left = check_all_restore(storage, history)  # (bitwise, each step)
    assert 0 in left and 29 in left  # the oldest doomed ones are what is left
    collect_garbage(storage, policy)
    assert check_all_restore(storage, history) == list(range(20, 30))


def test_latest_logs_the_steps_it_skips_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A lost full leaves every delta after it without a chain: `latest()` names them in one
    warning (the newest one's reason and how many), not a line per step (thousands, in a long
    history, before any command's own output)."""
    storage = LocalStorage(str(tmp_path))
    tr = SynthTrainer(storage)
    tr.save("full")
    tr.train(1)
    good = tr.save().step
    tr.train(1)
    lost = tr.save("full")
    after = []
    for _ in range(30):
        tr.train(1)
        after.append(tr.save().step)
    storage.delete_prefix(f"{lost.folder}/")
    with caplog.at_level("WARNING", logger="deck.read.lineage"):
        assert build_graph(read_manifests(storage)).latest() == good
    lines = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"skipping 30 steps without a complete chain ({after[0]} to ")
    assert f"the newest, step {after[-1]}: " in lines[0], lines[0]


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("lost", [3, 0])
@pytest.mark.parametrize("all_steps", [True, False])
def test_a_lost_commit_record_makes_gc_keep_what_builds_on_it(
    tmp_path: Path, lost: int, whole: bool, all_steps: bool
) -> None:
    """One ``manifest.json`` lost (a copy or sync that missed it), its files still there: the
    later steps of the newest timeline have no chain, which `deck verify` calls damage. GC keeps
    them, and the lost record's files, saying why (a break-it finding: the default GC deleted
    every step after it, or before it, and the files that restoring the record would bring
    back; and, with the bounded policy, what the lost step builds on). Restoring the record
    restores every step."""
    storage = LocalStorage(tmp_path / "ck")
    tr = SynthTrainer(storage)
    tr.save("full")
    for i in range(1, 9):
        tr.train()
        tr.save("full" if i == 2 else "delta")
    record = tmp_path / f"ck/step-{lost:012d}/manifest.json"
    saved = record.read_bytes()
    record.unlink()
    # (the bounded policy drops the steps below the full of step 2 that the lost step 3 and
    # what builds on it restore from, as with the record there)
    first = 0 if all_steps or not lost else 2

    def files() -> list[Path]:
        return sorted(
            p
            for p in (tmp_path / "ck").glob("step-*/**/*")
            if p.is_file() and int(p.relative_to(tmp_path / "ck").parts[0][5:]) >= first
        )

    before = files()
    policy = RetentionPolicy(grace_s=0, keep_all_steps=all_steps, keep_last_fulls=1)
    rep = collect_garbage(storage, policy, whole=whole)
    assert sorted(int(f[5:17]) for f, _ in rep.deleted) == list(range(first)), rep
    assert not rep.orphans and files() == before, rep
    kept = dict(rep.kept)
    assert any(
        f"step-{lost:012d}/" in k and "parent of committed step" in w for k, w in kept.items()
    ), kept
    said = f"may need step {lost}, whose commit record is missing"
    assert any(said in w for w in kept.values()), kept
    record.write_bytes(saved)
    history = {s.id: s.state for s in tr.saved.values()}
    assert check_all_restore(storage, history) == list(range(first, 9))


def test_a_record_lost_before_a_restart_is_damage_to_gc_verify_and_ls(tmp_path: Path) -> None:
    """A break-it finding: a commit record lost (step 2), the job restarted after it (a new
    epoch going on from the latest step) and a merger full above it (step 5) making the newest
    steps restorable without it (steps 3 and 4 are not). Every step after the lost one and before the restart was
    taken for a timeline a rollback left: `deck verify --all` said nothing of them, `deck ls`
    called them abandoned, and the default GC deleted them and the lost record's files, for
    good. They are broken (damage), kept, and restore again once the record is back."""
    from deck.ops.listing import list_rows

    storage = LocalStorage(tmp_path / "ck")
    tr = saved_chain(storage, 5)
    # (a merger full of step 5 and no merged delta: those would restore around the lost record)
    merge_all(storage, MergeConfig(stride=16, full=FullPolicy(every=5, max_live_fraction=None)))
    assert {m.kind for m in read_manifests(storage).merged.values()} == {Kind.FULL}
    tr.rollback(5)  # (a restart from the latest step: a new epoch, the same timeline)
    for _ in range(3):
        tr.train()
        tr.save()
    record = tmp_path / "ck/step-000000000002/manifest.json"
    saved = record.read_bytes()
    record.unlink()
    graph = build_graph(read_manifests(storage))
    assert graph.latest() == 8 and graph.abandoned() == set()
    assert sorted(graph.unrestorable()) == [3, 4]  # (what `deck verify --all` reports)
    # ... saying to put the record back, not only to give the steps up (as GC says)
    assert "step-000000000002/manifest.json was lost: put it back" in graph.unrestorable()[3]
    states = {r.step: r.state for r in list_rows(storage)[1] if not r.merged}
    assert [states[s] for s in (3, 4, 5, 6)] == ["broken"] * 2 + ["committed"] * 2, states
    rep = collect_garbage(storage, RetentionPolicy(grace_s=0))
    assert not rep.deleted and not any(o.startswith("step-") for o, _ in rep.orphans), rep
    kept = dict(rep.kept)
    said = "may need step 2, whose commit record is missing"
    assert all(any(f"step-{s:012d}" in k and said in w for k, w in kept.items()) for s in (3, 4))
    record.write_bytes(saved)
    history = {s.id: s.state for s in tr.saved.values()}
    assert check_all_restore(storage, history) == list(range(9))


def test_the_latest_never_goes_back_onto_a_timeline_a_rollback_left(tmp_path: Path) -> None:
    """A break-it finding: rolled back to step 3 (past bad data), the new timeline's first
    record lost, "latest" fell to the highest restorable step of any epoch: step 10 of the
    timeline the rollback left, restorable through a merger full of step 6. The latest is the
    newest step no newer timeline left (step 3, where the new one went on from)."""
    storage = LocalStorage(tmp_path / "ck")
    tr = saved_chain(storage, 6)
    merge_all(storage, MergeConfig(stride=16, full=FullPolicy(every=6, max_live_fraction=None)))
    for _ in range(4):
        tr.train()
        tr.save()
    tr.rollback(3)
    for _ in range(2):
        tr.train()
        tr.save()  # steps 4 and 5 again (epoch 1)
    graph = build_graph(read_manifests(storage))
    assert graph.latest() == 5 and graph.abandoned() == {6, 7, 8, 9, 10}
    (tmp_path / "ck/step-000000000004/manifest.json").unlink()
    graph = build_graph(read_manifests(storage))
    assert graph.restorable(10) and graph.latest() == 3


def test_a_rollback_abandons_the_steps_above_where_it_went_on(tmp_path: Path) -> None:
    """What a rollback leaves: the older timeline's steps above the step the new one went on
    from (the parent of its first delta); below it, the steps are the new timeline's history.
    A new epoch that starts with a full went on from where it is not recorded: the steps below
    the full count as its history."""
    storage = LocalStorage(tmp_path / "ck")
    tr = saved_chain(storage, 6)
    tr.rollback(2)
    tr.train()
    tr.save()  # step 3 again (epoch 1): 4..6 of epoch 0 are left
    assert build_graph(read_manifests(storage)).abandoned() == {4, 5, 6}
    tr.rollback(3)
    tr.parent = None  # (epoch 2 starts with a full, at step 4: 5, 6 are left, 4 saved again)
    tr.train()
    tr.save("full")
    assert build_graph(read_manifests(storage)).abandoned() == {5, 6}


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("keep_all_steps", [True, False])
def test_a_rollback_leaves_the_abandoned_timeline_for_the_grace_period(
    tmp_path: Path, merge: bool, keep_all_steps: bool
) -> None:
    """Break-it finding: a restore of the latest step started, then the trainer rolled back and
    saved a step again (a new timeline); `deck gc --grace 3600` right after deleted the older
    timeline's steps above the rollback and the attempt folder the new record replaced: the
    restore, started within the grace period, failed part way (rank 0 part missing). The
    replaced record is gone, so no replayed moment saw what it kept: what the older timelines
    hold from where a timeline begun within the period starts now stays for the period, and
    so does an attempt folder whose step was committed again within it. Past the period both
    go."""
    storage = LocalStorage(tmp_path / "ck")
    tr = SynthTrainer(storage)
    history: dict[str, State] = {}

    def save(kind: str = "delta") -> None:
        m = tr.save(kind)
        history[m.id] = snapshot(tr.shards)

    save("full")
    for _ in range(12):
        tr.train(rows=4)
        save()
    if merge:
        merge_all(storage, MergeConfig(stride=4, full=FullPolicy(every=None)))
    age_commits(storage, 86400)
    manifests = read_manifests(storage)
    policy = RetentionPolicy(grace_s=3600, keep_all_steps=keep_all_steps)
    # Restores started before the rollback, of steps the policy retained then
    retained = plan_retention(manifests, policy).retained_steps
    readers = {s: chain_for(manifests, s) for s in (12, 9) if s in retained}
    assert 12 in readers
    tr.rollback(6)
    tr.train(rows=4)
    save("full")
    collect_garbage(storage, policy)
    for step, chain in readers.items():
        got, user = restore_state(storage, chain)
        assert user == step and not same(got, history[chain[-1].id]), step
    age_commits(storage, 3601)
    report = collect_garbage(storage, policy)
    gone = [label for label, _ in report.deleted] + [p for p, _ in report.orphans]
    assert any(g.startswith("step-000000000008 ") for g in gone), gone
    assert any(g.startswith("step-000000000007/") for g in gone), gone
    assert 7 in check_all_restore(storage, history)


def test_a_restore_of_an_abandoned_step_survives_the_new_timeline_saving_it(
    tmp_path: Path,
) -> None:
    """Break-it finding: a merger full of an abandoned timeline's step still restores that step
    (docs: until the new timeline saves it). A restore of it started, the new timeline -- begun
    two hours earlier -- saved the step again ten minutes later, and GC right after deleted the
    merger full under the restore. What older timelines hold from the newer one's first step
    on, and the chains it applies on, stay for the grace period after such a save."""
    storage = LocalStorage(tmp_path / "ck")
    tr = SynthTrainer(storage)
    history: dict[str, State] = {}

    def save() -> None:
        tr.train(rows=6)
        m = tr.save()
        history[m.id] = snapshot(tr.shards)

    tr.save("full")
    for _ in range(8):
        save()
    merge_all(storage, MergeConfig(stride=2, full=FullPolicy(every=8, max_live_fraction=None)))
    age_commits(storage, 86400)
    tr.rollback(6)
    save()  # the new timeline's first save: step 7
    age_commits(storage, 2 * 3600)
    chain = chain_for(read_manifests(storage), 8)  # a restore of the abandoned step 8 starts
    assert chain[0].is_merged and chain[-1].epoch == 0
    age_commits(storage, 600)
    save()  # the new timeline saves step 8
    collect_garbage(storage, RetentionPolicy(grace_s=3600))
    got, user = restore_state(storage, chain)
    assert user == 8 and not same(got, history[chain[-1].id])
    age_commits(storage, 3601)
    report = collect_garbage(storage, RetentionPolicy(grace_s=3600))
    # (retired by the first run: its files go as an orphan's now)
    gone = [label for label, _ in report.deleted] + [p for p, _ in report.orphans]
    assert any(label.startswith(chain[0].folder) for label in gone), gone


def _gc_interrupted_at(storage: Storage, policy: RetentionPolicy, point: str) -> None:
    """A GC run interrupted (as by a Ctrl-C) at failpoint ``point`` (``name:nth``)."""
    from deck import failpoints

    failpoints.configure(f"{point}:interrupt")
    try:
        with pytest.raises(KeyboardInterrupt):
            collect_garbage(storage, policy)
    finally:
        failpoints.configure(None)


MERGER_FOLLOWING = MergeConfig(stride=2, full=FullPolicy(every=3, max_live_fraction=None))


def _merger_following(
    tmp_path: Path, steps: int = 18
) -> tuple[Storage, SynthTrainer, dict[str, State]]:
    """``steps`` steps saved, a merger pass after each (deck merge --follow, a merger full
    every 3): the store, the trainer, and the state each checkpoint saved."""
    storage = LocalStorage(tmp_path / "ck")
    tr = SynthTrainer(storage, seed=1, id_seed=1)
    m = tr.save("full")
    history = {m.id: snapshot(tr.shards)}
    for _ in range(steps):
        tr.train(rows=6)
        m = tr.save()
        history[m.id] = snapshot(tr.shards)
        merge_all(storage, MERGER_FOLLOWING)
    return storage, tr, history


@pytest.mark.parametrize("keep_merged_deltas", [True, False])
def test_merger_checkpoints_restores_pick_are_retired_then_deleted(
    tmp_path: Path, keep_merged_deltas: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Break-it finding: with a grace period, the merger fulls and merged deltas the rules
    delete but which are on the chain restores pick (a merger following the trainer leaves
    many) were held for ever -- a restore may always have started on them a moment ago. GC
    now retires them (uncommits them, so restores pick other chains; their files stay) and
    deletes their files a grace period later: everything the rules delete goes within two runs
    a grace period apart, and a restore chosen before the retirement reads its chain whole."""
    storage, _, history = _merger_following(tmp_path)
    policy = RetentionPolicy(keep_merged_deltas=keep_merged_deltas)
    manifests = read_manifests(storage)
    doomed = plan_retention(manifests, policy).delete
    graph = build_graph(manifests)
    assert any(graph.nodes[c].merged for c in doomed)
    # Restores that chose their chains before any GC ran
    readers = {s: cheapest_chain(graph, s) for s in graph.restorable_steps()}
    assert any(m.id in doomed for chain in readers.values() for m in chain)
    files = {s: chain_files(storage, ch) for s, ch in readers.items()}
    age_commits(storage, 86400)
    with caplog.at_level(logging.INFO, logger="deck.ops.retention.gc"):
        first = collect_garbage(storage, policy)
    assert first.retired and not first.deleted, (first.retired, first.deleted)
    # (the one line `deck merge --gc` logs says so too)
    assert f"retired {len(first.retired)} merger checkpoint(s)" in caplog.text
    assert {label for label, _ in first.retired} == {
        graph.nodes[c].folder for c in doomed if graph.nodes[c].merged
    }
    for step, chain in readers.items():  # still whole, while the retirement is young
        assert all(storage.exists(k) for k in files[step]), step
        got, user = restore_state(storage, chain)
        assert user == step and not same(got, history[chain[-1].id]), step
    # New restores pick chains without what was retired
    after = read_manifests(storage)
    assert not set(after.merged) & set(doomed)
    assert check_all_restore(storage, history) == graph.restorable_steps()
    # A run within the grace period of the retirement deletes and retires nothing
    age_commits(storage, 1800)
    held = collect_garbage(storage, policy)
    assert held.retire_wait_s is not None and 0 < held.retire_wait_s <= 1800
    assert not held.deleted and not held.retired
    assert not [p for p, why in held.orphans if why == "retired by GC"]
    age_commits(storage, 1801)
    last = collect_garbage(storage, policy)
    assert last.retire_wait_s is None
    assert {p for p, why in last.orphans if why == "retired by GC"} == {
        f"{graph.nodes[c].folder}/" for c in doomed if graph.nodes[c].merged
    }
    for c in doomed:
        assert not storage.list(f"{graph.nodes[c].folder}/"), graph.nodes[c].folder
    assert not plan_retention(read_manifests(storage), policy).delete
    assert check_all_restore(storage, history) == graph.restorable_steps()


def test_a_retirement_mark_dated_in_the_future_holds_deletions_one_grace_period(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A break-it finding: `_clock/gc-retired` dated years ahead (copied with its times from a
    host whose clock was ahead) made every run delete and retire nothing until that date, with
    exit 0. A run now writes it again and holds deletions for one grace period from there; a
    dry run says so and writes nothing; a run a grace period later deletes."""
    storage, _, history = _merger_following(tmp_path)
    policy = RetentionPolicy()
    steps = build_graph(read_manifests(storage)).restorable_steps()
    age_commits(storage, 86400)
    assert collect_garbage(storage, policy).retired
    ahead = time.time() + 5 * 365 * 86400
    set_store_time(storage, RETIRE_MARK, ahead)
    with caplog.at_level(logging.WARNING, logger="deck.ops.retention.gc"):
        dry = collect_garbage(storage, policy, dry_run=True)
        assert "in the store's future: a run without --dry-run writes it again" in caplog.text
        assert dry.retire_wait_s == policy.grace_s
        assert storage.modified(RETIRE_MARK) == ahead
        held = collect_garbage(storage, policy)
    assert "written again now" in caplog.text
    assert held.retire_wait_s == policy.grace_s and not held.deleted and not held.retired
    assert (storage.modified(RETIRE_MARK) or ahead) < time.time() + 60
    age_commits(storage, policy.grace_s + 1)
    last = collect_garbage(storage, policy)
    assert last.retire_wait_s is None and [w for p, w in last.orphans if w == "retired by GC"]
    assert check_all_restore(storage, history) == steps


@pytest.mark.parametrize("nth", [1, 3])
def test_a_gc_stopped_while_retiring_loses_nothing_and_a_later_run_finishes(
    tmp_path: Path, nth: int
) -> None:
    """A GC stopped between a retirement's marker and the record it removes: every step still
    restores bitwise; runs within the grace period of the stopped one delete and retire
    nothing (its retirements' moments are unknown), and runs a grace period apart after it
    finish the work."""
    storage, _, history = _merger_following(tmp_path)
    policy = RetentionPolicy()
    steps = build_graph(read_manifests(storage)).restorable_steps()
    age_commits(storage, 86400)
    _gc_interrupted_at(storage, policy, f"gc.retire.before_uncommit:{nth}")
    assert check_all_restore(storage, history) == steps
    held = collect_garbage(storage, policy)
    assert held.retire_wait_s is not None and not held.retired and not held.deleted
    for _ in range(2):
        age_commits(storage, 3601)
        collect_garbage(storage, policy)
        assert check_all_restore(storage, history) == steps
    assert not plan_retention(read_manifests(storage), policy).delete
    retired = [k for k in storage.list("merged/") if k.endswith("/gc-retired")]
    assert not retired, retired


def test_a_retirement_waits_for_the_steps_the_grace_period_holds_that_need_it(
    tmp_path: Path,
) -> None:
    """Break-it finding: with --no-keep-all-steps and a grace period, GC deleted steps 0 and 1
    and retired the merger full of step 2, while steps 2 and 3 -- held by the grace period,
    their only chain through that full -- stayed committed: `ls` showed them broken, and every
    later run kept them as built on a lost record (exit 1, "restore step 1 from a backup").
    A merger checkpoint a step staying committed restores only through is retired by the run
    that deletes that step."""
    storage = LocalStorage(tmp_path / "ck")
    tr = SynthTrainer(storage, seed=12)
    history: dict[str, State] = {}
    m = tr.save("full")
    history[m.id] = snapshot(tr.shards)
    cfg = MergeConfig(stride=2, full=FullPolicy(every=None, max_live_fraction=0.3))
    policy = RetentionPolicy(keep_all_steps=False, keep_last_fulls=1)
    for i in range(1, 13):
        tr.train()
        m = tr.save()
        history[m.id] = snapshot(tr.shards)
        if i % 2 == 0:
            merge_all(storage, cfg)
        if i % 3 == 0:
            age_commits(storage, 1200)
            report = collect_garbage(storage, policy)
            assert not report.kept and not report.errors, (i, report.kept, report.errors)
            graph = build_graph(read_manifests(storage))
            assert not graph.unrestorable(), (i, graph.unrestorable())
            check_all_restore(storage, history)
    age_commits(storage, 100000)
    for _ in range(2):
        report = collect_garbage(storage, policy, whole=True)
        assert not report.kept and not report.errors, (report.kept, report.errors)
        age_commits(storage, 3601)
    assert sorted(read_manifests(storage)) == [12]
    assert check_all_restore(storage, history) == [12]
    # GC's marker stays in the folder of step 11, deleted under step 12 that builds on it
    parent = read_manifests(storage)[12].parent_id
    assert [k for k in storage.list("") if k.endswith(GC_DELETING)] == [
        f"step-000000000011/{parent}/{GC_DELETING}"
    ]


def test_a_retired_merger_checkpoint_the_merger_builds_again_keeps_its_old_files(
    tmp_path: Path,
) -> None:
    """Break-it finding: GC retired merger full F-21; the trainer rolled back to step 21 and
    the merger following built F-21 again (the same inputs: the same id and folder) under new
    attempt files; the next GC, minutes later, deleted the retired build's files as strays of
    the committed folder (by their own old times), under restores that had chosen F-21 before.
    They wait for the retirement's grace period, as the folder would have."""
    storage, tr, history = _merger_following(tmp_path, steps=30)
    age_commits(storage, 86400)
    graph = build_graph(read_manifests(storage))
    readers = {s: cheapest_chain(graph, s) for s in graph.restorable_steps()}
    files = {s: chain_files(storage, c) for s, c in readers.items()}
    report = collect_garbage(storage, RetentionPolicy())
    assert "merged/F-000000000021" in {label[:21] for label, _ in report.retired}
    age_commits(storage, 300)
    tr.rollback(21)
    for _ in range(4):
        tr.train(rows=6)
        m = tr.save()
        history[m.id] = snapshot(tr.shards)
        merge_all(storage, MERGER_FOLLOWING)
    again = [
        m
        for m in read_manifests(storage).merged.values()
        if m.folder.startswith("merged/F-000000000021")
    ]
    assert again and storage.exists(f"{again[0].folder}/gc-retired")  # built again, same folder
    age_commits(storage, 300)
    for whole in (True, False):
        collect_garbage(storage, RetentionPolicy(), whole=whole)
    for step, chain in readers.items():
        missing = [k for k in files[step] if not storage.exists(k)]
        assert not missing, (step, [m.folder for m in chain], missing[:3])
        got, user = restore_state(storage, chain)
        assert user == step and not same(got, history[chain[-1].id]), step
    # Past the grace period the old build's files go (and the new build too, once the rules
    # retire it in its turn)
    parts = read_rank_manifests(storage, again[0])
    new = {f"{again[0].folder}/{c.path}" for p in parts for sh in p.shards for c in sh.chunks}
    old = {k for c in files.values() for k in c if k.startswith(again[0].folder)}
    old = {k for k in old if k.endswith(".chunk")} - new
    for _ in range(3):
        age_commits(storage, 3601)
        collect_garbage(storage, RetentionPolicy(), whole=True)
    assert old and not [k for k in old if storage.exists(k)]
    assert check_all_restore(storage, history)


def test_a_quarantine_record_under_another_name_is_kept_while_its_checkpoint_stays(
    tmp_path: Path,
) -> None:
    """A break-it finding: a quarantine record whose file name is not the id it holds (renamed,
    or written by hand) was honoured by restores, yet GC deleted it as "of a deleted checkpoint"
    (by its name), lifting the quarantine without a word. GC goes by what it says, as readers do:
    kept while that checkpoint stays (KEPT, saying how to repair it); one of a checkpoint that
    is gone, or unreadable as a record, is decided as before (deleted / kept)."""
    from deck.read.catalog import quarantine

    storage = LocalStorage(tmp_path / "ck")
    tr = saved_chain(storage, 4)
    quarantine(storage, read_manifests(storage)[2], "test")
    root = tmp_path / "ck" / "quarantine"
    renamed = root / "00000000000000aa.json"
    (root / f"{tr.saved[2].id}.json").rename(renamed)
    (root / "00000000000000bb.json").write_bytes(b"garbage")
    assert tr.saved[2].id in read_manifests(storage).quarantined  # (what readers honour)
    rep = collect_garbage(storage, RetentionPolicy(grace_s=0))
    kept = dict(rep.kept)
    assert f"quarantines checkpoint {tr.saved[2].id}" in kept["quarantine/00000000000000aa.json"]
    assert "cannot be read" in kept["quarantine/00000000000000bb.json"], kept
    assert renamed.exists() and tr.saved[2].id in read_manifests(storage).quarantined


def test_another_jobs_record_copied_over_a_step_is_damage_not_a_rollback(tmp_path: Path) -> None:
    """A break-it finding (S3): another job's valid commit record copied over step 3's (epoch 0,
    where what builds on step 3 is of epoch 1) made the default GC delete the deltas built on
    the record it replaced and that record's attempt folder, as a rollback's leftovers, exit 0.
    Only a newer epoch saves a step again: GC keeps them, saying what to put back."""
    storage = LocalStorage(tmp_path / "ck")
    tr = saved_chain(storage, 2)
    tr.rollback(2)  # (a restart: epoch 1, starting with a full at step 3)
    tr.parent = None
    for kind in ("full", "delta", "delta"):
        tr.train()
        tr.save(kind)
    other = LocalStorage(tmp_path / "other")
    saved_chain(other, 3)
    record = tmp_path / "ck/step-000000000003/manifest.json"
    saved = record.read_bytes()
    record.write_bytes((tmp_path / "other/step-000000000003/manifest.json").read_bytes())
    rep = collect_garbage(storage, RetentionPolicy(grace_s=0))
    assert not rep.deleted and not any(o.startswith("step-") for o, _ in rep.orphans), rep
    kept = dict(rep.kept)
    said = "may need step 3, whose commit record is another checkpoint's"
    assert all(any(f"step-{s:012d}" in k and said in w for k, w in kept.items()) for s in (4, 5))
    attempt = f"step-000000000003/{tr.saved[3].id}/"
    assert "names checkpoint" in kept[attempt] and "put its own record back" in kept[attempt]
    record.write_bytes(saved)
    history = {s.id: s.state for s in tr.saved.values()}
    assert check_all_restore(storage, history) == list(range(6))


def test_a_step_a_save_seems_to_have_begun_at_keeps_its_chain_too(tmp_path: Path) -> None:
    """A break-it finding (S3): a folder marker in a step folder (`step-4/x/`, as a console's
    "create folder" makes) read as a save of that step that began during the run; GC kept the
    step, as it must while a save may be committing there, but deleted its parent, which left
    it broken for good. What such a step restores through is kept with it."""
    storage = LocalStorage(str(tmp_path / "ck"))
    tr = SynthTrainer(storage)
    tr.save("full")
    tr.save_deltas(4)
    tr.train()
    tr.save("full")
    marker = tmp_path / "ck" / "step-000000000004" / "x"
    marker.mkdir()
    policy = RetentionPolicy(keep_last_fulls=1, keep_all_steps=False, grace_s=0)
    said: list[str] = []
    report = collect_garbage(storage, policy, whole=True, progress=said.append)
    assert not report.deleted, report.deleted
    # (a break-it finding: `deck gc: deleting step-...4` went to stderr for the step it kept)
    assert not said, said
    busy = dict(report.busy)
    assert (
        "a save of step 4 may have begun" in busy["step-000000000004 (id " + tr.saved[4].id + ")"]
    )
    assert len(busy) == 5, busy
    assert latest_restorable(read_manifests(storage)) == 5
    assert chain_for(read_manifests(storage), 4)  # still whole
    assert not marker.exists()  # (an empty folder: this run removed it, the next decides)
    report = collect_garbage(storage, policy, whole=True)
    assert len(report.deleted) == 5 and not report.busy, report
    assert sorted(read_manifests(storage)) == [5]


def test_a_merger_full_whose_record_is_lost_is_kept_while_steps_need_it(tmp_path: Path) -> None:
    """A break-it finding (S3 and local): after GC deleted the trainer steps a merger full
    replaced, that full's commit record was lost, and the next GC deleted its folder as an
    uncommitted merger folder: the only copy, nothing restorable any more. While committed
    steps cannot be restored, an uncommitted merger folder at or below them is kept (exit 1,
    naming its record); the record put back, the newest step restores bitwise."""
    storage = LocalStorage(tmp_path / "ck")
    tr = SynthTrainer(storage)
    tr.save("full")
    tr.save_deltas(7)
    want = snapshot(tr.shards)
    merge_all(storage, MergeConfig(stride=16, full=FullPolicy(every=7, max_live_fraction=None)))
    bounded = RetentionPolicy(keep_last_fulls=1, keep_all_steps=False, grace_s=0)
    collect_garbage(storage, bounded)
    manifests = read_manifests(storage)
    (full,) = [m for m in manifests.merged.values() if m.kind is Kind.FULL]
    assert sorted(manifests) == [7], sorted(manifests)  # only the merger full restores 7
    record = tmp_path / "ck" / full.folder / "manifest.json"
    kept = record.read_bytes()
    record.unlink()
    for policy in (bounded, RetentionPolicy(grace_s=0)):
        rep = collect_garbage(storage, policy)
        assert not rep.orphans, rep.orphans
        assert any(full.folder in f and "record was lost" in why for f, why in rep.kept), rep.kept
    record.write_bytes(kept)
    got, step = restore_state(storage, cheapest_chain(build_graph(read_manifests(storage)), 7))
    assert step == 7 and not same(got, want)


def test_steps_broken_by_a_parent_gc_deleted_go_when_the_rules_delete_them(
    tmp_path: Path,
) -> None:
    """A break-it finding (two GC runs at once on S3, `deck merge --follow --gc` beside a
    `deck gc` loop): one deleted trainer full 0 while its deltas, held by the grace period,
    stayed, restorable through a merger full the other run retired. Every later run kept the
    deltas as built on a lost record (exit 1 for ever, "restore step 0 from a backup" of a
    record GC had deleted). GC leaves its marker in the folder of a parent it deletes under
    deltas that stay; a step broken only by such a parent is no damage: the rules delete it,
    then the marker goes."""
    storage = LocalStorage(tmp_path / "ck")
    tr = SynthTrainer(storage)
    tr.save("full")
    tr.save_deltas(4)
    parent = tr.saved[0].id
    tr.train()
    tr.save("full")  # step 5
    tr.train()
    tr.save()
    # Where the race leaves it: step 0 deleted by a GC run (its marker kept), 1..4 committed
    marker = tmp_path / "ck" / "step-000000000000" / parent / GC_DELETING
    (tmp_path / "ck" / "step-000000000000" / "manifest.json").unlink()
    shutil.rmtree(marker.parent)
    marker.parent.mkdir()
    marker.write_bytes(b"deck gc deletes this checkpoint\n")
    age_commits(storage, 7200)
    policy = RetentionPolicy(keep_all_steps=False, keep_last_fulls=1)
    rep = collect_garbage(storage, policy)
    assert not rep.kept and not rep.errors, (rep.kept, rep.errors)
    assert sorted(read_manifests(storage)) == [5, 6]
    collect_garbage(storage, policy)
    assert not marker.exists() and not marker.parent.exists()
