"""What a GC run sees of a store: the whole of it, or its newest part where that decides alike.

:func:`whole_view` lists the store and reads every commit record (the run that verifies the
catalog and reaches every old folder). :func:`newest_view` reads only the folders of the newest
steps: it takes the catalog's segments (their step ranges and newest trainer record, never their
records) to know what lies below, then lists and reads the commit records of the step and merger
folders from about where the grace period starts down, twice as many segments each time, until
a step :func:`deck.ops.retention.window.is_cut` accepts; failing that, the newest segment where
every checkpoint in it is in the grace period (none of them can go, whatever the rest of the
lineage says). The records themselves are the truth there as in a whole read; what the catalog
contributes is only the newest trainer record below the cut (a merger full's epoch is the one
of the trainer record of its state, which is at or below that). A catalog is not trusted to
say that: the newest epoch witnessed (:mod:`deck.format.epochs`, one listing and one read)
counts as newest below the cut at the step under it unless its witness says the epoch began
at or above the cut, so a newer timeline left out of the catalog can only make fewer cuts
(what it counts as newest is never older than the truth); a store with no witness is read
whole.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial

from deck.errors import DeckError
from deck.format.commit_log import SegmentRef, record_key_kind
from deck.format.epochs import newest_witness, witnessed_step
from deck.format.manifest import (
    MANIFEST,
    MERGED_ROOT,
    QUARANTINE_ROOT,
    CheckpointManifest,
    Kind,
    load_model,
    parse_merged_dir,
    parse_step_dir,
    step_dir,
    step_dirs_from,
)
from deck.ops.retention.clock import CLOCK_DIR
from deck.ops.retention.window import is_cut
from deck.read.catalog import ManifestSet, get_records, manifest_set, overlapped, read_manifests
from deck.read.indexed import RecordBytes, read_indexed
from deck.read.lineage import LineageGraph, build_graph
from deck.storage import Storage

# A cut further down than this share of the catalog's segments: the whole store is read instead
# (as cheap by then).
_MOST = 0.5

Listing = list[tuple[str, float | None]]


@dataclass
class StoreView:
    """The keys a GC run plans from, with the store's time of each, and their commit records.
    ``floor``: the lowest step of the folders it holds (None: the whole store)."""

    listing: Listing
    manifests: ManifestSet
    floor: int | None = None


def whole_view(storage: Storage) -> StoreView:
    """Every key of ``storage`` and every commit record."""
    listing = storage.list_modified("")
    return StoreView(listing, read_manifests(storage, [k for k, _ in listing]))


def newest_view(
    storage: Storage,
    *,
    keep_last_fulls: int,
    keep_fulls_every: int | None,
    cutoff: float | None,
    now: float | None,
) -> StoreView | None:
    """The folders of the steps at and above the highest cut found (see the module doc), the
    quarantine records of their checkpoints and the clock markers; None when the store keeps no
    catalog with segments, or no cut is found in the newer half of its segments: the caller
    reads the whole store. ``cutoff``: the grace period's start on the store's clock (None: no
    grace period; -inf: a store that tells no times, where everything is in it); ``now``: the
    store's time (a commit whose time is unknown counts as made now)."""
    index = read_indexed(storage, lambda ks: get_records(storage, ks), lazy=True)
    if index is None or not index.segments:
        return None
    refs = index.segments
    # Trainer records read after the catalog (a rollback's, below any segment's newest)
    logged = _logged_trainer(index.records.items())
    if logged is None:
        return None  # a record of unknown epoch below: the whole read decides about it
    # The newest epoch witnessed (deck.format.epochs): a catalog may leave out the records of
    # a newer timeline below the cut; none (a store of a deck before them): the whole read
    witness = newest_witness(storage)
    if witness is None:
        return None
    first = witnessed_step(storage, witness)  # (its records are all at or above it)
    # The lowest segment a window may start at (further down, reading every record is as
    # cheap): every folder the view may hold is of its first step or above
    newest = len(refs) - 1
    limit = max(1, len(refs) - max(2, int(len(refs) * _MOST)))
    bound = refs[min(limit, newest)].first
    # Where a cut can be: below the newest step committed before the grace period began (the
    # newest fulls older than it), found by the store's times of a few records: the segments'
    # first steps' (hints, never decisions: a step gone since its catalog counts as young)
    firsts = [r.first for r in refs[min(limit, newest) :]]
    young = cutoff is not None and _time(storage, firsts[0]) > cutoff
    lowest = max(
        limit, newest if young else _segment_of(refs, _last_before(storage, firsts, cutoff))
    )
    # The step folders, listed from the lowest step a window reads (again if it grows: a
    # listing's cost on an object store follows the names above its bound, not the history)
    steps = _StepFolders(storage)
    merged: dict[str, int] = {}
    above = f"{bound:012d}"
    for name in storage.list_dir(f"{MERGED_ROOT}/"):
        name = name.rstrip("/")
        # (a merger folder's step is the 12 digits before its id: most names are passed over
        # without a parse)
        if name[-29:-17] >= above and (parsed := parse_merged_dir(name)) is not None:
            merged[f"{MERGED_ROOT}/{name}"] = parsed[1]
    extra = storage.list_modified(f"{QUARANTINE_ROOT}/") + storage.list_modified(f"{CLOCK_DIR}/")
    listed: dict[str, Listing] = {}

    def view_at(floor: int, manifests: ManifestSet) -> StoreView:
        kept = _folders(steps, merged, floor)
        ids = {m.id for m in manifests.all() if m.step >= floor}
        listing = [kt for f in sorted(kept) for kt in listed[f]]
        listing += [kt for kt in extra if _quarantined_id(kt[0]) in ids or CLOCK_DIR in kt[0]]
        gone = {parsed[0] for f in kept if (parsed := parse_merged_dir(f.partition("/")[2]))}
        return StoreView(listing, _above(manifests, floor, gone), floor)

    raw: dict[str, RecordBytes | None] = {}
    seen: dict[str, tuple[bytes, CheckpointManifest]] = {}  # records parsed, by key

    def read_down_to(start: int) -> tuple[ManifestSet, LineageGraph, dict[str, float | None]]:
        """The records of the folders at and above ``start`` (each folder listed and each
        record read once in the whole search)."""
        folders = _folders(steps, merged, start)
        todo = [f for f in folders if f not in listed]
        for folder, got in overlapped(storage, lambda f: storage.list_modified(f"{f}/"), todo):
            if isinstance(got, Exception):
                raise got
            listed[folder] = got
        keys = [k for f in todo for k, _ in listed[f]] + ([] if raw else [k for k, _ in extra])
        raw.update(get_records(storage, [k for k in keys if record_key_kind(k) is not None]))
        manifests = manifest_set(storage, raw.items(), None, seen)
        seen.update(manifests.parsed)
        times = {k: t for f in folders for k, t in listed[f]}
        return manifests, build_graph(manifests), times

    while not young and newest >= limit:
        start = refs[lowest].first
        manifests, graph, times = read_down_to(start)
        below = [r.newest for r in refs[:lowest] if r.newest is not None]
        below += [es for es in logged if es[1] < start]
        if start > 0 and (first is None or first < start):
            below.append((witness, start - 1))  # (what the newest epoch may hold below)
        floor = _highest_cut(
            graph,
            start,
            max(below, default=None),
            keep_last_fulls=keep_last_fulls,
            keep_fulls_every=keep_fulls_every,
            cutoff=cutoff,
            when=partial(_when, commit_times(graph, times), now),
        )
        if floor is not None:
            return view_at(floor, manifests)
        if lowest == limit:
            break
        # Twice the segments each time: a window growing by one would build its graph again
        # for each
        lowest = max(limit, lowest - (len(refs) - lowest))
    if cutoff is None:
        return None
    # No cut, but where every checkpoint of the newest segment is in the grace period none of
    # them goes, whatever a plan of every record says (their folders' orphans are decided folder
    # by folder). A cut, where there is one, is preferred: this deletes no checkpoint.
    start = refs[newest].first
    manifests, graph, times = read_down_to(start)
    when = partial(_when, commit_times(graph, times), now)
    if all(when(n.id) > cutoff for n in graph.nodes.values() if n.step >= start):
        return view_at(start, manifests)
    return None


def _last_before(storage: Storage, steps: list[int], cutoff: float | None) -> int:
    """About the newest step committed at or before ``cutoff`` (None: the newest step): a
    binary search of the steps' record times, which grow with the step but where a rollback
    wrote again (a hint where to look, never a decision)."""
    if cutoff is None or not steps:
        return steps[-1] if steps else 0
    lo, hi = 0, len(steps) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _time(storage, steps[mid]) <= cutoff:
            lo = mid
        else:
            hi = mid - 1
    return steps[lo]


def _time(storage: Storage, step: int) -> float:
    t = storage.modified(f"{step_dir(step)}/{MANIFEST}")
    return t if t is not None else math.inf  # (unknown or absent: young)


def _segment_of(refs: tuple[SegmentRef, ...], step: int) -> int:
    """The index of the segment holding ``step`` (the last one starting at or below it)."""
    return max(0, bisect.bisect_right([r.first for r in refs], step) - 1)


class _StepFolders:
    """The store's step folders, listed from the lowest step asked for so far."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.start: int | None = None
        self.steps: list[int] = []

    def from_step(self, start: int) -> list[int]:
        """The steps of the folders at and above ``start`` (ascending)."""
        if self.start is None or start < self.start:
            names = self.storage.list_dir_after("", step_dirs_from(start))
            self.steps = sorted(
                s for n in names if (s := parse_step_dir(n.rstrip("/"))) is not None
            )
            self.start = start
        return self.steps[bisect.bisect_left(self.steps, start) :]


def _folders(steps: _StepFolders, merged: dict[str, int], start: int) -> list[str]:
    """The step folders and merger folders of the steps at and above ``start``."""
    return [step_dir(s) for s in steps.from_step(start)] + [
        f for f, s in merged.items() if s >= start
    ]


def commit_times(graph: LineageGraph, times: Mapping[str, float | None]) -> dict[str, float | None]:
    """Checkpoint id -> when the store wrote its commit record, by a listing's ``times`` (None:
    unknown, counted as just committed).

    A run lists before it reads the records, and a step's record is written again when a new
    timeline saves the step again: the listed time of ``step-N/manifest.json`` may be the
    replaced record's, hours older than the record read. A trainer record is dated no earlier
    than the newest listed file of its own attempt folder (written before it), and unknown when
    the listing shows none: it came after the listing."""
    attempts: dict[str, float | None] = {}
    for key, t in times.items():
        folder, _, rest = key.partition("/")
        aid, sep, _ = rest.partition("/")
        if sep:
            name = f"{folder}/{aid}"
            was = attempts.get(name, -math.inf)
            attempts[name] = None if t is None or was is None else max(t, was)
    out: dict[str, float | None] = {}
    for cid, n in graph.nodes.items():
        t = times.get(f"{n.folder}/{MANIFEST}")
        if t is not None and not n.merged:
            files = attempts.get(f"{n.folder}/{cid}")
            t = None if files is None else max(t, files)
        out[cid] = t
    return out


def _when(committed: Mapping[str, float | None], now: float | None, cid: str) -> float:
    """Checkpoint ``cid``'s commit time (:func:`commit_times`); unknown: ``now``, as
    :func:`deck.ops.retention.plan.grace_protected` counts it."""
    t = committed.get(cid)
    return t if t is not None else (now if now is not None else float("inf"))


def _highest_cut(
    graph: LineageGraph,
    start: int,
    catalog_below: tuple[int, int] | None,
    *,
    keep_last_fulls: int,
    keep_fulls_every: int | None,
    cutoff: float | None,
    when: Callable[[str], float],
) -> int | None:
    """The highest step at or above ``start`` that is a cut of ``graph`` (every record at or
    above ``start``), ``catalog_below`` the newest trainer record below ``start``."""
    fulls = sorted((s for s, n in graph.trainer.items() if n.kind is Kind.FULL), reverse=True)
    for floor in fulls:
        if floor < start:
            break
        period = floor - floor % keep_fulls_every if keep_fulls_every else floor
        if period < start:
            continue  # an older full of its period may be below what was read
        nodes = list(graph.nodes.values())
        below = [
            (n.epoch, n.step)
            for n in nodes
            if n.step < floor and (not n.merged or n.kind is Kind.FULL)
        ]
        if catalog_below is not None:
            below.append(catalog_below)
        if is_cut(
            floor,
            [n for n in nodes if n.step >= floor],
            newest_below=max(below, default=None),
            full_in_period_below=any(
                n.kind is Kind.FULL and n.quarantined is None and period <= n.step < floor
                for n in nodes
            ),
            keep_last_fulls=keep_last_fulls,
            keep_fulls_every=keep_fulls_every,
            cutoff=cutoff,
            when=when,
        ):
            return floor
    return None


def _logged_trainer(records: Iterable[tuple[str, object]]) -> list[tuple[int, int]] | None:
    """(epoch, step) of the trainer records among ``records`` (those read after the catalog);
    None when one of them cannot be read."""
    out = []
    for key, data in records:
        kind = record_key_kind(key)
        if kind is None or kind[0] is None or kind[1] is not None:
            continue  # a quarantine record or a merger's
        if not isinstance(data, bytes):
            return None
        try:
            m = load_model(CheckpointManifest, data, key)
        except DeckError:
            return None
        out.append((m.epoch, m.step))
    return out


def _quarantined_id(key: str) -> str:
    return key.rpartition("/")[2].removesuffix(".json")


def _above(ms: ManifestSet, floor: int, folder_ids: set[str]) -> ManifestSet:
    """The records of ``ms`` at or above ``floor`` (``folder_ids``: the ids of the merger folders
    there, for the unreadable merger records)."""
    merged = {i: m for i, m in ms.merged.items() if m.step >= floor}
    trainer = {s: m for s, m in ms.items() if s >= floor}
    ids = {m.id for m in trainer.values()} | set(merged)
    out = ManifestSet(
        trainer, merged, {i: r for i, r in ms.quarantined.items() if i in ids}, uri=ms.uri
    )
    out.damaged = {s: p for s, p in ms.damaged.items() if s >= floor}
    out.damaged_merged = {i: p for i, p in ms.damaged_merged.items() if i in folder_ids}
    return out
