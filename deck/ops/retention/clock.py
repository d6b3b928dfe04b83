"""The store's clock: what GC measures every age on.

Hosts' clocks disagree, and a store's file times are the store's clock (a file system's mtimes,
an object store's ``LastModified``), while commit records carry their writer's. GC therefore
never compares its own clock, nor a writer's, with a file time: it writes a marker object,
reads back the time the store gave it, and takes ages as that time minus other objects' times
from the same store. Its own clock is only compared with the store's, to refuse a run on a host
whose clock is off by more than a bound (a store that keeps the times its clients send, such as
a copy made with ``rsync -t``, would otherwise mix clocks again).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from deck.errors import ClockSkewError, DeckError
from deck.storage import Storage
from deck.storage.clock import MARKER_DIR, StoreTime, store_now

logger = logging.getLogger(__name__)

__all__ = ["CLOCK_DIR", "delete_stale_markers", "read_store_clock"]

# Where GC's markers live (one object per run, deleted at once; a crashed run's marker is
# deleted by a later run): beside the writer lease's folder, outside every checkpoint folder.
CLOCK_DIR = MARKER_DIR


def read_store_clock(
    storage: Storage,
    *,
    max_skew_s: float | None,
    local_clock: Callable[[], float] = time.time,
) -> StoreTime:
    """The store's time (:func:`deck.storage.clock.store_now`, a marker under
    :data:`CLOCK_DIR`).

    Raises :class:`ClockSkewError` when this host's clock (``local_clock``) is more than
    ``max_skew_s`` seconds from the store's (None: no bound), saying by how much. A store that
    reports no times gives ``now=None``: ages are then unknown and GC deletes nothing that
    waits for an age. A marker that cannot be written is a :class:`StorageError` (a read-only
    credential cannot run GC)."""
    clock = store_now(storage, local_clock)
    if clock.now is None:
        logger.warning(
            "deck gc: %s reports no modification times; nothing is deleted that waits for an age",
            storage.uri,
        )
        return clock
    off = abs(clock.skew_s) - clock.uncertainty_s
    if max_skew_s is not None and off > max_skew_s:
        way = "behind" if clock.skew_s > 0 else "ahead of"
        raise ClockSkewError(
            f"this host's clock is {abs(clock.skew_s):.0f} s {way} the clock of {storage.uri} "
            f"(more than the {max_skew_s:g} s allowed): GC deletes nothing. Ages are measured "
            "on the store's clock either way; fix this host's clock (NTP), or allow the skew "
            "with `deck gc --max-clock-skew S` (RetentionPolicy.max_clock_skew_s) if the "
            "store's file times are its own"
        )
    if off > 60:
        logger.warning(
            "deck gc: this host's clock is %+.0f s from %s's; ages are measured on the "
            "store's clock",
            -clock.skew_s,
            storage.uri,
        )
    return clock


def delete_stale_markers(
    storage: Storage, listing: list[tuple[str, float | None]], now: float, older_than_s: float
) -> int:
    """Delete the markers crashed runs left (listed under :data:`CLOCK_DIR`, older than
    ``older_than_s`` on the store's clock); returns how many went."""
    gone = 0
    for key, stamp in listing:
        if key.startswith(f"{CLOCK_DIR}/") and stamp is not None and now - stamp >= older_than_s:
            with contextlib.suppress(DeckError, OSError):
                storage.delete(key)
                gone += 1
    return gone
