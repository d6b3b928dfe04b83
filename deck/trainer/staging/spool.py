"""The spool: a rank's staged files and pending records on local disk.

In the ``local`` tier the spool is the destination folder itself; in ``cpu-ssd-remote`` it is
scratch space (``staging.spool_dir``) whose files go once uploaded, its size bounded by
``staging.spool_max_bytes``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from deck.config import StagingConfig
from deck.errors import SpoolError, StorageError, UnsafePathError
from deck.failpoints import failpoint
from deck.format.chunks import Buffer
from deck.format.manifest import dump_model, rank_dir, step_dir
from deck.format.pending import PendingPart, pending_name
from deck.storage.atomic import atomic_file
from deck.storage.local import LocalStorage, write_new_file
from deck.storage.retry import is_out_of_space
from deck.trainer.staging.records import NeverCommits

logger = logging.getLogger(__package__)


class SpoolDir:
    """The spool folder ``root`` and what every stager thread does in it.

    - the spool writer thread: :meth:`write` (a file; its fsync starts at once on ``syncer``),
      :meth:`write_pending` (a part's pending record, after its files);
    - the commit thread: :meth:`fsync` (a part's files, durable-local), :meth:`remove_files`
      and :meth:`remove_pending` (cleanup), :meth:`release` (its space);
    - the training thread: :meth:`reserve` (space for a part, before its snapshot); on restart
      :meth:`claim` (the space of parts found pending); :meth:`remove_files`,
      :meth:`remove_pending` and :meth:`release` for a part it discards.

    ``scratch``: the spool is not the destination (``cpu-ssd-remote``): its space is counted
    against ``staging.spool_max_bytes`` and its files go once uploaded.
    """

    def __init__(
        self,
        root: str,
        cfg: StagingConfig,
        scratch: bool,
        syncer: ThreadPoolExecutor,
        released: Callable[[int], None] | None = None,
    ) -> None:
        """``released``: where space given back is counted instead (a staging process's spool:
        its training process reserves it)."""
        self._released = released
        self.root = root
        # Every read, delete and folder of the spool goes through a store rooted at it, so that
        # nothing a restart finds there (in the local tier: the URI) makes it follow a link out.
        self.store = LocalStorage(root)
        self.cfg = cfg
        self.scratch = scratch
        # Each spooled file is fsynced as soon as it is written, on its own thread, so that the
        # part's durability wait overlaps the writes of the files after it instead of starting
        # when the last one is written (the writer thread never waits for the disk to flush).
        self._syncer = syncer
        self._early_syncs: dict[str, Future[None]] = {}
        self._syncs_lock = threading.Lock()
        self._made_dirs: set[str] = set()
        self._space = threading.Condition()
        self._bytes = 0
        self._said_full = False  # the full spool is said once

    # ---- space (scratch spools only) -------------------------------------------------------------
    def reserve(self, nbytes: int, on_wait: Callable[[], None] | None = None) -> bool:
        """Room for ``nbytes``: waits (``block``, after calling ``on_wait``) or returns False
        (``skip``)."""
        if not self.scratch:
            return True
        with self._space:
            while self._bytes and self._bytes + nbytes > self.cfg.spool_max_bytes:
                if self.cfg.spool_full == "skip":
                    return False
                if on_wait is not None:
                    on_wait()
                # Once at WARNING (a break-it finding: a line per second of every wait)
                logger.log(
                    logging.DEBUG if self._said_full else logging.WARNING,
                    "deck spool %s is full (staging.spool_max_bytes): training waits for "
                    "uploads; said once",
                    self.root,
                )
                self._said_full = True
                self._space.wait(1.0)
            self._bytes += nbytes
        return True

    def claim(self, nbytes: int) -> None:
        """Count ``nbytes`` already in the spool (a part found pending on restart)."""
        with self._space:
            self._bytes += nbytes

    def release(self, nbytes: int) -> None:
        if nbytes and self.scratch and self._released is not None:
            self._released(nbytes)
            return
        if nbytes and self.scratch:
            with self._space:
                self._bytes = max(0, self._bytes - nbytes)
                self._space.notify_all()

    # ---- files -----------------------------------------------------------------------------------
    def path(self, step: int, rel: str) -> str:
        return os.path.join(self.root, step_dir(step), rel)

    def key(self, step: int, rel: str) -> str:
        """The file's key in :attr:`store`."""
        return f"{step_dir(step)}/{rel}"

    def size(self, p: PendingPart, rel: str) -> int:
        try:
            return self.store.size(self.key(p.step, rel))
        except OSError:
            return 0

    def write(
        self,
        step: int,
        rel: str,
        data: bytes | Buffer,
        nbytes: int,
        make_record: Callable[[], None],
    ) -> None:
        """Spool writer: ``make_record`` (the file's record), then write its first ``nbytes``
        and start its fsync."""
        key = f"{step_dir(step)}/{rel}"
        try:
            make_record()
            path = self.path(step, rel)
            folder = os.path.dirname(path)
            failpoint("stager.spool.before_write")
            if folder not in self._made_dirs:  # one makedirs per folder, not per chunk
                self.store.make_folder(key.rpartition("/")[0])  # never through a link
                self._made_dirs.add(folder)
            failpoint("stager.spool.write", path)  # test hook: a kill or ENOSPC here
            write_new_file(path, memoryview(data)[:nbytes])
            failpoint("stager.spool.after_write")
            with self._syncs_lock:
                self._early_syncs[path] = self._syncer.submit(_fsync_path, path)
        except OSError as e:
            raise self.error(step, key, e) from e

    def fsync(self, p: PendingPart) -> None:
        """Make the part's files and their folders durable (waiting for the early fsyncs).

        A failed fsync fails the part for good (:class:`NeverCommits`) and is never retried:
        Linux reports a writeback error to one fsync only and may drop the pages that failed,
        so a second fsync could succeed over lost data."""
        paths = [self.path(p.step, rel) for rel in p.files]
        with self._syncs_lock:
            early = {path: self._early_syncs.pop(path, None) for path in paths}
        for path in [*paths, *sorted({os.path.dirname(path) for path in paths})]:
            try:
                done = early.get(path)
                if done is None:  # a folder, or a part recovered after a restart
                    _fsync_path(path)
                else:
                    done.result()
            except OSError as e:
                # The local tier's spool is the URI's own folder: name that disk, not a spool
                where = "the spool" if self.scratch else "the destination"
                raise NeverCommits(
                    f"fsync of {path} (step {p.step}) in {where} {self.root} failed: "
                    f"{e.strerror or e}. Its written data may be lost, so the part is dropped, not "
                    f"retried: the next checkpoint is a full. Check the disk of {self.root} "
                    "(dmesg)"
                ) from e

    def remove_files(self, step: int, files: list[str]) -> None:
        for rel in files:
            path = self.path(step, rel)
            with self._syncs_lock:
                self._early_syncs.pop(path, None)
            try:
                self.store.delete(self.key(step, rel))  # a link goes, never what it points to
            except UnsafePathError as e:
                logger.warning("deck: not deleting spooled file %s: %s", rel, e)
            except OSError:
                pass

    # ---- pending records -------------------------------------------------------------------------
    def pending_key(self, p: PendingPart) -> str:
        """The key of the part's pending record in :attr:`store`."""
        return f"{step_dir(p.step)}/{p.ckpt_id}/{pending_name(p.rank)}"

    def pending_path(self, p: PendingPart) -> str:
        return os.path.join(self.root, *self.pending_key(p).split("/"))

    def write_pending(self, p: PendingPart, part: bytes | None = None) -> None:
        """Durably record a staged part (temp + fsync + rename) so a restart can finish it.
        ``part``: its rank manifest's canonical JSON, when already encoded."""
        path = self.pending_path(p)
        failpoint("stager.pending.before_write")
        try:
            self.store.make_folder(f"{step_dir(p.step)}/{p.ckpt_id}")  # never through a link
            # The temp file's name is the one a restart removes (recovery._scan_spool).
            with atomic_file(path, tmp=path + ".tmp") as f:
                failpoint("stager.pending.write", f.name)
                f.write(dump_model(p, None if part is None else {"part": part}))
                failpoint("stager.pending.before_rename")
        except OSError as e:
            raise self.error(p.step, os.path.relpath(path, self.root), e) from e
        failpoint("stager.pending.after_write")

    def remove_pending(self, p: PendingPart) -> None:
        self.store.delete(self.pending_key(p))

    def remove_folders(self, p: PendingPart) -> None:
        """A scratch spool's folders of part ``p``, once its files and record are gone: its own
        (with any file a failed write left there), then its attempt's and its step's if nothing
        else is in them. Left, they were a few empty folders per checkpoint that a restart's
        recovery lists, each time, for as long as the job ran. (In the local tier the spool is
        the destination: its folders are the checkpoint's.)"""
        if not self.scratch:
            return
        step = step_dir(p.step)
        try:
            self.store.delete_prefix(f"{step}/{p.ckpt_id}/{rank_dir(p.rank)}/")
        except (StorageError, OSError) as e:
            logger.debug("deck: spool folders of step %d left: %s", p.step, e)
            return
        if self.store.remove_empty_folder(f"{step}/{p.ckpt_id}"):
            self.store.remove_empty_folder(step)

    def error(self, step: int, key: str, e: OSError) -> SpoolError:
        full = is_out_of_space(e)  # a folder's creation fails as a StorageError raised from it
        if not self.scratch:  # the local tier: the spool is the destination folder
            where = "the destination"
            hint = (
                "free space on its disk (deck gc with a retention policy removes old "
                "checkpoints) or move the URI to a larger disk"
                if full
                else "check the destination folder's permissions and disk"
            )
        else:
            where = "the spool"
            hint = (
                "free space on the spool's disk, lower staging.spool_max_bytes below what it "
                "holds, or set staging.spool_dir to a larger local disk"
                if full
                else "check the spool directory's permissions and disk"
            )
        return SpoolError(
            f"could not write {key} of step {step} to {where} {self.root}: "
            f"{e.strerror or e}; {hint}. Nothing of step {step} is committed and what it held "
            "goes into the next checkpoint; committed checkpoints are untouched"
        )


def _fsync_path(path: str) -> None:
    """fsync a file or a folder by path."""
    failpoint("stager.spool.fsync", path)  # test hook: an fsync that fails (enospc)
    # Never through a link at the file, never blocking on a FIFO.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
