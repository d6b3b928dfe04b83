"""GC's grace-period protection, replayed incrementally: what every moment of the grace period
kept, without planning the lineage again at each moment.

The rule (:func:`deck.ops.retention.plan.grace_protected`): nothing committed in the last
``grace_s`` seconds goes, and for the lineage as it was at the period's start and after each
commit since, nothing its retention plan kept and nothing on the cheapest chain of a step it
retained. Planning every moment from scratch costs O(checkpoints) per moment, O(n**2) over a
history whose commits all fall in the period (deck/testing/grace_reference.py keeps that
version: the reference these decisions are tested against, tests/ops/test_grace_incremental.py).

Here the lineage grows commit by commit (:class:`_Replay`, one :meth:`_Replay.add` per moment),
and each part of the plan is kept up to date from what the new checkpoints change:

- the cheapest ways into states (:class:`_Tree`, one per usability rule: any usable checkpoint,
  and the plan's restricted set): a new checkpoint recomputes its state and, while that changes
  anything, the states after it (edges go from older to newer steps);
- which trainer checkpoints are restorable (only ever more, as checkpoints are only added), the
  latest (the steps newer timelines left recomputed when a timeline starts or a step is saved
  again: a restart or a rollback, not a commit), the active window (a delta on the latest extends it), the fulls kept (recomputed when
  a full, the window's anchor or the latest chain's full changes; the chain-budget walk resumed
  at the first step whose inputs changed, stopped once it agrees with the last walk again), the
  restricted set (what the kept fulls and the latest chain leave out);
- the union over moments: a retained step's chain is walked when the step becomes retained or
  its chain changes, each walk stopping at the first link (:class:`deck.read.lineage.PathLink`, a
  link names its whole path) an earlier walk reached; and the merger's work in progress, when
  it or its window state appears.

The lineage at the period's start is planned once, like a retention plan (its cheapest paths
into the states before the first recent commit's taken from the whole graph, which keeps them
for the plan GC makes next). After that a trainer delta appended at the head -- the common
commit -- costs O(1): one state, one chain link, one window step. A merger commit or a full
recomputes the states after it (the merger's lag, the steps since a full), a rollback the window
back to its full. So a grace period of m commits over a history of n costs one plan of n plus
what each of the m changes, where planning every moment again cost m plans of n.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Container, Iterable, Mapping
from typing import Protocol

from deck.format.manifest import Kind
from deck.ops.retention.active import active_window
from deck.read.lineage import (
    ChainWay,
    LineageGraph,
    LineageNode,
    PathLink,
    StateKey,
    abandoned_steps,
    chain_way_from,
    cheapest_way_in,
    keep_chain,
)

__all__ = ["replay_protected"]


class RetentionPolicy(Protocol):
    """What the replay reads of a :class:`deck.ops.retention.plan.RetentionPolicy` (a protocol,
    not an import: plan.py imports this module)."""

    @property
    def keep_last_fulls(self) -> int: ...
    @property
    def keep_fulls_every(self) -> int | None: ...
    @property
    def keep_all_steps(self) -> bool: ...
    @property
    def chain_delta_budget(self) -> float | None: ...
    @property
    def keep_merged_deltas(self) -> bool: ...
    @property
    def grace_s(self) -> float: ...


def replay_protected(
    graph: LineageGraph,
    policy: RetentionPolicy,
    now: float,
    when: Callable[[str], float],
) -> set[str]:
    """What :func:`deck.ops.retention.plan.grace_protected` returns for a grace period (the
    caller handles ``grace_s <= 0`` and an unknown ``now``); ``when(id)``: a checkpoint's commit
    time on the clock of ``now``."""
    cutoff = now - policy.grace_s
    protected = {i for i in graph.nodes if when(i) > cutoff}
    if len(protected) == len(graph.nodes):
        return protected  # every checkpoint is recent: nothing left to decide
    old: list[LineageNode] = []
    moments: dict[float, list[LineageNode]] = {}
    for n in graph.nodes.values():
        t = when(n.id)
        if t <= cutoff:
            old.append(n)
        elif t <= now:  # (a commit after ``now`` is in no moment's lineage)
            moments.setdefault(t, []).append(n)
    # The paths into states before any recent commit's are the whole lineage's (the same
    # checkpoints end in them): taken from the graph, which keeps them for the plan GC makes
    # next, instead of found again
    first = min((n.state for n in graph.nodes.values() if when(n.id) > cutoff), default=None)
    paths = graph.best_paths(frozenset())
    replay = _Replay(graph, policy, protected)
    replay.add(old, {st: b for st, b in paths.items() if first is None or st < first})
    for t in sorted(moments):
        if len(protected) == len(graph.nodes):
            break
        replay.add(moments[t])
    return protected


class _Tree:
    """The cheapest way into every state over the checkpoints added so far, leaving out the
    quarantined ones and those in ``exclude`` (which may change: :meth:`update` the states of
    what changed)."""

    def __init__(self, replay: _Replay, exclude: Container[str]) -> None:
        self.replay = replay
        self.exclude = exclude
        self.best: dict[StateKey, PathLink] = {}
        self.started = False  # whether an update ran (then states outside it may have ways)

    def update(self, dirty: Iterable[StateKey]) -> set[StateKey]:
        """Recompute the states ``dirty`` (a checkpoint into them was added or changed its
        usability) and, in step order, every state after one that changed; returns the states
        whose way changed, appeared or went. A state keeps its link when its way is the same
        (same link before it, same checkpoint), so a link's identity says its path did not
        change."""
        r = self.replay
        best = self.best
        first = not self.started and not best
        self.started = True
        if first:
            # Every state with a way in is dirty: one pass in step order, nothing to follow.
            # (Not so for a later update that finds no way known yet: a full quarantined below
            # leaves every state without one, and a merger full then arriving at one of them
            # opens the way to the states after it, which were added before; a fuzz finding.)
            for st in sorted(set(dirty)):
                way = cheapest_way_in(
                    st, r.fulls_at.get(st, ()), r.ending_at.get(st, ()), best, self.exclude
                )
                if way is not None:
                    best[st] = PathLink(*way)
            return set(best)
        heap = sorted(set(dirty))  # (a sorted list is a heap)
        queued = set(heap)
        changed: set[StateKey] = set()
        while heap:
            st = heapq.heappop(heap)
            way = cheapest_way_in(
                st, r.fulls_at.get(st, ()), r.ending_at.get(st, ()), best, self.exclude
            )
            old = best.get(st)
            if way is None:
                if old is None:
                    continue
                del best[st]
            elif old is not None and old.prev is way[2] and old.id == way[3]:
                continue
            else:
                best[st] = PathLink(*way)
            changed.add(st)
            for e in r.starts_from.get(st, ()):
                # only a state after ``st`` counts a way through it (see cheapest_way_in)
                if e.state > st and e.state not in queued:
                    queued.add(e.state)
                    heapq.heappush(heap, e.state)
        return changed

    def chain_way(self, t: LineageNode) -> ChainWay | None:
        """Like :meth:`deck.read.lineage.LineageGraph.chain_way` of ``t``'s step."""
        r = self.replay
        st = t.state
        return chain_way_from(
            t, r.fulls_at.get(st, ()), r.ending_at.get(st, ()), self.best, self.exclude
        )


class _Replay:
    """The lineage of one URI growing commit by commit, with what its retention plan keeps at
    each moment (see the module docstring); :attr:`protected` collects the union."""

    def __init__(self, graph: LineageGraph, policy: RetentionPolicy, protected: set[str]) -> None:
        self.nodes = graph.nodes
        self.policy = policy
        self.protected = protected
        # The checkpoints added so far, indexed like a LineageGraph's (and from where they start)
        self.trainer: dict[int, LineageNode] = {}
        self.steps: list[int] = []  # the trainer's steps, ascending
        self.fulls_at: dict[StateKey, list[LineageNode]] = {}
        self.ending_at: dict[StateKey, list[LineageNode]] = {}
        self.starts_from: dict[StateKey, list[LineageNode]] = {}
        self.merged_at: dict[str, list[LineageNode]] = {}  # merged deltas by their state's id
        # input id -> the merged deltas that merged it (its keys: what merged deltas consumed)
        self._merged_from: dict[str, list[LineageNode]] = {}
        self.any = _Tree(self, frozenset())
        # the plan's restricted chains: not through ``excluded`` (merger checkpoints neither
        # kept as a full nor on the latest chain; see plan_lineage's ``allowed``)
        self.excluded: set[str] = set()
        self.restricted = _Tree(self, self.excluded)
        self.restorable: set[str] = set()
        self.left: frozenset[int] = frozenset()  # steps a newer timeline left
        self._epoch_low: dict[int, int] = {}  # epoch -> its lowest trainer step
        # Every checkpoint added, in order, and how many of them a moment without a latest
        # protected (all of those)
        self._added_ids: list[str] = []
        self._kept_upto = 0
        self.latest: LineageNode | None = None
        self.window: list[LineageNode] = []  # oldest first
        self.window_ids: set[str] = set()
        self.anchor: StateKey | None = None
        self.latest_full: LineageNode | None = None  # a full on the latest chain at its state
        self.latest_excluded: set[str] = set()  # restrictable checkpoints on the latest chain
        self.by_state: dict[StateKey, LineageNode] = {}  # the full each state would keep
        self.prekept: dict[StateKey, LineageNode] = {}  # the fulls kept but the budget's
        self.budget: dict[int, StateKey] = {}  # step -> the state the budget walk kept there
        self.since: dict[int, int] = {}  # step -> the walk's delta bytes after it
        self.kept: dict[StateKey, LineageNode] = {}
        self.kept_ids: set[str] = set()
        self.retained: set[int] = set()  # (bounded policy) the retained steps
        self.walked: set[PathLink] = set()  # links whose whole path is protected
        self._up: dict[PathLink, tuple[str, PathLink | None]] = {}
        # Added while nothing was restorable (all protected then); the plan's parts take them
        # in once something is
        self._pending: list[LineageNode] = []
        self._planned = False  # whether a moment had a plan yet
        self._added = False  # whether a moment had checkpoints yet
        self._prekept_anchor: StateKey | None = None

    # ---- helpers ---------------------------------------------------------------------------
    def trainer_at(self, state: StateKey) -> LineageNode | None:
        n = self.trainer.get(state[0])
        return n if n is not None and n.id == state[1] else None

    def merged_from(self, cid: str) -> list[LineageNode]:
        return self._merged_from.get(cid, [])

    def restrictable(self, n: LineageNode) -> bool:
        """Left out of the restricted chains unless kept or on the latest chain."""
        return n.merged and (n.kind is Kind.FULL or not self.policy.keep_merged_deltas)

    def up(self, link: PathLink) -> tuple[str, PathLink | None]:
        """(the full the path of ``link`` starts from, the newest restrictable link on it),
        remembered per link (links never change): O(1) per link over the replay."""
        todo = []
        x: PathLink | None = link
        while x is not None and x not in self._up:
            todo.append(x)
            x = x.prev
        above = self._up[x] if x is not None else None
        for y in reversed(todo):
            mine = y if self.restrictable(self.nodes[y.id]) else None
            above = (y.id, mine) if above is None else (above[0], mine or above[1])
            self._up[y] = above
        return self._up[link]

    # ---- one moment --------------------------------------------------------------------------
    def add(
        self, batch: list[LineageNode], known: Mapping[StateKey, PathLink] | None = None
    ) -> None:
        """The lineage after the commits ``batch``: protect what its plan keeps that earlier
        moments did not. ``known``: for the first batch, cheapest paths already known (into
        states no later commit changes: only the others are found)."""
        if not batch:
            return
        # A timeline starts or loses its lowest step (a rollback's, a restart's first save, a
        # step saved again): which steps a newer timeline left may change, and the latest with
        # it (a restart at most, not every commit)
        timelines = any(
            not n.merged
            and (n.step in self.trainer or n.step < self._epoch_low.get(n.epoch, n.step + 1))
            for n in batch
        )
        for n in batch:
            self._index(n)
        self._added_ids.extend(n.id for n in batch)
        initial = not self._added
        self._added = True
        if initial and known:
            self.any.best = dict(known)
            changed = self.any.update({n.state for n in batch if n.state not in known})
        else:
            changed = self.any.update({n.state for n in batch})
        # The trainer checkpoints whose cheapest chain may have changed (all, the first time)
        touched = (
            {t.id: t for t in self.trainer.values()} if initial else self._touched(changed, batch)
        )
        ways: dict[str, ChainWay] = {}  # this moment's cheapest chains, as found
        fresh = []
        for t in touched.values():
            if t.id not in self.restorable:
                way = self.any.chain_way(t)
                if way is not None:
                    ways[t.id] = way
                    fresh.append(t)
        self.restorable.update(t.id for t in fresh)
        if timelines:
            self._timelines()
        else:
            for t in fresh:
                if t.step not in self.left and (
                    self.latest is None or (t.epoch, t.step) > (self.latest.epoch, self.latest.step)
                ):
                    self.latest = t
        self._pending.extend(batch)
        if self.latest is None:
            # Nothing restorable: the plan keeps everything added so far (once: a restart's
            # new timeline can leave nothing restorable after a moment that had a latest)
            self.protected.update(self._added_ids[self._kept_upto :])
            self._kept_upto = len(self._added_ids)
            return
        batch, self._pending = self._pending, []
        first = not self._planned
        self._planned = True
        latest_full, latest_excluded = self.latest_full, self.latest_excluded
        window_added, extended = self._window(batch)
        if window_added is not None or self.latest.id in touched:
            self._latest_chain()
        kept_before = self.kept_ids
        kept_changed = self._kept(batch, first or latest_full is not self.latest_full)
        dirty: set[StateKey] = set() if first else {n.state for n in batch}
        if first:
            # The restricted paths start as the cheapest ones; only what the restricted set
            # leaves out is recomputed (and what follows it)
            self.restricted.best = dict(self.any.best)
        toggled = self._restrict(batch, kept_before, latest_excluded, dirty)
        touched_r = self._touched(self.restricted.update(dirty), toggled)
        self._walk(fresh, touched, touched_r, ways, first, window_added, extended, kept_changed)
        self._in_progress(batch, window_added)

    def _timelines(self) -> None:
        """The steps newer timelines left, each timeline's lowest step, and the latest: the
        newest restorable checkpoint no newer timeline left (LineageGraph.latest)."""
        self.left = abandoned_steps(self.trainer)
        self._epoch_low = {}
        for t in self.trainer.values():
            self._epoch_low[t.epoch] = min(self._epoch_low.get(t.epoch, t.step), t.step)
        self.latest = max(
            (
                t
                for t in self.trainer.values()
                if t.id in self.restorable and t.step not in self.left
            ),
            key=lambda t: (t.epoch, t.step),
            default=None,
        )

    def _index(self, n: LineageNode) -> None:
        if not n.merged:
            self.trainer[n.step] = n
            bisect.insort(self.steps, n.step)
        if n.kind is Kind.FULL:
            self.fulls_at.setdefault(n.state, []).append(n)
        else:
            self.ending_at.setdefault(n.state, []).append(n)
        if n.start is not None:
            self.starts_from.setdefault(n.start, []).append(n)
        if n.kind is Kind.MERGED:
            self.merged_at.setdefault(n.state[1], []).append(n)
            for i in n.inputs:
                self._merged_from.setdefault(i, []).append(n)

    def _touched(
        self, changed: set[StateKey], nodes: Iterable[LineageNode]
    ) -> dict[str, LineageNode]:
        """The trainer checkpoints whose chain may differ: those of the states where ``nodes``
        end, and of the states reached from a state whose way ``changed`` (by id)."""
        out: dict[str, LineageNode] = {}
        for st in changed:
            for e in self.starts_from.get(st, ()):
                t = self.trainer_at(e.state)
                if t is not None:
                    out[t.id] = t
        for n in nodes:
            t = self.trainer_at(n.state)
            if t is not None:
                out[t.id] = t
        return out

    def _window(self, batch: list[LineageNode]) -> tuple[list[LineageNode] | None, bool]:
        """Bring the active window up to date (plan.py's _active_window): returns the trainer
        checkpoints new in it (None: it is unchanged) and whether it only grew by the latest."""
        latest = self.latest
        assert latest is not None
        prev = self.window[-1] if self.window else None
        # a new full of a window state ends the window there
        cut = any(
            n.kind is Kind.FULL
            and n.usable
            and n.state[1] in self.window_ids
            and self.trainer_at(n.state) is not None
            for n in batch
        )
        if prev is not None and self.anchor is not None and not cut:
            if latest is prev:
                return None, False
            if (
                latest.start == prev.state
                and latest.kind is not Kind.FULL
                and not any(f.usable for f in self.fulls_at.get(latest.state, ()))
            ):
                self.window.append(latest)
                self.window_ids.add(latest.id)
                return [latest], True
        window, self.anchor = active_window(self, latest)
        added = [w for w in window if w.id not in self.window_ids]
        self.window = window[::-1]
        self.window_ids = {w.id for w in window}
        return added, False

    def _latest_chain(self) -> None:
        """The latest chain's full at the latest state (kept: plan.py's _kept_fulls) and its
        restrictable checkpoints (allowed in restricted chains)."""
        latest = self.latest
        assert latest is not None
        way = self.any.chain_way(latest)
        assert way is not None
        _, prev, last = way
        out: set[str] = set()
        if last is not None and self.restrictable(self.nodes[last]):
            out.add(last)
        if prev is not None:
            root, near = self.up(prev)
            while near is not None:
                out.add(near.id)
                near = self.up(near.prev)[1] if near.prev is not None else None
        else:
            root = last if last is not None else latest.id
        full = self.nodes[root]
        self.latest_full = full if full.state == latest.state else None
        self.latest_excluded = out

    def _kept(self, batch: list[LineageNode], redo: bool) -> bool:
        """Bring the kept fulls up to date (plan.py's _kept_fulls; ``redo``: the rules but the
        budget are to be applied again); whether they changed."""
        # The full each state would keep: the trainer's, else the smallest (eligible: usable,
        # and the trainer checkpoint of its state committed)
        changed_states = []
        for st in {n.state for n in batch if n.kind is Kind.FULL or not n.merged}:
            good = [f for f in self.fulls_at.get(st, ()) if f.usable]
            pick = (
                min(good, key=lambda n: (n.merged, n.bytes, n.id))
                if good and self.trainer_at(st) is not None
                else None
            )
            if pick is not self.by_state.get(st):
                if pick is None:
                    del self.by_state[st]
                else:
                    self.by_state[st] = pick
                changed_states.append(st)
        redo = redo or bool(changed_states) or self.anchor != self._prekept_anchor
        # The budget walk again from the first step whose inputs changed: a new trainer
        # checkpoint, the full its state would keep, whether another rule keeps it
        steps = [n.step for n in batch if not n.merged] + [st[0] for st in changed_states]
        if redo:
            old = self.prekept
            self.prekept = self._prekept()
            self._prekept_anchor = self.anchor
            steps += [st[0] for st in old.keys() ^ self.prekept.keys()]
        walked = self._budget_walk(steps) if steps else False
        if not (redo or walked):
            return False
        kept = dict(self.prekept)
        for st in self.budget.values():
            kept[st] = self.by_state[st]
        if kept.keys() == self.kept.keys() and all(kept[k] is self.kept[k] for k in kept):
            return False
        self.kept = kept
        self.kept_ids = {f.id for f in kept.values()}
        return True

    def _prekept(self) -> dict[StateKey, LineageNode]:
        """The kept fulls of every rule but the chain budget, in plan.py's order."""
        policy = self.policy
        kept: dict[StateKey, LineageNode] = {}
        if self.anchor is not None and self.anchor in self.by_state:
            kept[self.anchor] = self.by_state[self.anchor]
        newest = sorted(self.by_state.values(), key=lambda n: (n.epoch, n.step), reverse=True)
        for f in newest[: policy.keep_last_fulls]:
            kept[f.state] = f
        if policy.keep_fulls_every:
            period: dict[int, LineageNode] = {}
            for f in sorted(self.by_state.values(), key=lambda n: (n.step, -n.epoch)):
                period.setdefault(f.step // policy.keep_fulls_every, f)
            for f in period.values():
                kept[f.state] = f
        if self.latest_full is not None:
            kept[self.latest_full.state] = self.latest_full
        return kept

    def _budget_walk(self, steps: list[int]) -> bool:
        """plan.py's _keep_budget_fulls over the trainer's steps, from the first of ``steps``
        (whose inputs changed) until, past the last of them, it agrees with the last walk
        again (the rest then would too); whether a kept state changed."""
        policy = self.policy
        if not policy.keep_all_steps or policy.chain_delta_budget is None:
            return False
        budget = policy.chain_delta_budget
        lo, hi = min(steps), max(steps)
        i = bisect.bisect_left(self.steps, lo)
        since = self.since[self.steps[i - 1]] if i > 0 else 0
        changed = False
        for step in self.steps[i:]:
            n = self.trainer[step]
            anchor = self.by_state.get(n.state)
            if anchor is not None and (
                n.kind is Kind.FULL
                or anchor.state in self.prekept
                or since >= budget * anchor.bytes
            ):
                since = 0
                kept: StateKey | None = anchor.state
            else:
                kept = None
                if n.kind is not Kind.FULL:
                    since += n.bytes
            old_since = self.since.get(step)
            if self.budget.get(step) != kept:
                changed = True
                if kept is None:
                    del self.budget[step]
                else:
                    self.budget[step] = kept
            elif step > hi and old_since == since:
                break
            self.since[step] = since
        return changed

    def _restrict(
        self,
        batch: list[LineageNode],
        kept_before: set[str],
        latest_before: set[str],
        dirty: set[StateKey],
    ) -> list[LineageNode]:
        """Bring the restricted set up to date (plan.py's ``allowed``); returns the checkpoints
        whose usability in restricted chains changed (their states added to ``dirty``)."""
        candidates = [n for n in batch if self.restrictable(n)]
        for cid in (kept_before ^ self.kept_ids) | (latest_before ^ self.latest_excluded):
            n = self.nodes[cid]
            if self.restrictable(n):
                candidates.append(n)
        toggled = []
        for n in candidates:
            out = n.id not in self.kept_ids and n.id not in self.latest_excluded
            if out != (n.id in self.excluded):
                if out:
                    self.excluded.add(n.id)
                else:
                    self.excluded.discard(n.id)
                dirty.add(n.state)
                toggled.append(n)
        return toggled

    def _walk(
        self,
        fresh: list[LineageNode],
        touched: Mapping[str, LineageNode],
        touched_r: Mapping[str, LineageNode],
        ways: Mapping[str, ChainWay],
        first: bool,
        window_added: list[LineageNode] | None,
        extended: bool,
        kept_changed: bool,
    ) -> None:
        """Protect the chains (the cheapest, and the restricted one) of the retained steps that
        are new or whose chain may have changed (``touched``: the cheapest, ``touched_r``: the
        restricted one); ``ways``: cheapest chains found this moment."""
        todo: dict[str, LineageNode] = {}
        if self.policy.keep_all_steps:
            # every restorable step is retained (the window's and kept fulls' steps are too)
            todo.update((t.id, t) for t in fresh)
            for t in (*touched.values(), *touched_r.values()):
                if t.id in self.restorable:
                    todo[t.id] = t
        else:
            if extended and not kept_changed:
                assert window_added is not None
                now = self.retained | {window_added[0].step}
            elif window_added is not None or kept_changed:
                now = {w.step for w in self.window} | {st[0] for st in self.kept}
            else:
                now = self.retained
            for s in now - self.retained:
                if s in self.trainer:
                    todo[self.trainer[s].id] = self.trainer[s]
            for t in (*touched.values(), *touched_r.values()):
                if t.step in now:
                    todo[t.id] = t
            self.retained = now
        for t in todo.values():
            if t.id not in self.restorable:
                continue
            way = ways.get(t.id) or self.any.chain_way(t)
            if way is not None:
                keep_chain(way, self.protected, self.walked)
            if first and t.id not in touched_r:
                continue  # the restricted paths are the cheapest but where touched_r says
            way = self.restricted.chain_way(t)
            if way is not None:
                keep_chain(way, self.protected, self.walked)

    def _in_progress(
        self, batch: list[LineageNode], window_added: list[LineageNode] | None
    ) -> None:
        """Protect the merger's work in progress (plan.py's _in_progress): merged deltas of a
        window state that no merged delta consumes yet -- new ones, and those of new window
        states."""
        cands = [n for n in batch if n.kind is Kind.MERGED and n.state[1] in self.window_ids]
        for w in window_added or ():
            cands.extend(self.merged_at.get(w.id, ()))
        self.protected.update(n.id for n in cands if n.usable and n.id not in self._merged_from)
