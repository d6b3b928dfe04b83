"""The checkpoint's destination as the stager's threads use it: patient, one-attempt and
best-effort calls, each named for how it meets an outage."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

from deck.config import StagingConfig
from deck.errors import (
    CorruptCheckpointError,
    DeckError,
    LeaseHeldError,
    NotFoundError,
    StorageError,
    UnsafePathError,
)
from deck.failpoints import failpoint
from deck.format.epochs import EpochWitnesses
from deck.format.manifest import (
    MANIFEST,
    CheckpointManifest,
    load_model,
    rank_failure_name,
    step_dir,
)
from deck.format.pending import PendingPart
from deck.storage import Storage
from deck.storage.base import MAX_RECORD_BYTES, get_bounded
from deck.storage.retry import RetryPolicy, call_with_retry, is_out_of_space
from deck.trainer.writer import commit
from deck.version import __version__

logger = logging.getLogger(__name__)

T = TypeVar("T")

FAILURE_RECORD_BYTES = 4096  # read of a rank's failure record (a line of text)

# The fence's read for a commit record runs beside the reads of the other ranks' parts, while
# the record before it is being written. It stands for the record when it began at most this
# long before the record's put (a round trip or two on a slow store); an older one (the record
# waited for a rank's part, or for a slow put before it) is read again. Either way the lease's
# own clock (lost or expired, no read) is checked right before the put.
FENCE_REUSE_S = 1.0


class Destination:
    """The checkpoint's destination (``storage``) as the stager's threads use it. Each call's
    name says how it meets an outage, so a call site picks its retry behaviour by name, never
    by which handle of the store it happens to hold:

    - **patient** (``patient_*``): retried with backoff for as long as
      ``staging.upload_timeout_s``, so outages are waited out (the store's own retries only cover
      short blips): the upload threads (files of the ``cpu-remote`` tier, uploads from the spool),
      part manifests, and the checks that decide a part's fate (is it committed, is a rank's part
      there) in the commit thread and restart recovery;
    - **once** (``*_once``): one attempt (with the store's own retries); the error goes to a
      caller that copes with it: rank 0's poll for the other ranks' parts (it polls again), the
      failure record of a part (logged; rank 0 also learns at the next collective), the commit
      record (the part fails, the next checkpoint is a full);
    - **best effort** (``best_effort_*``): errors are ignored: files of a part that will not be
      committed.
    """

    def __init__(
        self,
        storage: Storage,
        cfg: StagingConfig,
        fence: Callable[[], None] | None = None,
        gone: Callable[[], bool] | None = None,
    ) -> None:
        self._storage = storage
        self.cfg = cfg
        self._fence = fence  # raises when this job may no longer commit (the writer lease)
        self._gone = gone  # the same, known without reading the store (lost or expired)
        # The witness of each epoch goes before its first commit record (deck.format.epochs)
        self._witnesses = EpochWitnesses(storage)

    @property
    def uri(self) -> str:
        return self._storage.uri

    def describe(self, key: str) -> str:
        """``key`` as error messages and logs name it."""
        return self._storage.describe(key)

    # ---- patient ---------------------------------------------------------------------------------
    def patient_put(self, key: str, data: bytes | bytearray) -> None:
        self._patiently("upload", key, lambda: self._storage.put(key, data))

    def patient_exists(self, key: str) -> bool:
        return self._patiently("read", key, lambda: self._storage.exists(key))

    def patient_committed_id(self, step: int) -> str | None:
        """The id of the checkpoint committed at ``step``, if any (an unreadable record: none)."""
        key = f"{step_dir(step)}/{MANIFEST}"

        def read() -> bytes | None:
            try:
                return get_bounded(self._storage, key)
            except (NotFoundError, CorruptCheckpointError):  # too large, a link, a FIFO, ...
                return None

        data = self._patiently("read", key, read)
        if data is None:
            return None
        try:
            return load_model(CheckpointManifest, data, self._storage.describe(step_dir(step))).id
        except DeckError:
            return None

    # ---- once --------------------------------------------------------------------------------------
    def put_failure_record(self, p: PendingPart, why: str, unless: str | None = None) -> None:
        """Tell rank 0 that part ``p`` (of another rank) failed, so that it stops waiting for
        it: a failure record in the part's folder, unless key ``unless`` (its rank manifest)
        is there. One attempt: the store may be what failed, and rank 0 learns at the next
        collective anyway; a warning when it cannot be put."""
        key = f"{step_dir(p.step)}/{p.ckpt_id}/{rank_failure_name(p.rank)}"
        try:
            if unless is not None and self.exists_once(unless):
                return
            failpoint("stager.failure_record.put", key)
            self.put_once(key, f"rank {p.rank}: {why}".encode())
        except (StorageError, OSError) as e:
            logger.warning(
                "deck: could not tell rank 0 through %s that step %d failed (%s); it learns at "
                "the next checkpoint or flush",
                self.describe(key),
                p.step,
                e,
            )

    def put_once(self, key: str, data: bytes | bytearray) -> None:
        self._storage.put(key, data)

    def exists_once(self, key: str) -> bool:
        return self._storage.exists(key)

    def commit_id(self, step: int) -> str | None:
        """The id of the checkpoint whose commit record is at ``step`` now (None: none, or
        unreadable). One read: what a part's owner reached, never a restore's check."""
        data = self._storage.get_or_none(f"{step_dir(step)}/{MANIFEST}", MAX_RECORD_BYTES)
        if data is None:
            return None
        try:
            return load_model(CheckpointManifest, data, f"{step_dir(step)}/{MANIFEST}").id
        except DeckError:
            return None

    def list_once(self, folder: str) -> list[str]:
        """What lies directly in ``folder`` (:meth:`~deck.storage.Storage.list_dir`)."""
        return self._storage.list_dir(folder)

    def get_records_once(self, keys: list[str]) -> dict[str, bytes | None]:
        """The records at ``keys`` (None where there is none), read concurrently where the store
        can, each bounded (:data:`~deck.storage.base.MAX_RECORD_BYTES`)."""
        if not keys:
            return {}
        return dict(self._storage.get_many(keys, limit=MAX_RECORD_BYTES))

    def failure_reason_once(self, key: str) -> str:
        """What the failure record at ``key`` says: at most its first
        :data:`FAILURE_RECORD_BYTES` (a record is a line of text; the store is not trusted to
        hold only that). :class:`NotFoundError` when there is none."""
        return self._storage.get(key, 0, FAILURE_RECORD_BYTES).decode(errors="replace")

    @property
    def fenced(self) -> bool:
        """Whether commit records are fenced (a writer lease)."""
        return self._fence is not None

    def check_fence(self) -> None:
        """Raise :class:`~deck.errors.LeaseHeldError` if this job may no longer commit here
        (no-op without a fence)."""
        if self._fence is not None:
            self._fence()

    def commit_once(
        self,
        p: PendingPart,
        own_bytes: bytes | None = None,
        parts: Mapping[int, bytes] | None = None,
        fenced_at: float | None = None,
    ) -> None:
        """Rank 0, every rank's part is there: verify the parts and write the commit record of
        ``p``'s checkpoint (:func:`deck.trainer.writer.commit`). ``own_bytes``: what this
        process wrote as ``p``'s part manifest (used instead of reading it back); ``parts``:
        other ranks' part manifests as already read; ``fenced_at``: when a passed
        :meth:`check_fence` began (monotonic), which stands for the fence if recent
        (:data:`FENCE_REUSE_S`)."""

        def fence() -> None:
            if self._fence is None:
                return
            fresh = fenced_at is not None and time.monotonic() - fenced_at <= FENCE_REUSE_S
            if not fresh or (self._gone is not None and self._gone()):
                self._fence()  # raises with the reason when this job may no longer commit

        commit(
            self._storage,
            step=p.step,
            ckpt_id=p.ckpt_id,
            kind=p.kind,
            parent=(p.parent, p.parent_id) if p.parent is not None and p.parent_id else None,
            base=p.base,
            epoch=p.epoch,
            world_size=p.world_size,
            deck_version=__version__,
            own=None if own_bytes is None or p.part is None else (p.part, own_bytes),
            read=parts,
            fence=fence,
            witnesses=self._witnesses,
        )

    # ---- best effort -------------------------------------------------------------------------------
    def best_effort_delete(self, step: int, files: list[str]) -> None:
        """Delete files of a part that will not be committed; errors are ignored (what stays
        behind belongs to no commit record, and GC removes it)."""
        for rel in files:
            with contextlib.suppress(OSError, StorageError):
                self._storage.delete(f"{step_dir(step)}/{rel}")

    def _patiently(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """``fn`` with backoff for as long as ``upload_timeout_s``: outages are waited out (the
        store's own retries only cover short blips). Every storage error is retried but those
        waiting does not fix: a link or special file in the way (UnsafePathError); a full disk
        or quota -- the part fails at once and its files go (the committer), instead of the
        later checkpoints piling up behind it on the same full disk; and any, once this job's
        writer lease is lost (it raises LeaseHeldError then: the part can never commit)."""

        def passing(e: BaseException) -> bool:
            return (
                isinstance(e, StorageError)
                and not isinstance(e, UnsafePathError)
                and not is_out_of_space(e)
                and not (self._gone is not None and self._gone())
            )

        policy = RetryPolicy(
            attempts=None,
            deadline_s=self.cfg.upload_timeout_s,
            initial_delay=min(self.cfg.retry_initial_s, self.cfg.retry_max_s),
            max_delay=self.cfg.retry_max_s,
            jitter=0.0,
            retry_on=passing,
        )
        try:
            return call_with_retry(fn, policy, f"deck: {what} of {self._storage.describe(key)}")
        except StorageError as e:
            if self._gone is not None and self._gone():
                # Lost while waiting: the part can never commit (dropped as the fence's refusal).
                raise LeaseHeldError(
                    f"stopped waiting for {what} of {self._storage.describe(key)}: this job's "
                    f"writer lease is lost, so the part can never commit ({e})"
                ) from e
            if not passing(e):
                raise
            raise StorageError(
                f"giving up on {what} of {self._storage.describe(key)} after "
                f"{self.cfg.upload_timeout_s:.0f} s: {e}"
            ) from e
