"""The commit thread: takes each staged part to the destination and, on rank 0, commits it."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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


@dataclass
class _Item:
    """One part for the commit thread: staged by this process, or found in the spool."""

    pending: PendingPart  # of a staged part: without files and manifest until its writes are done
    progress: PartProgress  # the part's state: written by the commit thread only
    spool_reserved: int  # spool space held for it, given back at cleanup
    staged: StagedPart | None = None


class Committer:
    """The background thread (``deck-commit``) that finishes one rank's parts, in order.

    The training thread (through :class:`~deck.trainer.staging.Stager`) calls:

    1. :meth:`submit` -- a part every rank staged, or one found pending on restart;
    2. :meth:`take_failure` -- whether a part failed since the last call (the next checkpoint
       is then a full) and :meth:`take_failed` -- this rank's parts that failed since, to tell
       rank 0 at the next collective; on rank 0, :meth:`abandon` for the parts other ranks told
       it about;
    3. :meth:`flush` -- wait until every submitted part is committed or failed;
    4. :meth:`stop` -- once, after the last :meth:`flush`.

    The commit thread, for each part, in the order submitted (:meth:`_finish`):

    1. waits for the part's writes and pending record (``StagedPart.wait_written``);
    2. skips to cleanup when the destination already has it committed (after a restart);
    3. verifies a part found pending on restart against its manifest (torn spool files);
    4. fsyncs its spool files (durable-local);
    5. uploads them from the spool (``cpu-ssd-remote``; on the upload pool, with retries);
    6. puts the rank part manifest at the destination;
    7. rank 0: waits until every rank's part manifest is there (or a rank reports its part
       failed), checks a delta's parent is committed, writes the commit record;
    8. cleans up: spool copies (``cpu-ssd-remote``), the pending record, the spool space.

    A part that fails is recorded for :meth:`take_failure` (the next checkpoint is a full); on a
    rank other than 0 a failure record tells rank 0 at once (:meth:`_report_failed`). The thread
    never calls collectives.
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
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        # Parts another rank reported failed at a collective (step, id): rank 0 stops waiting.
        self._abandoned: dict[tuple[int, str], str] = {}
        # Parts of this rank that failed in the background, not yet told at a collective.
        self._failed_parts: list[tuple[int, str]] = []
        self._idle = threading.Condition()
        self._busy = 0
        # A part failed after training moved on (a full next), until take_failure() takes it.
        self._failure = False
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
        self._queue.put(_Item(pending, progress, spool_reserved, staged))

    def take_failed(self) -> list[tuple[int, str]]:
        """(step, id) of this rank's parts (rank > 0) that failed in the background since the
        last call: what a collective tells rank 0 (:meth:`abandon`)."""
        with self._idle:
            out, self._failed_parts = self._failed_parts, []
        return out

    def take_failure(self) -> bool:
        """Whether a part failed since the last call, and forget it: read and cleared in one step
        under the lock, so a failure recorded right after is kept for the next call."""
        with self._idle:
            failure, self._failure = self._failure, False
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

    # ---- commit thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        lower_priority(self.cfg.background_nice)
        while True:
            item = self._queue.get()
            if item is None:
                return
            pending = item.pending
            try:
                if item.staged is not None:
                    try:  # its writes (still running when training was released early)
                        item.staged.wait_written()
                        pending = item.staged.pending()
                    except Exception as e:
                        pending = pending.model_copy(update={"files": tuple(item.staged.files)})
                        raise NeverCommits(str(e)) from e
                self._finish(pending, item)
            except Exception as e:
                self._fail(pending, item, e)
            finally:
                try:
                    # Before the flush() it may wake: a flushed part's event has been delivered.
                    item.progress.end()
                finally:  # whatever ending it raised, a flush() must not wait for it forever
                    with self._idle:
                        self._busy -= 1
                        self._idle.notify_all()

    def _fail(self, pending: PendingPart, item: _Item, e: Exception) -> None:
        if pending.rank != 0 and item.progress.get().state not in ("uploaded", "committed"):
            self._report_failed(pending, e)
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
            self._failure = True
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
        key = f"{step_dir(p.step)}/{p.ckpt_id}/{rank_failure_name(p.rank)}"
        try:
            failpoint("stager.failure_record.put", key)
            self.dest.put_once(key, f"rank {p.rank}: {e}".encode())
        except (StorageError, OSError) as put_error:
            logger.warning(
                "deck: could not tell rank 0 through %s that step %d failed (%s); it learns at "
                "the next checkpoint or flush",
                self.dest.describe(key),
                p.step,
                put_error,
            )

    def _finish(self, p: PendingPart, item: _Item) -> None:
        if p.part is None:
            raise DeckError(f"pending part of step {p.step} has no rank manifest")
        progress = item.progress
        if self.dest.patient_committed_id(p.step) == p.ckpt_id:
            self._cleanup(p, item)
            progress.advance("committed")
            return
        part_key = f"{step_dir(p.step)}/{p.ckpt_id}/{rank_manifest_name(p.rank)}"
        # A crash after the part manifest went up (it is written last) may have removed the
        # spool copies already: the part is at the destination, only the commit is left.
        recovering = progress.get().state == "recovering"
        own: bytes | None = None  # the part manifest as written here (rank 0 commits with it)
        if not (recovering and self.dest.patient_exists(part_key)):
            own = self._put_part(p, progress, recovering, part_key, item.staged)
        # The time is the upload's on ranks > 0, the commit's on rank 0.
        progress.advance("uploaded", committed=p.rank != 0)
        if p.rank == 0:
            self._wait_for_parts(p)
            failpoint("stager.commit.before")
            self._commit(p, own)
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

    def _put_part(
        self,
        p: PendingPart,
        progress: PartProgress,
        recovering: bool,
        part_key: str,
        staged: StagedPart | None,
    ) -> bytes:
        """The part's files durable and at the destination, then its rank manifest (returned as
        written; ``staged``: the part as this process staged it, whose manifest its pending
        record already encoded)."""
        assert p.part is not None
        if recovering:
            failpoint("stager.recover.before_check")
            assert self.spool is not None  # a recovered part was found in the spool
            check_recovered(self.spool, p)
        if self.spool is not None:
            failpoint("stager.fsync.before")
            self.spool.fsync(p)
            failpoint("stager.fsync.after")
            progress.advance("durable", durable=True)
        if self.tier == "cpu-ssd-remote":
            self._upload(p)
        failpoint("stager.part_manifest.before_put")
        data = dump_model(p.part) if staged is None else with_checksum(staged.encoded_part())
        self.dest.patient_put(part_key, data)
        failpoint("stager.part_manifest.after_put")
        return data

    def _commit(self, p: PendingPart, own: bytes | None) -> None:
        """Rank 0, every rank's part is there: the commit record (a delta's parent must be
        committed). ``own``: rank 0's part manifest as this process wrote it, if it did."""
        if (
            p.kind is Kind.DELTA
            and p.parent is not None
            and self.dest.patient_committed_id(p.parent) != p.parent_id
        ):
            # A parent gone from the URI may mean the URI itself was deleted or replaced: the
            # fence says so first (and marks the lease lost, so the next checkpoint raises)
            self.dest.check_fence()
            raise CheckpointNotFoundError(
                f"step {p.step} is a delta of step {p.parent} ({p.parent_id}), which is not committed at "
                f"{self.dest.uri}; the next checkpoint will be a full"
            )
        self.dest.commit_once(p, own)

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
                    if not self.dest.exists_once(f"{folder}/{rank_manifest_name(r)}")
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
