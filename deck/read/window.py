"""Planning a restore from the newest part of a long history.

A restore of the latest step (or of one step) needs the records its chain can come from, not
every record the job ever wrote. :func:`read_window` reads the catalog lazily
(:func:`deck.read.indexed.read_indexed` with ``lazy=True``) and its segments from the newest
step back, until the question asked can be answered inside what was read: the cheapest chain
of the step (:meth:`deck.read.lineage.LineageGraph._near_paths` reaches back only as far as a
full bounds it) and, for the latest step, no unread segment holding a newer trainer checkpoint
and the newest epoch its witness names (:mod:`deck.format.epochs`) among what was read.
A graph built from the result answers the same as one built from every record, or raises
:class:`~deck.read.catalog.OutsideWindow` (never a wrong answer); the reader then reads more.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

from deck.errors import DeckError
from deck.format.epochs import newest_witness
from deck.format.manifest import CheckpointManifest
from deck.read.catalog import (
    ManifestSet,
    OutsideWindow,
    Window,
    get_records,
    manifest_set,
    read_manifests,
)
from deck.read.indexed import load_segments, read_indexed
from deck.read.lineage import chain_for, latest_restorable
from deck.storage import Storage

T = TypeVar("T")

# A window reaching back over more than this share of the segments reads every record instead
# (as cheap by then, and one code path fewer).
_MOST = 0.5


def read_window(storage: Storage, step: int | None = None) -> ManifestSet | None:
    """The records a restore of ``step`` needs (and, always, of the latest step: a restore
    checks whether it rolls back), as a :class:`ManifestSet` whose ``window`` says what it
    holds; None when a windowed read cannot be used or would not save much (no catalog with
    segments, damage in one, no epoch witness, a window reaching back over most of the
    history, the newest epoch's witness naming an epoch the records read do not hold): the caller
    reads every record (:func:`deck.read.catalog.read_manifests`)."""
    index = read_indexed(storage, lambda ks: get_records(storage, ks), lazy=True)
    if index is None or not index.segments:
        return None
    # The newest epoch (one listing): a catalog leaving out a newer timeline's records below
    # the steps it gives must not make an older timeline's step the latest. None: no witness
    # (a store of a deck before them): only every record says which epoch is the newest.
    witness = newest_witness(storage)
    if witness is None:
        return None
    refs = index.segments
    lowest = len(refs) - 1
    if step is not None:
        lowest = min(lowest, max(0, sum(1 for r in refs if r.first <= step) - 1))
    parsed: Mapping[str, tuple[bytes, CheckpointManifest]] = {}
    out: ManifestSet | None = None  # (each damaged record said by the first round only)
    while len(refs) - lowest <= max(2, int(len(refs) * _MOST)):
        try:
            load_segments(storage, index, refs[lowest:])
        except DeckError:  # a segment damaged or gone: the whole read passes that catalog by
            return None
        unread = [r.newest for r in refs[:lowest] if r.newest is not None]
        window = Window(floor=refs[lowest].first, horizon=max(unread) if unread else None)
        out = manifest_set(storage, sorted(index.records.items()), index, parsed, said=out)
        parsed = out.parsed
        out.window = window if lowest > 0 else None  # (from the first segment on: all of it)
        out.witness, out.witness_listed = witness, True
        try:
            # (not said here: a catalog's copies may be forged or stale; the caller's read of
            # the records says what it passed over, a break-it finding: a forged catalog made
            # every restore warn that the latest step could not be restored, then restore it)
            latest = latest_restorable(out, log=False)
            if latest is None:
                # Nothing restorable in what was read: a record it needs may be below, or left
                # out of a forged catalog (even one read whole); only every record's read can
                # say there is none
                return None
            if out[latest].epoch < witness:
                # A newer epoch was witnessed than the latest step found: a catalog that tells
                # the truth says where its records are (an unread segment's ``newest`` would
                # have widened the window), so this one left them out (or none was committed
                # after its witness, or none is restorable): only every record can say
                return None
            if step is not None and step >= window.floor:
                chain_for(out, step)
            elif step is not None:
                raise OutsideWindow(step)
            return out
        except OutsideWindow as e:
            need = e.step
        except DeckError:  # no chain, a damaged record on it: the answer of every record's read
            return None
        if need < 0:
            return None
        lowest = min(lowest - 1, max(0, sum(1 for r in refs if r.first <= need) - 1))
        if lowest < 0:
            return None
    return None


def ask_newest(
    storage: Storage, ask: Callable[[ManifestSet], T], previous: ManifestSet | None = None
) -> T:
    """``ask(records)``, with the records of the newest part of the history (:func:`read_window`,
    for the latest step) where it answers there, else with every record
    (:func:`deck.read.catalog.read_manifests`, going on from ``previous``, an earlier such
    read): the same answer, at the cost of what is new rather than of the history, for a
    reader that asks again and again (a follower's poll). ``ask`` may run twice: what it does
    before it raises :class:`~deck.read.catalog.OutsideWindow` must bear being done again."""
    window = read_window(storage)
    if window is not None:
        try:
            return ask(window)
        except OutsideWindow:
            pass
    return ask(read_manifests(storage, previous=previous))
