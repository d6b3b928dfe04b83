"""The commit threads: take each staged part to the destination and, on rank 0, commit it.

Consecutive parts overlap: the files and part manifests of several parts go up at once, and rank
0 reads what the next commit needs (the other ranks' part manifests, the writer lease's fence)
while the previous commit record is being written. Commit records are written one at a time, in
the order the parts were submitted (step order), each only once its own parts are at the
destination and the one before it returned: a delta's record never before its parent's, and
never when its parent failed.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import queue
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deck.config import StagingConfig
from deck.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DeckError,
    LeaseHeldError,
    NotFoundError,
    SpoolError,
    StorageError,
)
from deck.failpoints import failpoint
from deck.format.manifest import (
    Kind,
    dump_model,
    rank_failure_name,
    rank_manifest_name,
    step_dir,
    with_checksum,
)
from deck.format.pending import PendingPart
from deck.storage.retry import is_out_of_space
from deck.trainer.staging.destination import Destination
from deck.trainer.staging.records import NeverCommits, PartProgress
from deck.trainer.staging.recovery import check_recovered
from deck.trainer.staging.spool import SpoolDir

if TYPE_CHECKING:
    from deck.trainer.staging.part import StagedPart

logger = logging.getLogger(__package__)

# Parts whose files and part manifest go to the destination at once. Each waits on the store's
# round trips, not on the CPU: on a slow store one part's requests take longer than the
# interval between checkpoints, and doing them one part after the other queued the commits up.
# Their files share the upload pool (upload_concurrency), which bounds the memory they hold.
PARTS_IN_FLIGHT = 4

# How many finished parts' outcomes the commit thread remembers (a later delta's parent is
# always a recent one); parts still in flight are never forgotten.
REMEMBERED_PARTS = 256


@dataclass
class _Item:
    """One part for the commit thread: staged by this process, or found in the spool."""

    pending: PendingPart  # of a staged part: without files and manifest until its writes are done
    progress: PartProgress  # the part's state: written by the commit threads only
    spool_reserved: int  # spool space held for it, given back at cleanup
    staged: StagedPart | None = None
    # its files written and fsynced (a staged part: taken there in submission order, whatever
    # the uploads of the parts before it wait for)
    durable: Future[None] | None = field(default=None, repr=False)
    put: Future[_Put] | None = field(default=None, repr=False)  # its files and part manifest
    recorded: bool = False  # its checkpoint is committed (whatever its cleanup did after)


@dataclass
class _Put:
    """A part whose files and rank part manifest are at the destination."""

    pending: PendingPart  # with its files and rank manifest
    own: bytes | None  # the part manifest as written here (None: it was there already)
    committed: bool = False  # its checkpoint was found committed (a restart): nothing to do


@dataclass
class _Reads:
    """Rank 0's reads for a commit that need nothing of the part, begun with it."""

    fence: Future[float] | None = None  # when the fence's read began (monotonic)
    parent: Future[str | None] | None = None  # the id the parent's step holds committed

    def wait(self) -> None:
        """Until they are done, whatever they found (the part failed for its own reason)."""
        for read in (self.fence, self.parent):
            if read is not None:
                read.exception()


@dataclass
class _Ready:
    """Rank 0: what the commit record of a part needs, read before it is its turn."""

    parts: dict[int, bytes]  # the other ranks' part manifests, as read
    parent_read: bool = False  # whether the parent's record was read (not committed here)
    parent_id: str | None = None  # the id the parent's step holds committed, if read
    fenced_at: float | None = None  # when the fence's read began (monotonic)


# In what take_failure() returns: a part failed, which one is not known (the next checkpoint is
# a full whatever its chain).
UNKNOWN_FAILURE = (-1, "")


class Committer:
    """The background threads that finish one rank's parts, committed in order.

    The training thread (through :class:`~deck.trainer.staging.Stager`) calls:

    1. :meth:`submit` -- a part every rank staged, or one found pending on restart;
    2. :meth:`take_failure` -- the parts that failed since the last call (the next checkpoint
       is a full if one of them is in its chain) and :meth:`take_failed` -- this rank's parts that failed since, to tell
       rank 0 at the next collective; on rank 0, :meth:`abandon` for the parts other ranks told
       it about;
    3. :meth:`flush` -- wait until every submitted part is committed or failed;
    4. :meth:`stop` -- once, after the last :meth:`flush`.

    Each part goes through three stages, on three kinds of threads:

    - **durable** (``deck-durable``, one part after the other, :meth:`_make_durable`): waits
      for a staged part's writes and pending record (``StagedPart.wait_written``) and fsyncs its
      spool files (durable-local: in the first tier). Apart from the uploads, so that a store
      that is down or slow holds no part out of the first tier: training goes on while the
      spool grows (a break-it finding: with the stage below holding every upload slot through
      an outage, the next parts were never fsynced, and training waited on
      ``staging.max_unwritten`` for the whole outage, told to checkpoint less often).
    - **put** (``deck-part``, up to :data:`PARTS_IN_FLIGHT` parts at once, :meth:`_put_part`):
      once the part is durable -- or, found pending after a restart, skips the rest when the
      destination already has it committed, else verifies the spooled files (torn files) and
      fsyncs them -- uploads them (``cpu-ssd-remote``; on the upload pool, with retries); puts
      the rank part manifest. A part of a rank other than 0 that fails here (or durable) writes
      its failure record at once.
    - **ready** (``deck-commit``, one part after the other, :meth:`_ready`): rank 0 reads the
      fence and, for a delta of a checkpoint another process committed, the parent's commit
      record (both begun beside the part's uploads), and once its own part is up the other
      ranks' part manifests (polling until every one is there, or a rank reports its part
      failed) -- while the part before is still being committed.
    - **end** (``deck-record``, one part after the other, :meth:`_end`): rank 0 checks a
      delta's parent is committed (known here for a parent committed by this process) and
      writes the commit record; then every rank cleans up: spool copies (``cpu-ssd-remote``),
      the pending record, the spool space. A failed part is recorded for :meth:`take_failure`
      (the next checkpoint is a full). So commit records go out one at a time in submission
      order, each after the one before it returned.

    None of these threads calls collectives.
    """

    def __init__(
        self,
        dest: Destination,
        cfg: StagingConfig,
        tier: str,
        spool: SpoolDir | None,
        uploads: ThreadPoolExecutor,
        *,
        label: str = "checkpoint",
    ) -> None:
        self.label = label  # what its parts are, in logs: "checkpoint" or "publish"
        self.dest = dest
        self.cfg = cfg
        self.tier = tier
        self.spool = spool
        self._uploads = uploads
        lower = functools.partial(lower_priority, cfg.background_nice)
        self._durable = ThreadPoolExecutor(1, thread_name_prefix="deck-durable", initializer=lower)
        self._parts = ThreadPoolExecutor(
            PARTS_IN_FLIGHT, thread_name_prefix="deck-part", initializer=lower
        )
        # One thread: the commit records (and every part's end) go out in submission order.
        self._records = ThreadPoolExecutor(1, thread_name_prefix="deck-record", initializer=lower)
        # The reads before a commit that do not depend on each other: the fence and a parent.
        self._reads = ThreadPoolExecutor(2, thread_name_prefix="deck-read", initializer=lower)
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        # Parts another rank reported failed at a collective (step, id): rank 0 stops waiting.
        self._abandoned: dict[tuple[int, str], str] = {}
        # Parts of this rank that failed in the background, not yet told at a collective.
        self._failed_parts: list[tuple[int, str]] = []
        # (step, id) of the parts submitted here -> committed (rank 0; uploaded elsewhere) or
        # not, None while in flight: a delta's parent committed by this process is not read
        # back from the store.
        self._outcomes: collections.OrderedDict[tuple[int, str], bool | None] = (
            collections.OrderedDict()
        )
        self._idle = threading.Condition()
        self._busy = 0
        # (step, id) of the parts that failed after training moved on (a full next if one is
        # in the chain), until take_failure() takes them.
        self._failure: set[tuple[int, str]] = set()
        self._thread = threading.Thread(target=self._run, name="deck-commit", daemon=True)
        self._thread.start()

    # ---- training thread -------------------------------------------------------------------------
    def submit(
        self,
        pending: PendingPart,
        progress: PartProgress,
        spool_reserved: int,
        staged: StagedPart | None = None,
    ) -> None:
        """Finish ``pending`` in the background, moving ``progress`` on as it goes.
        ``spool_reserved``: the spool space the part holds (given back once it is done);
        ``staged``: the part as this process staged it (its writes may still be running), or
        None for a part found pending on restart."""
        with self._idle:
            self._busy += 1
            self._outcomes[(pending.step, pending.ckpt_id)] = None
        item = _Item(pending, progress, spool_reserved, staged)
        if staged is not None:
            item.durable = self._durable.submit(self._make_durable, item)
        item.put = self._parts.submit(self._put_part, item)
        self._queue.put(item)

    def take_failed(self) -> list[tuple[int, str]]:
        """(step, id) of this rank's parts (rank > 0) that failed in the background since the
        last call: what a collective tells rank 0 (:meth:`abandon`)."""
        with self._idle:
            out, self._failed_parts = self._failed_parts, []
        return out

    def forget_committed(self) -> None:
        """A restore moved the chain: a delta's parent is the restored step, which another
        process (or this one, long ago) committed and GC may have deleted since. Forget which
        parts committed here, so that the next delta's commit reads its parent's record."""
        with self._idle:
            for key in [k for k, v in self._outcomes.items() if v is not None]:
                del self._outcomes[key]

    def take_failure(self) -> set[tuple[int, str]]:
        """(step, id) of the parts that failed since the last call, and forget them: read and
        cleared in one step under the lock, so a failure recorded right after is kept for the
        next call."""
        with self._idle:
            failure, self._failure = self._failure, set()
        return failure

    def abandon(self, step: int, ckpt_id: str, why: str) -> None:
        """Rank 0: another rank's part of ``step`` failed; do not wait for it (nor commit)."""
        with self._idle:
            self._abandoned[(step, ckpt_id)] = why
            self._idle.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted part is committed or failed; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._records.shutdown()
        self._parts.shutdown()
        self._durable.shutdown()
        self._reads.shutdown()

    # ---- commit thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        lower_priority(self.cfg.background_nice)
        while True:
            item = self._queue.get()
            if item is None:
                return
            assert item.put is not None
            # Rank 0's reads that do not need the part (the fence, a parent's record) begin
            # now, beside the part's own uploads.
            reads = self._reads_before(item.pending) if item.pending.rank == 0 else _Reads()
            put: _Put | None = None
            ready: _Ready | None = None
            error: Exception | None = None
            try:
                put = item.put.result()
                if put.pending.rank == 0 and not put.committed:
                    ready = self._ready(put.pending, reads)
            except Exception as e:
                error = e
                reads.wait()  # they end before the part does; its error says why it failed
            self._records.submit(self._end, item, put, ready, error)

    def _end(
        self, item: _Item, put: _Put | None, ready: _Ready | None, error: Exception | None
    ) -> None:
        """The part's last stage, in submission order: its commit record (rank 0), cleanup, or
        its failure; then the part has ended."""
        try:
            if error is None:
                assert put is not None
                try:
                    self._commit(item, put, ready)
                except Exception as e:
                    error = e
            if error is not None:
                self._fail(put.pending if put is not None else item.pending, item, error)
            key = (item.pending.step, item.pending.ckpt_id)
            with self._idle:
                self._outcomes[key] = error is None or item.recorded
                while len(self._outcomes) > REMEMBERED_PARTS:
                    first = next(iter(self._outcomes))
                    if self._outcomes[first] is None:
                        break
                    del self._outcomes[first]
        finally:
            try:
                # Before the flush() it may wake: a flushed part's event has been delivered.
                item.progress.end()
            finally:  # whatever ending it raised, a flush() must not wait for it forever
                with self._idle:
                    self._busy -= 1
                    self._idle.notify_all()

    def _fail(self, pending: PendingPart, item: _Item, e: Exception) -> None:
        full_disk = is_out_of_space(e)
        error = str(e)
        if full_disk and not isinstance(e.__cause__, SpoolError):  # a spool error says it all
            error += (
                f"; a disk is full: the part's files are removed and the next checkpoint is a "
                f"full. Free space (deck gc with a retention policy removes old checkpoints at "
                f"{self.dest.uri}) or move the URI{' or spool_dir' if self.tier != 'local' else ''}"
                " to a larger disk"
            )
        item.progress.fail(error)
        with self._idle:
            self._failure.add((pending.step, pending.ckpt_id))
        logger.error(
            "deck: %s of step %d (%s) at %s failed in the background: %s",
            self.label,
            pending.step,
            pending.ckpt_id,
            self.dest.uri,
            error,
        )
        if full_disk or isinstance(
            e, (CheckpointNotFoundError, CorruptCheckpointError, NeverCommits, LeaseHeldError)
        ):
            # It can never commit (its parent is gone, its spooled files are torn, a rank's
            # part failed, or the fence refused it: this job's lease was lost, and a restart
            # must not commit it into what another trainer wrote since), or it must not wait
            # (its disk is full: its files are what the next checkpoint needs room for): drop
            # it, or every restart would retry it.
            try:
                self._cleanup(pending, item, drop=True)
            except Exception as cleanup_error:  # what is left is removed at the next restart
                logger.warning(
                    "deck: could not remove the files of failed step %d (%s): %s",
                    pending.step,
                    pending.ckpt_id,
                    cleanup_error,
                )

    def _report_failed(self, p: PendingPart, e: BaseException) -> None:
        """A part of a rank other than 0 failed before its rank manifest went up: rank 0 must
        not wait for it. A failure record at the destination tells it at once (best effort: the
        store may be what failed: one attempt, never waiting out an outage); :meth:`take_failed`
        tells it at the next collective."""
        with self._idle:
            self._failed_parts.append((p.step, p.ckpt_id))
        self.dest.put_failure_record(p, str(e))

    # ---- stage 1: the part's files and manifest (deck-durable, deck-part threads) -----------------
    def _make_durable(self, item: _Item) -> None:
        """A staged part's files written (still running when training was released early) and,
        in a spool, fsynced: the part is in the first tier."""
        assert item.staged is not None
        try:
            item.staged.wait_written()
            item.pending = item.staged.pending()
        except Exception as e:
            item.pending = item.pending.model_copy(update={"files": tuple(item.staged.files)})
            raise NeverCommits(str(e)) from e
        if self.spool is not None:
            failpoint("stager.fsync.before")
            self.spool.fsync(item.pending)
            failpoint("stager.fsync.after")
            item.progress.advance("durable", durable=True)

    def _put_part(self, item: _Item) -> _Put:
        """The part at the destination: its files durable and uploaded, then its rank part
        manifest. A failure of a rank other than 0 is reported at once (not in turn): rank 0
        may be waiting for this very part."""
        try:
            if item.durable is not None:
                item.durable.result()
            return self._upload_part(item.pending, item)
        except Exception as e:
            done = item.progress.get().state in ("uploaded", "committed")
            if item.pending.rank != 0 and not done:
                self._report_failed(item.pending, e)
            raise

    def _upload_part(self, p: PendingPart, item: _Item) -> _Put:
        if p.part is None:
            raise DeckError(f"pending part of step {p.step} has no rank manifest")
        progress = item.progress
        # A freshly staged part has an id no store holds yet: only a part found pending after
        # a restart may already be committed (a crash after its commit record, before cleanup).
        recovering = progress.get().state == "recovering"
        if recovering and self.dest.patient_committed_id(p.step) == p.ckpt_id:
            return _Put(p, None, committed=True)
        part_key = f"{step_dir(p.step)}/{p.ckpt_id}/{rank_manifest_name(p.rank)}"
        # A crash after the part manifest went up (it is written last) may have removed the
        # spool copies already: the part is at the destination, only the commit is left.
        own: bytes | None = None  # the part manifest as written here (rank 0 commits with it)
        if not (recovering and self.dest.patient_exists(part_key)):
            if recovering:  # (a staged part was made durable before: _make_durable)
                failpoint("stager.recover.before_check")
                assert self.spool is not None  # a recovered part was found in the spool
                check_recovered(self.spool, p)
                failpoint("stager.fsync.before")
                self.spool.fsync(p)
                failpoint("stager.fsync.after")
                progress.advance("durable", durable=True)
            if self.tier == "cpu-ssd-remote":
                self._upload(p)
            failpoint("stager.part_manifest.before_put")
            staged = item.staged
            own = dump_model(p.part) if staged is None else with_checksum(staged.encoded_part())
            self.dest.patient_put(part_key, own)
            failpoint("stager.part_manifest.after_put")
        # The time is the upload's on ranks > 0, the commit's on rank 0.
        progress.advance("uploaded", committed=p.rank != 0)
        return _Put(p, own)

    def _upload(self, p: PendingPart) -> None:
        assert self.spool is not None
        spool = self.spool

        def one(rel: str) -> None:
            data = spool.store.get(spool.key(p.step, rel))  # never through a link
            failpoint("stager.upload.before_put")
            self.dest.patient_put(f"{step_dir(p.step)}/{rel}", data)
            failpoint("stager.upload.after_put")

        for fut in [self._uploads.submit(one, rel) for rel in p.files]:
            fut.result()

    # ---- stage 2: rank 0's reads before a commit (deck-commit thread) ----------------------------
    def _reads_before(self, p: PendingPart) -> _Reads:
        """Rank 0: start the fence's read, and the parent's commit record when no part of this
        process is the parent (none is read for a parent committed here)."""
        reads = _Reads()
        if self.dest.fenced:
            reads.fence = self._reads.submit(self._fence)
        if p.kind is Kind.DELTA and p.parent is not None and p.parent_id is not None:
            with self._idle:
                ours = (p.parent, p.parent_id) in self._outcomes
            if not ours:
                reads.parent = self._reads.submit(self.dest.patient_committed_id, p.parent)
        return reads

    def _ready(self, p: PendingPart, reads: _Reads) -> _Ready:
        """Rank 0, once its own part is up: every other rank's part manifest (waited for), and
        the reads begun before (:meth:`_reads_before`), while the part before this one may
        still be committed."""
        try:
            parts = self._wait_for_parts(p)
        except BaseException:
            reads.wait()
            raise
        fenced_at = None
        if reads.fence is not None:
            try:
                fenced_at = reads.fence.result()
            except StorageError as e:
                # Read while the store was down, beside uploads that waited the outage out: the
                # commit reads the fence again (a failure then fails the part)
                logger.info("deck: step %d reads its commit fence again: %s", p.step, e)
        return _Ready(
            parts,
            parent_read=reads.parent is not None,
            parent_id=None if reads.parent is None else reads.parent.result(),
            fenced_at=fenced_at,
        )

    def _fence(self) -> float:
        """The fence's store read; when it began (monotonic)."""
        began = time.monotonic()
        self.dest.check_fence()
        return began

    def _wait_for_parts(self, p: PendingPart) -> dict[int, bytes]:
        """Rank 0: every other rank's part manifest, as read from the destination, once all are
        there; raises once a rank reports its part failed, or after ``commit_timeout_s``. The
        parts are read at once (usually all there: every rank's part goes up at the same
        pace); then each poll lists the checkpoint's folder: which part manifests and failure
        records have come."""
        deadline = time.monotonic() + self.cfg.commit_timeout_s
        delay = 0.02
        folder = f"{step_dir(p.step)}/{p.ckpt_id}"
        keys = {r: f"{folder}/{rank_manifest_name(r)}" for r in range(p.world_size) if r != p.rank}
        got: dict[int, bytes] = {}
        first = True
        next_report = time.monotonic() + 30
        while True:
            missing = [r for r in keys if r not in got]
            try:
                if not first:
                    listed = set(self.dest.list_once(f"{folder}/"))
                    failed = [r for r in missing if rank_failure_name(r) in listed]
                    self._raise_if_failed(p, [f"{folder}/{rank_failure_name(r)}" for r in failed])
                    missing = [r for r in missing if rank_manifest_name(r) in listed]
                read = self.dest.get_records_once([keys[r] for r in missing])
                got.update((r, data) for r in missing if (data := read[keys[r]]) is not None)
            except StorageError as e:
                logger.warning("deck: cannot check rank parts of step %d yet: %s", p.step, e)
            first = False
            missing = [r for r in keys if r not in got]
            if not missing:
                return got
            if time.monotonic() > next_report:
                logger.warning(
                    "deck: step %d waits for the parts of rank(s) %s at %s (giving up in %.0f s)",
                    p.step,
                    missing,
                    self.dest.describe(folder),
                    deadline - time.monotonic(),
                )
                next_report = time.monotonic() + 30
            if time.monotonic() > deadline:
                raise DeckError(
                    f"step {p.step}: the parts of rank(s) {missing} did not arrive at "
                    f"{self.dest.describe(folder)} within {self.cfg.commit_timeout_s:.0f} s; "
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
                why = self.dest.failure_reason_once(key)
                break
        with self._idle:
            told = self._abandoned.pop((p.step, p.ckpt_id), None)
        if why is not None or told is not None:
            raise NeverCommits(f"step {p.step} is not committed: {why or told}")

    # ---- stage 3: the commit record and cleanup (deck-record thread) -----------------------------
    def _commit(self, item: _Item, put: _Put, ready: _Ready | None) -> None:
        p, progress = put.pending, item.progress
        if put.committed:
            item.recorded = True
            self._cleanup(p, item)
            progress.advance("committed")
            return
        if p.rank == 0:
            assert ready is not None
            failpoint("stager.commit.before")
            self._check_parent(p, ready)
            self.dest.commit_once(p, put.own, ready.parts, ready.fenced_at)
            item.recorded = True
            progress.advance("committed", committed=True)
        self._cleanup(p, item)
        now = progress.get()
        logger.debug(
            "deck: step %d %s on rank %d at %s: durable-local %s s, %s %.3f s after the snapshot",
            p.step,
            now.state,
            p.rank,
            self.dest.uri,
            "-" if now.durable_local_s is None else f"{now.durable_local_s:.3f}",
            "committed" if p.rank == 0 else "uploaded",
            now.committed_s,
        )

    def _check_parent(self, p: PendingPart, ready: _Ready) -> None:
        """A delta commits only on a committed parent: one this process committed (its record
        went out before this one, in this thread), or one the store holds."""
        if p.kind is not Kind.DELTA or p.parent is None or p.parent_id is None:
            return
        with self._idle:
            here = self._outcomes.get((p.parent, p.parent_id))
        if here is None:
            read = ready.parent_id if ready.parent_read else None
            if not ready.parent_read:  # ours, but forgotten since (far behind): ask the store
                read = self.dest.patient_committed_id(p.parent)
            committed = read == p.parent_id
            if not committed:
                # A parent gone from the URI may mean the URI itself was deleted or replaced:
                # the fence says so first (and marks the lease lost, so the next checkpoint
                # raises)
                self.dest.check_fence()
        else:
            committed = here
        if not committed:
            raise CheckpointNotFoundError(
                f"step {p.step} is a delta of step {p.parent} ({p.parent_id}), which is not committed at "
                f"{self.dest.uri}; the first checkpoint taken once this is known is a full (deltas "
                "taken before then on this one fail alike)"
            )

    def _cleanup(self, p: PendingPart, item: _Item, drop: bool = False) -> None:
        """Forget a finished part: spool copies go (in the local tier they are the checkpoint).
        ``drop``: the part failed and will never commit: its files go in the local tier too
        (no commit record names them: rank 0 writes it last, once every part is up, and
        none of the failures that drop a part comes after it)."""
        if self.spool is None:
            return
        failpoint("stager.cleanup.before")
        if self.tier == "cpu-ssd-remote" or drop:
            self.spool.remove_files(p.step, list(p.files))
        failpoint("stager.cleanup.after_files")
        self.spool.remove_pending(p)
        self.spool.remove_folders(p)
        self.spool.release(item.spool_reserved)


def lower_priority(increment: int) -> None:
    """Lower the calling thread's CPU priority by ``increment`` nice levels (Linux: priorities are
    per thread; elsewhere a no-op)."""
    if not increment or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(
            os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment)
        )
