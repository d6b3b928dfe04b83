"""The writer lease: one training job per checkpoint URI, fenced.

Rank 0 of a trainer holds the lease. Each taking of it creates a new, numbered record
``_lease/<epoch>.json`` (owner id, host, pid, expiry) with :meth:`Storage.put_if_absent`, so of
two trainers taking it at once exactly one creates the next epoch, whatever the store's latency:
local files link exclusively, S3 sends ``If-None-Match: *``. (Stores without an atomic create
fall back to write, wait twice as long as the write took, and read back.) The holder renews its
own record in the background; a second trainer is refused while the newest record is live, and
takes over only once it has expired (its holder died without releasing it) by creating the next
epoch. Whether another trainer's record expired is judged on the store's clock (the time the
store gave that record at its last renewal, against a marker the taker writes: hosts' clocks
disagree), with the holder's own ``ttl_s`` from the record. The epoch is the fencing token: before every commit record the committer checks
(:meth:`Lease.check`) that its epoch is still the newest and its lease unexpired, so a holder
that was paused past its expiry and taken over never commits again. Merger workers do not take
the lease.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
import uuid

from pydantic import BaseModel, ConfigDict, Field

from deck.errors import CorruptCheckpointError, LeaseHeldError, NotFoundError, StorageError
from deck.failpoints import failpoint
from deck.format.manifest import UnixTime, load_model
from deck.storage import Storage
from deck.storage.base import get_bounded
from deck.storage.clock import store_now

logger = logging.getLogger(__name__)

LEASE_DIR = "_lease"
_RECORD = re.compile(r"^(\d{1,40})\.json$")  # 20 digits as written; more after a huge one
KEEP_EPOCHS = 8  # older records are deleted: a taker's view is never that stale
MAX_CREATES = 16  # attempts to create the next record before acquire() gives up


def lease_key(epoch: int) -> str:
    """The key of the lease record of ``epoch``."""
    return f"{LEASE_DIR}/{epoch:020d}.json"


class LeaseRecord(BaseModel):
    """``_lease.json``. Values no live trainer writes (a pid no process can have, an expiry
    that is NaN, infinite, negative or past the year 5000) make the record damaged: treated as
    no lease, never waited on forever, never an OverflowError."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    owner: str = Field(max_length=256)
    host: str = Field(max_length=1024)
    pid: int = Field(ge=1, le=2**31 - 1)  # a pid_t: os.kill takes nothing larger
    expires_unix: UnixTime
    # The holder's pid namespace: a pid is only checked for life in the namespace it names
    # (containers sharing a hostname see other pids, or none).
    pidns: str | None = Field(default=None, max_length=64)
    # The holder's time to live: a taker ages the record by the store's clock against this
    # (records of older deck versions have none: then their writer's expires_unix is compared
    # with the taker's clock, as those versions did).
    ttl_s: float | None = Field(default=None, ge=0, le=1e9, allow_inf_nan=False)


class Lease:
    """The writer lease of one URI for one trainer; ``release()`` (or expiry) frees it."""

    def __init__(self, storage: Storage, ttl_s: float, settle_s: float = 0.2, wait_s: float = 0.0):
        self.storage = storage
        self.ttl_s = ttl_s
        self.settle_s = settle_s
        self.wait_s = wait_s
        self.owner = uuid.uuid4().hex
        self.epoch: int | None = None  # the fencing token, once taken
        self.lost = threading.Event()
        self.lost_why: str | None = None  # what check() found when it set ``lost``
        # Lost because renewals failed for ttl_s, not because another trainer took it: the
        # renewing thread takes it again once the store answers and no one else did (_retake)
        self.lapsed = False
        self._expires = 0.0  # monotonic time our last written record expires at
        self._said_waiting: tuple[str, str] | None = None  # the holder acquire() said it waits for
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self, expires_unix: float | None = None) -> LeaseRecord:
        return LeaseRecord(
            owner=self.owner,
            host=socket.gethostname(),
            pid=os.getpid(),
            expires_unix=time.time() + self.ttl_s if expires_unix is None else expires_unix,
            pidns=_pid_namespace(),
            ttl_s=self.ttl_s,
        )

    def _put_own(self) -> None:
        """Renew: rewrite our own epoch's record with a new expiry (no one else writes it)."""
        assert self.epoch is not None
        started = time.monotonic()
        self.storage.put(lease_key(self.epoch), self._record().model_dump_json().encode())
        self._expires = started + self.ttl_s

    def newest(self) -> tuple[int, LeaseRecord | None]:
        """The newest epoch (0: none yet) and its record (None when there is none, or it is
        damaged: treated as free). Read errors are raised, never taken for a free lease."""
        epochs = self._epochs()
        if not epochs:
            return 0, None
        key = lease_key(epochs[-1])
        try:
            record = get_bounded(self.storage, key)
            return epochs[-1], load_model(LeaseRecord, record, self.storage.describe(key))
        except NotFoundError:  # deleted since the listing (someone removed _lease/): free
            return epochs[-1], None
        except CorruptCheckpointError as e:
            # Unreadable (invalid values, too large, a link or a FIFO): taking the lease creates
            # the next epoch's record, never writing through this one.
            logger.warning("deck: ignoring a damaged lease record: %s", e)
            return epochs[-1], None

    def read(self) -> LeaseRecord | None:
        """The newest lease record, or None when there is none (or it is damaged)."""
        return self.newest()[1]

    def _epochs(self) -> list[int]:
        names = self.storage.list_dir(f"{LEASE_DIR}/")
        return sorted(int(m.group(1)) for n in names if (m := _RECORD.match(n)))

    def _takeable(self, epoch: int, held: LeaseRecord | None) -> bool:
        if held is None or held.owner == self.owner or held.expires_unix == 0:
            return True  # none, ours, or released
        if self._expired(epoch, held):
            return True
        # A holder on this host (and in this pid namespace) whose process is gone crashed: a
        # restart need not wait for expiry. Another namespace's pid cannot be checked: wait.
        return (
            held.host == socket.gethostname()
            and held.pidns is not None
            and held.pidns == _pid_namespace()
            and not _alive(held.pid)
        )

    def _expired(self, epoch: int, held: LeaseRecord) -> bool:
        """Whether ``held`` (epoch ``epoch``'s record, another trainer's) was last renewed more
        than its ``ttl_s`` ago by the store's clock. Unknown (a store that tells no times, a
        record that vanished) is not expired."""
        if held.ttl_s is None:  # an older deck's record: only its writer's clock is known
            return held.expires_unix <= time.time()
        renewed = self.storage.modified(lease_key(epoch))
        now = store_now(self.storage).now
        return renewed is not None and now is not None and now - renewed > held.ttl_s

    def acquire(self) -> None:
        """Take the lease or raise :class:`LeaseHeldError` naming the holder; renews it from a
        background thread until :meth:`release`. Of several trainers taking it at once, at most
        one succeeds (exactly one where the store creates atomically).

        Free, expired, or held by a dead process on this host: taken at once. Otherwise waited
        on for up to ``wait_s`` (a holder on another host may have died), then refused."""
        deadline = time.monotonic() + self.wait_s
        tried = 0  # the last epoch we failed to create
        failed = 0
        while True:
            epoch, held = self.newest()
            if not self._takeable(epoch, held):
                assert held is not None
                self._wait_or_refuse(held, deadline)
                continue
            if held is not None and held.owner != self.owner and held.expires_unix > 0:
                logger.warning(
                    "taking over the writer lease of %s (host %s, pid %d: expired or dead) at %s",
                    held.owner,
                    held.host,
                    held.pid,
                    self.storage.uri,
                )
            # Past an epoch we failed to create that no listing shows (a link or FIFO planted
            # at its name): it is damage, never ours to write through.
            tried = max(epoch, tried) + 1
            if self._create(tried):
                break
            # Another trainer created that epoch first: its record decides (held, or expired).
            failed += 1
            if failed >= MAX_CREATES:
                raise LeaseHeldError(
                    f"could not create a writer lease record under "
                    f"{self.storage.describe(LEASE_DIR)}/ in {MAX_CREATES} attempts (last: epoch "
                    f"{tried}): records there are being written by others or cannot be read "
                    "back; stop the other writers, or remove the folder if no trainer is running"
                )
        self._prune()
        self._thread = threading.Thread(target=self._renew, name="deck-lease", daemon=True)
        self._thread.start()

    def _wait_or_refuse(self, held: LeaseRecord, deadline: float) -> None:
        if (
            held.host == socket.gethostname()
            and held.pid == os.getpid()
            and held.pidns == _pid_namespace()
        ):
            raise LeaseHeldError(
                f"{self.storage.uri} is already being written by this process (pid "
                f"{held.pid}): another deck checkpointer on it is still open. close() it (or "
                "use `with deck.enable(...)`) before enabling deck again on this URI, or use "
                "another URI; one whose last reference was dropped stays open until the process "
                "exits (deck.at_exit.close_open() closes those now, on this rank)"
            )
        if time.monotonic() >= deadline:
            raise self._held_error(held)
        said = (held.owner, held.host)
        logger.log(
            logging.DEBUG if said == self._said_waiting else logging.WARNING,  # once per holder
            "waiting for the writer lease of %s held by %s (host %s), up to %.0f s more",
            self.storage.uri,
            held.owner,
            held.host,
            max(0.0, deadline - time.monotonic()),
        )
        self._said_waiting = said
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def _create(self, epoch: int) -> bool:
        """Create ``epoch``'s record; True when it is ours afterwards."""
        key = lease_key(epoch)
        failpoint("lease.acquire.before_put")
        started = time.monotonic()
        # Whatever it answers, the read-back below decides (a retried create whose first attempt
        # landed reports False; a store that ignores If-None-Match lets a later writer win).
        self.storage.put_if_absent(key, self._record().model_dump_json().encode())
        took = time.monotonic() - started
        failpoint("lease.acquire.after_put")
        if not self.storage.atomic_create:
            # A simultaneous taker's check-then-write lands within about one write's time.
            time.sleep(max(self.settle_s, 2 * took))
        try:
            mine = load_model(
                LeaseRecord, get_bounded(self.storage, key), self.storage.describe(key)
            )
        except NotFoundError:
            return False
        except CorruptCheckpointError as e:  # not a record we could write
            logger.warning("deck: ignoring a damaged lease record: %s", e)
            return False
        if mine.owner != self.owner or self._epochs()[-1:] != [epoch]:
            return False
        self.epoch = epoch
        self._expires = started + self.ttl_s
        return True

    def _prune(self) -> None:
        """Delete records older than the last :data:`KEEP_EPOCHS` (best effort)."""
        assert self.epoch is not None
        try:
            for old in self._epochs():
                if old <= self.epoch - KEEP_EPOCHS:
                    self.storage.delete(lease_key(old))
        except StorageError as e:
            logger.warning("deck: could not prune old lease records of %s: %s", self.storage.uri, e)

    def gone(self) -> bool:
        """Whether this job may no longer commit, as far as it knows without reading the store:
        the lease was found lost, or its last record expired by the clock."""
        return self.lost.is_set() or time.monotonic() >= self._expires

    def why_gone(self) -> str | None:
        """What :meth:`gone` found, in words (None while the lease is held): a checkpoint
        refused for it says this."""
        if self.lost.is_set():
            return self.lost_why or f"the writer lease of {self.storage.uri} is lost"
        return self._lapse_text() if self.gone() else None

    def _lapse_text(self) -> str:
        return (
            f"the writer lease of {self.storage.uri} lapsed: it could not be renewed for "
            f"{self.ttl_s:g} s (lease_ttl_s), so another trainer may have taken over. This "
            "job commits nothing until deck takes the lease again, once the store answers "
            "and if no other trainer took it (rank 0's log says when); check the store's "
            "availability, or whether this process was paused (stopped, swapping)"
        )

    def check(self) -> None:
        """The fence, called before every commit record: raise :class:`LeaseHeldError` (and set
        :attr:`lost`) unless this lease's epoch is still the newest and its record unexpired.
        A read error is raised too: a commit that cannot be fenced is not made."""
        if self.epoch is None:
            raise LeaseHeldError(f"the writer lease of {self.storage.uri} is not held")
        for_good = self.lost.is_set() and not self.lapsed  # never a lapse (to take again) now
        if not for_good and time.monotonic() >= self._expires:
            raise self._lose(self._lapse_text(), lapsed=True)
        self._fence(*self.newest())  # what the store shows now, said first
        if for_good:
            raise LeaseHeldError(self.lost_why or f"the writer lease of {self.storage.uri} is lost")
        if time.monotonic() >= self._expires:
            # The read outlasted the lease (a store that hangs rather than fails): what it
            # showed may be stale by more than the lease's lifetime
            raise self._lose(self._lapse_text(), lapsed=True)

    def _fence(self, epoch: int, held: LeaseRecord | None) -> None:
        """Raise (the lease lost for good) unless ``epoch`` (the newest) is ours and ``held``
        (its record) names us."""
        assert self.epoch is not None
        if epoch > self.epoch and held is not None and held.owner == self.owner:
            return  # our own taking again (_retake), landed before it set self.epoch
        if epoch < self.epoch:
            raise self._lose(
                f"the writer lease records of {self.storage.uri} were deleted ({LEASE_DIR}/ holds "
                f"no epoch {self.epoch}, ours): this job commits nothing more, since another may "
                "have started; restart it once no other trainer writes there"
            )
        if epoch == self.epoch and held is None:
            raise self._lose(
                f"the writer lease record {self.storage.describe(lease_key(epoch))} (ours) is "
                f"gone or unreadable: was {self.storage.uri} deleted or replaced while this job "
                "ran? This job commits nothing more, since another trainer may write there now; "
                "check the URI and restart the job"
            )
        if epoch == self.epoch and held is not None and held.owner != self.owner:
            raise self._lose(
                f"the writer lease record {self.storage.describe(lease_key(epoch))} (ours) now "
                f"names another trainer (owner {held.owner}, host {held.host}, pid {held.pid}): "
                f"was {self.storage.uri} replaced by another job's checkpoints while this job "
                "ran? This job commits nothing more; check the URI and restart the job"
            )
        if epoch != self.epoch or held is None or held.owner != self.owner:
            who = f"owner {held.owner}, host {held.host}, pid {held.pid}" if held else "unknown"
            raise self._lose(
                f"the writer lease of {self.storage.uri} was taken over (epoch {epoch}, ours "
                f"{self.epoch}; {who}): this job commits nothing more. Stop one of the two jobs"
            )

    def _retake(self) -> None:
        """After a lapse: take the lease again, as a restarted job would, when the newest record
        is still ours (no other trainer took it since: its own taking would have created a
        newer epoch) by creating the next epoch -- of this and another trainer creating it at
        once, exactly one succeeds. Raises (lost for good) when another trainer has it."""
        epoch, held = self.newest()
        self._fence(epoch, held)  # ours, or lost for good
        assert self.epoch is not None
        if epoch > self.epoch:
            # Our own create of an earlier round landed, its read-back failed (_fence knows it
            # by this Lease's owner id): keep it
            self.epoch = epoch
            self._put_own()
        elif not self._create(epoch + 1):  # the record there is another trainer's
            raise self._lose(
                f"the writer lease of {self.storage.uri} was taken over after it lapsed "
                f"(epoch {epoch + 1} is another trainer's): this job commits nothing more. "
                "Stop one of the two jobs"
            )
        self._prune()
        self.lapsed = False
        self.lost_why = None
        self.lost.clear()
        logger.warning(
            "deck: took the writer lease of %s again (epoch %d) after it lapsed: no other trainer "
            "had taken it; checkpoints resume (the next is a full if a part failed meanwhile)",
            self.storage.uri,
            self.epoch,
        )

    def _lose(self, why: str, lapsed: bool = False) -> LeaseHeldError:
        """Mark the lease lost (for good unless ``lapsed``), remembering ``why`` for the
        checkpoints refused after."""
        self.lapsed = lapsed
        self.lost_why = why
        self.lost.set()
        return LeaseHeldError(why)

    def _held_error(self, held: LeaseRecord) -> LeaseHeldError:
        ttl = held.ttl_s if held.ttl_s is not None else self.ttl_s
        return LeaseHeldError(
            f"{self.storage.uri} is being written by another trainer (owner {held.owner}, host {held.host}, "
            f"pid {held.pid}; its lease expires {ttl:g} s after its last renewal, by the store's clock). "
            "Stop that job, use another URI, or wait for the lease to expire if that job is dead "
            f"(delete {self.storage.describe(LEASE_DIR)}/ to force it)."
        )

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if self.lapsed:
                    self._retake()
                    continue
                self.check()  # our record only while the lease is still ours
                self._put_own()
            except LeaseHeldError as e:
                logger.error("deck: %s", e)
                if not self.lapsed:  # taken over or deleted: lost for good
                    return
            except StorageError as e:  # keep trying: the lease is valid until it expires
                logger.warning(
                    "deck: could not renew the writer lease of %s: %s", self.storage.uri, e
                )

    def release(self) -> None:
        """Stop renewing and mark the lease free if it is still ours (its record stays, expired,
        so the next taker creates the next epoch); idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            try:
                epoch, held = self.newest()
                if epoch == self.epoch and held is not None and held.owner == self.owner:
                    released = self._record(expires_unix=0.0).model_dump_json().encode()
                    self.storage.put(lease_key(epoch), released)
            except StorageError as e:
                logger.warning(
                    "deck: could not release the writer lease of %s: %s", self.storage.uri, e
                )


class Leases:
    """The leases that fence one chain together: a publish chain commits only while its job
    holds both the checkpoint URI's lease and the publish URI's (the same interface as one
    :class:`Lease` to a chain and its committer)."""

    def __init__(self, *leases: Lease):
        self.leases = leases

    def check(self) -> None:
        """Every lease's :meth:`Lease.check`, in order: the first that refuses raises."""
        for lease in self.leases:
            lease.check()

    def gone(self) -> bool:
        """Whether any of the leases is gone (:meth:`Lease.gone`)."""
        return any(lease.gone() for lease in self.leases)

    def why_gone(self) -> str | None:
        """What the first lease that is gone found, in words; None while all are held."""
        return next((why for lease in self.leases if (why := lease.why_gone())), None)


def _pid_namespace() -> str | None:
    """This process's pid namespace (``pid:[inode]`` on Linux), or None where it cannot be told."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
