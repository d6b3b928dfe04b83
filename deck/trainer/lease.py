"""The writer lease: one training job per checkpoint URI.

Rank 0 of a trainer holds ``_lease.json`` at the URI root (owner id, host, pid, expiry) and
renews it in the background; a second trainer on the same URI is refused while the lease is
live, and may take it over only once it has expired (its holder died without releasing it).
Object stores have no compare-and-swap, so acquisition writes, waits, and reads back to detect a
simultaneous taker; the loser gets the error. Merger workers do not take the lease.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deck.errors import CorruptCheckpointError, LeaseHeldError, NotFoundError, StorageError
from deck.failpoints import failpoint
from deck.storage import Storage
from deck.storage.base import get_bounded

logger = logging.getLogger(__name__)

LEASE_FILE = "_lease.json"


class LeaseRecord(BaseModel):
    """``_lease.json``. Values no live trainer writes (a pid no process can have, an expiry
    that is NaN, infinite, negative or past the year 5000) make the record damaged: treated as
    no lease, never waited on forever, never an OverflowError."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    owner: str = Field(max_length=256)
    host: str = Field(max_length=1024)
    pid: int = Field(ge=1, le=2**31 - 1)  # a pid_t: os.kill takes nothing larger
    expires_unix: float = Field(ge=0, le=1e11, allow_inf_nan=False)


class Lease:
    """The writer lease of one URI for one trainer; ``release()`` (or expiry) frees it."""

    def __init__(self, storage: Storage, ttl_s: float, settle_s: float = 0.2, wait_s: float = 0.0):
        self.storage = storage
        self.ttl_s = ttl_s
        self.settle_s = settle_s
        self.wait_s = wait_s
        self.owner = uuid.uuid4().hex
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> LeaseRecord:
        return LeaseRecord(
            owner=self.owner,
            host=socket.gethostname(),
            pid=os.getpid(),
            expires_unix=time.time() + self.ttl_s,
        )

    def read(self) -> LeaseRecord | None:
        """The current lease, or None when there is none (or it is unreadable: treated as free)."""
        try:
            return LeaseRecord.model_validate_json(get_bounded(self.storage, LEASE_FILE))
        except NotFoundError:
            return None
        except (ValidationError, CorruptCheckpointError) as e:
            # Unreadable (invalid values, too large, a link or a FIFO): taking the lease replaces
            # the entry with a real record (a put renames over it, never writes through it).
            logger.warning(
                "ignoring a damaged lease file at %s: %s", self.storage.describe(LEASE_FILE), e
            )
            return None

    def _takeable(self, held: LeaseRecord | None) -> bool:
        if held is None or held.owner == self.owner or held.expires_unix <= time.time():
            return True
        # A holder on this host whose process is gone crashed: a restart need not wait for expiry.
        return held.host == socket.gethostname() and not _alive(held.pid)

    def acquire(self) -> None:
        """Take the lease or raise :class:`LeaseHeldError` naming the holder; renews it from a
        background thread until :meth:`release`.

        Free, expired, or held by a dead process on this host: taken at once. Otherwise waited
        on for up to ``wait_s`` (a holder on another host may have died), then refused."""
        deadline = time.monotonic() + self.wait_s
        held = self.read()
        while not self._takeable(held):
            assert held is not None
            if held.host == socket.gethostname() and held.pid == os.getpid():
                raise LeaseHeldError(
                    f"{self.storage.uri} is already being written by this process (pid "
                    f"{held.pid}): another deck checkpointer on it is still open. close() it (or "
                    "use `with deck.enable(...)`) before enabling deck again on this URI, or use "
                    "another URI"
                )
            if time.monotonic() >= deadline:
                raise self._held_error(held)
            logger.warning(
                "waiting for the writer lease of %s held by %s (host %s)",
                self.storage.uri,
                held.owner,
                held.host,
            )
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            held = self.read()
        if held is not None and held.owner != self.owner:
            logger.warning(
                "taking over the writer lease of %s (host %s, pid %d: expired or dead) at %s",
                held.owner,
                held.host,
                held.pid,
                self.storage.uri,
            )
        failpoint("lease.acquire.before_put")
        self.storage.put(LEASE_FILE, self._record().model_dump_json().encode())
        failpoint("lease.acquire.after_put")
        time.sleep(self.settle_s)  # a simultaneous taker's write lands within this window
        held = self.read()
        if held is None or held.owner != self.owner:
            raise (
                self._held_error(held)
                if held
                else LeaseHeldError(
                    f"the writer lease of {self.storage.uri} vanished while taking it; retry"
                )
            )
        self._thread = threading.Thread(target=self._renew, name="deck-lease", daemon=True)
        self._thread.start()

    def _held_error(self, held: LeaseRecord) -> LeaseHeldError:
        left = held.expires_unix - time.time()
        return LeaseHeldError(
            f"{self.storage.uri} is being written by another trainer (owner {held.owner}, host {held.host}, "
            f"pid {held.pid}; lease expires in {left:.0f} s). Stop that job, use another URI, or wait for the "
            f"lease to expire if that job is dead (delete {self.storage.describe(LEASE_FILE)} to force it)."
        )

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                held = self.read()
                if held is not None and held.owner != self.owner:
                    self.lost.set()
                    logger.error(
                        "deck: the writer lease of %s was taken over by %s",
                        self.storage.uri,
                        held.owner,
                    )
                    return
                self.storage.put(LEASE_FILE, self._record().model_dump_json().encode())
            except StorageError as e:  # keep trying: the lease is valid until it expires
                logger.warning(
                    "deck: could not renew the writer lease of %s: %s", self.storage.uri, e
                )

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            try:
                held = self.read()
                if held is not None and held.owner == self.owner:
                    self.storage.delete(LEASE_FILE)
            except StorageError as e:
                logger.warning(
                    "deck: could not release the writer lease of %s: %s", self.storage.uri, e
                )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
