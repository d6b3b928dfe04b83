"""Multi-layer staging: CPU chunk buffers -> local SSD spool -> destination, in the background.

The training thread fills at most ``chunks_in_flight`` reusable buffers; a spool writer thread
writes each to the spool and hands the buffer back, so CPU memory stays bounded whatever the
model size. Training resumes once every chunk of a rank's part is in a buffer
(``release="in_memory"``) or written to the spool with the part's pending record beside it
(``"first_tier"``). A background thread then, per checkpoint and in order: waits for the part's
writes and pending record, fsyncs the spool files (durable-local), uploads them with retries
(remote tiers), puts the rank part manifest at the destination, and -- on rank 0, once every
rank's part manifest is there -- writes the commit record. A part of another rank that fails
(its writes after training was released, or its upload) puts a failure record where its manifest
would go, so rank 0 stops waiting for it at once; the next collective checkpoint or flush also
tells rank 0 (the record may not be writable). The background thread never calls collectives.

A process that restarts finds pending records in the spool and finishes them, or discards them
when the destination already has them or a later full made them useless.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import logging
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch
from pydantic import BaseModel, ConfigDict

from deck.config import StagingConfig
from deck.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DeckError,
    NotFoundError,
    SpoolError,
    StorageError,
)
from deck.failpoints import failpoint
from deck.format.checksum import checksum
from deck.format.chunks import Buffer, aligned_buffer
from deck.format.manifest import (
    MANIFEST,
    CheckpointManifest,
    Kind,
    RankManifest,
    dump_model,
    load_model,
    parse_step_dir,
    rank_dir,
    rank_failure_name,
    rank_manifest_name,
    step_dir,
)
from deck.storage import Storage
from deck.storage.atomic import atomic_file
from deck.storage.local import write_new_file
from deck.storage.retry import RetryPolicy, call_with_retry
from deck.trainer.writer import commit
from deck.version import __version__

if TYPE_CHECKING:
    from deck.trainer.coordination import Coordinator

logger = logging.getLogger(__name__)
T = TypeVar("T")

PENDING_SUFFIX = ".pending.json"


class _NeverCommits(DeckError):
    """A part that failed for good (its writes, or another rank's part): drop it, or every
    restart would retry it."""


class PendingPart(BaseModel):
    """Everything needed to finish one rank's part of a checkpoint after a restart."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uri: str
    step: int
    ckpt_id: str
    rank: int
    world_size: int
    kind: Kind
    parent: int | None
    parent_id: str | None
    base: int
    epoch: int
    files: tuple[str, ...] = ()  # relative to the step folder; data files of this part
    part: RankManifest | None = None  # set once the part is written


@dataclass
class CheckpointStats:
    """One checkpoint as this rank saw it. Stall and sizes are filled when ``step``/``save``
    returns (sizes summed over ranks); the background thread fills the rest as it goes."""

    step: int
    kind: str
    id: str
    stall_s: float = 0.0
    # Of the stall, the longest any rank waited for a free chunk buffer: > 0 when a rank's part
    # was larger than the pool (chunks_in_flight x chunk_bytes), which then bounds the stall.
    buffer_wait_s: float = 0.0
    # Where the stall went (each the longest of any rank): the first all-gather (agreeing on id
    # and kind; it also absorbs the ranks' arrival skew), claiming the tracked rows, and copying
    # them into buffers (the snapshot: rows, dense and extra state). The rest of ``stall_s`` is
    # the second all-gather that releases training.
    agree_s: float = 0.0
    claim_s: float = 0.0
    snapshot_s: float = 0.0
    bytes: int = 0
    rows: int = 0
    chunks: int = 0
    durable_local_s: float | None = None  # snapshot start -> this rank's files fsynced
    committed_s: float | None = None  # snapshot start -> part uploaded (rank 0: manifest written)
    state: str = "staged"  # staged | recovering | durable | uploaded | committed | failed
    error: str | None = None
    spool_reserved: int = field(default=0, repr=False)
    started: float = field(default_factory=time.perf_counter, repr=False)


@dataclass
class _Item:
    """One part for the commit thread: staged by this process, or found in the spool."""

    pending: PendingPart  # of a staged part: without files and manifest until its writes are done
    stats: CheckpointStats
    staged: StagedPart | None = None


class BufferPool:
    """``count`` reusable buffers of ``size`` bytes, allocated on first use.

    With ``pinned`` (tables on a GPU) buffers are page-locked host memory, so device-to-host
    copies into them are true DMA transfers that can run on a side stream.
    """

    def __init__(self, count: int, size: int, pinned: bool = False):
        self.size = size
        self.count = count
        self.pinned = pinned
        self._keep: list[torch.Tensor] = []  # owners of pinned buffers
        self._free: queue.LifoQueue[Buffer] = queue.LifoQueue()
        self._allocated = 0
        self._lock = threading.Lock()
        self.in_use = 0
        self.peak_in_use = 0

    @property
    def allocated_bytes(self) -> int:
        return self._allocated * self.size

    def _new(self) -> Buffer:
        if not self.pinned:
            return aligned_buffer(self.size)
        owner = torch.empty(self.size, dtype=torch.uint8, pin_memory=True)
        self._keep.append(owner)
        return memoryview(owner.numpy())  # type: ignore[arg-type]

    def acquire(self) -> Buffer:
        """A free buffer; blocks while ``count`` are in use (this is the memory bound)."""
        with self._lock:
            if self._free.empty() and self._allocated < self.count:
                self._allocated += 1
                self._free.put(self._new())
        buf = self._free.get()
        with self._lock:
            self.in_use += 1
            self.peak_in_use = max(self.peak_in_use, self.in_use)
        return buf

    def release(self, buf: Buffer) -> None:
        with self._lock:
            self.in_use -= 1
        self._free.put(buf)


def resolve_tier(staging: StagingConfig, storage: Storage) -> str:
    """The tier actually used: ``auto`` is ``local`` for local destinations, else spool + upload."""
    if staging.tiers == "auto":
        return "local" if storage.local_path() is not None else "cpu-ssd-remote"
    if staging.tiers == "local" and storage.local_path() is None:
        raise DeckError(f"staging.tiers='local' needs a local destination, got {storage.uri}")
    return staging.tiers


class StagedPart:
    """One rank's part of one checkpoint while the training thread writes it (the writer's sink)."""

    def __init__(self, stager: Stager, info: PendingPart, reserved: int):
        self.stager = stager
        self.info = info
        self.reserved = reserved
        self.files: list[str] = []
        # A counter and the first error, not one Future per chunk: memory must not grow with
        # the number of chunks.
        self._outstanding = 0
        self._error: BaseException | None = None
        self._done = threading.Condition()
        self._sealed = False  # every file is submitted (and the pending record queued)
        self.bytes = 0
        self.buffer_wait_s = 0.0  # time the training thread waited for a free pool buffer
        # How to build the rank manifest (from records the writes made); built once, by the
        # spool writer (the pending record) or the commit thread, whichever asks first.
        self._build: Callable[[], RankManifest] | None = None
        self._part: RankManifest | None = None
        self._part_lock = threading.Lock()

    # -- sink interface used by deck.trainer.writer.RankPartWriter --
    def buffer(self) -> Buffer:
        t0 = time.perf_counter()
        buf = self.stager.pool.acquire()
        self.buffer_wait_s += time.perf_counter() - t0
        return buf

    def submit(self, rel: str, buf: Buffer, nbytes: int, describe: Callable[[], None]) -> None:
        """Hand a filled pool buffer over; it returns to the pool once written."""
        self.files.append(rel)
        self.bytes += nbytes
        self._track(self.stager.write_out(self.info.step, rel, buf, nbytes, describe, pooled=True))

    def submit_bytes(self, rel: str, data: bytes | bytearray, describe: Callable[[], None]) -> None:
        self.files.append(rel)
        self.bytes += len(data)
        self._track(
            self.stager.write_out(self.info.step, rel, data, len(data), describe, pooled=False)
        )

    def finish_part(self, build: Callable[[], RankManifest]) -> None:
        self._build = build

    @property
    def part(self) -> RankManifest | None:
        """The rank manifest, once every file is written (None: the writer never finished)."""
        with self._part_lock:
            if self._part is None and self._build is not None:
                self._part = self._build()
            return self._part

    # -- protocol --
    def _track(self, fut: Future[None]) -> None:
        with self._done:
            self._outstanding += 1

        def done(f: Future[None]) -> None:
            with self._done:
                self._outstanding -= 1
                if self._error is None and f.exception() is not None:
                    self._error = f.exception()
                self._done.notify_all()

        fut.add_done_callback(done)

    def error(self) -> BaseException | None:
        """The first write error so far, without waiting."""
        with self._done:
            return self._error

    def seal(self) -> None:
        """Every file of the part is submitted. With a spool, its pending record is queued on
        the spool writer behind them (once): written (fsynced) right after the part's last file,
        unless a write failed, whatever the commit thread is doing, so a restart finds it. A
        failure to write it (a full disk) is this part's staging failure, not a part that
        silently never commits."""
        if self._sealed:
            return
        self._sealed = True
        if self._build is not None and self.stager.spool_root is not None:
            self._track(self.stager.record_pending(self))

    def wait_written(self, seal: bool = True) -> None:
        """Seal the part and block until every file and its pending record are in the first
        tier; raises the first write error. Called by the training thread before the ranks agree
        the part is staged (``release="first_tier"``) or by the commit thread before it goes on
        with the part. ``seal=False``: only wait for what was submitted (a discarded part)."""
        if seal:
            self.seal()
        with self._done:
            while self._outstanding:
                self._done.wait()
            if self._error is not None:
                raise self._error

    def pending(self) -> PendingPart:
        """The part with its rank manifest; only once every file is written."""
        part = self.part
        if part is None:
            raise DeckError("internal: rank part was not finished")
        return self.info.model_copy(update={"files": tuple(self.files), "part": part})


class Stager:
    """Moves checkpoint parts of one rank from CPU buffers to the destination, in the background."""

    def __init__(self, storage: Storage, staging: StagingConfig, rank: int, pinned: bool = False):
        self.storage = storage
        self.cfg = staging
        self.rank = rank
        self.tier = resolve_tier(staging, storage)
        # A buffer holds one chunk, or one bundle of chunks filled in place (bundle_bytes).
        size = max(staging.chunk_bytes, staging.bundle_bytes)
        self.pool = BufferPool(staging.chunks_in_flight, size, pinned=pinned)
        if self.tier == "local":
            self.spool_root: str | None = storage.local_path()
            assert self.spool_root is not None
        elif self.tier == "cpu-ssd-remote":
            base = staging.spool_dir or os.path.join(tempfile.gettempdir(), "deck-spool")
            key = hashlib.sha1(storage.uri.encode()).hexdigest()[:16]
            self.spool_root = os.path.join(base, key)
            os.makedirs(self.spool_root, exist_ok=True)
        else:
            self.spool_root = None
        lower = functools.partial(_lower_priority, staging.background_nice)
        # Released at the snapshot, training does not wait for the spool writer (its checksums,
        # records and writes): it yields the CPU to training like the other background threads.
        self._writer = ThreadPoolExecutor(
            1,
            thread_name_prefix="deck-spool",
            initializer=lower if staging.release == "in_memory" else None,
        )
        # Each spooled file is fsynced as soon as it is written, on its own thread, so that the
        # part's durability wait overlaps the writes of the files after it instead of starting
        # when the last one is written (the writer thread never waits for the disk to flush).
        self._syncer = ThreadPoolExecutor(1, thread_name_prefix="deck-fsync", initializer=lower)
        self._early_syncs: dict[str, Future[None]] = {}
        self._syncs_lock = threading.Lock()
        self._made_dirs: set[str] = set()
        self._uploads = ThreadPoolExecutor(
            staging.upload_concurrency, thread_name_prefix="deck-upload", initializer=lower
        )
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        # Parts another rank reported failed at a collective (step, id): rank 0 stops waiting.
        self._abandoned: dict[tuple[int, str], str] = {}
        # Parts of this rank that failed in the background, not yet told at a collective.
        self._failed_parts: list[tuple[int, str]] = []
        self._idle = threading.Condition()
        self._busy = 0
        self._spool_bytes = 0
        self.failed = threading.Event()  # a part failed after training moved on: take a full next
        self._thread = threading.Thread(target=self._run, name="deck-commit", daemon=True)
        self._thread.start()

    # ---- training thread -------------------------------------------------------------------------
    def reserve(self, nbytes: int) -> bool:
        """Room for ``nbytes`` in the spool: waits (``block``) or returns False (``skip``)."""
        if self.tier != "cpu-ssd-remote":
            return True
        with self._idle:
            while self._spool_bytes and self._spool_bytes + nbytes > self.cfg.spool_max_bytes:
                if self.cfg.spool_full == "skip":
                    return False
                logger.warning("deck spool %s is full: training waits for uploads", self.spool_root)
                self._idle.wait(1.0)
            self._spool_bytes += nbytes
        return True

    def begin(self, info: PendingPart, reserved: int) -> StagedPart:
        """Start staging a part; ``reserved`` is what :meth:`reserve` granted for it."""
        return StagedPart(self, info, reserved)

    def write_out(
        self,
        step: int,
        rel: str,
        data: bytes | Buffer,
        nbytes: int,
        describe: Callable[[], None],
        pooled: bool,
    ) -> Future[None]:
        """Write one file to the first tier (spool, or upload for cpu-remote), after
        ``describe`` (its checksum and record, from the bytes while the buffer is held)."""
        key = f"{step_dir(step)}/{rel}"

        def spool() -> None:
            try:
                describe()
                path = os.path.join(self.spool_root, key)  # type: ignore[arg-type]
                folder = os.path.dirname(path)
                failpoint("stager.spool.before_write")
                if folder not in self._made_dirs:  # one makedirs per folder, not per chunk
                    os.makedirs(folder, exist_ok=True)
                    self._made_dirs.add(folder)
                failpoint("stager.spool.write", path)  # test hook: a kill or ENOSPC here
                write_new_file(path, memoryview(data)[:nbytes])
                failpoint("stager.spool.after_write")
                with self._syncs_lock:
                    self._early_syncs[path] = self._syncer.submit(_fsync_path, path)
            except OSError as e:
                raise self._spool_error(step, key, e) from e
            finally:
                if pooled:
                    self.pool.release(data)  # type: ignore[arg-type]

        def upload() -> None:
            try:
                describe()
                self._put_with_retry(key, bytes(memoryview(data)[:nbytes]))
            finally:
                if pooled:
                    self.pool.release(data)  # type: ignore[arg-type]

        return (
            self._uploads.submit(upload) if self.spool_root is None else self._writer.submit(spool)
        )

    def record_pending(self, staged: StagedPart) -> Future[None]:
        """Write ``staged``'s pending record on the spool writer, after the files queued before
        it; skipped when one of them failed (the part is failing anyway)."""

        def record() -> None:
            if staged.error() is None:
                self.write_pending(staged.pending())

        return self._writer.submit(record)

    def enqueue(self, staged: StagedPart, stats: CheckpointStats) -> None:
        """Every rank staged its part (in buffers or already in the first tier): go on in the
        background, starting by waiting for this part's writes (its manifest is built then)."""
        stats.spool_reserved = staged.reserved
        with self._idle:
            self._busy += 1
        self._queue.put(_Item(staged.info, stats, staged))

    def take_failed(self) -> list[tuple[int, str]]:
        """(step, id) of this rank's parts (rank > 0) that failed in the background since the
        last call: what a collective tells rank 0 (:meth:`abandon`)."""
        with self._idle:
            out, self._failed_parts = self._failed_parts, []
        return out

    def abandon(self, step: int, ckpt_id: str, why: str) -> None:
        """Rank 0: another rank's part of ``step`` failed; do not wait for it (nor commit)."""
        with self._idle:
            self._abandoned[(step, ckpt_id)] = why
            self._idle.notify_all()

    def discard(self, staged: StagedPart) -> None:
        """Drop a part that will not be committed (another rank failed)."""
        with contextlib.suppress(Exception):
            staged.wait_written(seal=False)
        self._remove_files(staged.info.step, staged.files, remote=self.spool_root is None)
        if self.spool_root is not None:
            self._remove_pending(staged.info)
        self._release_spool(staged.reserved)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every enqueued part is committed or failed; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join()
        self._writer.shutdown()
        self._syncer.shutdown()
        self._uploads.shutdown()

    # ---- restart ---------------------------------------------------------------------------------
    def recover(self, coord: Coordinator | None = None) -> list[CheckpointStats]:
        """Find this rank's pending parts in the spool and finish or discard them.

        Collective when ``coord`` is given (call it on every rank, on the training thread): a
        crash can leave a part pending on some ranks only (a rank died before finishing its
        snapshot). Such a part can never commit, so it is discarded at once instead of rank 0
        waiting ``commit_timeout_s`` for the missing rank. Spool files of this rank without a
        pending record (a snapshot cut short) and torn record temps are removed."""
        found = self._scan_spool()
        if coord is not None and coord.world_size > 1:
            found = self._agree_on_pending(found, coord)
        out = []
        for p in sorted(found, key=lambda p: p.step):
            stats = CheckpointStats(
                step=p.step, kind=p.kind.value, id=p.ckpt_id, state="recovering"
            )
            logger.info(
                "deck: resuming pending %s checkpoint of step %d from spool %s",
                p.kind.value,
                p.step,
                self.spool_root,
            )
            stats.spool_reserved = (
                sum(self._spool_size(p, f) for f in p.files) if self.tier == "cpu-ssd-remote" else 0
            )
            with self._idle:
                self._busy += 1
                self._spool_bytes += stats.spool_reserved
            self._queue.put(_Item(p, stats))
            out.append(stats)
        return out

    def _scan_spool(self) -> list[PendingPart]:
        if self.spool_root is None or not os.path.isdir(self.spool_root):
            return []
        found = []
        name = rank_manifest_name(self.rank).replace(".json", PENDING_SUFFIX)
        part_dir = rank_dir(self.rank)
        for step_name in sorted(os.listdir(self.spool_root)):
            step_path = os.path.join(self.spool_root, step_name)
            if parse_step_dir(step_name) is None or not os.path.isdir(step_path):
                continue
            for attempt in os.listdir(step_path):
                path = os.path.join(step_path, attempt, name)
                # NotADirectoryError: in the local tier the spool is the destination, whose step
                # folders also hold manifest.json (a file, not an attempt folder).
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    os.remove(path + ".tmp")  # a record torn by a crash: its part never staged
                p = None
                if os.path.isfile(path):
                    try:
                        with open(path, "rb") as f:
                            p = load_model(PendingPart, f.read(), path)
                    except (DeckError, OSError) as e:
                        logger.warning("deck: ignoring unreadable pending record %s: %s", path, e)
                        os.remove(path)
                if p is not None and p.uri == self.storage.uri:
                    found.append(p)
                elif self.tier == "cpu-ssd-remote":
                    # Only a spool holds nothing but pending parts; in the local tier this folder
                    # may be a committed checkpoint (GC handles attempts that never committed).
                    shutil.rmtree(os.path.join(step_path, attempt, part_dir), ignore_errors=True)
        return found

    def _agree_on_pending(self, found: list[PendingPart], coord: Coordinator) -> list[PendingPart]:
        """Keep the parts every other rank also has pending, or has already uploaded."""
        n = int(coord.gather([float(len(found))])[:, 0].max())
        mine = [v for p in found for v in (float(p.step), float(int(p.ckpt_id, 16)))]
        rows = coord.gather(mine + [-1.0] * (2 * n - len(mine))) if n else None
        keep = []
        for p in found:
            have = {
                r
                for r in range(coord.world_size)
                if rows is not None
                and any(
                    rows[r, 2 * i] == p.step and rows[r, 2 * i + 1] == int(p.ckpt_id, 16)
                    for i in range(n)
                )
            }
            missing = [
                r
                for r in range(p.world_size)
                if r not in have
                and not self._exists(f"{step_dir(p.step)}/{p.ckpt_id}/{rank_manifest_name(r)}")
            ]
            if missing and self._committed_id(p.step) != p.ckpt_id:
                logger.warning(
                    "deck: discarding the spooled part of step %d (%s) in %s: rank(s) %s never "
                    "staged theirs before the crash, so it cannot be committed",
                    p.step,
                    p.ckpt_id,
                    self.spool_root,
                    missing,
                )
                self._remove_files(p.step, list(p.files), remote=False)
                self._remove_pending(p)
                continue
            keep.append(p)
        return keep

    def _exists(self, key: str) -> bool:
        return self._retrying("read", key, lambda: self.storage.exists(key))

    # ---- background ------------------------------------------------------------------------------
    def _run(self) -> None:
        _lower_priority(self.cfg.background_nice)
        while True:
            item = self._queue.get()
            if item is None:
                return
            pending, stats = item.pending, item.stats
            try:
                if item.staged is not None:
                    try:  # its writes (still running when training was released early)
                        item.staged.wait_written()
                        pending = item.staged.pending()
                    except Exception as e:
                        pending = pending.model_copy(update={"files": tuple(item.staged.files)})
                        raise _NeverCommits(str(e)) from e
                self._finish(pending, stats)
            except Exception as e:
                if pending.rank != 0 and stats.state not in ("uploaded", "committed"):
                    self._report_failed(pending, e)
                stats.state, stats.error = "failed", str(e)
                self.failed.set()
                logger.error(
                    "deck: checkpoint of step %d (%s) failed in the background: %s",
                    pending.step,
                    pending.ckpt_id,
                    e,
                )
                if isinstance(e, (CheckpointNotFoundError, CorruptCheckpointError, _NeverCommits)):
                    # It can never commit (its parent is gone, its spooled files are torn, a
                    # rank's part failed): drop it, or every restart would retry it.
                    with contextlib.suppress(Exception):
                        self._cleanup(pending, stats)
            finally:
                with self._idle:
                    self._busy -= 1
                    self._idle.notify_all()

    def _report_failed(self, p: PendingPart, e: BaseException) -> None:
        """A part of a rank other than 0 failed before its rank manifest went up: rank 0 must
        not wait for it. A failure record at the destination tells it at once (best effort: the
        store may be what failed); :meth:`take_failed` tells it at the next collective."""
        with self._idle:
            self._failed_parts.append((p.step, p.ckpt_id))
        key = f"{step_dir(p.step)}/{p.ckpt_id}/{rank_failure_name(p.rank)}"
        try:
            failpoint("stager.failure_record.put", key)
            self.storage.put(key, f"rank {p.rank}: {e}".encode())
        except (StorageError, OSError) as put_error:
            logger.warning(
                "deck: could not tell rank 0 through %s that step %d failed (%s); it learns at "
                "the next checkpoint or flush",
                self.storage.describe(key),
                p.step,
                put_error,
            )

    def _finish(self, p: PendingPart, stats: CheckpointStats) -> None:
        if p.part is None:
            raise DeckError(f"pending part of step {p.step} has no rank manifest")
        root = step_dir(p.step)
        if self._committed_id(p.step) == p.ckpt_id:
            self._cleanup(p, stats)
            stats.state = "committed"
            return
        part_key = f"{root}/{p.ckpt_id}/{rank_manifest_name(p.rank)}"
        # A crash after the part manifest went up (it is written last) may have removed the
        # spool copies already: the part is at the destination, only the commit is left.
        uploaded = stats.state == "recovering" and self._exists(part_key)
        if stats.state == "recovering" and not uploaded:
            failpoint("stager.recover.before_check")
            self._check_recovered(p)
        if self.spool_root is not None and not uploaded:
            failpoint("stager.fsync.before")
            self._fsync(p)
            failpoint("stager.fsync.after")
            stats.durable_local_s = time.perf_counter() - stats.started
            stats.state = "durable"
        if self.tier == "cpu-ssd-remote" and not uploaded:
            self._upload(p)
        if not uploaded:
            failpoint("stager.part_manifest.before_put")
            self._put_with_retry(part_key, dump_model(p.part))
            failpoint("stager.part_manifest.after_put")
        stats.state = "uploaded"
        if p.rank == 0:
            self._wait_for_parts(p)
            failpoint("stager.commit.before")
            if (
                p.kind is Kind.DELTA
                and p.parent is not None
                and self._committed_id(p.parent) != p.parent_id
            ):
                raise CheckpointNotFoundError(
                    f"step {p.step} is a delta of step {p.parent} ({p.parent_id}), which is not committed at "
                    f"{self.storage.uri}; the next checkpoint will be a full"
                )
            commit(
                self.storage,
                step=p.step,
                ckpt_id=p.ckpt_id,
                kind=p.kind,
                parent=(p.parent, p.parent_id) if p.parent is not None and p.parent_id else None,
                base=p.base,
                epoch=p.epoch,
                world_size=p.world_size,
                deck_version=__version__,
            )
            stats.state = "committed"
        stats.committed_s = time.perf_counter() - stats.started
        self._cleanup(p, stats)
        logger.info(
            "deck: step %d %s on rank %d at %s: durable-local %s s, %s %.3f s after the snapshot",
            p.step,
            stats.state,
            p.rank,
            self.storage.uri,
            "-" if stats.durable_local_s is None else f"{stats.durable_local_s:.3f}",
            "committed" if p.rank == 0 else "uploaded",
            stats.committed_s,
        )

    def _committed_id(self, step: int) -> str | None:
        key = f"{step_dir(step)}/{MANIFEST}"

        def read() -> bytes | None:
            try:
                return self.storage.get(key)
            except NotFoundError:
                return None

        data = self._retrying("read", key, read)
        if data is None:
            return None
        try:
            return load_model(CheckpointManifest, data, self.storage.describe(step_dir(step))).id
        except DeckError:
            return None

    def _spool_path(self, p: PendingPart, rel: str) -> str:
        assert self.spool_root is not None
        return os.path.join(self.spool_root, step_dir(p.step), rel)

    def _spool_size(self, p: PendingPart, rel: str) -> int:
        try:
            return os.path.getsize(self._spool_path(p, rel))
        except OSError:
            return 0

    def _check_recovered(self, p: PendingPart) -> None:
        """After a crash the spool may hold torn files: verify every one against the manifest."""
        assert p.part is not None
        # Per file, the (offset, nbytes, checksum) ranges it must hold: the whole file, or each
        # chunk of a bundle (which then ends where its last chunk ends).
        expected: dict[str, list[tuple[int, int, str]]] = {}
        for s in p.part.shards:
            for c in s.chunks:
                expected.setdefault(c.path, []).append((c.offset or 0, c.nbytes, c.checksum))
        for fr in (p.part.extra, p.part.dense):
            if fr is not None:
                expected[fr.path] = [(0, fr.nbytes, fr.checksum)]
        for rel, ranges in expected.items():
            try:
                with open(self._spool_path(p, rel), "rb") as f:
                    data = memoryview(f.read())
            except FileNotFoundError:
                data = memoryview(b"")
            if len(data) != max(off + n for off, n, _ in ranges) or any(
                checksum(data[off : off + n]) != digest for off, n, digest in ranges
            ):
                raise CorruptCheckpointError(
                    f"spooled file {self._spool_path(p, rel)} of step {p.step} is damaged; discarding it"
                )

    def _fsync(self, p: PendingPart) -> None:
        dirs = set()
        for rel in p.files:
            path = self._spool_path(p, rel)
            with self._syncs_lock:
                early = self._early_syncs.pop(path, None)
            try:
                if early is None:
                    raise OSError("not fsynced yet")  # e.g. a part recovered after a restart
                early.result()
            except OSError:
                _fsync_path(path)
            dirs.add(os.path.dirname(path))
        for d in dirs:
            _fsync_path(d)

    def _upload(self, p: PendingPart) -> None:
        def one(rel: str) -> None:
            with open(self._spool_path(p, rel), "rb") as f:
                data = f.read()
            failpoint("stager.upload.before_put")
            self._put_with_retry(f"{step_dir(p.step)}/{rel}", data)
            failpoint("stager.upload.after_put")

        for fut in [self._uploads.submit(one, rel) for rel in p.files]:
            fut.result()

    def _put_with_retry(self, key: str, data: bytes | bytearray) -> None:
        self._retrying("upload", key, lambda: self.storage.put(key, data))

    def _retrying(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """``fn`` with backoff for as long as ``upload_timeout_s``: outages are waited out (the
        store's own retries only cover short blips). Every storage error is retried."""
        policy = RetryPolicy(
            attempts=None,
            deadline_s=self.cfg.upload_timeout_s,
            initial_delay=min(self.cfg.retry_initial_s, self.cfg.retry_max_s),
            max_delay=self.cfg.retry_max_s,
            jitter=0.0,
            retry_on=lambda e: isinstance(e, StorageError),
        )
        try:
            return call_with_retry(fn, policy, f"deck: {what} of {self.storage.describe(key)}")
        except StorageError as e:
            raise StorageError(
                f"giving up on {what} of {self.storage.describe(key)} after "
                f"{self.cfg.upload_timeout_s:.0f} s: {e}"
            ) from e

    def _wait_for_parts(self, p: PendingPart) -> None:
        """Rank 0: until every rank's part manifest is at the destination; raises once a rank
        reports its part failed, or after ``commit_timeout_s``."""
        deadline = time.monotonic() + self.cfg.commit_timeout_s
        delay = 0.02
        folder = f"{step_dir(p.step)}/{p.ckpt_id}"
        missing = list(range(p.world_size))
        next_report = time.monotonic() + 30
        while True:
            try:
                missing = [
                    r
                    for r in missing
                    if not self.storage.exists(f"{folder}/{rank_manifest_name(r)}")
                ]
                self._raise_if_failed(p, [f"{folder}/{rank_failure_name(r)}" for r in missing])
            except StorageError as e:
                logger.warning("deck: cannot check rank parts of step %d yet: %s", p.step, e)
            if not missing:
                return
            if time.monotonic() > next_report:
                logger.warning(
                    "deck: step %d waits for the parts of rank(s) %s at %s (giving up in %.0f s)",
                    p.step,
                    missing,
                    self.storage.describe(folder),
                    deadline - time.monotonic(),
                )
                next_report = time.monotonic() + 30
            if time.monotonic() > deadline:
                raise DeckError(
                    f"step {p.step}: the parts of rank(s) {missing} did not arrive at "
                    f"{self.storage.describe(folder)} within {self.cfg.commit_timeout_s:.0f} s; "
                    "not committing it"
                )
            with self._idle:  # abandon() wakes it
                if (p.step, p.ckpt_id) not in self._abandoned:
                    self._idle.wait(delay)
            delay = min(delay * 2, 1.0)

    def _raise_if_failed(self, p: PendingPart, failure_keys: list[str]) -> None:
        """A missing rank part that will never come: its rank said so (a failure record, or at
        a collective through :meth:`abandon`)."""
        why = None
        for key in failure_keys:  # first: a record says what failed, the collective only who
            with contextlib.suppress(NotFoundError):
                why = self.storage.get(key).decode(errors="replace")
                break
        with self._idle:
            told = self._abandoned.pop((p.step, p.ckpt_id), None)
        if why is not None or told is not None:
            raise _NeverCommits(f"step {p.step} is not committed: {why or told}")

    def _cleanup(self, p: PendingPart, stats: CheckpointStats) -> None:
        """Forget a finished part: spool copies go (in the local tier they are the checkpoint)."""
        if self.spool_root is None:
            return
        failpoint("stager.cleanup.before")
        if self.tier == "cpu-ssd-remote":
            self._remove_files(p.step, list(p.files), remote=False)
        failpoint("stager.cleanup.after_files")
        self._remove_pending(p)
        self._release_spool(stats.spool_reserved)

    def _pending_path(self, p: PendingPart) -> str:
        assert self.spool_root is not None
        return os.path.join(
            self.spool_root,
            step_dir(p.step),
            p.ckpt_id,
            rank_manifest_name(p.rank).replace(".json", PENDING_SUFFIX),
        )

    def write_pending(self, p: PendingPart) -> None:
        """Durably record a staged part (temp + fsync + rename) so a restart can finish it."""
        path = self._pending_path(p)
        failpoint("stager.pending.before_write")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            # The temp file's name is the one a restart removes (_scan_spool).
            with atomic_file(path, tmp=path + ".tmp") as f:
                failpoint("stager.pending.write", f.name)
                f.write(dump_model(p))
                failpoint("stager.pending.before_rename")
        except OSError as e:
            raise self._spool_error(p.step, os.path.relpath(path, self.spool_root), e) from e
        failpoint("stager.pending.after_write")

    def _spool_error(self, step: int, key: str, e: OSError) -> SpoolError:
        hint = (
            "free space on the spool's disk, lower staging.spool_max_bytes below what it holds, or "
            "set staging.spool_dir to a larger local disk"
            if e.errno == errno.ENOSPC
            else "check the spool directory's permissions and disk"
        )
        return SpoolError(
            f"could not write {key} of step {step} to the spool {self.spool_root}: "
            f"{e.strerror or e}; {hint}. The checkpoint of step {step} is not taken (its rows stay "
            "pending for the next one); committed checkpoints are untouched"
        )

    def _remove_pending(self, p: PendingPart) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._pending_path(p))

    def _remove_files(self, step: int, files: list[str], remote: bool) -> None:
        for rel in files:
            key = f"{step_dir(step)}/{rel}"
            try:
                if remote:
                    self.storage.delete(key)
                elif self.spool_root is not None:
                    path = os.path.join(self.spool_root, key)
                    with self._syncs_lock:
                        self._early_syncs.pop(path, None)
                    os.remove(path)
            except (OSError, StorageError):
                pass

    def _release_spool(self, nbytes: int) -> None:
        if nbytes and self.tier == "cpu-ssd-remote":
            with self._idle:
                self._spool_bytes = max(0, self._spool_bytes - nbytes)
                self._idle.notify_all()


def _lower_priority(increment: int) -> None:
    """Lower the calling thread's CPU priority by ``increment`` nice levels (Linux: priorities are
    per thread; elsewhere a no-op)."""
    if not increment or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(
            os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment)
        )


def _fsync_path(path: str) -> None:
    """fsync a file or a folder by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
