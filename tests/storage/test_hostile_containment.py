"""A URI written by someone else never makes deck touch anything outside it, block, or fail
without a typed error (the hostile-storage review's findings 1-3 "outside the URI", 10 "file types and sizes", and
the lease values of 12).

Real checkpoints in the exact on-disk format: the synthetic trainer (deck/testing/synth.py, 2
ranks, the real writer; a full at step 0 and a delta every 3 steps up to 12), then the URI is
edited the way a careless colleague, a compromised job or a damaged disk could. The CLI runs as
``python -m deck.cli``; restores go through the library. The restart of finding 2 and the
trainer's save into a linked step folder run a real 2-rank TorchRec trainer (local tier: the
URI is its own spool). Every case is bounded by pytest-timeout's per-test marker.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import deck
from deck.demo import (
    ModelSpec,
    TrainState,
    build_model,
    capture_state,
    diff_states,
    train_step,
    train_with_checkpoints,
)
from deck.errors import CorruptCheckpointError, DeckError, StorageError, UnsafePathError
from deck.format.manifest import MANIFEST, QUARANTINE_ROOT, step_dir
from deck.read.catalog import read_manifests, read_rank_manifests
from deck.storage import FsspecStorage, LocalStorage
from deck.testing.dist_harness import run_ranks
from deck.testing.synth import Saved, SynthTrainer, restore_step, same
from deck.trainer.lease import Lease, lease_key

STEPS = [0, 3, 6, 9, 12]
GIB2 = 2 * 2**30


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Saved]]:
    """Steps 0-12 (a full, then a delta every 3 steps) and what each saved."""
    root = tmp_path_factory.mktemp("hostile") / "ck"
    tr = SynthTrainer(LocalStorage(root))
    tr.save("full")
    for _ in range(4):
        tr.train(3, rows=40)
        tr.save()
    assert sorted(tr.saved) == STEPS
    return root, tr.saved


@pytest.fixture
def ck(written: tuple[Path, dict[int, Saved]], tmp_path: Path) -> Path:
    """A fresh copy of the checkpoint, with an ``outside`` folder beside it (not in the URI)."""
    root = tmp_path / "ck"
    shutil.copytree(written[0], root, symlinks=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "keep.bin").write_bytes(b"not deck's")
    return root


def _deck(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deck.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file below ``folder`` (not following links) with its bytes."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def _refused(p: subprocess.CompletedProcess[str], *names: str) -> None:
    """A deck command that met hostile input: a typed refusal (exit 1 or 2) naming what, never
    a Python crash."""
    out = p.stdout + p.stderr
    assert p.returncode in (1, 2), out
    assert "Traceback" not in out and "MemoryError" not in out, out
    for name in names:
        assert name in out, (name, out)


def _restores(root: Path, saved: dict[int, Saved], steps: list[int]) -> None:
    storage = LocalStorage(root)
    for step in steps:
        state, user = restore_step(storage, step)
        assert same(state, saved[step].state) == [] and user == step, step


def _attempt(root: Path, step: int) -> Path:
    (attempt,) = [p for p in (root / step_dir(step)).iterdir() if p.is_dir()]
    return attempt


# ---- findings 1 and 3: links below the root ---------------------------------------------------


@pytest.mark.timeout(120)
def test_gc_never_deletes_through_a_linked_attempt_folder(
    ck: Path, written: tuple[Path, dict[int, Saved]], tmp_path: Path
) -> None:
    """Finding 1: the attempt folder of a step GC deletes is a link to a folder elsewhere (here:
    a copy of its files, and a file of someone else). GC removes the link, nothing it points to."""
    outside = tmp_path / "outside"
    # A second full at step 15: with the bounded policy, steps 0-12 are not retained.
    tr = SynthTrainer(LocalStorage(ck))
    tr.step = 15
    tr.save("full")
    attempt = _attempt(ck, 3)
    shutil.copytree(attempt, outside / attempt.name)
    shutil.rmtree(attempt)
    attempt.symlink_to(outside / attempt.name, target_is_directory=True)
    before = _tree(outside)
    p = _deck("gc", str(ck), "--no-keep-all-steps", "--keep-last-fulls", "1", "--grace", "0")
    assert p.returncode == 0, p.stdout + p.stderr
    assert _tree(outside) == before  # nothing outside the URI was deleted
    assert not os.path.lexists(attempt)  # the link itself went with its step
    assert sorted(read_manifests(LocalStorage(ck))) == [15]


@pytest.mark.timeout(120)
def test_a_linked_step_folder_is_invisible_and_never_written_through(
    ck: Path, written: tuple[Path, dict[int, Saved]], tmp_path: Path
) -> None:
    """A ``step-N/`` that is a link: readers do not see it (the other steps restore), GC does
    not enter it, and a save of that step is refused naming the link, writing nothing there.
    Each command says it left the link out (a break-it finding: not a word)."""
    outside = tmp_path / "outside"
    linked = ck / step_dir(12)
    shutil.copytree(linked, outside / "s12")
    shutil.rmtree(linked)
    linked.symlink_to(outside / "s12", target_is_directory=True)
    before = _tree(outside)
    assert sorted(read_manifests(LocalStorage(ck))) == STEPS[:-1]
    _restores(ck, written[1], [9])
    said = f"{linked} is a symbolic link: deck never follows links below its root"
    for cmd in (("gc", str(ck), "--grace", "0"), ("verify", str(ck), "--all"), ("ls", str(ck))):
        p = _deck(*cmd)
        assert p.returncode == 0, p.stdout + p.stderr
        assert p.stderr.count(said) == 1, p.stderr
    tr = SynthTrainer(LocalStorage(ck))
    tr.step = 12
    with pytest.raises(UnsafePathError, match=f"{step_dir(12)} is a symbolic link"):
        tr.save("full")
    assert _tree(outside) == before


@pytest.mark.timeout(180)
def test_merge_never_writes_through_a_linked_merged_folder(ck: Path, tmp_path: Path) -> None:
    """Finding 3: ``merged/`` is a link elsewhere: ``deck merge --once`` returns, refusing to
    write through it (naming it), and writes nothing there."""
    outside = tmp_path / "outside"
    (ck / "merged").symlink_to(outside, target_is_directory=True)
    before = _tree(outside)
    p = _deck(
        "merge", str(ck), "--once", "--stride", "2", "--full-every", "4",
        "--full-live-fraction", "0",
    )  # fmt: skip
    out = p.stdout + p.stderr
    assert "Traceback" not in out, out
    assert p.returncode != 0 and "merged" in out and "symbolic link" in out, out
    assert _tree(outside) == before


@pytest.mark.timeout(120)
def test_verify_never_writes_its_record_through_a_linked_quarantine(
    ck: Path, tmp_path: Path
) -> None:
    """Finding 3: ``quarantine/`` is a link elsewhere and a checkpoint is damaged: ``deck verify
    --quarantine`` reports the damage and refuses to write the record there (exit 2, naming
    the link)."""
    outside = tmp_path / "outside"
    (ck / QUARANTINE_ROOT).symlink_to(outside, target_is_directory=True)
    chunk = sorted(_attempt(ck, 6).rglob("*.chunk"))[0]
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x5A
    chunk.write_bytes(bytes(data))
    before = _tree(outside)
    p = _deck("verify", str(ck), "--all", "--quarantine")
    _refused(p, QUARANTINE_ROOT, "symbolic link")
    assert _tree(outside) == before


@pytest.mark.timeout(120)
def test_reads_never_follow_a_linked_file(
    ck: Path, written: tuple[Path, dict[int, Saved]], tmp_path: Path
) -> None:
    """A chunk file that is a link to a file elsewhere (even one with the right bytes) is
    refused as damage naming it: restore raises, ``allow_fallback``-style readers see a
    :class:`CorruptCheckpointError`, verify fails; the other steps restore."""
    outside = tmp_path / "outside"
    chunk = sorted(_attempt(ck, 12).rglob("*.chunk"))[0]
    shutil.copy(chunk, outside / "copy.chunk")
    chunk.unlink()
    chunk.symlink_to(outside / "copy.chunk")
    with pytest.raises(CorruptCheckpointError, match="symbolic link") as info:
        restore_step(LocalStorage(ck), 12)
    assert isinstance(info.value, UnsafePathError) and chunk.name in str(info.value)
    _refused(_deck("verify", str(ck), "--step", "12"), chunk.name)
    _restores(ck, written[1], [9])


@pytest.mark.timeout(30)
def test_object_names_that_could_leave_the_root_are_never_listed() -> None:
    """Object stores take any name: one with ``..``, ``.`` or empty components (planted by
    another client) is neither listed nor reachable, so GC never acts on it. (SeaweedFS refuses
    such names itself; memory:// keeps them.)"""
    store = FsspecStorage(f"memory://deck-hostile-{uuid.uuid4().hex}/run")
    store.put("step-000000000001/manifest.json", b"{}")
    root = store.fs._strip_protocol(store.uri)
    for name in ("step-000000000001/../../victim", "a//b", "./c", "d/./e"):
        store.fs.pipe_file(f"{root}/{name}", b"x")
    assert store.list() == store.list("") == ["step-000000000001/manifest.json"]
    assert store.list("step-000000000001/") == ["step-000000000001/manifest.json"]
    store.delete_prefix("")
    assert store.list() == [] and len(store.fs.find(root)) == 4


# ---- finding 10: file types and sizes --------------------------------------------------------


def _plant(path: Path, what: str) -> None:
    """Replace the file at ``path`` by a FIFO, a link to /dev/zero or a 2 GiB sparse file."""
    path.unlink()
    if what == "fifo":
        os.mkfifo(path)
    elif what == "devzero":
        path.symlink_to("/dev/zero")
    else:
        with open(path, "wb") as f:
            f.truncate(GIB2)


def _victim(root: Path, which: str) -> Path:
    """The file of step 12 (or the lease) that a case replaces."""
    attempt = _attempt(root, 12)
    if which == "manifest":
        return root / step_dir(12) / MANIFEST
    if which == "rank_manifest":
        return attempt / "rank-00001.json"
    if which == "extra":
        return attempt / "rank-00000" / "extra.safetensors"
    return sorted(attempt.rglob("*.chunk"))[0]


KINDS = ["fifo", "devzero", "sparse"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", KINDS)
@pytest.mark.parametrize("which", ["manifest", "rank_manifest", "extra", "chunk"])
def test_special_and_huge_files_are_refused_fast(
    ck: Path, written: tuple[Path, dict[int, Saved]], which: str, what: str
) -> None:
    """Finding 10: a FIFO, a link to /dev/zero or a 2 GiB sparse file in place of a manifest,
    rank manifest, extra state or chunk: restore raises a :class:`DeckError` naming it at once
    (no hang, no 2 GiB read, no MemoryError), ``deck ls`` and ``deck verify`` return, and the
    intact steps still restore."""
    victim = _victim(ck, which)
    assert victim.exists()
    _plant(victim, what)
    storage = LocalStorage(ck)
    t0 = time.monotonic()
    if which == "manifest":
        manifests = read_manifests(storage)  # the record is damage: listed, not fatal
        assert sorted(manifests) == STEPS[:-1] and victim.name in manifests.damaged[12]
        p = _deck("verify", str(ck))
        _refused(p, str(victim))
    else:
        with pytest.raises(DeckError) as info:
            restore_step(storage, 12)
        assert victim.name in str(info.value), str(info.value)
        assert isinstance(info.value, CorruptCheckpointError), repr(info.value)
        _refused(_deck("verify", str(ck), "--step", "12"), victim.name)
    p = _deck("ls", str(ck))
    # A commit record that cannot be read (a huge, sparse or special file) is listed as
    # damaged (exit 1), never as a pending checkpoint; a damaged data file is for verify
    assert p.returncode == (1 if which == "manifest" else 0), p.stdout + p.stderr
    assert (" damaged " in p.stdout) == (which == "manifest"), p.stdout
    assert "Traceback" not in p.stderr, p.stderr
    assert time.monotonic() - t0 < 60  # bounded: nothing read 2 GiB or waited on the FIFO
    _restores(ck, written[1], [9])


@pytest.mark.timeout(60)
def test_rank_manifest_larger_than_its_record_is_not_read(ck: Path) -> None:
    """A rank manifest replaced by a 2 GiB sparse file: reading it stops one byte past the
    size its commit record gives."""
    storage = LocalStorage(ck)
    m = read_manifests(storage)[12]
    _plant(_attempt(ck, 12) / "rank-00000.json", "sparse")
    with pytest.raises(CorruptCheckpointError, match="rank 0 part of step 12 fails"):
        read_rank_manifests(storage, m)


# ---- finding 12 (lease values) and finding 10 (lease file) ------------------------------------

DAMAGED_LEASES = {
    "nan": '{"owner": "x", "host": "%s", "pid": 1, "expires_unix": NaN}',
    "inf": '{"owner": "x", "host": "%s", "pid": 1, "expires_unix": Infinity}',
    "negative": '{"owner": "x", "host": "%s", "pid": 1, "expires_unix": -5}',
    "pid_2_70": '{"owner": "x", "host": "%s", "pid": 1180591620717411303424, "expires_unix": 1e10}',
    "pid_negative": '{"owner": "x", "host": "%s", "pid": -1, "expires_unix": 1e10}',
    "truncated": '{"owner": "x", "host": "%s", "pid',
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", [*DAMAGED_LEASES, *KINDS])
def test_damaged_lease_is_taken_over_not_waited_on(
    tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding 12: a lease whose expiry is NaN, infinite or negative, or whose pid no process
    can have (2^70, -1), and finding 10: a lease that is a FIFO, a link to /dev/zero or a 2 GiB
    sparse file, is a damaged record: logged and taken over at once (the put replaces the
    entry, never writes through it), never an endless wait or an OverflowError."""
    import socket

    storage = LocalStorage(tmp_path / "ck")
    storage.put("x", b"")
    path = tmp_path / "ck" / lease_key(1)
    path.parent.mkdir()
    if case in DAMAGED_LEASES:
        path.write_text(DAMAGED_LEASES[case] % socket.gethostname())
    else:
        path.write_bytes(b"")
        _plant(path, case)
    lease = Lease(storage, ttl_s=60, settle_s=0.0, wait_s=3600)
    with caplog.at_level(logging.WARNING, logger="deck.trainer.lease"):
        assert lease.read() is None
        lease.acquire()
    try:
        said = [r.getMessage() for r in caplog.records if "damaged lease" in r.getMessage()]
        # one line naming the record (a break-it finding: pydantic's text of several lines)
        assert said and all("\n" not in m and lease_key(1) in m for m in said), said
        held = lease.read()
        assert held is not None and held.owner == lease.owner
        assert lease.epoch == 2  # the next epoch's record: the damaged one is never written
        if case == "devzero":
            assert path.is_symlink()
    finally:
        lease.release()


# ---- finding 2 (forged pending records) and 3 (a trainer's save): a real 2-rank trainer --------


def _forge(uri: Path, outside: Path, id6: str) -> list[Path]:
    """Pending records of step 9 (never committed) that name files outside their attempt
    folder: absolute, ``../``, another attempt's, and one behind a link. Returns the planted
    record files."""
    victims = {
        "abs": outside / "victim_abs",
        "rel": outside / "victim_rel",
        "linked": outside / "linked" / "t" / "c.chunk",
    }
    for v in victims.values():
        v.parent.mkdir(parents=True, exist_ok=True)
        v.write_bytes(b"someone else's")
    step9 = uri / step_dir(9)
    base = {
        "uri": str(uri),
        "step": 9,
        "rank": 0,
        "world_size": 2,
        "kind": "delta",
        "parent": 6,
        "parent_id": id6,
        "base": 0,
        "epoch": 0,
    }
    forged = {
        "a" * 16: [str(victims["abs"]), "../../outside/victim_rel"],
        "b" * 16: [f"{id6}/rank-00000/extra.safetensors"],  # a committed step's file
        "c" * 16: [f"{'c' * 16}/rank-00000/t/c.chunk"],  # its own, but rank-00000 is a link
    }
    records = []
    for ckpt_id, files in forged.items():
        folder = step9 / ckpt_id
        folder.mkdir(parents=True)
        record = folder / "rank-00000.pending.json"
        record.write_text(json.dumps({**base, "ckpt_id": ckpt_id, "files": files}))
        records.append(record)
    (step9 / ("c" * 16) / "rank-00000").symlink_to(outside / "linked")
    # The ../ file really resolves to the outside folder from the step folder.
    assert (step9 / "../../outside/victim_rel").resolve() == victims["rel"].resolve()
    return records


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _trainer_job(rank: int, world_size: int, root: str) -> None:
    spec = ModelSpec(num_tables=2, rows=1000, dim=8, batch=32)
    uri = Path(root) / "ck"
    outside = Path(root) / "outside"
    config = deck.DeckConfig(uri=str(uri), delta_every_steps=3, lease_ttl_s=None)
    model, opt = build_model(spec)
    user = TrainState()
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ckpt:
        live = train_with_checkpoints(ckpt, model, opt, spec, user, 6)
    id6 = read_manifests(LocalStorage(uri))[6].id
    if rank == 0:
        outside.mkdir()
        records = _forge(uri, outside, id6)
    dist.barrier()
    before = _tree(outside)

    # Finding 2: the restart (enable, then restore) finds the forged records, refuses them, and
    # deletes nothing outside their attempt folders; the committed steps restore bitwise.
    seen = _Collect()
    logging.getLogger("deck").addHandler(seen)
    model, opt = build_model(spec, seed=99)
    user = TrainState()
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ckpt:
        assert ckpt.restore() == 6
        assert not diff_states(live[6], capture_state(model, opt, user))
        dist.barrier()
        assert _tree(outside) == before
        if rank == 0:
            refused = [m for m in seen.messages if "pending record" in m]
            for record in records[:2]:  # invalid: refused when read
                assert any(str(record.name) in m and record.parent.name in m for m in refused), (
                    record,
                    seen.messages,
                )
            # valid, but its file is behind a link: the delete is refused
            assert any("not deleting" in m and "symbolic link" in m for m in seen.messages)
        # Finding 3: the next step's folder is a link elsewhere: the trainer's save of it is
        # refused (nothing written there); training and the next checkpoint go on.
        if rank == 0:
            shutil.rmtree(uri / step_dir(9))
            (uri / step_dir(9)).symlink_to(outside, target_is_directory=True)
        dist.barrier()
        before = _tree(outside)
        for step in range(7, 13):
            train_step(model, opt, spec, step)
            user.step = step
            try:
                if ckpt.step(step) is not None:
                    live[step] = capture_state(model, opt, user)
            except DeckError as e:
                assert step == 9 and "symbolic link" in str(e), (step, e)
            if step == 9:
                ckpt.flush()
        ckpt.flush()
    logging.getLogger("deck").removeHandler(seen)
    dist.barrier()
    assert _tree(outside) == before  # nothing written through the link
    if rank == 0:
        assert any("symbolic link" in m for m in seen.messages), seen.messages
    assert 9 not in read_manifests(LocalStorage(uri))
    model, opt = build_model(spec, seed=7)
    user = TrainState()
    with deck.DeltaCheckpointer(model, [opt], config, state=user) as ckpt:
        assert ckpt.restore() == 12
        assert not diff_states(live[12], capture_state(model, opt, user))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_restart_refuses_forged_pending_records_and_linked_step(tmp_path: Path) -> None:
    """Findings 2 and 3 on a real 2-rank TorchRec trainer (local tier: the URI is its spool)."""
    run_ranks(_trainer_job, str(tmp_path))


def test_an_empty_folder_is_removed_never_through_a_link(tmp_path: Path) -> None:
    """The spool's cleaner of empty folders (LocalStorage.remove_empty_folder): an empty folder
    goes; one holding anything stays; a link there, or on the way, is neither followed nor
    removed; and a folder a cleaner removes between a writer's making of it and of its child
    is made again (make_folder)."""
    outside = tmp_path / "outside"
    (outside / "empty").mkdir(parents=True)
    store = LocalStorage(str(tmp_path / "root"))
    store.make_folder("a/b")
    store.put("a/file", b"x")
    assert store.remove_empty_folder("a/b") and not (tmp_path / "root/a/b").exists()
    assert not store.remove_empty_folder("a")  # holds a file
    os.symlink(outside, tmp_path / "root/link")
    os.symlink(outside / "empty", tmp_path / "root/a/linked")
    assert not store.remove_empty_folder("link/empty")  # through a link
    assert not store.remove_empty_folder("a/linked")  # a link itself
    assert (outside / "empty").is_dir() and (tmp_path / "root/a/linked").is_symlink()
    store.make_folder("c")
    real = os.mkdir
    removed = []

    def raced(name: Any, *args: Any, **kwargs: Any) -> None:
        if name == "d" and not removed:  # the parent emptied and removed just before
            removed.append(store.remove_empty_folder("c"))
        real(name, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "mkdir", raced)
        store.make_folder("c/d")
    assert removed == [True] and (tmp_path / "root/c/d").is_dir()


def test_a_put_into_a_folder_a_cleaner_removes_under_it_makes_it_again(tmp_path: Path) -> None:
    """A break-it finding: `deck gc` pruned an emptied `_log/` between a trainer's opening of it
    and its entry's temp file, and the commit failed ("its folder was removed while it was
    written"). A put (and put_if_absent) now opens the folder again and writes; a folder that
    keeps vanishing still fails, naming the file."""
    import deck.storage.local as local

    store = LocalStorage(str(tmp_path / "root"))
    real = local.write_new_file
    removed: list[bool] = []

    def raced(name: str, *args: Any, **kwargs: Any) -> None:
        if len(removed) < 1:  # the folder emptied and removed just before
            removed.append(store.remove_empty_folder("_log"))
        real(name, *args, **kwargs)

    for put in (store.put, store.put_if_absent):
        removed.clear()
        store.make_folder("_log")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(local, "write_new_file", raced)
            put("_log/1.json", b"entry")
        assert removed == [True] and (tmp_path / "root/_log/1.json").read_bytes() == b"entry"
        (tmp_path / "root/_log/1.json").unlink()

    def always(name: str, *args: Any, **kwargs: Any) -> None:
        store.remove_empty_folder("_log")
        real(name, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(local, "write_new_file", always)
        with pytest.raises(StorageError, match=r"_log/1.json.*folder was removed"):
            store.put("_log/1.json", b"entry")
