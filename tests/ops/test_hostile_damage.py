"""Damage never makes GC or the merger lose an intact step, nor hang them, and fallback covers
missing files (a hostile-storage review's findings 4-7; GC's report of what it failed to delete).

Real checkpoints in the exact on-disk format: the synthetic trainer (deck/testing/synth.py, 2
ranks, the real writer; a full at step 0 and a delta every 3 steps up to 12) and the real merger;
the last test is a real 2-rank TorchRec DMP run. The CLI runs as ``python -m deck.cli``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

import deck
from deck.demo import (
    ModelSpec,
    TrainState,
    build_model,
    capture_state,
    diff_states,
    train_with_checkpoints,
)
from deck.errors import CorruptCheckpointError
from deck.format.manifest import MANIFEST, Kind, step_dir
from deck.merge.policy import FullPolicy, MergeConfig
from deck.merge.worker import MergeWorker
from deck.ops.retention import RetentionPolicy, collect_garbage, plan_retention
from deck.read.catalog import quarantine, read_manifests
from deck.read.lineage import LineageNode, best_valid_chain, build_graph, chain_for
from deck.storage import LocalStorage
from deck.testing.dist_harness import run_ranks
from deck.testing.faulty_storage import FaultyStorage
from deck.testing.lineage_checks import check_all_restore
from deck.testing.synth import State, SynthTrainer, restore_state, same

STEPS = [0, 3, 6, 9, 12]
# A merger full of step 12 from the full and the four deltas (plus merged deltas, stride 2).
MERGE = MergeConfig(stride=2, full=FullPolicy(every=4, max_live_fraction=None))
MERGE_ARGS = ("--stride", "2", "--full-every", "4", "--full-live-fraction", "0")
NO_FULLS = MergeConfig(stride=2, full=FullPolicy(every=None, max_live_fraction=None))
NO_FULL_ARGS = ("--stride", "2", "--full-live-fraction", "0")


def _written(root: Path) -> dict[str, State]:
    """Steps 0-12 (a full, then a delta every 3 steps); the exact state saved under each id."""
    tr = SynthTrainer(LocalStorage(root))
    tr.save("full")
    for _ in range(4):
        tr.train(3, rows=40)
        tr.save()
    assert sorted(tr.saved) == STEPS
    return {s.id: s.state for s in tr.saved.values()}


def _deck(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deck.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def _flip(path: Path) -> bytes:
    """Flip one byte in the middle of ``path``; returns the original bytes."""
    data = path.read_bytes()
    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 0x5A
    path.write_bytes(bytes(damaged))
    return data


def _merger_full(root: Path) -> tuple[str, str]:
    """(folder, id) of the merger full that step 12's cheapest chain starts with."""
    chain = chain_for(read_manifests(LocalStorage(root)), 12)
    assert chain[0].is_merged and chain[0].kind is Kind.FULL, [m.folder for m in chain]
    return chain[0].folder, chain[0].id


def _order(n: LineageNode) -> tuple[int, int]:
    return (n.layer, n.step)


# ---- finding 4: an unreadable commit record is "unknown, keep" ---------------------------------


def test_unreadable_commit_record_keeps_the_steps_that_may_need_it(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    history = _written(root)
    record = root / step_dir(3) / MANIFEST
    original = _flip(record)
    before = _files(root)
    storage = LocalStorage(root)
    assert 3 in read_manifests(storage).damaged

    # Default GC, run when every record is older than the grace period.
    rep = collect_garbage(storage, RetentionPolicy(), now=time.time() + 7200)
    assert not rep.deleted and not rep.orphans and not rep.errors, rep
    kept = dict(rep.kept)
    assert f"{step_dir(3)}/" in kept and "unreadable" in kept[f"{step_dir(3)}/"]
    for step in (6, 9, 12):  # the later deltas may need step 3's record
        (why,) = [w for f, w in rep.kept if f.startswith(f"{step_dir(step)} ")]
        assert "may need step 3" in why and str(record.relative_to(root)) in why
    assert _files(root) == before

    # The CLI says so, and exits 1: someone has to look at the record.
    p = _deck("gc", str(root), "--grace", "0")
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"KEPT {step_dir(3)}/" in p.stdout and "may need step 3" in p.stdout, p.stdout
    assert "deleted 0 checkpoint(s) and 0 orphan(s)" in p.stdout, p.stdout
    assert _files(root) == before

    # Repairing one record brings every later step back, bitwise.
    record.write_bytes(original)
    assert check_all_restore(storage, history) == STEPS


def test_unreadable_record_in_bounded_retention_keeps_what_it_builds_on(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    history = _written(root)
    storage = LocalStorage(root)
    MergeWorker(storage, MERGE).run_once(wait_s=0)  # a merger full of step 12
    _merger_full(root)
    original = _flip(root / step_dir(9) / MANIFEST)
    bounded = RetentionPolicy(keep_all_steps=False, grace_s=0)
    rep = collect_garbage(storage, bounded)
    # Step 12 restores from the merger full: the window is step 12 alone, and steps 3 and 6
    # would go -- but step 9's unreadable record may build on them.
    assert rep.latest == 12 and not rep.errors, rep
    assert not [f for f, _ in rep.deleted if f.startswith("step-")], rep.deleted
    kept = {f.split()[0]: why for f, why in rep.kept}
    assert "unreadable" in kept[f"{step_dir(9)}/"]
    for step in (3, 6):
        assert "step 9, whose commit record is unreadable, may build on it" in kept[step_dir(step)]
    (root / step_dir(9) / MANIFEST).write_bytes(original)
    assert check_all_restore(storage, history) == STEPS


# ---- finding 5: a damaged replacement keeps what it replaces ------------------------------------


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped"])
def test_damaged_merger_full_keeps_the_deltas_it_replaces(tmp_path: Path, damage: str) -> None:
    root = tmp_path / "ck"
    history = _written(root)
    p = _deck("merge", str(root), "--once", *MERGE_ARGS)
    assert p.returncode == 0, p.stdout + p.stderr
    full, full_id = _merger_full(root)
    chunk = sorted((root / full).rglob("*.chunk"))[0]
    if damage == "missing":
        chunk.unlink()
    elif damage == "truncated":
        chunk.write_bytes(chunk.read_bytes()[:-1])
    else:
        _flip(chunk)
    # Checksums by default: a flipped byte too (an operator's break-it run: with sizes only,
    # this GC deleted the trainer full and every delta, and no step restored any more).
    p = _deck("gc", str(root), "--no-keep-all-steps", "--grace", "0")
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"KEPT {full}" in p.stdout and "what would replace it is damaged" in p.stdout, p.stdout
    storage = LocalStorage(root)
    manifests = read_manifests(storage)
    assert sorted(manifests) == STEPS  # every trainer checkpoint of the window is still there
    # Step 12 restores around the damaged full (what restore(allow_fallback=True) does).
    found = best_valid_chain(storage, 12)
    assert list(found.rejected) == [full_id]
    got, _ = restore_state(storage, found.chain)
    assert not same(got, history[found.chain[-1].id])
    # Once quarantined, GC deletes the damaged full and still keeps every step restorable.
    p = _deck("gc", str(root), "--no-keep-all-steps", "--grace", "0")
    assert p.returncode == 0 and "KEPT" not in p.stdout, p.stdout + p.stderr
    assert f"deleted {full}" in p.stdout, p.stdout
    assert 12 in check_all_restore(storage, history)


def test_a_quarantined_delta_keeps_the_steps_after_it_until_repaired_or_given_up(
    tmp_path: Path,
) -> None:
    """An operator's break-it run: one flipped byte in delta 6, found by the merger (which
    quarantined it), and its `deck merge --gc` deleted steps 6-12 for good, the newest included:
    a file restored from a backup could no longer repair anything. Now they stay (exit 1, each
    named) while the quarantine stands; repaired, every step restores again; given up
    (--drop-quarantined), they go."""
    root = tmp_path / "ck"
    history = _written(root)
    storage = LocalStorage(root)
    delta6 = read_manifests(storage)[6]
    chunk = sorted((root / delta6.folder).rglob("*.chunk"))[0]
    original = _flip(chunk)
    p = _deck("merge", str(root), "--once", "--gc", "--grace", "0", *NO_FULL_ARGS)
    assert p.returncode == 1, p.stdout + p.stderr
    assert delta6.id in read_manifests(storage).quarantined
    assert sorted(read_manifests(storage)) == STEPS  # nothing deleted
    p = _deck("gc", str(root), "--grace", "0")
    assert p.returncode == 1, p.stdout + p.stderr
    for step in (6, 9, 12):
        assert f"KEPT {step_dir(step)}" in p.stdout, p.stdout
    assert f"quarantine/{delta6.id}.json" in p.stdout and "--drop-quarantined" in p.stdout
    assert sorted(read_manifests(storage)) == STEPS
    assert check_all_restore(storage, history) == [0, 3]

    # Repaired: the file restored, its quarantine record deleted by hand.
    chunk.write_bytes(original)
    (root / "quarantine" / f"{delta6.id}.json").unlink()
    assert check_all_restore(storage, history) == STEPS
    p = _deck("gc", str(root), "--grace", "0")
    assert p.returncode == 0 and "KEPT" not in p.stdout, p.stdout + p.stderr

    # Given up: the quarantined delta and the steps only it restored go.
    _flip(chunk)
    quarantine(storage, delta6, "flipped again")
    p = _deck("gc", str(root), "--grace", "0", "--drop-quarantined")
    assert p.returncode == 0 and "KEPT" not in p.stdout, p.stdout + p.stderr
    assert sorted(read_manifests(storage)) == [0, 3]


def test_without_checksums_a_flipped_merger_full_is_not_seen(tmp_path: Path) -> None:
    """What --no-verify-replacements gives up (sizes only): the flipped full is trusted, what
    it replaces goes, and step 12 no longer restores."""
    root = tmp_path / "ck"
    _written(root)
    p = _deck("merge", str(root), "--once", *MERGE_ARGS)
    assert p.returncode == 0, p.stdout + p.stderr
    full, _ = _merger_full(root)
    _flip(sorted((root / full).rglob("*.chunk"))[0])
    p = _deck("gc", str(root), "--no-keep-all-steps", "--grace", "0", "--no-verify-replacements")
    assert p.returncode == 0 and "KEPT" not in p.stdout, p.stdout + p.stderr
    assert sorted(read_manifests(LocalStorage(root))) == [0, 12]


def test_without_damage_the_replaced_deltas_go(tmp_path: Path) -> None:
    # The control: the same GC on an intact merger full deletes the deltas it replaces.
    root = tmp_path / "ck"
    history = _written(root)
    p = _deck("merge", str(root), "--once", *MERGE_ARGS)
    assert p.returncode == 0, p.stdout + p.stderr
    p = _deck("gc", str(root), "--no-keep-all-steps", "--grace", "0")
    assert p.returncode == 0 and "KEPT" not in p.stdout, p.stdout + p.stderr
    storage = LocalStorage(root)
    assert sorted(read_manifests(storage)) == [0, 12]
    assert check_all_restore(storage, history) == [0, 12]


# ---- finding 6: the merger never loops on a damaged record ------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("which", ["full", "merged delta"])
def test_merge_once_returns_on_a_damaged_merger_record(tmp_path: Path, which: str) -> None:
    root = tmp_path / "ck"
    history = _written(root)
    # Without merger fulls for the merged delta: a newer full would make it unwanted.
    args, config = (MERGE_ARGS, MERGE) if which == "full" else (NO_FULL_ARGS, NO_FULLS)
    p = _deck("merge", str(root), "--once", *args)
    assert p.returncode == 0, p.stdout + p.stderr
    graph = build_graph(read_manifests(LocalStorage(root)))
    kind = Kind.FULL if which == "full" else Kind.MERGED
    # The top one: nothing committed consumes it, so the merger still wants it.
    top = max((n for n in graph.nodes.values() if n.merged and n.kind is kind), key=_order)
    folder = top.folder
    _flip(root / folder / MANIFEST)

    p = _deck("merge", str(root), "--once", *args, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stderr.count("commit record is unreadable") == 1, p.stderr  # logged once
    assert folder.split("/")[1] in p.stderr and "some work is left" in p.stdout, p.stderr
    assert (root / folder / MANIFEST).exists()  # not rebuilt over: a person decides

    # In process: the pass reports the item failed, never progress.
    worker = MergeWorker(LocalStorage(root), config)
    stats, left = worker.run_once(wait_s=0)
    assert left and stats.failed and not worker.run_pass().progressed
    # GC keeps the folder and says so; every step still restores (from the trainer's deltas).
    p = _deck("gc", str(root), "--grace", "0")
    assert p.returncode == 1 and f"KEPT {folder}/" in p.stdout, p.stdout + p.stderr
    assert check_all_restore(LocalStorage(root), history) == STEPS


def test_merge_once_exits_1_on_a_damaged_trainer_record(tmp_path: Path) -> None:
    """A break-it finding: with a trainer delta's commit record truncated, `deck merge --once`
    merged nothing past it and exited 0 ("0 committed"). Now exit 1, the record named."""
    root = tmp_path / "ck"
    _written(root)
    record = root / step_dir(9) / MANIFEST
    record.write_bytes(record.read_bytes()[:20])
    p = _deck("merge", str(root), "--once", *NO_FULL_ARGS)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "deck merge: the commit record(s) of step(s) [9]" in p.stderr, p.stderr


# ---- GC's orphan and finish paths record their errors ----------------------------------------


def test_gc_orphan_and_quarantine_delete_errors_are_in_the_report(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    history = _written(root)
    storage = LocalStorage(root)
    MergeWorker(storage, NO_FULLS).run_once(wait_s=0)
    # A merged delta GC deletes anyway, quarantined: its record goes on the orphan and finish paths.
    manifests = read_manifests(storage)
    policy = RetentionPolicy(grace_s=0)
    doomed = [i for i in plan_retention(manifests, policy).delete if i in manifests.merged]
    assert doomed
    quarantine(storage, manifests.merged[doomed[0]], "test")
    # And an orphan attempt folder of a crashed save of step 3.
    (root / step_dir(3) / "0123456789abcdef").mkdir()
    (root / step_dir(3) / "0123456789abcdef" / "rank-00000.json").write_bytes(b"{}")

    faulty = FaultyStorage(
        storage, fail_delete=lambda key: "quarantine/" in key or "0123456789abcdef" in key
    )
    rep = collect_garbage(faulty, policy)
    errors = "\n".join(rep.errors)
    assert f"quarantine/{doomed[0]}.json" in errors and "0123456789abcdef" in errors, errors
    assert "injected failure of delete" in errors
    assert any(manifests.merged[i].folder == f for i in doomed for f, _ in rep.deleted)
    assert check_all_restore(storage, history) == STEPS
    # A rerun without the faults finishes the job.
    cli = _deck("gc", str(root), "--grace", "0")
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert not (root / step_dir(3) / "0123456789abcdef").exists()


# ---- finding 7: a missing file is damage, and fallback goes around it ---------------------------


def test_missing_chunk_is_a_corrupt_checkpoint_naming_the_file(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _written(root)
    storage = LocalStorage(root)
    chain = chain_for(read_manifests(storage), 12)
    chunk = sorted((root / step_dir(6)).rglob("*.chunk"))[0]
    chunk.unlink()
    with pytest.raises(CorruptCheckpointError, match=chunk.name) as info:
        restore_state(storage, chain)
    assert "step 6" in str(info.value) and "missing" in str(info.value)


def _restore_job(rank: int, world_size: int, root: str) -> None:
    spec = ModelSpec(num_tables=2, rows=1000, dim=8, batch=32)
    uri = f"{root}/ck"
    config = deck.DeckConfig(uri=uri, delta_every_steps=3, lease_ttl_s=None)
    model, opt = build_model(spec)
    user = TrainState()
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
        live = train_with_checkpoints(ck, model, opt, spec, user, 12)
    chunk = sorted((Path(uri) / step_dir(9)).rglob("*.chunk"))[0]
    if rank == 0:
        chunk.unlink()
    dist.barrier()

    def restore(**kw: bool) -> tuple[int | None, object, object]:
        model, opt = build_model(spec, seed=99)
        user = TrainState()
        with deck.DeltaCheckpointer(model, [opt], config, state=user) as ck:
            got = ck.restore(None, **kw)
            return got, ck.last_restore, capture_state(model, opt, user)

    with pytest.raises(CorruptCheckpointError) as info:  # not a NotFoundError
        restore()
    assert chunk.name in str(info.value) or "restore from" in str(info.value), str(info.value)
    got, stats, state = restore(allow_fallback=True)
    assert got == 6, got  # steps 12 and 9 need the lost chunk
    assert stats.fallback and "instead of step 12" in stats.fallback, stats.fallback
    if rank == 0:
        assert chunk.name in stats.fallback, stats.fallback
    assert not diff_states(live[6], state)


@pytest.mark.slow
def test_restore_with_fallback_goes_around_a_missing_chunk(tmp_path: Path) -> None:
    run_ranks(_restore_job, str(tmp_path))
