"""The stager the training thread drives: one rank's parts to the destination, in the background."""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import itertools
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from deck.config import LOCAL_TIER_NEEDS, StagingConfig
from deck.errors import ConfigError
from deck.format.chunks import Buffer
from deck.format.manifest import step_dir
from deck.format.pending import PendingPart
from deck.storage import Storage
from deck.trainer.staging.committer import Committer, lower_priority
from deck.trainer.staging.destination import Destination
from deck.trainer.staging.part import StagedPart
from deck.trainer.staging.pool import BufferPool
from deck.trainer.staging.records import CheckpointStats, PartProgress
from deck.trainer.staging.recovery import recover
from deck.trainer.staging.spool import SpoolDir

if TYPE_CHECKING:
    from deck.trainer.coordination import Coordinator

logger = logging.getLogger(__name__)
T = TypeVar("T")

# The longest a checkpoint's stall keeps the first tier's writer from starting a file
# (:meth:`Stager.stall`): a safety valve, never reached when every wait opens the gate first.
STALL_GATE_MAX_S = 1.0

RECENT_PARTS = 8  # the pool holds the largest of this many recent delta parts


def new_pool(staging: StagingConfig, pinned: bool = False, shared: bool = False) -> BufferPool:
    """The chunk buffer pool of a stager: a buffer holds one chunk, or one bundle of chunks
    filled in place (bundle_bytes)."""
    size = max(staging.chunk_bytes, staging.bundle_bytes)
    return BufferPool(
        staging.chunks_in_flight,
        size,
        cap=staging.snapshot_memory_bytes // size,
        pinned=pinned,
        shared=shared,
    )


def spool_root(tier: str, cfg: StagingConfig, storage: Storage) -> str | None:
    """The spool folder of ``storage`` in ``tier`` (made if needed); None: no spool."""
    if tier == "local":
        root = storage.local_path()
        assert root is not None
        return root
    if tier == "cpu-ssd-remote":
        base = cfg.spool_dir or os.path.join(tempfile.gettempdir(), "deck-spool")
        key = hashlib.sha1(storage.uri.encode()).hexdigest()[:16]
        root = os.path.join(base, key)
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"staging.spool_dir: cannot make the spool folder {root} ({e.strerror}): name a "
                "writable local folder, on a local SSD, in StagingConfig(spool_dir=...)"
            ) from e
        return root
    return None


def resolve_tier(staging: StagingConfig, storage: Storage) -> str:
    """The tier actually used: ``auto`` is ``local`` for local destinations, else spool + upload."""
    if staging.tiers == "auto":
        return "local" if storage.local_path() is not None else "cpu-ssd-remote"
    if staging.tiers == "local" and storage.local_path() is None:
        raise ConfigError(f"staging.tiers='local' {LOCAL_TIER_NEEDS} {storage.uri}")
    return staging.tiers


class Stager:
    """Moves checkpoint parts of one rank from CPU buffers to the destination, in the background.

    The training thread's side. Behind it: the spool writer (``deck-spool``, one thread: files
    and pending records in the order submitted), the fsync thread (``deck-fsync``), the upload
    pool (``deck-upload``) and the commit thread (``deck-commit``, :class:`Committer`).

    The training thread calls, per checkpoint:

    1. :meth:`reserve` -- room in the spool for the part (False: ``spool_full="skip"``);
    2. :meth:`begin` -- the part's :class:`StagedPart`, which the rank's ``RankPartWriter``
       fills: each file goes through :meth:`write_out` to the spool writer (or, without a
       spool, the upload pool) and its pool buffer returns once written -- held until step 4
       when :meth:`size_pool` says so (a steady delta with ``release="in_memory"``);
    3. ``StagedPart.seal`` -- queues the part's pending record behind its files
       (:meth:`record_pending`); with ``release="first_tier"`` then ``StagedPart.wait_written``,
       before the ranks agree the part is staged;
    4. :meth:`enqueue` once every rank staged its part, so its writes start and the commit
       thread finishes it -- or :meth:`discard` when a rank did not (held writes never start);
    5. at the next collective: :meth:`take_failure` (whether a part failed: the next
       checkpoint is a full), :meth:`take_failed` (this rank's parts that failed in the
       background, for rank 0) and, on rank 0, :meth:`abandon` for those other ranks told.

    Once per process: :meth:`recover` before the first checkpoint (collective), :meth:`flush`
    to wait for the background, :meth:`close` last.
    """

    def __init__(
        self,
        storage: Storage,
        staging: StagingConfig,
        rank: int,
        pinned: bool = False,
        fence: Callable[[], None] | None = None,
        gone: Callable[[], bool] | None = None,
        label: str = "checkpoint",
        pool: BufferPool | None = None,
        spool_space: Callable[[int], None] | None = None,
    ):
        """``pool`` and ``spool_space``: in a staging process, the training process's shared
        buffers as mapped here, and where the spool space a part gives back is counted."""
        self.storage = storage
        self.cfg = staging
        self.rank = rank
        self.tier = resolve_tier(staging, storage)
        self.pool = pool or new_pool(staging, pinned)
        self._recent_needs: collections.deque[int] = collections.deque(maxlen=RECENT_PARTS)
        self.spool_root: str | None = self._spool_root()
        lower = functools.partial(lower_priority, staging.background_nice)
        # Released at the snapshot, training does not wait for the spool writer (its checksums,
        # records and writes): it yields the CPU to training like the other background threads.
        self._writer = ThreadPoolExecutor(
            1,
            thread_name_prefix="deck-spool",
            initializer=lower if staging.release == "in_memory" else None,
        )
        self._syncer = ThreadPoolExecutor(1, thread_name_prefix="deck-fsync", initializer=lower)
        # The training thread's own reads of the store that can overlap its copy (not lowered:
        # it waits for them in the stall)
        self._aside = ThreadPoolExecutor(1, thread_name_prefix="deck-aside")
        # Copy-on-write parts' rows, copied after the stall (deck.trainer.cow). Not lowered:
        # until it is done every lookup checks its rows against the part's
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="deck-copy")
        # The lookups' copies of such rows before their backward writes them, beside the step
        # (:meth:`deck.trainer.tracker.TrackerStore.guard`). Not lowered: a backward waits.
        self.guard_runner = ThreadPoolExecutor(1, thread_name_prefix="deck-guard")
        # Cleared while the training thread is stalled in a checkpoint (:meth:`stall`); writes
        # are numbered as submitted, and those submitted before the stall began wait for it
        self._writes_may_start = threading.Event()
        self._writes_may_start.set()
        self._write_numbers = itertools.count()
        self._stalled_from: int | None = None
        self._stalled_thread: int | None = None
        self._uploads = ThreadPoolExecutor(
            staging.upload_concurrency, thread_name_prefix="deck-upload", initializer=lower
        )
        self._spool = (
            None
            if self.spool_root is None
            else SpoolDir(
                self.spool_root,
                staging,
                self.tier == "cpu-ssd-remote",
                syncer=self._syncer,
                released=spool_space,
            )
        )
        self._dest = Destination(storage, staging, fence, gone)
        self._committer = Committer(
            self._dest, staging, self.tier, self._spool, self._uploads, label=label
        )

    def _spool_root(self) -> str | None:
        return spool_root(self.tier, self.cfg, self.storage)

    # ---- training thread -------------------------------------------------------------------------
    def reserve(self, nbytes: int) -> bool:
        """Room for ``nbytes`` in the spool: waits (``block``) or returns False (``skip``)."""
        return self._spool is None or self._spool.reserve(nbytes, on_wait=self.resume_writes)

    def size_pool(self, staged: StagedPart, needed: int, full: bool) -> bool:
        """Size the buffer pool for ``staged``, a part that fills ``needed`` buffers, so it
        never waits for one: deltas set the pool's size (the largest of the last few, so the
        next one finds its buffers warm), a full borrows up to the cap for itself only. Returns
        whether the cap (``snapshot_memory_bytes``) won. Buffers earlier parts still hold (a
        full being written) come on top, within the cap: a part waits for another part's writes
        only when the cap leaves it no room.

        Released in memory, a part the pool already holds free buffers for (a steady delta)
        keeps its writes until :meth:`enqueue`, after the ranks' vote: nothing competes with
        the stalled training threads. A larger part (a full, a first delta) writes as it fills,
        so its buffers come back to be reused instead of new ones being faulted in the stall."""
        pool = self.pool
        warm = needed <= pool.allocated - pool.in_use
        if not full:
            self._recent_needs.append(needed)
        if warm and self.cfg.release == "in_memory":
            staged.hold()
        want = max(needed, *self._recent_needs, 0)
        self._size_beside_others(want, own=0)
        return want > pool.cap

    def _settle_pool(self, writing: int) -> None:
        """After a part is handed on (``writing``: the pool buffers it still holds): back to
        the deltas' size plus the buffers earlier parts still hold (a full's, whose writes
        this part's queue behind), so those are kept as they come back and the next delta takes
        them instead of waiting for them; other buffers a full borrowed are freed as they come
        back, extra free ones are freed and missing ones made ready off the training thread.
        Before the first delta the pool keeps what the full borrowed and makes no more (that
        delta sizes it): faulting in the rest of the full's need would cost hundreds of ms of
        background CPU, while deltas are taken, for buffers the first delta frees. The cap
        (``snapshot_memory_bytes``) bounds it all."""
        if self._recent_needs:
            self._size_beside_others(max(self._recent_needs), own=writing)
            self._syncer.submit(self._settle_buffers)

    def _size_beside_others(self, want: int, own: int) -> None:
        """Size the pool to ``want`` buffers plus those other parts still hold (``own``: the
        buffers in use that are the sizing part's own), within the cap."""
        self.pool.size_for(want + max(0, self.pool.in_use - own))

    def _settle_buffers(self) -> None:
        self.pool.trim()
        self.pool.prefault()

    @contextlib.contextmanager
    def stall(self) -> Iterator[None]:
        """While the training thread is stalled in a checkpoint, the first tier's writer starts
        no file of an earlier part (e.g. a full still being written): its checksums, records and
        writes (Python between system calls, at a lower priority) would take the GIL each time
        the stalled thread lets it go and hold it while descheduled. Measured: a delta taken
        while a 2 GiB full is written stalled 8-15 ms instead of 6-7 ms. Files the stalled
        checkpoint itself writes as it fills (a full, ``first_tier``) go on: its buffers come
        back and its writes overlap its copy. Any wait of the training thread for writes opens
        the gate first (:meth:`resume_writes`), and the writer never waits more than
        ``STALL_GATE_MAX_S``."""
        self._stalled_from = next(self._write_numbers)
        self._stalled_thread = threading.get_ident()
        self._writes_may_start.clear()
        try:
            yield
        finally:
            self._stalled_from = self._stalled_thread = None
            self._writes_may_start.set()

    def resume_writes(self) -> None:
        """Let the writer start files again within a :meth:`stall`, when the stalled thread is
        about to wait for writes (buffers, a ``first_tier`` release, a dropped part, spool
        space); the commit thread starting a part's writes leaves the gate shut."""
        if threading.get_ident() == self._stalled_thread:
            self._writes_may_start.set()

    def aside(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on a thread of its own while the training thread goes on (it waits for the
        result within the same checkpoint); its exception is the future's."""
        return self._aside.submit(fn)

    def begin(self, info: PendingPart, reserved: int) -> StagedPart:
        """Start staging a part; ``reserved`` is what :meth:`reserve` granted for it."""
        return StagedPart(self, info, reserved)

    def write_out(
        self,
        step: int,
        rel: str,
        data: Buffer | Callable[[], bytes],
        nbytes: int | None,
        make_record: Callable[[], None],
        pooled: bool,
    ) -> Future[None]:
        """Write one file to the first tier (spool, or upload for cpu-remote), after
        ``make_record`` (its checksum and record, from the bytes while the buffer is held): the
        first ``nbytes`` of a buffer, or the bytes ``data()`` makes here (``nbytes`` None)."""
        spool = self._spool
        number = next(self._write_numbers)

        def write() -> None:
            stalled_from = self._stalled_from
            if stalled_from is not None and number < stalled_from:
                self._writes_may_start.wait(STALL_GATE_MAX_S)
            try:
                body = data() if callable(data) else data
                size = len(body) if nbytes is None else nbytes
                if spool is not None:
                    spool.write(step, rel, body, size, make_record)
                else:
                    make_record()
                    self._dest.patient_put(
                        f"{step_dir(step)}/{rel}", bytes(memoryview(body)[:size])
                    )
            finally:
                if pooled:
                    self.pool.release(data)  # type: ignore[arg-type]

        return (self._uploads if spool is None else self._writer).submit(write)

    def record_pending(self, staged: StagedPart) -> Future[None]:
        """Write ``staged``'s pending record on the spool writer, after the files queued before
        it; skipped when one of them failed (the part is failing anyway)."""
        assert self._spool is not None
        spool = self._spool

        def record() -> None:
            if staged.error() is None:
                spool.write_pending(staged.pending(), staged.encoded_part())

        return self._writer.submit(record)

    def enqueue(
        self,
        staged: StagedPart,
        stats: CheckpointStats,
        copied: Callable[[], None] = lambda: None,
    ) -> None:
        """Every rank staged its part (in buffers or already in the first tier): go on in the
        background, starting by waiting for this part's writes (its manifest is built then).
        A copy-on-write part's rows are copied first (``copied()`` once they all are)."""
        staged.start_writes()
        staged.start_copy(self._copier, copied)
        self._committer.submit(staged.info, stats.progress, staged.reserved, staged)
        self._settle_pool(writing=staged.pooled)

    def hand_on(self, staged: StagedPart, progress: PartProgress) -> None:
        """A staging process: the part its training process staged goes to the commit thread
        (:meth:`enqueue` without the training process's side)."""
        staged.start_writes()
        self._committer.submit(staged.info, progress, staged.reserved, staged)

    def hand_on_recovered(self, p: PendingPart, progress: PartProgress, reserved: int) -> None:
        """A staging process: a part its training process found pending in the spool."""
        self._committer.submit(p, progress, reserved)

    def forget_committed(self) -> None:
        """After a restore: the next delta's commit checks its parent in the store
        (:meth:`Committer.forget_committed`)."""
        self._committer.forget_committed()

    def take_failure(self) -> set[tuple[int, str]]:
        """(step, id) of the parts that failed after training moved on since the last call (the
        next checkpoint must be a full if one is in its chain; :data:`UNKNOWN_FAILURE`: some
        part did, which one is not known); taken atomically, so a failure recorded while the
        ranks vote is kept for the next vote instead of being cleared with this one."""
        return self._committer.take_failure()

    def take_failed(self) -> list[tuple[int, str]]:
        """(step, id) of this rank's parts (rank > 0) that failed in the background since the
        last call: what a collective tells rank 0 (:meth:`abandon`)."""
        return self._committer.take_failed()

    def abandon(self, step: int, ckpt_id: str, why: str) -> None:
        """Rank 0: another rank's part of ``step`` failed; do not wait for it (nor commit)."""
        self._committer.abandon(step, ckpt_id, why)

    def discard(self, staged: StagedPart) -> None:
        """Drop a part that will not be committed (another rank failed)."""
        staged.drop_held()
        try:
            staged.wait_written(seal=False)  # nothing may still be writing what is removed
        except Exception as e:  # the part is dropped anyway: its write error changes nothing
            logger.debug(
                "deck: dropped part of step %d had a failed write: %s", staged.info.step, e
            )
        if self._spool is None:
            self._dest.best_effort_delete(staged.info.step, staged.files)
        else:
            self._spool.remove_files(staged.info.step, staged.files)
            self._spool.remove_pending(staged.info)
            self._spool.release(staged.reserved)
        self._settle_pool(writing=0)  # its buffers are back

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every enqueued part is committed or failed; False on timeout."""
        return self._committer.flush(timeout)

    def close(self) -> None:
        self.flush()
        self._committer.stop()
        self._writer.shutdown()
        self._syncer.shutdown()
        self._aside.shutdown()
        self._copier.shutdown()
        self.guard_runner.shutdown()
        self._uploads.shutdown()

    # ---- restart ---------------------------------------------------------------------------------
    def recover(
        self, coord: Coordinator | None = None, newest_epoch: int | None = None
    ) -> list[CheckpointStats]:
        """Find this rank's pending parts in the spool and finish or discard them.

        Collective when ``coord`` is given (call it on every rank, on the training thread): a
        crash can leave a part pending on some ranks only (a rank died before finishing its
        snapshot). Such a part can never commit, so it is discarded at once instead of rank 0
        waiting ``commit_timeout_s`` for the missing rank. Spool files of this rank without a
        pending record (a snapshot cut short) and torn record temps are removed. A part of an
        epoch older than ``newest_epoch`` (the newest at the URI) is discarded: a newer timeline
        was written since."""
        return recover(
            self._spool, self._dest, self.rank, coord, self._committer.submit, newest_epoch
        )
