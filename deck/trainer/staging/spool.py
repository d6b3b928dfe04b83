"""The spool: a rank's staged files and pending records on local disk.

In the ``local`` tier the spool is the destination folder itself; in ``cpu-ssd-remote`` it is
scratch space (``staging.spool_dir``) whose files go once uploaded, its size bounded by
``staging.spool_max_bytes``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from deck.config import StagingConfig
from deck.errors import SpoolError
from deck.failpoints import failpoint
from deck.format.chunks import Buffer
from deck.format.manifest import dump_model, rank_manifest_name, step_dir
from deck.storage.atomic import atomic_file
from deck.storage.local import write_new_file
from deck.trainer.staging.records import PENDING_SUFFIX, PendingPart

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
        self, root: str, cfg: StagingConfig, scratch: bool, syncer: ThreadPoolExecutor
    ) -> None:
        self.root = root
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

    # ---- space (scratch spools only) -------------------------------------------------------------
    def reserve(self, nbytes: int) -> bool:
        """Room for ``nbytes``: waits (``block``) or returns False (``skip``)."""
        if not self.scratch:
            return True
        with self._space:
            while self._bytes and self._bytes + nbytes > self.cfg.spool_max_bytes:
                if self.cfg.spool_full == "skip":
                    return False
                logger.warning("deck spool %s is full: training waits for uploads", self.root)
                self._space.wait(1.0)
            self._bytes += nbytes
        return True

    def claim(self, nbytes: int) -> None:
        """Count ``nbytes`` already in the spool (a part found pending on restart)."""
        with self._space:
            self._bytes += nbytes

    def release(self, nbytes: int) -> None:
        if nbytes and self.scratch:
            with self._space:
                self._bytes = max(0, self._bytes - nbytes)
                self._space.notify_all()

    # ---- files -----------------------------------------------------------------------------------
    def path(self, step: int, rel: str) -> str:
        return os.path.join(self.root, step_dir(step), rel)

    def size(self, p: PendingPart, rel: str) -> int:
        try:
            return os.path.getsize(self.path(p.step, rel))
        except OSError:
            return 0

    def write(
        self, step: int, rel: str, data: bytes | Buffer, nbytes: int, describe: Callable[[], None]
    ) -> None:
        """Spool writer: ``describe`` the file, then write its first ``nbytes`` and start its
        fsync."""
        key = f"{step_dir(step)}/{rel}"
        try:
            describe()
            path = self.path(step, rel)
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
            raise self.error(step, key, e) from e

    def fsync(self, p: PendingPart) -> None:
        """Make the part's files and their folders durable (waiting for the early fsyncs)."""
        dirs = set()
        for rel in p.files:
            path = self.path(p.step, rel)
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

    def remove_files(self, step: int, files: list[str]) -> None:
        for rel in files:
            path = self.path(step, rel)
            with self._syncs_lock:
                self._early_syncs.pop(path, None)
            with contextlib.suppress(OSError):
                os.remove(path)

    # ---- pending records -------------------------------------------------------------------------
    def pending_path(self, p: PendingPart) -> str:
        return os.path.join(
            self.root,
            step_dir(p.step),
            p.ckpt_id,
            rank_manifest_name(p.rank).replace(".json", PENDING_SUFFIX),
        )

    def write_pending(self, p: PendingPart) -> None:
        """Durably record a staged part (temp + fsync + rename) so a restart can finish it."""
        path = self.pending_path(p)
        failpoint("stager.pending.before_write")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            # The temp file's name is the one a restart removes (recovery._scan_spool).
            with atomic_file(path, tmp=path + ".tmp") as f:
                failpoint("stager.pending.write", f.name)
                f.write(dump_model(p))
                failpoint("stager.pending.before_rename")
        except OSError as e:
            raise self.error(p.step, os.path.relpath(path, self.root), e) from e
        failpoint("stager.pending.after_write")

    def remove_pending(self, p: PendingPart) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.pending_path(p))

    def error(self, step: int, key: str, e: OSError) -> SpoolError:
        hint = (
            "free space on the spool's disk, lower staging.spool_max_bytes below what it holds, or "
            "set staging.spool_dir to a larger local disk"
            if e.errno == errno.ENOSPC
            else "check the spool directory's permissions and disk"
        )
        return SpoolError(
            f"could not write {key} of step {step} to the spool {self.root}: "
            f"{e.strerror or e}; {hint}. The checkpoint of step {step} is not taken (its rows stay "
            "pending for the next one); committed checkpoints are untouched"
        )


def _fsync_path(path: str) -> None:
    """fsync a file or a folder by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
