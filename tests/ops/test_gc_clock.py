"""GC and time: every age on the store's clock, never this host's nor a writer's; a host whose
clock is off beyond the bound is refused; what GC deletes as no record's is checked again right
before it goes. Synthetic checkpoints in the exact on-disk format (deck/testing/synth.py) at a
local store and an in-memory fsspec one; hosts' clocks are moved with ``local_clock`` (what
``time.time()`` would say on a host whose clock is off), the store's with ``set_store_time``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from deck.errors import ClockSkewError
from deck.format.manifest import MANIFEST, merged_dir
from deck.ops.retention import RetentionPolicy, collect_garbage
from deck.ops.retention.clock import CLOCK_DIR
from deck.read.catalog import read_manifests
from deck.storage import FsspecStorage, LocalStorage, Storage
from deck.storage.wrapper import StorageWrapper
from deck.testing.lineage_checks import age_commits, check_all_restore, mem, set_store_time
from deck.testing.s3_server import SeaweedS3
from deck.testing.synth import State, SynthTrainer, snapshot

HOURS_2 = 7200.0
RECORD_10 = f"step-000000000010/{MANIFEST}"
BOUNDED = RetentionPolicy(keep_last_fulls=1, keep_all_steps=False, grace_s=3600)


def _clock(offset_s: float) -> Callable[[], float]:
    return lambda: time.time() + offset_s


def _store(kind: str, tmp_path: Path) -> Storage:
    return LocalStorage(str(tmp_path / "uri")) if kind == "local" else mem()


def _history(
    storage: Storage, *, fulls_every: int = 4, steps: int = 12
) -> tuple[SynthTrainer, dict[str, State]]:
    """A trainer's timeline: a full every ``fulls_every`` steps, deltas between."""
    tr = SynthTrainer(storage)
    history: dict[str, State] = {}
    m = tr.save("full")
    history[m.id] = snapshot(tr.shards)
    for step in range(1, steps + 1):
        tr.train()
        m = tr.save("full" if step % fulls_every == 0 else "delta")
        history[m.id] = snapshot(tr.shards)
    return tr, history


def _resave_in_progress(
    storage: Storage, tr: SynthTrainer, history: dict[str, State]
) -> tuple[str, bytes]:
    """A trainer rolled back to step 8 and is saving step 10 again: its files are written, its
    commit record not yet (the old timeline's step 10 stays committed). Returns its folder and
    the record it will commit."""
    old = storage.get(RECORD_10)
    tr.rollback(8)
    for _ in range(2):
        tr.train()
        m = tr.save()
        history[m.id] = snapshot(tr.shards)
    record = storage.get(RECORD_10)
    storage.put(RECORD_10, old)  # not committed yet
    return f"step-000000000010/{m.id}/", record


def _files(storage: Storage) -> list[str]:
    return storage.list("")


@pytest.mark.parametrize("kind", ["local", "memory"])
@pytest.mark.parametrize("offset", [HOURS_2, -HOURS_2])
def test_a_host_clock_off_by_hours_is_refused_and_nothing_is_deleted(
    kind: str, offset: float, tmp_path: Path
) -> None:
    storage = _store(kind, tmp_path)
    _, history = _history(storage)
    age_commits(storage, 3 * 3600)  # everything old enough to go, on the store's clock
    before = _files(storage)
    way = "ahead of" if offset > 0 else "behind"
    with pytest.raises(ClockSkewError, match=rf"7\d\d\d s {way} the clock of .*max-clock-skew"):
        collect_garbage(storage, BOUNDED, local_clock=_clock(offset))
    with pytest.raises(ClockSkewError):
        collect_garbage(storage, BOUNDED, dry_run=True, local_clock=_clock(offset))
    assert _files(storage) == before  # nothing deleted, no marker left
    check_all_restore(storage, history)
    # Within the bound the same run deletes (the store says it is old enough).
    rep = collect_garbage(storage, BOUNDED, local_clock=_clock(offset / 10))
    assert rep.deleted and rep.clock_skew_s is not None and abs(rep.clock_skew_s - offset / 10) < 5
    assert not storage.list(f"{CLOCK_DIR}/")


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_a_clock_hours_ahead_deletes_nothing_the_store_says_is_young(
    kind: str, tmp_path: Path
) -> None:
    """The finding: GC with its clock 2 h ahead found every grace period empty and deleted a
    re-save in progress as "uncommitted checkpoint older than a committed later step", and
    checkpoints restores were reading. Allowed to run with that clock, it ages on the store's."""
    storage = _store(kind, tmp_path)
    tr, history = _history(storage)
    resave, _ = _resave_in_progress(storage, tr, history)
    before = _files(storage)
    policy = BOUNDED.model_copy(update={"max_clock_skew_s": None})
    rep = collect_garbage(storage, policy, local_clock=_clock(HOURS_2))
    assert not rep.deleted and not rep.orphans and not rep.errors, rep
    assert rep.grace_held and rep.grace_held_orphans
    assert _files(storage) == before
    assert storage.list(resave)
    check_all_restore(storage, history)
    # What the old code did: its own clock as "now" (the same as the store 2 h later).
    old = collect_garbage(storage, policy, now=time.time() + HOURS_2, dry_run=True)
    assert old.deleted and any(p == resave for p, _ in old.orphans)


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_a_clock_hours_behind_reclaims_once_the_store_says_so(kind: str, tmp_path: Path) -> None:
    """The finding: with the clock 2 h behind every age was negative and nothing was ever
    reclaimed. Ages on the store's clock: what is old there goes."""
    storage = _store(kind, tmp_path)
    tr, history = _history(storage)
    resave, _ = _resave_in_progress(storage, tr, history)
    policy = BOUNDED.model_copy(update={"max_clock_skew_s": None})
    slow = _clock(-HOURS_2)
    assert not collect_garbage(storage, policy, local_clock=slow).deleted  # young: kept
    age_commits(storage, 2 * 3600)
    for key in storage.list(resave):
        set_store_time(storage, key, time.time() - 2 * 3600)  # an abandoned save, 2 h old
    rep = collect_garbage(storage, policy, local_clock=slow)
    assert rep.deleted and not rep.errors
    assert any(p == resave for p, _ in rep.orphans) and not storage.list(resave)
    manifests = read_manifests(storage)
    assert max(manifests) == 12
    check_all_restore(storage, history)


class _AfterFirstRelisting(StorageWrapper):
    """Runs ``act`` once, when GC lists the folder ``target`` again right before deleting it as
    an orphan (the moment after its plan): what a trainer or merger does during the run."""

    def __init__(
        self, inner: Storage, target: str, act: Callable[[Storage, str], None], *, before: bool
    ):
        super().__init__(inner)
        self.target, self.act, self.before, self.fired = target, act, before, False

    def list_modified(self, prefix: str = "") -> list[tuple[str, float | None]]:
        fire = prefix == self.target and not self.fired
        if fire and self.before:
            self.fired = True
            self.act(self.inner, prefix)
        out = self.inner.list_modified(prefix)
        if fire and not self.before:
            self.fired = True
            self.act(self.inner, prefix)
        return out


def test_an_attempt_committed_during_the_run_is_kept() -> None:
    """A re-save GC planned as "attempt folder no record references" commits after the plan:
    GC reads the step's record again before deleting and keeps it."""
    storage = mem()
    tr, history = _history(storage)
    resave, record = _resave_in_progress(storage, tr, history)

    def commit(inner: Storage, prefix: str) -> None:
        inner.put(RECORD_10, record)

    # No grace period at all: only the second look keeps it.
    racing = _AfterFirstRelisting(storage, resave, commit, before=False)
    rep = collect_garbage(racing, RetentionPolicy(grace_s=0))
    assert racing.fired
    assert (resave, "committed during this run") in rep.busy, rep.busy
    assert storage.list(resave)
    assert read_manifests(storage)[10].id == resave.split("/")[1]
    check_all_restore(storage, history)


def test_an_uncommitted_merger_folder_committed_during_the_run_is_kept() -> None:
    storage = mem()
    _history(storage)
    folder = merged_dir("ab" * 8, 2, layer=1, first_step=1) + "/"
    storage.put(f"{folder}rank-0.part", b"x")

    def commit(inner: Storage, prefix: str) -> None:
        inner.put(f"{folder}{MANIFEST}", b"{}")  # its record landed (read or not, it is there)

    racing = _AfterFirstRelisting(storage, folder, commit, before=False)
    rep = collect_garbage(racing, RetentionPolicy(grace_s=0))
    assert racing.fired
    assert (folder, "committed during this run") in rep.busy, rep.busy
    assert storage.exists(f"{folder}rank-0.part")


def test_an_orphan_written_to_during_the_run_is_kept() -> None:
    """A folder that changes between GC's plan and its deletion has a writer at work."""
    storage = mem()
    tr, history = _history(storage)
    resave, _ = _resave_in_progress(storage, tr, history)

    def write(inner: Storage, prefix: str) -> None:
        inner.put(f"{prefix}rank-1.new", b"y")

    racing = _AfterFirstRelisting(storage, resave, write, before=True)
    rep = collect_garbage(racing, RetentionPolicy(grace_s=0))
    assert racing.fired
    assert (resave, "written to during this run") in rep.busy, rep.busy
    assert storage.exists(f"{resave}rank-1.new")
    check_all_restore(storage, history)


def _faked_gc(uri: str, offset: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``deck gc`` in a process whose clock is off by ``offset`` (libfaketime's FAKETIME, e.g.
    "+2h"): the real finding's setup, file times left alone (they are the store's)."""
    import libfaketime

    lib = Path(libfaketime.__file__).parent / "vendor/libfaketime/src/libfaketime.so.1"
    env = {**os.environ, "LD_PRELOAD": str(lib), "FAKETIME": offset, "NO_FAKE_STAT": "1"}
    exe = Path(sys.executable).with_name("deck")
    return subprocess.run(
        [str(exe), "gc", uri, *args], capture_output=True, text=True, timeout=300, env=env
    )


def test_deck_gc_on_a_host_two_hours_off(tmp_path: Path) -> None:
    """The command itself, its process's clock moved by libfaketime: refused by default at
    +2 h and -2 h; allowed, it deletes nothing young at +2 h, and reclaims at -2 h what the
    store says is old."""
    storage = LocalStorage(str(tmp_path / "uri"))
    tr, history = _history(storage)
    resave, _ = _resave_in_progress(storage, tr, history)
    bounded = ["--no-keep-all-steps", "--keep-last-fulls", "1"]
    before = _files(storage)
    for offset, way in (("+2h", "ahead of"), ("-2h", "behind")):
        r = _faked_gc(storage.uri, offset, *bounded)
        assert r.returncode == 2, r.stdout + r.stderr
        assert re.search(rf"deck gc: this host's clock is 7\d\d\d s {way}", r.stderr), r.stderr
    assert _files(storage) == before
    r = _faked_gc(storage.uri, "+2h", *bounded, "--max-clock-skew", "-1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "deleted 0 checkpoint(s) and 0 orphan(s)" in r.stdout, r.stdout
    assert "this host's clock is +7" in r.stdout, r.stdout
    assert _files(storage) == before
    age_commits(storage, 2 * 3600)
    for key in storage.list(resave):
        set_store_time(storage, key, time.time() - 2 * 3600)
    r = _faked_gc(storage.uri, "-2h", *bounded, "--max-clock-skew", "-1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"deleted {resave}" in r.stdout and not storage.list(resave), r.stdout
    assert re.search(r"deleted [1-9]\d* checkpoint", r.stdout), r.stdout
    check_all_restore(storage, history)


def test_the_skew_to_an_s3_store_is_measured_on_its_clock(
    s3_server: SeaweedS3, s3_uri: str
) -> None:
    """SeaweedFS stamps LastModified to the second: the skew is measured within the bound's
    allowance, and a host 2 h off is refused there too."""
    storage = FsspecStorage(s3_uri, s3_server.storage_options)
    _history(storage, steps=3)
    rep = collect_garbage(storage, RetentionPolicy(), dry_run=True)
    assert rep.clock_skew_s is not None and abs(rep.clock_skew_s) < 3, rep.clock_skew_s
    with pytest.raises(ClockSkewError, match=r"7\d\d\d s ahead of"):
        collect_garbage(storage, RetentionPolicy(), local_clock=_clock(HOURS_2))
    assert not storage.list(f"{CLOCK_DIR}/")


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_markers_a_crash_left_are_removed_once_old(kind: str, tmp_path: Path) -> None:
    """A lease taker or GC killed between writing its clock marker and deleting it leaves the
    marker; GC removes those older than the grace period (on the store's clock), not young ones
    (another reader may be reading its own right now)."""
    storage = _store(kind, tmp_path)
    _history(storage, steps=2)
    old, young = f"{CLOCK_DIR}/clock-dead", f"{CLOCK_DIR}/clock-busy"
    for key in (old, young):
        storage.put(key, b"deck clock marker\n")
    set_store_time(storage, old, time.time() - 2 * 3600)
    collect_garbage(storage, RetentionPolicy(grace_s=3600))
    assert storage.list(f"{CLOCK_DIR}/") == [young]
