"""What a GC run sees of a store: the whole of it, or its newest part where that decides alike.

:func:`whole_view` lists the store and reads every commit record (the run that verifies the
catalog and reaches every old folder). :func:`newest_view` reads only the folders of the newest
steps: it takes the catalog's segments (their step ranges and newest trainer record, never their
records) to know what lies below, then lists and reads the commit records of the step and merger
folders from the newest segment down, one segment at a time, until a step
:func:`deck.ops.retention.window.is_cut` accepts. The records themselves are the truth there as
in a whole read; what the catalog contributes is only the newest trainer record below the cut
(a merger full's epoch is the one of the trainer record of its state, which is at or below that).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

from deck.errors import DeckError
from deck.format.commit_log import record_key_kind
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
)
from deck.ops.retention.clock import CLOCK_DIR
from deck.ops.retention.window import is_cut
from deck.read.catalog import ManifestSet, get_records, overlapped, read_manifests
from deck.read.indexed import read_indexed
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
    grace period); ``now``: the store's time (a commit whose time is unknown counts as made
    now)."""
    index = read_indexed(storage, lambda ks: get_records(storage, ks), lazy=True)
    if index is None or not index.segments:
        return None
    refs = index.segments
    # Trainer records read after the catalog (a rollback's, below any segment's newest)
    logged = _logged_trainer(index.records.items())
    if logged is None:
        return None  # a record of unknown epoch below: the whole read decides about it
    steps = sorted(
        s for n in storage.list_dir("") if (s := parse_step_dir(n.rstrip("/"))) is not None
    )
    merged: dict[str, int] = {}
    for name in storage.list_dir(f"{MERGED_ROOT}/"):
        parsed = parse_merged_dir(name.rstrip("/"))
        if parsed is not None:
            merged[f"{MERGED_ROOT}/{name.rstrip('/')}"] = parsed[1]
    extra = storage.list_modified(f"{QUARANTINE_ROOT}/") + storage.list_modified(f"{CLOCK_DIR}/")
    listed: dict[str, Listing] = {}
    lowest = len(refs) - 1
    while lowest >= 1 and len(refs) - lowest <= max(2, int(len(refs) * _MOST)):
        start = refs[lowest].first
        folders = [step_dir(s) for s in steps if s >= start]
        folders += [f for f, s in merged.items() if s >= start]
        todo = [f for f in folders if f not in listed]
        for folder, got in overlapped(storage, lambda f: storage.list_modified(f"{f}/"), todo):
            if isinstance(got, Exception):
                raise got
            listed[folder] = got
        keys = [k for f in folders for k, _ in listed[f]] + [k for k, _ in extra]
        manifests = read_manifests(storage, keys)
        graph = build_graph(manifests)
        below = [r.newest for r in refs[:lowest] if r.newest is not None]
        below += [es for es in logged if es[1] < start]
        times = {k: t for f in folders for k, t in listed[f]}
        floor = _highest_cut(
            graph,
            start,
            max(below, default=None),
            keep_last_fulls=keep_last_fulls,
            keep_fulls_every=keep_fulls_every,
            cutoff=cutoff,
            when=partial(_when, graph, times, now),
        )
        if floor is not None:
            kept = {f for f in folders if _folder_step(f, merged) >= floor}
            ids = {n.id for n in graph.nodes.values() if n.step >= floor}
            listing = [kt for f in sorted(kept) for kt in listed[f]]
            listing += [kt for kt in extra if _quarantined_id(kt[0]) in ids or CLOCK_DIR in kt[0]]
            gone = {parsed[0] for f in kept if (parsed := parse_merged_dir(f.partition("/")[2]))}
            return StoreView(listing, _above(manifests, floor, gone), floor)
        lowest -= 1
    return None


def _when(
    graph: LineageGraph, times: dict[str, float | None], now: float | None, cid: str
) -> float:
    """Checkpoint ``cid``'s commit time (its record's file time); unknown: ``now``, as
    :func:`deck.ops.retention.plan.grace_protected` counts it."""
    n = graph.nodes[cid]
    t = times.get(f"{n.folder}/{MANIFEST}")
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
        if kind is None or kind[1] is not None:
            continue  # a quarantine record or a merger's
        if not isinstance(data, bytes):
            return None
        try:
            m = load_model(CheckpointManifest, data, key)
        except DeckError:
            return None
        out.append((m.epoch, m.step))
    return out


def _folder_step(folder: str, merged: dict[str, int]) -> int:
    step = parse_step_dir(folder)
    return step if step is not None else merged[folder]


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
