"""The lineage graph of a URI: every committed checkpoint (trainer fulls and deltas, the merger's
merged deltas and fulls), what each applies on, and the cheapest chain that reproduces a step.

Lineage is data in the commit records (docs/format.md), never a separate index. The graph's unit
is the *training state* ``(step, id of the trainer checkpoint of that step)``:

- a full (the trainer's, or a merger full) *reproduces* a state on its own;
- a delta or a merged delta *takes* state ``start`` (its ``parent`` step and id) *to* its state.

A chain for step ``t`` is a full, then deltas / merged deltas each starting where the previous one
ended, ending with the trainer checkpoint of ``t`` (whose folder holds the dense and extra state).
:func:`cheapest_chain` picks the one with the fewest bytes; ids make sure a chain never mixes
timelines (a step saved again after a rollback gets a new id, so nothing built on the old one
applies to it).

``deck.lineage_graph(uri)`` (this module's :func:`lineage_graph`) returns the graph of a URI;
``deck.read.lineage`` is this module.
"""

from __future__ import annotations

import heapq
import logging
import re
import weakref
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from deck.errors import CheckpointNotFoundError, CorruptCheckpointError, NotFoundError, StorageError
from deck.format.commit_log import LOG_ROOT, key_step, listed_seqs, log_key, read_log_entry
from deck.format.epochs import EPOCH_ROOT, newest_witness, witness_key, witnessed_step
from deck.format.jsonio import paused_gc
from deck.format.manifest import (
    MANIFEST,
    MERGED_ROOT,
    QUARANTINE_ROOT,
    CheckpointManifest,
    Kind,
    QuarantineRecord,
    load_model,
    parse_merged_dir,
    parse_step_dir,
    step_dir,
    step_dirs_from,
    steps_text,
)
from deck.read.catalog import (
    ManifestSet,
    OutsideWindow,
    Window,
    manifest_keys,
    quarantine,
    read_every_record,
    read_manifests,
)
from deck.storage import Storage
from deck.storage.base import MAX_RECORD_BYTES

logger = logging.getLogger(__name__)

StateKey = tuple[int, str]
"""A training state: (step, id of the trainer checkpoint saved at that step)."""


@dataclass(frozen=True)
class LineageNode:
    """One committed checkpoint in the lineage graph."""

    id: str
    kind: Kind  # full | delta | merged
    merged: bool  # written by the merger (a merged delta or a merger full)
    step: int
    first_step: int  # first trainer step whose rows it holds (a full: its step)
    layer: int  # 0: trainer checkpoints and merger fulls; i >= 1: merged deltas of layer i
    start: StateKey | None  # the state it applies on (None for a full)
    state: StateKey  # the state it reproduces
    inputs: tuple[str, ...]  # ids it was merged from (merger checkpoints), oldest first
    bytes: int  # all files of the checkpoint, all ranks
    epoch: int
    folder: str
    quarantined: str | None  # why it must not be used, or None
    manifest: CheckpointManifest = field(repr=False, compare=False)

    @property
    def covers(self) -> tuple[int, int]:
        """(first, last) trainer step whose rows it holds."""
        return (self.first_step, self.step)

    @property
    def usable(self) -> bool:
        return self.quarantined is None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready description (for ``deck lineage --json``)."""
        return {
            "id": self.id,
            "kind": self.kind.value,
            "merged": self.merged,
            "step": self.step,
            "covers": list(self.covers),
            "layer": self.layer,
            "start": list(self.start) if self.start else None,
            "state": list(self.state),
            "inputs": list(self.inputs),
            "bytes": self.bytes,
            "epoch": self.epoch,
            "folder": self.folder,
            "quarantined": self.quarantined,
        }


def _node(m: CheckpointManifest, quarantined: dict[str, str]) -> LineageNode:
    return LineageNode(
        id=m.id,
        kind=m.kind,
        merged=m.is_merged,
        step=m.step,
        first_step=m.covers[0],
        layer=m.layer,
        start=m.start,
        state=m.state,
        inputs=m.inputs,
        bytes=m.data_bytes,
        epoch=m.epoch,
        folder=m.folder,
        quarantined=quarantined.get(m.id),
        manifest=m,
    )


class PathLink:
    """Cheapest known way to reach a state: total bytes, then fewest checkpoints, then ids (the
    path's ids compared like tuples, from the full on).

    One link of a persistent list: ``id`` is the last checkpoint of the path and ``prev`` the
    way to the state it applies on (None: ``id`` is a full). Paths share their prefixes, so
    reaching a state costs one link, not a copy of the path before it: a chain of n deltas is
    O(n), where whole tuples per state were O(n**2). Never changed once made, so a link also
    names its whole path (:mod:`deck.ops.retention.grace` keeps the links it has walked).
    """

    __slots__ = ("cost", "id", "length", "prev")

    def __init__(self, cost: int, length: int, prev: PathLink | None, id: str) -> None:
        self.cost = cost
        self.length = length  # checkpoints on the path
        self.prev = prev
        self.id = id

    @property
    def path(self) -> tuple[str, ...]:
        """Ids of the path, the full first."""
        return _ids(self, ())

    def __repr__(self) -> str:
        return f"PathLink(cost={self.cost}, path={self.path})"


def _ids(link: PathLink | None, tail: tuple[str, ...]) -> tuple[str, ...]:
    """The ids of the path ending in ``link``, then ``tail``."""
    out = list(reversed(tail))
    while link is not None:
        out.append(link.id)
        link = link.prev
    return tuple(reversed(out))


# A way in, before it is made a link: (cost, length, prev, id) -- the path of ``prev``, then
# ``id`` (a candidate of :func:`cheapest_way_in` or :func:`chain_way_from`).
_Way = tuple[int, int, "PathLink | None", str]


def _before(a: _Way, b: _Way) -> bool:
    """Whether way ``a`` is cheaper than ``b``: bytes, then checkpoints, then the ids like
    tuples (the first that differs, from the full on)."""
    if a[0] != b[0]:
        return a[0] < b[0]
    if a[1] != b[1]:
        return a[1] < b[1]
    # Equal lengths: walk both from the end; the last difference seen is the first from the
    # start. Paths of one graph share their links, so the walk stops where they meet.
    aid, ap, bid, bp = a[3], a[2], b[3], b[2]
    verdict = False
    while True:
        if aid != bid:
            verdict = aid < bid
        if ap is bp:  # the same link, or both at the full (equal lengths: None together)
            return verdict
        assert ap is not None and bp is not None
        aid, ap, bid, bp = ap.id, ap.prev, bp.id, bp.prev


def cheapest_way_in(
    st: StateKey,
    fulls: Iterable[LineageNode],
    endings: Iterable[LineageNode],
    best: Mapping[StateKey, PathLink],
    exclude: Container[str],
) -> _Way | None:
    """The cheapest way into state ``st``: a usable full of it, or a usable delta / merged delta
    ending in it after the cheapest way to where it starts (``best``, known for every state
    before ``st``); usable: not quarantined, not in ``exclude``. The first of equal ones wins
    (none are: paths differ in their ids)."""
    win: _Way | None = None
    for f in fulls:
        if f.quarantined is None and f.id not in exclude:
            c: _Way = (f.bytes, 1, None, f.id)
            if win is None or _before(c, win):
                win = c
    for d in endings:
        start = d.start
        # (a delta's parent is older: its start sorts before ``st``, the order states are
        # visited in; the check keeps a record saying otherwise out, as that order always did)
        if start is None or d.quarantined is not None or d.id in exclude or not start < st:
            continue
        prev = best.get(start)
        if prev is None:
            continue
        # (the costs first: most candidates are decided by them, without a tuple)
        cost = prev.cost + d.bytes
        if win is None or cost < win[0]:
            win = (cost, prev.length + 1, prev, d.id)
        elif cost == win[0]:
            c = (cost, prev.length + 1, prev, d.id)
            if _before(c, win):
                win = c
    return win


ChainWay = tuple[LineageNode, "PathLink | None", "str | None"]


def chain_way_from(
    t: LineageNode,
    fulls: Iterable[LineageNode],
    endings: Iterable[LineageNode],
    best: Mapping[StateKey, PathLink],
    exclude: Container[str],
) -> ChainWay | None:
    """How the cheapest chain of trainer checkpoint ``t`` reaches its state, given the cheapest
    ways ``best`` and the fulls and endings of ``t.state``: ``(t, prev, last)``, the chain being
    the path of ``prev``, then ``last`` (if not None), then ``t``; None when there is none
    (usable: not quarantined, not in ``exclude``)."""
    if t.quarantined is not None or t.id in exclude:
        return None
    if t.kind is Kind.FULL:
        return (t, None, None)
    win: _Way | None = None
    b = best.get(t.start) if t.start is not None else None
    if b is not None:
        # Through its own start: ``t`` is the chain's last checkpoint (appended by the caller)
        win = (b.cost + t.bytes, b.length, b.prev, b.id)
    # Or reach the state itself another way (a merger full of it, or a merged delta ending
    # in it): the trainer checkpoint then only contributes its records (dense / extra
    # state, its id), not its rows (restore.apply_chain skips them), so it costs nothing.
    for f in fulls:
        if f.quarantined is None and f.id not in exclude:
            c: _Way = (f.bytes, 1, None, f.id)
            if win is None or _before(c, win):
                win = c
    for d in endings:
        if d.id == t.id or d.quarantined is not None or d.id in exclude or d.start is None:
            continue
        prev = best.get(d.start)
        if prev is not None:
            c = (prev.cost + d.bytes, prev.length + 1, prev, d.id)
            if win is None or _before(c, win):
                win = c
    return None if win is None else (t, win[2], win[3])


def _usable_in(exclude: Container[str]) -> Callable[[LineageNode], bool]:
    return lambda n: n.quarantined is None and n.id not in exclude


# A graph whose paths are not computed answers its first few chains from the part of the
# lineage they come from (:meth:`LineageGraph._near_paths`), then computes every path once (a
# caller asking for every step's chain). Asked so far, per graph.
_NEAR_CHAINS = 16
_NEAR_ASKED: weakref.WeakKeyDictionary[LineageGraph, int] = weakref.WeakKeyDictionary()


def keep_chain(way: ChainWay, into: set[str], walked: set[PathLink]) -> None:
    """Add the ids of the chain ``way`` (what :meth:`LineageGraph.chain_way` returned) to
    ``into``, walking only links not in ``walked`` (each added there): a link names its whole
    path, so a path already walked is already in ``into``. The chains of every step of a
    lineage cost O(its checkpoints) together, not O(steps x chain length)."""
    t, prev, last = way
    into.add(t.id)
    if last is not None:
        into.add(last)
    while prev is not None and prev not in walked:
        walked.add(prev)
        into.add(prev.id)
        prev = prev.prev


class LineageGraph:
    """Every committed checkpoint of one URI and how they connect (see the module docstring).

    ``nodes``: all checkpoints by id. ``trainer``: the trainer's checkpoints by step.
    ``fulls_at[state]`` / ``ending_at[state]``: fulls reproducing a state, and deltas / merged
    deltas ending in it. Quarantined checkpoints are in the graph (marked) but never in a chain.
    """

    def __init__(self, manifests: ManifestSet | dict[int, CheckpointManifest], uri: str = ""):
        quarantined = manifests.quarantined if isinstance(manifests, ManifestSet) else {}
        merged = manifests.merged if isinstance(manifests, ManifestSet) else {}
        self.uri = uri or (manifests.uri if isinstance(manifests, ManifestSet) else "")
        # Steps whose commit record cannot be read: a chain that needs one says so, not "missing"
        self.damaged: dict[int, str] = (
            dict(manifests.damaged) if isinstance(manifests, ManifestSet) else {}
        )
        # Only part of the lineage was read: questions that reach below it raise OutsideWindow
        self.window: Window | None = (
            manifests.window if isinstance(manifests, ManifestSet) else None
        )
        self._index(_node(m, quarantined) for m in [*manifests.values(), *merged.values()])

    def _index(self, nodes: Iterable[LineageNode]) -> None:
        """Fill the lookups (``nodes``, ``trainer``, ``fulls_at``, ``ending_at``) from ``nodes``."""
        self.nodes: dict[str, LineageNode] = {}
        self.trainer: dict[int, LineageNode] = {}
        self.fulls_at: dict[StateKey, list[LineageNode]] = {}
        self.ending_at: dict[StateKey, list[LineageNode]] = {}
        for n in nodes:
            self.nodes[n.id] = n
            if not n.merged:
                self.trainer[n.step] = n
            if n.kind is Kind.FULL:
                self.fulls_at.setdefault(n.state, []).append(n)
            else:
                self.ending_at.setdefault(n.state, []).append(n)
        self._best: dict[StateKey, PathLink] | None = None
        self._best_excluding: frozenset[str] = frozenset()
        self._merged_from: dict[str, list[LineageNode]] | None = None
        self._full_below: dict[str, CheckpointManifest | None] = {}  # (full_below's answers)
        self._abandoned: frozenset[int] | None = (
            None  # (abandoned's answer: latest, unrestorable, GC)
        )

    # ---- derived graphs (the same nodes, no manifest read or parsed again) ---------------------
    def _derived(self, nodes: Iterable[LineageNode]) -> LineageGraph:
        graph = LineageGraph.__new__(LineageGraph)
        graph.uri = self.uri
        graph.damaged = self.damaged
        graph.window = self.window
        with paused_gc():  # (a node per checkpoint, as build_graph makes them)
            graph._index(nodes)
        return graph

    def marked(self, unusable: Mapping[str, str]) -> LineageGraph:
        """This graph with the checkpoints ``unusable`` (id -> problem) marked like quarantined
        ones, in memory only (nothing is written): what a chain, a plan or a restore would do
        if they were quarantined. This graph is unchanged."""
        return self._derived(
            replace(n, quarantined=unusable[n.id]) if n.id in unusable else n
            for n in self.nodes.values()
        )

    def unmarked(self) -> LineageGraph:
        """This graph without its quarantine marks, in memory only: what a chain or a plan
        would do were nothing quarantined. This graph is unchanged."""
        return self._derived(
            replace(n, quarantined=None) if n.quarantined is not None else n
            for n in self.nodes.values()
        )

    def as_of(
        self, cutoff: float, committed_at: Callable[[str], float] | None = None
    ) -> LineageGraph:
        """The graph of the checkpoints committed at or before ``cutoff``: the lineage as it
        was then, quarantine marks as now. ``committed_at(id)`` is a checkpoint's commit time
        on the clock of ``cutoff`` (default: its record's ``created_unix``, the writer's clock).
        This graph is unchanged."""
        at = committed_at or (lambda i: self.nodes[i].manifest.created_unix)
        return self._derived(n for n in self.nodes.values() if at(n.id) <= cutoff)

    # ---- queries ---------------------------------------------------------------------------
    def trainer_at(self, state: StateKey) -> LineageNode | None:
        """The trainer checkpoint of ``state`` if it is still committed."""
        n = self.trainer.get(state[0])
        return n if n is not None and n.id == state[1] else None

    def merged_from(self, cid: str) -> list[LineageNode]:
        """The merged deltas naming ``cid`` among their inputs."""
        if self._merged_from is None:
            self._merged_from = {}
            for n in self.nodes.values():
                if n.kind is Kind.MERGED:
                    for i in n.inputs:
                        self._merged_from.setdefault(i, []).append(n)
        return self._merged_from.get(cid, [])

    def parents(self, node_id: str) -> list[LineageNode]:
        """What a checkpoint was made from / applies on: a merger checkpoint's inputs, or the
        trainer checkpoint a delta's parent link names (those still committed)."""
        n = self.nodes[node_id]
        out = [self.nodes[i] for i in n.inputs if i in self.nodes]
        if not n.merged and n.start is not None:
            p = self.trainer_at(n.start)
            if p is not None:
                out.append(p)
        return out

    def full_below(self, node_id: str) -> CheckpointManifest | None:
        """The full that checkpoint ``node_id``'s chains start from (itself for a full): its
        parent links (a merger checkpoint's oldest input) followed down; None when one is gone.
        Every checkpoint the walk passes keeps the answer: asked of every checkpoint (`deck
        verify --all`), each link is followed once, not once per checkpoint above it."""
        node: LineageNode | None = self.nodes.get(node_id)
        walked: dict[str, None] = {}  # (in order; a set's lookups)
        found: CheckpointManifest | None = None
        while node is not None:
            if node.id in self._full_below:
                found = self._full_below[node.id]
                break
            if node.kind is Kind.FULL:
                found = node.manifest
                break
            if node.id in walked:
                break  # (a cycle only a forged lineage makes: no full)
            walked[node.id] = None
            below = self.parents(node.id)
            node = below[0] if below else None
        self._full_below.update(dict.fromkeys(walked, found))
        return found

    def children(self, node_id: str) -> list[LineageNode]:
        """Checkpoints made from this one, or whose parent link names it."""
        n = self.nodes[node_id]
        return [
            c
            for c in self.nodes.values()
            if node_id in c.inputs or (not c.merged and not n.merged and c.start == n.state)
        ]

    def restorable_steps(self) -> list[int]:
        """Trainer steps that have a complete chain, ascending."""
        return [s for s in sorted(self.trainer) if self.restorable(s)]

    def restorable(self, step: int) -> bool:
        """Whether trainer step ``step`` has a complete chain."""
        return self._chain_ids(step, frozenset()) is not None

    def unrestorable(self, above: int = -1, *, advice: bool = True) -> dict[int, str]:
        """Trainer steps (those after ``above`` only) without a complete chain that no newer
        timeline left (:meth:`abandoned`), each with what its chain lacks: damage (and, with
        ``advice``, what a trainer's restore may do instead). A rollback's abandoned steps are
        left out (the steps it saved again make the old ones after them unrestorable by
        design)."""
        return {s: why for s, (why, _) in self.gaps(above, advice=advice).items()}

    def gaps(self, above: int = -1, *, advice: bool = True) -> dict[int, tuple[str, int | None]]:
        """:meth:`unrestorable`, each with the step whose record its chain lacks (None: the
        link missing is an unusable checkpoint, or no full starts the chain)."""
        left = self.abandoned()
        return {
            s: self._gap(s, frozenset(), advice)
            for s in sorted(self.trainer)
            if s > above and s not in left and not self.restorable(s)
        }

    def abandoned(self) -> frozenset[int]:
        """Trainer steps a newer timeline left: those above the step a newer epoch's timeline
        went on from (the parent of that epoch's lowest checkpoint here). The steps below it are
        that timeline's history, whatever their epoch: a process restarted from the latest step
        takes a new epoch too (a break-it finding: a commit record lost before a restart hid
        the steps after it from verify as "abandoned", and GC deleted them). Where a full starts
        an epoch, where it went on from is not recorded: the steps below the full count as its
        history (said damaged rather than abandoned, kept rather than deleted)."""
        if self._abandoned is None:
            self._abandoned = abandoned_steps(self.trainer)
        return self._abandoned

    def latest(self, log: bool = True, below: int | None = None) -> int | None:
        """The newest trainer checkpoint (highest epoch, then step) with a complete chain that
        no newer timeline left (:meth:`abandoned`: a break-it finding, a rollback's new
        timeline made unrestorable by a lost record sent the latest back onto the timeline the
        rollback had left, through a merger full of it); checkpoints skipped on the way are
        logged with the reason (unless not ``log``: a caller that reports them itself).
        ``below``: the newest such checkpoint of a step below it."""
        horizon = self.window.horizon if self.window is not None else None
        skipped: list[int] = []
        left = self.abandoned()
        try:
            for n in sorted(self.trainer.values(), key=lambda n: (n.epoch, n.step), reverse=True):
                if horizon is not None and (n.epoch, n.step) < horizon:
                    raise OutsideWindow(horizon[1])  # a newer one may be among those not read
                if n.step in left or (below is not None and n.step >= below):
                    continue
                if self._chain_ids(n.step, frozenset()) is not None:
                    return n.step
                skipped.append(n.step)
            return None
        finally:
            if log and skipped:
                self._log_skipped(skipped)

    def _log_skipped(self, skipped: list[int]) -> None:
        """One warning for the steps :meth:`latest` went past (newest first): the newest one's
        reason, and how many more there were (one damaged full can leave thousands)."""
        try:
            why = self._why_not(skipped[0], frozenset())
        except OutsideWindow:  # (a window's answer: the latest is known, the reason is below)
            why = (
                f"step {skipped[0]} has no complete chain (`deck verify {self.uri or 'URI'} "
                "--all` says why)"
            )
        if len(skipped) == 1:
            logger.warning("skipping step %d: %s", skipped[0], why)
        else:
            logger.warning(
                "skipping %d steps without a complete chain (%d to %d); the newest, step %d: %s",
                len(skipped),
                min(skipped),
                max(skipped),
                skipped[0],
                why,
            )

    def chain(self, step: int, exclude: Iterable[str] = ()) -> list[CheckpointManifest]:
        """Shorthand for :func:`cheapest_chain` ``(self, step, exclude=exclude)``."""
        return cheapest_chain(self, step, exclude=exclude)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready graph: nodes, plus the cheapest chain of every restorable step."""
        return {
            "uri": self.uri,
            "nodes": [n.to_dict() for n in sorted(self.nodes.values(), key=_order)],
            "chains": {
                str(s): [m.id for m in cheapest_chain(self, s)] for s in self.restorable_steps()
            },
        }

    # ---- shortest paths ----------------------------------------------------------------------
    def _usable(self, n: LineageNode, exclude: frozenset[str]) -> bool:
        return n.quarantined is None and n.id not in exclude

    def best_paths(self, exclude: frozenset[str] = frozenset()) -> dict[StateKey, PathLink]:
        """Cheapest path (bytes) from some full to every reachable state.

        Edges only go to later steps (a delta's parent is older), so one pass in step order is
        a complete shortest-path computation; each state adds one link (:class:`PathLink`).
        The paths of the last ``exclude`` asked are kept.
        """
        if self._best is not None and (
            self._best_excluding is exclude or self._best_excluding == exclude
        ):
            return self._best
        if self.window is not None:
            raise OutsideWindow(-1)
        best: dict[StateKey, PathLink] = {}
        fulls_at, ending_at = self.fulls_at, self.ending_at
        with paused_gc():  # (a link per state, kept: see paused_gc)
            for st in sorted({*fulls_at, *ending_at}):
                way = cheapest_way_in(
                    st, fulls_at.get(st, ()), ending_at.get(st, ()), best, exclude
                )
                if way is not None:
                    best[st] = PathLink(*way)
        self._best, self._best_excluding = best, exclude
        return best

    def chain_way(self, step: int, exclude: frozenset[str]) -> ChainWay | None:
        """``(t, prev, last)``: the cheapest chain of trainer step ``step`` is the path of
        ``prev``, then ``last`` (if not None), then ``t`` (see :func:`chain_way_from`); None when
        there is none. Nothing is copied: O(in-degree) once the paths are known."""
        t = self.trainer.get(step)
        if self.window is not None and step < self.window.floor:
            raise OutsideWindow(step)
        if t is None:
            return None
        st = t.state
        if self._best is not None and (
            self._best_excluding is exclude or self._best_excluding == exclude
        ):
            best: Mapping[StateKey, PathLink] = self._best
        elif _NEAR_ASKED.get(self, 0) < _NEAR_CHAINS:
            # A few chains of a graph whose paths are not known (a restore plans one): only
            # the part of the lineage they can come from, not every state of a long history
            _NEAR_ASKED[self] = _NEAR_ASKED.get(self, 0) + 1
            best = self._near_paths(t, exclude)
        else:
            best = self.best_paths(exclude)
        return chain_way_from(
            t, self.fulls_at.get(st, ()), self.ending_at.get(st, ()), best, exclude
        )

    def _near_paths(self, t: LineageNode, exclude: frozenset[str]) -> dict[StateKey, PathLink]:
        """The cheapest paths into the states a chain of ``t`` goes on from (its start, the
        starts of what else ends in its state) -- exactly :meth:`best_paths`' for those, those
        only -- computed over the states a cheapest path into one of them can pass through.

        Which those are, a search back from each finds (Dijkstra over the reversed edges, by
        the bytes from the state on): a state ``b`` bytes back costs at least ``b`` on any path
        through it (bytes are never negative), so once a full found on the way gives a path of
        ``u`` bytes, nothing more than ``u`` bytes back can be on a cheapest one (nor on an
        equally cheap one: ties stay in, for the tie-breaks). Then :meth:`best_paths`' pass in
        step order over those states alone: the paths it finds into them may be dearer than
        the lineage's, but not on the cheapest ones, which lie wholly among them. A long
        history costs the bytes of one or two fulls' worth of steps back, not every state."""
        targets, near = self._near_states(t, exclude)
        best: dict[StateKey, PathLink] = {}
        for st in sorted(near):
            way = cheapest_way_in(
                st, self.fulls_at.get(st, ()), self.ending_at.get(st, ()), best, exclude
            )
            if way is not None:
                best[st] = PathLink(*way)
        return {st: best[st] for st in targets if st in best}

    def chain_reach(self, step: int) -> int:
        """The lowest step whose checkpoints can be on the cheapest chain of trainer step
        ``step`` (the search of :meth:`_near_paths` goes no lower): which chain is cheapest
        depends on the records of the steps from there to ``step`` only (and their quarantine
        records). A read that holds those as the store does plans what every record plans."""
        t = self.trainer.get(step)
        if t is None:
            return step
        _, near = self._near_states(t, frozenset())
        return min((st[0] for st in near), default=step)

    def _near_states(
        self, t: LineageNode, exclude: frozenset[str]
    ) -> tuple[set[StateKey], set[StateKey]]:
        """The states a chain of ``t`` goes on from, and those a cheapest path into one of them
        can pass through (see :meth:`_near_paths`)."""
        targets = {t.start} if t.start is not None else set()
        for d in self.ending_at.get(t.state, ()):
            if d.id != t.id and d.start is not None:
                targets.add(d.start)
        usable = _usable_in(exclude)
        near: set[StateKey] = set()
        for target in targets:
            back = {target: 0}
            heap = [(0, target)]
            bound = None  # bytes of the cheapest complete path found so far
            while heap:
                b, st = heapq.heappop(heap)
                if b > back[st]:
                    continue  # (a stale entry)
                if bound is not None and b > bound:
                    break
                if self.window is not None and st[0] < self.window.floor:
                    raise OutsideWindow(st[0])
                near.add(st)
                for f in self.fulls_at.get(st, ()):
                    if usable(f) and (bound is None or b + f.bytes < bound):
                        bound = b + f.bytes
                for e in self.ending_at.get(st, ()):
                    if e.start is not None and e.start < st and usable(e):
                        nb = b + e.bytes
                        if nb < back.get(e.start, nb + 1):
                            back[e.start] = nb
                            heapq.heappush(heap, (nb, e.start))
        return targets, near

    def chain_ways(self, steps: Iterable[int], exclude: frozenset[str]) -> dict[int, ChainWay]:
        """:meth:`chain_way` of each of ``steps`` that has a chain, by step (one lookup of
        the paths for all: a plan asks for every step's)."""
        best = self.best_paths(exclude)
        fulls_at, ending_at, trainer = self.fulls_at, self.ending_at, self.trainer
        out = {}
        for step in steps:
            t = trainer.get(step)
            if t is not None:
                way = chain_way_from(
                    t, fulls_at.get(t.state, ()), ending_at.get(t.state, ()), best, exclude
                )
                if way is not None:
                    out[step] = way
        return out

    def _chain_ids(self, step: int, exclude: frozenset[str]) -> tuple[str, ...] | None:
        """Ids of the cheapest chain of trainer step ``step``, or None when there is none."""
        way = self.chain_way(step, exclude)
        if way is None:
            return None
        t, prev, last = way
        return _ids(prev, (t.id,) if last is None else (last, t.id))

    def _why_not(self, step: int, exclude: frozenset[str]) -> str:
        """Why trainer step ``step`` has no chain: the first link that is missing."""
        return self._gap(step, exclude)[0]

    def lost_records(self, above: int) -> dict[int, str]:
        """The steps of :meth:`unrestorable` (after ``above``) whose chain lacks the record of a
        step after ``above`` (missing or unreadable; not a quarantined checkpoint, which
        restores go around by the operator's choice): a restore of step ``above`` or older
        would give them up, where putting the record back restores them all."""
        return _lost(self.gaps(above), above)

    def _gap(
        self, step: int, exclude: frozenset[str], advice: bool = True
    ) -> tuple[str, int | None]:
        """:meth:`_why_not`, and the step whose record the chain lacks (None: the link that is
        missing is a checkpoint that is unusable, or no full starts the chain)."""
        t = self.trainer.get(step)
        if t is None:
            return (
                f"no committed checkpoint at step {step}; "
                f"committed: {steps_text(self.trainer, step)}"
            ), None
        best = self.best_paths(exclude)
        node: LineageNode | None = t
        while node is not None:
            if not self._usable(node, exclude):
                why = node.quarantined or "excluded (failed verification)"
                return (
                    f"step {step} cannot be restored: its chain needs checkpoint {node.id} at step "
                    f"{node.step}, which is unusable ({why}) and no merged or full checkpoint "
                    "covers it" + (_OLDER if advice else "")
                ), None
            if node.kind is Kind.FULL or node.start is None:
                break
            if node.start in best:
                break
            parent = self.trainer_at(node.start)
            if parent is None:
                other = self.trainer.get(node.start[0])
                lost = other is None and node.start[0] not in self.damaged
                return (
                    f"step {step} cannot be restored: its chain needs checkpoint {node.start[1]} at "
                    f"step {node.start[0]} (for delta {node.step}), which is "
                    + (
                        f"unreadable ({self.damaged[node.start[0]]})"
                        if other is None and not lost
                        else f"missing{_LOST_RECORD.format(folder=step_dir(node.start[0]))}"
                        if lost
                        else "from another timeline"
                    )
                    # (a lost record's return restores it: an older step trained on from
                    # saves over it, which is said, not advised)
                    + (
                        ""
                        if not advice
                        else "; else restore an older step (training on from it saves the "
                        "steps after it again)"
                        if lost
                        else _OLDER
                    )
                ), (node.start[0] if other is None else None)
            node = parent
        return f"step {step} cannot be restored: no full checkpoint starts its chain", None


def abandoned_steps(trainer: Mapping[int, LineageNode]) -> frozenset[int]:
    """:meth:`LineageGraph.abandoned` of the trainer checkpoints ``trainer`` (step -> node)."""
    went_on: dict[int, int] = {}  # epoch -> the highest step of its history before it
    for s, n in sorted(trainer.items()):
        if n.epoch not in went_on:
            went_on[n.epoch] = n.start[0] if n.start is not None else s - 1
    # A step is left by any newer epoch that went on from below it: the least such start
    lowest_newer: dict[int, float] = {}
    least = float("inf")
    for e in sorted(went_on, reverse=True):
        lowest_newer[e] = least
        least = min(least, went_on[e])
    return frozenset(s for s, n in trainer.items() if s > lowest_newer[n.epoch])


def _order(n: LineageNode) -> tuple[int, int, int, str]:
    return (n.step, n.first_step, n.layer, n.id)


def build_graph(
    manifests: ManifestSet | dict[int, CheckpointManifest], uri: str = ""
) -> LineageGraph:
    """The lineage graph of what :func:`deck.read.catalog.read_manifests` returned."""
    with paused_gc():  # (a node per checkpoint: see paused_gc)
        return LineageGraph(manifests, uri)


def lineage_graph(storage: Storage) -> LineageGraph:
    """The lineage graph of every committed checkpoint at ``storage`` (trainer's and merger's).

    An empty store gives an empty graph. Folders without ``manifest.json`` are not checkpoints
    and are not in it. Every record is read from its file (:func:`read_every_record`).
    ``deck.lineage_graph(uri)`` opens a URI for it.
    """
    return build_graph(read_every_record(storage), storage.uri)


def cheapest_chain(
    graph: LineageGraph, step: int, *, exclude: Iterable[str] = ()
) -> list[CheckpointManifest]:
    """The chain with the fewest bytes that reproduces trainer step ``step``: a full (the
    trainer's or a merger full), then deltas / merged deltas, each starting from the state the
    previous one ended in, ending with the trainer checkpoint of ``step``.

    Guarantees: every element is committed and not quarantined nor in ``exclude``; each link
    matches by id (no timeline mixing); ties go to fewer checkpoints. Raises
    :class:`CheckpointNotFoundError` naming the first missing / unusable link when there is no
    chain.
    """
    ex = frozenset(exclude)
    ids = graph._chain_ids(step, ex)
    if ids is None:
        raise CheckpointNotFoundError(graph._why_not(step, ex))
    return [graph.nodes[i].manifest for i in ids]


def chain_bytes(chain: Iterable[CheckpointManifest]) -> int:
    """Bytes a restore of ``chain`` reads (all ranks; a checkpoint reproducing the same state as
    the one before it only has its records read, counted as nothing here)."""
    out, prev = 0, None
    for m in chain:
        if prev is None or m.state != prev.state:
            out += m.data_bytes
        prev = m
    return out


@dataclass
class VerifiedChain:
    """A chain whose every file was re-read and checksum-verified, and what was skipped."""

    chain: list[CheckpointManifest]
    rejected: dict[str, list[str]]  # id of a checkpoint that failed verification -> problems


def best_valid_chain(
    storage: Storage,
    step: int,
    *,
    manifests: ManifestSet | None = None,
    record: bool = True,
    max_rejects: int = 16,
) -> VerifiedChain:
    """The cheapest chain of ``step`` whose files all verify (sizes and checksums).

    Verifies the cheapest chain; a checkpoint with a problem is excluded (and, with ``record``,
    quarantined so later restores and the merger avoid it too) and the next cheapest chain is
    tried -- e.g. through a merged delta that covers a damaged delta. Reads every byte of the
    chain once more than a plain restore: for recovery after a restore failed with
    :class:`deck.errors.CorruptCheckpointError`. Raises :class:`CheckpointNotFoundError` naming
    the damaged checkpoints when no valid chain is left.
    """
    from deck.read.verify import (
        confirmed_damage,
        full_tables,
        uncommitted_meanwhile,
        verify_checkpoint,
    )

    manifests = manifests if manifests is not None else read_manifests(storage)
    graph = LineageGraph(manifests, storage.uri)
    rejected: dict[str, list[str]] = {}
    verified: set[str] = set()
    while len(rejected) <= max_rejects:
        try:
            chain = cheapest_chain(graph, step, exclude=rejected)
        except CheckpointNotFoundError as e:
            if not rejected:
                raise
            raise CheckpointNotFoundError(
                f"{e}; damaged checkpoints skipped: "
                + "; ".join(f"{i}: {p[0]}" for i, p in rejected.items())
            ) from None
        bad = None
        tables = full_tables(storage, chain[0]) if len(chain) > 1 else None
        for m in chain:
            if m.id in verified:
                continue
            of = None if m is chain[0] else tables  # (what its full names: see verify)
            report = confirmed_damage(storage, m, verify_checkpoint(storage, m, tables=of), of)
            if report.unreadable and not report.problems:
                # Unknown is not damage: no fallback, no quarantine; the caller retries.
                raise StorageError(
                    f"restore of step {step}: checkpoint {m.id} ({m.folder}) could not be read: "
                    f"{report.unreadable[0]}. A read error is not damage: nothing was "
                    "quarantined; retry once the storage answers"
                )
            if report.problems:
                bad = m
                # GC deleted it (or a rollback's save replaced it) under this restore: not
                # damage, nothing to quarantine; the chains left are planned again
                gone = uncommitted_meanwhile(storage, m)
                why = f"deleted or replaced while it was read: {report.problems[0]}"
                rejected[m.id] = [why] if gone else report.problems
                logger.warning(
                    "restore of step %d: checkpoint %s (%s) %s; trying another chain",
                    step,
                    m.id,
                    m.folder,
                    "was deleted or replaced while it was read (a GC with a short grace period?)"
                    if gone
                    else f"is damaged: {report.problems[0]}",
                )
                if record and not gone:
                    quarantine(storage, m, report.problems[0])
                break
            verified.add(m.id)
        if bad is None:
            return VerifiedChain(chain, rejected)
    raise CheckpointNotFoundError(
        f"step {step}: more than {max_rejects} damaged checkpoints in its lineage; run "
        f"`deck verify {storage.uri} --all`"
    )


def needs_new_full(
    storage: Storage,
    parent: tuple[int, str] | None,
    *,
    base: int | None = None,
    known: dict[str, int | None] | None = None,
) -> str | None:
    """Why the trainer's next checkpoint must be a full instead of a delta of ``parent``
    (``(step, id)`` of its last committed checkpoint), or None when a delta is fine.

    A delta of ``parent`` is only restorable if ``parent`` is: this says no when ``parent`` is
    gone or has no valid chain any more (a damaged checkpoint in it was quarantined and nothing
    covers it; DECK sec. 6: take a full). Costs one ``list`` of ``quarantine/`` when nothing is
    quarantined.

    ``base``: the step of the full the parent's chain starts from, when the caller knows it (a
    trainer does). Every checkpoint on a chain of the parent -- its own deltas, a merged delta
    or merger full standing in for some of them -- is at a step from ``base`` to the parent's,
    so a quarantined checkpoint outside those steps changes nothing, and the lineage (every
    commit record) is read only when one is inside. The step of each quarantine record is read
    once into ``known`` (record key -> step; None: its folder does not say), which the caller
    keeps between calls: a record never changes. Without ``base`` any quarantine record makes it read
    the lineage.
    """
    if parent is None:
        return "no committed checkpoint to be a delta of"
    keys = storage.list(f"{QUARANTINE_ROOT}/")
    if not keys:
        return None
    if base is not None:
        steps = _quarantined_steps(storage, keys, {} if known is None else known)
        if all(s is not None and not base <= s <= parent[0] for s in steps):
            return None
    graph = LineageGraph(read_manifests(storage), storage.uri)
    node = graph.trainer.get(parent[0])
    if node is None or node.id != parent[1]:
        return f"the parent checkpoint {parent[1]} of step {parent[0]} is no longer committed"
    if graph._chain_ids(parent[0], frozenset()) is None:
        return graph._why_not(parent[0], frozenset())
    return None


# A quarantine record that chains ignore (unreadable, or not a record): at no step of any chain
_IGNORED = -1


def _quarantined_steps(
    storage: Storage, keys: list[str], known: dict[str, int | None]
) -> list[int | None]:
    """The step of the checkpoint each quarantine record in ``keys`` names (None when its
    folder does not say), reading only the records not in ``known`` and adding them there."""
    out: list[int | None] = []
    for key in keys:
        if not key.endswith(".json"):
            continue  # not a record: read_manifests skips it too
        if key not in known:
            try:
                data = storage.get_or_none(key, MAX_RECORD_BYTES)
            except CorruptCheckpointError:
                data = b""  # too large, or not a file: ignored like read_manifests ignores it
            if data is None:
                continue  # deleted since the listing (with its checkpoint, by GC)
            known[key] = _record_step(storage, key, data)
        out.append(known[key])
    return out


def _record_step(storage: Storage, key: str, data: bytes) -> int | None:
    try:
        rec = load_model(QuarantineRecord, data, storage.describe(key))
    except CorruptCheckpointError:
        return _IGNORED
    head, _, name = rec.folder.partition("/")
    step = parse_step_dir(rec.folder)
    if step is None and head == MERGED_ROOT:
        named = parse_merged_dir(name)
        step = None if named is None else named[1]
    return step


def chain_for(manifests: dict[int, CheckpointManifest], step: int) -> list[CheckpointManifest]:
    """The checkpoints that reproduce ``step``: a full first, then deltas / merged deltas in
    order, ending with the trainer checkpoint of ``step`` itself (whose folder holds the dense
    and extra state, and whose id later deltas name as parent).

    With a :class:`ManifestSet` (what :func:`read_manifests` returns) this is the cheapest chain
    of the lineage graph (fewest bytes; merged checkpoints included, quarantined ones avoided);
    with a plain dict it follows ``parent`` links. Either way each link is checked by id, so
    deltas of an abandoned timeline are never mixed into another. Raises
    :class:`CheckpointNotFoundError` naming what is missing.
    """
    if isinstance(manifests, ManifestSet):
        if step in manifests.damaged:
            raise CorruptCheckpointError(f"step {step}: {manifests.damaged[step]}")

        return cheapest_chain(build_graph(manifests), step)
    if step not in manifests:
        raise CheckpointNotFoundError(
            f"no committed checkpoint at step {step}; committed: {steps_text(manifests, step)}"
        )
    chain = [manifests[step]]
    while chain[-1].kind is not Kind.FULL:
        child = chain[-1]
        parent = manifests.get(child.parent) if child.parent is not None else None
        if parent is None or parent.id != child.parent_id:
            raise CheckpointNotFoundError(
                f"step {step} cannot be restored: its chain needs checkpoint {child.parent_id} at step "
                f"{child.parent} (for delta {child.step}), which is "
                + (
                    "from another timeline"
                    if parent is not None
                    else "missing"
                    if child.parent is None
                    else f"missing{_LOST_RECORD.format(folder=step_dir(child.parent))}"
                )
                + _OLDER
            )
        chain.append(parent)
    return chain[::-1]


def left_by_a_rollback(steps: list[tuple[int, int | None]]) -> tuple[set[int], int, int]:
    """Of ``(step, epoch)`` pairs, the steps of older timelines at or after the step where the
    newest timeline starts (what a rollback left: each restores as itself, off the newest
    line, which replaces them as it reaches their steps), with that epoch and start step
    (``(set(), -1, -1)`` without epochs)."""
    known = [(s, e) for s, e in steps if e is not None]
    if not known:
        return set(), -1, -1
    newest = max(e for _, e in known)
    start = min(s for s, e in known if e == newest)
    return {s for s, e in known if e < newest and s >= start}, newest, start


# What a trainer may do about a step without a chain (not said to a serving process)
_OLDER = "; restore an older step or take a new full checkpoint"
# (a break-it finding: verify and restores said only "restore an older step" for a commit record
# a sync had missed, which gives up every step after it, where putting the record back restores
# them all, as GC said)
_LOST_RECORD = (
    " (if {folder}/ still holds its folder, its commit record {folder}/manifest.json was lost: "
    "put it back from a backup and every step after it restores again)"
)


def latest_restorable(manifests: dict[int, CheckpointManifest], log: bool = True) -> int | None:
    """The newest trainer checkpoint (highest epoch, then step) whose chain is complete; with
    ``log``, the steps passed over are said (:meth:`LineageGraph.latest`)."""
    if isinstance(manifests, ManifestSet):
        return build_graph(manifests).latest(log)
    for m in sorted(manifests.values(), key=lambda m: (m.epoch, m.step), reverse=True):
        try:
            chain_for(manifests, m.step)
        except CheckpointNotFoundError as e:
            logger.warning("skipping step %d: %s", m.step, e)
            continue
        return m.step
    return None


def latest_confirmed(storage: Storage, manifests: ManifestSet) -> tuple[ManifestSet, int | None]:
    """The latest restorable step as the records say (:func:`confirmed`, with ``latest``), and
    the manifests it was found in. The steps passed over on the way are said from those, not
    from a catalog's copies, which may be forged or stale (a break-it finding: a forged catalog
    made every restore warn that the latest step could not be restored, then restore it)."""
    checked = confirmed(storage, manifests, latest_restorable(manifests, log=False), latest=True)
    return checked, latest_restorable(checked)


@dataclass(frozen=True)
class LatestCheck:
    """What :func:`latest_checked` found about taking a step for the latest."""

    manifests: ManifestSet  # the read ``step`` is in
    step: int | None  # the step to take (None: none)
    # What taking the latest would give up (then ``step`` is the newest step before it), or
    # None: a plain restore refuses it, a fallback takes ``step``
    gives_up: str | None = None
    # Steps after ``step`` it goes around by the operator's choice (a quarantine), or None
    goes_around: str | None = None
    lost: bool = False  # whether what it gives up is steps whose chain lacks a record


def latest_checked(storage: Storage, manifests: ManifestSet, latest: int | None) -> LatestCheck:
    """:func:`_latest_checked`; where a window read cannot say why a step has no chain (its
    reason lies below the window), of every record."""
    try:
        return _latest_checked(storage, manifests, latest)
    except OutsideWindow:
        return _latest_checked(storage, read_manifests(storage), latest)


def _latest_checked(storage: Storage, manifests: ManifestSet, latest: int | None) -> LatestCheck:
    """Whether taking ``latest`` (the latest restorable step of ``manifests``, as
    :func:`latest_confirmed` gave it; None: none) for the latest would give committed work up.
    Two break-it findings: a job restarted after one commit record was lost restored an older
    step with a warning and saved its steps again over the ones the record's return would have
    restored; a rollback whose first record was lost (or whose first save crashed before it)
    made the latest the timeline it had left."""
    witnessed = manifests.witness if manifests.witness_listed else newest_witness(storage)
    begun = unrecorded_epoch(storage, witnessed, manifests.values())
    at = None if begun is None else begun[1]
    # (at the latest step itself, a save of the step just restored, whose crash leaves the
    # same witness, cannot be told from a rollback's: only a step above is refused)
    if begun is not None and at is not None and latest is not None and at < latest:
        gives_up = (
            f"epoch {begun[0]} began at step {at} ({storage.describe(witness_key(begun[0]))}) "
            f"and no commit record of it is at {storage.uri}: its first save crashed before its "
            f"commit, or its record (step {at} or later) was lost. Step {latest}, the newest "
            f"restorable one, is of epoch {manifests[latest].epoch}, above where epoch "
            f"{begun[0]} went on from: it is on the timeline that epoch's rollback left. Put the "
            f"lost record back, or take the step the rollback went on from (below {at})"
        )
        every = read_manifests(storage)
        return LatestCheck(every, build_graph(every).latest(log=False, below=at), gives_up)
    graph = build_graph(manifests)
    after = -1 if latest is None else latest
    gaps = graph.gaps(after)
    lost = _lost(gaps, after)
    if not lost and (unrecorded := announced_unrecorded(storage, manifests, latest)):
        gives_up = (
            f"step {unrecorded.step} at {storage.uri} "
            + ("" if latest is None else f"(after step {latest}, the newest restorable one) ")
            + unrecorded.why
        )
        return LatestCheck(manifests, latest, gives_up)
    if not lost:
        gone = gaps if latest is not None else {}
        around = f"passed by steps {steps_text(gone)}: {gone[max(gone)][0]}" if gone else None
        return LatestCheck(manifests, latest, goes_around=around)
    gives_up = (
        f"steps {steps_text(lost)} at {storage.uri} are committed "
        + ("" if latest is None else f"after step {latest}, the newest restorable one, ")
        + f"and cannot be restored: {lost[max(lost)]}"
    )
    if begun is not None:  # (the record named is then of the timeline a rollback left)
        gives_up += (
            f" (but epoch {begun[0]} began at step {at} and no commit record of it is there: "
            "the lost record may be that rollback's, which replaced the one named)"
        )
    return LatestCheck(manifests, latest, gives_up, lost=True)


@dataclass(frozen=True)
class Unrecorded:
    """A trainer checkpoint whose commit record was vouched for, with its rank parts at the
    URI and no record there (:func:`announced_unrecorded`)."""

    step: int
    id: str
    vouched: str  # who vouched for its record ("the commit log announced it (...)", ...)
    why: str  # what was found, and what to do


def announced_unrecorded(
    storage: Storage, manifests: ManifestSet, latest: int | None
) -> Unrecorded | None:
    """The newest trainer step after ``latest`` whose commit record was vouched for, with the
    rank parts of that checkpoint at the URI and no record there now; with what was found.
    Vouched for: the commit log announced it after ``latest``'s own commit (a timeline a
    rollback left announced its records before), a merger checkpoint of ``latest``'s epoch or
    newer was built on it, or the catalog held it (``manifests.catalog_only``, of that epoch or
    newer): the log is pruned as catalogs are written, so a record lost after that was only in
    the catalog. A break-it finding: the newest step's record lost, nothing builds on it, and a
    restore took the step before it without a word (training on saved the lost step again).
    The log is read from its newest entry back to ``latest``'s commit, at most
    :data:`LOG_LOOKBACK` entries."""
    held = {**manifests.damaged, **manifests}  # (damage: refused as such)
    vouched: dict[int, tuple[str, str]] = {}  # step -> (checkpoint id, who vouched)
    for step, (cid, said) in _logged_commits(storage, manifests, latest).items():
        vouched[step] = (cid, f"the commit log announced it ({said}; or its save was killed then)")
    above, epoch = (-1, -1) if latest is None else (latest, manifests[latest].epoch)
    for m in manifests.merged.values():
        step, cid = m.state
        if step > above and step not in held and m.epoch >= epoch:
            vouched.setdefault(step, (cid, f"merger checkpoint {m.folder} was built on it"))
    for step, m in manifests.catalog_only.items():
        if step > above and m.epoch >= epoch:
            vouched.setdefault(step, (m.id, "the catalog held it"))
    return _with_parts(storage, vouched)


def _logged_commits(
    storage: Storage, manifests: ManifestSet, latest: int | None
) -> dict[int, tuple[str, str]]:
    """Trainer steps without a record in ``manifests`` whose commit the log announced after
    ``latest``'s own: step -> (checkpoint id, the log entry)."""
    own = None if latest is None else (f"{step_dir(latest)}/{MANIFEST}", manifests[latest].id)
    dropped: set[tuple[str, str]] = set()  # (key, id) abandoned or deleted later
    announced: dict[int, tuple[str, str]] = {}
    for seq in reversed(listed_seqs(storage, LOG_ROOT)[-LOG_LOOKBACK:]):
        try:
            hints = read_log_entry(storage, seq)[0].hints
        except (NotFoundError, CorruptCheckpointError):
            # (pruned since it was listed, or damaged: what is older cannot be placed after
            # the latest's commit; what was read so far is after it. A read error is raised.)
            break
        for hint in reversed(hints):
            said = (hint.key, hint.id)
            if hint.op in ("delete", "abandon"):  # (a reread says nothing of a commit)
                dropped.add(said)
            elif hint.op != "commit" or said in dropped or hint.key.startswith(f"{MERGED_ROOT}/"):
                continue
            elif said == own:
                return announced
            elif (step := key_step(hint.key)) is not None and not (
                step in manifests or step in manifests.damaged
            ):
                announced.setdefault(step, (hint.id, storage.describe(log_key(seq))))
    return announced


# Log entries a restore of the latest step reads back, at most, for records announced after it
LOG_LOOKBACK = 256


def _with_parts(storage: Storage, vouched: Mapping[int, tuple[str, str]]) -> Unrecorded | None:
    """Of ``vouched`` (step -> (checkpoint id, who vouched for its record)), the newest whose
    rank parts are at the URI."""
    for step in sorted(vouched, reverse=True):
        cid, said = vouched[step]
        folder = f"{step_dir(step)}/{cid}/"
        parts = [k for k in storage.list(folder) if _RANK_PART.fullmatch(k[len(folder) :])]
        if parts:
            record = storage.describe(f"{step_dir(step)}/{MANIFEST}")
            return Unrecorded(
                step,
                cid,
                said,
                f"has the rank parts of checkpoint {cid} ({storage.describe(parts[0])}, ...) "
                f"and its commit record {record} is not there, but {said}: it was lost (put it "
                "back from a backup)",
            )
    return None


_RANK_PART = re.compile(r"rank-[0-9]{5}\.json")


def _lost(gaps: Mapping[int, tuple[str, int | None]], above: int) -> dict[int, str]:
    """Of :meth:`LineageGraph.gaps` after ``above``, the steps whose chain lacks the record of
    a step after ``above``, with why."""
    return {s: why for s, (why, gap) in gaps.items() if gap is not None and gap > above}


def unrecorded_epoch(
    storage: Storage, witnessed: int | None, records: Iterable[CheckpointManifest]
) -> tuple[int, int | None] | None:
    """Epoch ``witnessed`` (the newest one witnessed at ``storage``; None: none) and the step
    its witness says it began at (None: it does not say), when no commit record of it is among
    the trainer ``records``: its first save crashed before its record, or the record was lost
    (deck.format.epochs). One read of the witness, only then."""
    if witnessed is None or any(m.epoch >= witnessed for m in records):
        return None
    return witnessed, witnessed_step(storage, witnessed)


def confirmed(
    storage: Storage, manifests: ManifestSet, step: int | None, *, latest: bool = False
) -> ManifestSet:
    """``manifests`` when they were read record by record, or when what a restore of ``step``
    relies on, read through the catalog, is what the store holds now: the commit records of
    its chain and their quarantine records; every commit record of the steps its chain was
    chosen among (:meth:`LineageGraph.chain_reach` up to ``step``: a record left out, changed
    or added there may make another chain the cheapest, with every record of the chosen one
    intact), with the quarantine records of those the catalog says are quarantined; and, with
    ``latest`` (``step`` was chosen as the latest restorable, None: none was), the record of
    every step folder and merger folder above it, and ``step``'s epoch at least the newest one
    witnessed (:mod:`deck.format.epochs`: a newer timeline may have re-saved a step below it;
    no witness at all, a store of a deck before them, cannot tell). Else every record read
    again (logged). A catalog damaged or forged so that it still passes its checks costs this
    read, never another chain or another step than the records give."""
    index = manifests.index
    if index is None:
        return manifests
    if latest and index.catalog is not None and not _newest_epoch_held(storage, manifests, step):
        return _read_every_record(storage, step, manifests, said=True)
    keys: list[str] = []
    chain: list[CheckpointManifest] = []
    low = 0
    if step is not None:
        try:
            chain = chain_for(manifests, step)
            low = build_graph(manifests).chain_reach(step)
        except (CheckpointNotFoundError, CorruptCheckpointError, OutsideWindow):
            chain = []
        if not chain and (step in manifests or step in manifests.damaged):
            # No chain by the catalog (a quarantine, damage): whether the records say so too
            # is read, not taken from an index. Not a disagreement: no warning.
            logger.info(
                "step %d has no valid chain by the catalog at %s: reading every record to see",
                step,
                storage.uri,
            )
            return _read_every_record(storage, step, manifests, said=True)
        if not chain:  # a step the catalog does not hold: agreed if the store holds none either
            keys.append(f"{step_dir(step)}/{MANIFEST}")
        keys += [f"{m.folder}/{MANIFEST}" for m in chain]
        keys += [f"{QUARANTINE_ROOT}/{m.id}.json" for m in chain]
    root: list[str] = []
    merged: list[str] = []
    if chain or latest:  # (each listed once, whichever of the two looks)
        # (the step folders from the lowest step either looks at: a bounded listing on S3)
        root = storage.list_dir_after("", step_dirs_from(low))
        merged = storage.list_dir(f"{MERGED_ROOT}/")
    if chain:
        assert step is not None
        keys += _records_between(manifests, root, merged, low, step)
    if latest:
        above = -1 if step is None else step
        steps = {s for s in manifests if s > above} | {s for s in manifests.damaged if s > above}
        for name in root:
            listed = parse_step_dir(name.rstrip("/"))
            if listed is not None and listed > above and name.endswith("/"):
                steps.add(listed)
        keys += [f"{step_dir(s)}/{MANIFEST}" for s in sorted(steps)]
        # And every merger checkpoint ending above it: one left out (a forged catalog) may be
        # what makes a newer step restorable
        keys += [f"{m.folder}/{MANIFEST}" for m in manifests.merged.values() if m.step > above]
        keys += _merged_records(merged, above + 1, None)
    keys = list(dict.fromkeys(keys))
    try:
        now: dict[str, bytes | None] = dict(storage.get_many(keys, limit=MAX_RECORD_BYTES))
    except CorruptCheckpointError:  # (too large now, a link: damage the whole read names)
        now = {}
    if all(k in now and now[k] == _indexed_bytes(index.records.get(k)) for k in keys):
        return manifests
    return _read_every_record(storage, step, manifests)


def _records_between(
    manifests: ManifestSet, root: list[str], merged: list[str], low: int, high: int
) -> list[str]:
    """The commit record keys of steps ``low..high`` (trainer step folders, and merger
    folders by the step they end at) that ``manifests`` (read through the catalog) holds or
    the store lists (``root``, ``merged``: the listings of the root and of ``merged/``), and
    the quarantine records of those ``manifests`` says are quarantined."""
    index = manifests.index
    assert index is not None
    keys = {k for k in index.records if (s := key_step(k)) is not None and low <= s <= high}
    for name in root:
        listed = parse_step_dir(name.rstrip("/"))
        if listed is not None and low <= listed <= high and name.endswith("/"):
            keys.add(f"{step_dir(listed)}/{MANIFEST}")
    keys.update(_merged_records(merged, low, high))
    held = [m.id for m in manifests.all() if low <= m.step <= high]
    quarantined = [f"{QUARANTINE_ROOT}/{i}.json" for i in held if i in manifests.quarantined]
    return sorted(keys) + quarantined


def _merged_records(merged: list[str], low: int, high: int | None) -> list[str]:
    """The commit record keys of the merger folders in ``merged`` (a listing of ``merged/``)
    that end at steps ``low..high`` (None: any above ``low``)."""
    keys = []
    floor = f"{low:012d}"
    for name in merged:
        # (every merger folder's name ends with the step it ends at, 12 digits, and its id: a
        # long history's are passed over without a parse)
        if not name.endswith("/") or name[-30:-18] < floor:
            continue
        named = parse_merged_dir(name.rstrip("/"))
        if named is None or named[1] < low:
            continue
        if high is None or named[1] <= high:
            keys.append(f"{MERGED_ROOT}/{name.rstrip('/')}/{MANIFEST}")
    return keys


def _indexed_bytes(value: bytes | CorruptCheckpointError | None) -> bytes | None:
    return None if value is None or isinstance(value, CorruptCheckpointError) else value


def _newest_epoch_held(storage: Storage, manifests: ManifestSet, step: int | None) -> bool:
    """Whether ``step`` (the latest restorable step of ``manifests``, read through the catalog)
    is of the newest epoch the store's witnesses name (listed now unless the read did); when
    not, says why (once per URI where there is no witness at all)."""
    witness = manifests.witness if manifests.witness_listed else newest_witness(storage)
    m = manifests.get(step) if step is not None else None
    if witness is not None and m is not None and m.epoch >= witness:
        return True
    if witness is not None:
        logger.warning(
            "the catalog at %s holds no restorable step of epoch %d, the newest one witnessed "
            "(%s): reading every record",
            storage.uri,
            witness,
            storage.describe(witness_key(witness)),
        )
    elif storage.uri not in _TOLD_NO_WITNESS:
        _TOLD_NO_WITNESS.add(storage.uri)
        logger.info(
            "deck: %s holds no epoch witness (%s/: written by a deck before them): the latest "
            "step is chosen from every commit record until a trainer commits there",
            storage.uri,
            EPOCH_ROOT,
        )
    return False


# URIs already said to hold no epoch witness (logged once each)
_TOLD_NO_WITNESS: set[str] = set()


def _read_every_record(
    storage: Storage, step: int | None, known: ManifestSet, *, said: bool = False
) -> ManifestSet:
    """Every commit record at ``storage`` again (``known``: the read it replaces, whose damaged
    records were said then)."""
    if not said and storage.uri not in _disagreed:
        # Once per URI: a follower polling a store whose catalog lacks what the log lost said
        # it at every poll (a break-it run); the next GC over the whole store repairs it
        _disagreed.add(storage.uri)
        # (a break-it finding: a store without a catalog was said to have one)
        catalog = known.index is not None and known.index.catalog is not None
        logger.warning(
            "the %s at %s does not agree with the commit records %s: reading every record%s",
            "catalog" if catalog else "commit log",
            storage.uri,
            "a restore of the latest step relies on" if step is None else f"of step {step}",
            " (until the next `deck gc` over the whole store writes it again)" if catalog else "",
        )
    every = read_manifests(storage, manifest_keys(storage), previous=known)
    every.catalog_only = {
        s: m for s, m in known.items() if s not in every and s not in every.damaged
    }
    return every


_disagreed: set[str] = set()
