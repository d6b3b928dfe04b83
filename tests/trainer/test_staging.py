"""Staging: bounded memory, S3 outage, kill -9 during upload and restart recovery."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import deck
from deck.config import StagingConfig
from deck.model import TableShard
from deck.read.catalog import read_manifests
from deck.read.lineage import chain_for
from deck.read.restore import apply_chain
from deck.storage import local, open_storage
from deck.testing.staging import full_part_info
from deck.trainer import staging
from deck.trainer.staging import CheckpointStats, Stager
from deck.trainer.writer import RankPartWriter

JOB = str(Path(__file__).with_name("staging_job.py"))


def _shard(rows: int, dim: int) -> TableShard:
    g = torch.Generator().manual_seed(rows)
    return TableShard.whole(
        "m.embedding_bags.t0.weight",
        {
            "weight": torch.randn(rows, dim, generator=g),
            "momentum1": torch.rand(rows, generator=g),
        },
    )


def _stage_one_part(
    storage,
    cfg: StagingConfig,
    shard: TableShard,
    rows_for,
    dense,
    ckpt_id: str,
    pinned: bool = False,
) -> tuple[Stager, RankPartWriter, CheckpointStats]:
    """Drive a stager by hand, as the checkpointer does, for a one-rank full checkpoint of step 0."""
    stager = Stager(storage, cfg, rank=0, pinned=pinned)
    staged = stager.begin(full_part_info(storage.uri, 0, ckpt_id), reserved=0)
    writer = RankPartWriter(storage, 0, ckpt_id, 0, 1, cfg.chunk_bytes, sink=staged)
    writer.write_part([shard], rows_for, dense, {"user": None})
    staged.wait_written()
    stats = CheckpointStats(step=0, kind="full", id=ckpt_id)
    stager.enqueue(staged, stats)
    return stager, writer, stats


@pytest.mark.parametrize("uri_kind", ["local", "memory"])
def test_stager_memory_is_bounded_and_the_part_commits(tmp_path: Path, uri_kind: str) -> None:
    """A 100 MiB table goes through 3 buffers of 256 KiB; the result restores exactly."""
    uri = str(tmp_path / "ck") if uri_kind == "local" else f"memory://deck-{tmp_path.name}"
    storage = open_storage(uri)
    cfg = StagingConfig(
        chunk_bytes=256 * 1024, chunks_in_flight=3, spool_dir=str(tmp_path / "spool")
    )
    shard = _shard(rows=400_000, dim=64)
    stager, writer, stats = _stage_one_part(
        storage, cfg, shard, lambda s: None, {"dense.w": torch.ones(3)}, "00000000000000aa"
    )
    assert stager.flush(timeout=120)
    stager.close()

    assert writer.bytes_written > 100 * 2**20
    assert stager.pool.peak_in_use <= cfg.chunks_in_flight
    assert stager.pool.allocated_bytes <= cfg.chunks_in_flight * cfg.chunk_bytes
    assert (
        stats.state == "committed"
        and stats.durable_local_s is not None
        and stats.committed_s is not None
    )

    manifests = read_manifests(storage)
    target = _shard(rows=400_000, dim=64)
    for t in target.states.values():
        t.zero_()
    apply_chain(storage, chain_for(manifests, 0), [target], {shard.table: (400_000, 64)})
    assert all(torch.equal(target.states[k], shard.states[k]) for k in shard.states)
    if uri_kind == "memory":
        assert not [p for p in (tmp_path / "spool").rglob("*") if p.is_file()]


@pytest.mark.parametrize("direct", [True, False])
def test_first_tier_writes_direct_or_buffered_hold_the_bytes(tmp_path: Path, direct: bool) -> None:
    """Page-aligned pool buffers go with O_DIRECT where the filesystem takes it, anything else
    (and every buffer once a filesystem refused) buffered: the files hold exactly the bytes."""
    device = os.stat(tmp_path).st_dev
    saved = set(local._no_direct)
    if not direct:
        local._no_direct.add(device)
    try:
        pool = staging.BufferPool(1, 3 * 4096)
        buf = pool.acquire()
        data = torch.randint(0, 256, (3 * 4096,), dtype=torch.uint8).numpy().tobytes()
        buf[:] = data
        cases = {
            "aligned": memoryview(buf),  # a pool buffer: page-aligned, whole pages
            "partial": memoryview(buf)[: 4096 + 100],  # not whole pages: buffered
            "bytes": memoryview(data[:5000]),  # read-only (manifests, dense state): buffered
        }
        for name, view in cases.items():
            local.write_new_file(str(tmp_path / name), view)
            assert (tmp_path / name).read_bytes() == bytes(view), name
    finally:
        local._no_direct.clear()
        local._no_direct.update(saved)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
@pytest.mark.parametrize("release", ["in_memory", "first_tier"])
def test_background_threads_yield_the_cpu_to_training(tmp_path: Path, release: str) -> None:
    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    storage = open_storage(str(tmp_path / "ck"))
    stager = Stager(storage, StagingConfig(background_nice=7, release=release), rank=0)
    lower = min(19, nice() + 7)
    try:
        assert stager._syncer.submit(nice).result() == lower
        assert stager._uploads.submit(nice).result() == lower
        # The spool writer: training waits on it with first_tier, not with in_memory.
        writer = stager._writer.submit(nice).result()
        assert writer == (lower if release == "in_memory" else nice())
    finally:
        stager.close()


def _start(args: list[str], markers: Path) -> subprocess.Popen[bytes]:
    with open(markers / "job.log", "ab") as log:  # the child keeps its own copy of the fd
        return subprocess.Popen(
            [sys.executable, JOB, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _wait_marker(path: Path, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(
                f"job exited with {proc.returncode}: {(path.parent / 'job.log').read_text()[-3000:]}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {path.name}")
        time.sleep(0.1)


def _finish(proc: subprocess.Popen[bytes], markers: Path, timeout: float = 600) -> None:
    rc = proc.wait(timeout=timeout)
    assert rc == 0, (markers / "job.log").read_text()[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("then", ["resume", "die"])
def test_s3_outage_and_kill_during_upload(tmp_path: Path, s3_server, then: str) -> None:
    """Training goes on while SeaweedFS is down; uploads catch up when it returns (``resume``),
    or a kill -9 with parts still in the spool is finished by the next process (``die``)."""
    markers = tmp_path / "markers"
    markers.mkdir()
    common = [
        "--uri",
        s3_server.uri(f"{tmp_path.name}/ck"),
        "--options",
        json.dumps(s3_server.storage_options),
        "--spool",
        str(tmp_path / "spool"),
        "--markers",
        str(markers),
    ]
    proc = _start(["run", *common, "--then", then], markers)
    try:
        _wait_marker(markers / "phase1", proc)
        s3_server.pause()
        (markers / "outage").touch()
        _wait_marker(markers / "phase2", proc)
        # Steps 15 and 20 are staged and waiting for the store.
        pending = sorted(p.name for p in (tmp_path / "spool").rglob("*.pending.json"))
        assert len(pending) == 4, pending  # 2 steps x 2 ranks
        if then == "die":
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        s3_server.resume()
        if then == "resume":
            (markers / "resumed").touch()
            _finish(proc, markers)
        else:
            storage = open_storage(s3_server.uri(f"{tmp_path.name}/ck"), s3_server.storage_options)
            assert sorted(read_manifests(storage)) == [0, 5, 10]  # nothing half-visible
            _finish(_start(["verify", *common], markers), markers)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if not s3_server.running:
            s3_server.resume()
    infos = deck.list_checkpoints(s3_server.uri(f"{tmp_path.name}/ck"), s3_server.storage_options)
    assert [(i.step, i.kind) for i in infos] == [
        (0, "full"),
        (5, "delta"),
        (10, "delta"),
        (15, "delta"),
        (20, "delta"),
    ]
    assert not list((tmp_path / "spool").rglob("*.pending.json"))
    # The console script reaches the same S3 store through --storage-options.
    deck_exe = shutil.which("deck", path=str(Path(sys.executable).parent)) or "deck"
    uri = s3_server.uri(f"{tmp_path.name}/ck")
    opts = ["--storage-options", json.dumps(s3_server.storage_options)]
    r = subprocess.run(
        [deck_exe, *opts, "verify", uri, "--all"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "0 with problems" in r.stdout, r.stdout + r.stderr


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (none on CPU CI machines)"
)
def test_gpu_tables_stage_through_pinned_buffers(tmp_path: Path) -> None:
    """Tables on a GPU: gathered on a side stream into pinned buffers; round trip is exact."""
    storage = open_storage(str(tmp_path / "ck"))
    cfg = StagingConfig(chunk_bytes=64 * 1024, chunks_in_flight=2)
    shard = _shard(rows=50_000, dim=32)
    gpu = TableShard(**{**shard.__dict__, "states": {k: v.cuda() for k, v in shard.states.items()}})
    rows = torch.arange(0, 50_000, 3, device="cuda")
    stager, _, _ = _stage_one_part(
        storage, cfg, gpu, lambda s: rows, None, "00000000000000bb", pinned=True
    )
    assert stager.flush(timeout=60)
    stager.close()
    assert stager.pool.pinned and stager.pool.peak_in_use <= 2
    target = _shard(rows=50_000, dim=32)
    for t in target.states.values():
        t.zero_()
    apply_chain(
        storage, chain_for(read_manifests(storage), 0), [target], {shard.table: (50_000, 32)}
    )
    sel = rows.cpu()
    assert all(torch.equal(target.states[k][sel], shard.states[k][sel]) for k in shard.states)


def test_a_huge_failure_record_is_read_only_in_part(tmp_path: Path) -> None:
    """Rank 0 reads another rank's failure record to say why a step failed; the store is not
    trusted to hold a line of text there, so only the first few KiB are read."""
    from deck.errors import NotFoundError
    from deck.trainer.staging.destination import FAILURE_RECORD_BYTES, Destination

    storage = open_storage(str(tmp_path / "ck"))
    storage.put("step-00000001/abc/rank-1.failed", b"rank 1: disk full\n" + b"x" * (1 << 20))
    dest = Destination(storage, StagingConfig())
    why = dest.failure_reason_once("step-00000001/abc/rank-1.failed")
    assert why.startswith("rank 1: disk full") and len(why) == FAILURE_RECORD_BYTES
    with pytest.raises(NotFoundError):
        dest.failure_reason_once("step-00000001/abc/rank-2.failed")


def test_rank0_commits_with_its_own_part_as_written_or_read_back_alike(tmp_path: Path) -> None:
    """The commit thread hands rank 0's part manifest as it wrote it to the commit (not read
    back): the commit record's references are those of reading every part from the store."""
    from deck.format.manifest import Kind, RankManifest, load_model, rank_manifest_name, step_dir
    from deck.trainer.writer import commit

    storage = open_storage(str(tmp_path / "ck"))
    ckpt_id = "0123456789abcdef"
    parts = []
    for rank in range(2):
        w = RankPartWriter(storage, 5, ckpt_id, rank, 2, 4096)
        part = w.write_part([_shard(50 + rank, 4)], lambda s: None, None, {"r": rank})
        assert part is not None
        parts.append(part)
    key = f"{step_dir(5)}/{ckpt_id}/{rank_manifest_name(0)}"
    own = storage.get(key)
    assert load_model(RankManifest, own, key) == parts[0]
    args = dict(
        step=5,
        ckpt_id=ckpt_id,
        kind=Kind.FULL,
        parent=None,
        base=5,
        epoch=0,
        world_size=2,
        deck_version="test",
    )
    read_back = commit(storage, **args)  # type: ignore[arg-type]
    handed = commit(storage, own=(parts[0], own), **args)  # type: ignore[arg-type]
    assert handed.ranks == read_back.ranks


@pytest.mark.parametrize("scratch", [False, True])
def test_a_full_disk_while_making_a_folder_gets_the_full_disk_hint(
    tmp_path: Path, scratch: bool
) -> None:
    """A folder the spool writer creates fails as the store's StorageError raised from the
    ENOSPC (a break-it finding: it got the permissions hint, not what to free)."""
    import errno
    from concurrent.futures import ThreadPoolExecutor

    from deck.errors import StorageError
    from deck.trainer.staging.spool import SpoolDir

    with ThreadPoolExecutor(1) as syncer:
        spool = SpoolDir(str(tmp_path), StagingConfig(), scratch=scratch, syncer=syncer)
        try:
            raise StorageError("could not create step-000000000003/x/rank-00000") from OSError(
                errno.ENOSPC, "No space left on device"
            )
        except StorageError as e:
            message = str(spool.error(3, "step-000000000003/x/rank-00000/t.chunk", e))
    assert "free space on" in message, message
    assert ("move the URI" in message) != scratch and ("spool_max_bytes" in message) == scratch


def test_a_full_spool_is_said_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A break-it finding: "spool ... is full" was a WARNING for every second of every wait
    (30 lines for 16 checkpoints with spool_max_bytes=0). Said once; each wait still waits."""
    import logging
    from concurrent.futures import ThreadPoolExecutor

    from deck.trainer.staging.spool import SpoolDir

    caplog.set_level(logging.WARNING, logger="deck")
    with ThreadPoolExecutor(1) as syncer:
        spool = SpoolDir(str(tmp_path), StagingConfig(spool_max_bytes=0), True, syncer)
        assert spool.reserve(10)  # an empty spool takes any part
        for _ in range(3):
            waits = threading.Event()
            waiting = threading.Thread(target=spool.reserve, args=(10, waits.set))
            waiting.start()
            assert waits.wait(120)  # (a guard: it waits until the release below)
            spool.release(10)  # the part before it is uploaded: room for it
            waiting.join(120)
            assert not waiting.is_alive()
    full = [r for r in caplog.records if "is full" in r.getMessage()]
    assert len(full) == 1, [r.getMessage() for r in full]
