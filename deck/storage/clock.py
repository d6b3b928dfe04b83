"""The store's clock: the time a store gives the objects it writes.

Hosts' clocks disagree, and a store's object times are its own (a file system's mtimes, an
object store's ``LastModified``). Whoever judges an object's age -- GC, a trainer deciding
whether another's lease expired -- measures it on that one clock: it writes a marker, reads the
time the store gave it, and compares other objects' times with that, never with its own clock.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from deck.errors import DeckError
from deck.storage.base import Storage

__all__ = ["MARKER_DIR", "StoreTime", "store_now"]

# Where markers go, one folder for every reader of the store's time, so that GC removes those a
# crashed reader left (deck.ops.retention.clock.delete_stale_markers).
MARKER_DIR = "_clock"


@dataclass(frozen=True)
class StoreTime:
    """The store's time, read once, and how this host's clock compared with it."""

    now: float | None  # seconds since the epoch on the store's clock; None: it tells no times
    skew_s: float = 0.0  # the store's clock minus this host's (positive: this host is behind)
    uncertainty_s: float = 0.0  # the skew is known to within this (the marker's round trip)


def store_now(storage: Storage, local_clock: Callable[[], float] = time.time) -> StoreTime:
    """Write a marker object under :data:`MARKER_DIR`, read the time the store gave it, and
    delete it. A marker that cannot be written raises the store's error."""
    key = f"{MARKER_DIR}/clock-{secrets.token_hex(8)}"
    before = local_clock()
    storage.put(key, b"deck clock marker\n")
    after = local_clock()
    try:
        stamp = storage.modified(key)
    finally:
        with contextlib.suppress(DeckError, OSError):
            storage.delete(key)
    if stamp is None:
        return StoreTime(now=None)
    # Stamped between `before` and `after` on this host's clock; file systems stamp to the
    # tick, object stores to the second: allow a second.
    return StoreTime(
        now=stamp, skew_s=stamp - (before + after) / 2, uncertainty_s=(after - before) / 2 + 1.0
    )
