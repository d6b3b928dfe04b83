"""The retention plan and GC's grace-period protection as they were before both became
incremental: the reference the differential tests (tests/ops/test_grace_incremental.py) and
benchmarks/bench_history_scale.py compare the product with.

Frozen on purpose: cheapest paths as whole tuples per state (``(*prev.path, d.id)``), the plan
of every moment of the grace period computed from scratch (``as_of`` + a whole plan + the
cheapest chain of every retained step). Quadratic in a long history, and obviously what
docs/operations.md says; the product (:mod:`deck.read.lineage`, :mod:`deck.ops.retention.plan`)
must make exactly its decisions. Reads only a :class:`~deck.read.lineage.LineageGraph`'s
indexes (``nodes``, ``trainer``, ``fulls_at``, ``ending_at``), none of its path code.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass

from deck.errors import CheckpointNotFoundError
from deck.format.manifest import MANIFEST, Kind, step_dir
from deck.ops.retention.plan import RetentionPlan, RetentionPolicy
from deck.read.lineage import LineageGraph, LineageNode, StateKey

__all__ = [
    "ReferenceMoment",
    "reference_best_paths",
    "reference_chain_ids",
    "reference_grace_protected",
    "reference_moment",
    "reference_plan_lineage",
    "reference_takeovers",
]


@dataclass(frozen=True)
class _Best:
    cost: int
    path: tuple[str, ...]

    def key(self) -> tuple[int, int, tuple[str, ...]]:
        return (self.cost, len(self.path), self.path)


def _usable(n: LineageNode, exclude: frozenset[str]) -> bool:
    return n.quarantined is None and n.id not in exclude


def reference_best_paths(
    graph: LineageGraph, exclude: frozenset[str] = frozenset()
) -> dict[StateKey, _Best]:
    """Cheapest path (bytes, then fewest checkpoints, then ids) from a full to every state."""
    states = sorted({*graph.fulls_at, *graph.ending_at})
    best: dict[StateKey, _Best] = {}
    for st in states:
        cands = [_Best(f.bytes, (f.id,)) for f in graph.fulls_at.get(st, ()) if _usable(f, exclude)]
        for d in graph.ending_at.get(st, ()):
            if not _usable(d, exclude) or d.start is None:
                continue
            prev = best.get(d.start)
            if prev is not None:
                cands.append(_Best(prev.cost + d.bytes, (*prev.path, d.id)))
        if cands:
            best[st] = min(cands, key=_Best.key)
    return best


class _Paths:
    """The reference's answers about one graph (best paths cached per excluded set)."""

    def __init__(self, graph: LineageGraph):
        self.graph = graph
        self.cache: dict[frozenset[str], dict[StateKey, _Best]] = {}

    def best(self, exclude: frozenset[str]) -> dict[StateKey, _Best]:
        if exclude not in self.cache:
            self.cache[exclude] = reference_best_paths(self.graph, exclude)
        return self.cache[exclude]

    def chain_ids(self, step: int, exclude: frozenset[str] = frozenset()) -> tuple[str, ...] | None:
        g = self.graph
        t = g.trainer.get(step)
        if t is None or not _usable(t, exclude):
            return None
        if t.kind is Kind.FULL:
            return (t.id,)
        best = self.best(exclude)
        cands: list[_Best] = []
        if t.start is not None and t.start in best:
            b = best[t.start]
            cands.append(_Best(b.cost + t.bytes, b.path))
        for f in g.fulls_at.get(t.state, ()):
            if _usable(f, exclude):
                cands.append(_Best(f.bytes, (f.id,)))
        for d in g.ending_at.get(t.state, ()):
            if d.id != t.id and _usable(d, exclude) and d.start in best:
                assert d.start is not None
                prev = best[d.start]
                cands.append(_Best(prev.cost + d.bytes, (*prev.path, d.id)))
        if not cands:
            return None
        return (*min(cands, key=_Best.key).path, t.id)

    def chain(self, step: int, exclude: frozenset[str] = frozenset()) -> list[str]:
        ids = self.chain_ids(step, exclude)
        if ids is None:
            raise CheckpointNotFoundError(f"step {step} has no chain")
        return list(ids)

    def restorable_steps(self) -> list[int]:
        return [s for s in sorted(self.graph.trainer) if self.chain_ids(s) is not None]

    def latest(self) -> int | None:
        # Which steps a newer timeline left is the graph's definition, not an algorithm under
        # test here: taken from it (a rollback's timeline made unrestorable must not send the
        # latest back onto the timeline it left)
        left = self.graph.abandoned()
        nodes = sorted(self.graph.trainer.values(), key=lambda n: (n.epoch, n.step), reverse=True)
        for n in nodes:
            if n.step not in left and self.chain_ids(n.step) is not None:
                return n.step
        return None


def reference_chain_ids(
    graph: LineageGraph, step: int, exclude: frozenset[str] = frozenset()
) -> tuple[str, ...] | None:
    """Ids of the cheapest chain of trainer step ``step`` (None: there is none)."""
    return _Paths(graph).chain_ids(step, exclude)


def _eligible_full(graph: LineageGraph, n: LineageNode) -> bool:
    return n.kind is Kind.FULL and n.usable and graph.trainer_at(n.state) is not None


def reference_plan_lineage(
    graph: LineageGraph,
    policy: RetentionPolicy,
    *,
    damaged: Mapping[int, str] | None = None,
    unusable: Mapping[str, str] | None = None,
) -> RetentionPlan:
    """:func:`deck.ops.retention.plan.plan_lineage` as it was (no logging), and the steps only a
    quarantined checkpoint restores held (unless ``policy.drop_quarantined``)."""
    quarantine_holds = {} if policy.drop_quarantined else _quarantine_holds(graph)
    if unusable:
        graph = graph.marked(unusable)
    paths = _Paths(graph)
    latest = paths.latest()
    if latest is None:
        return RetentionPlan(None, [], [], [], set(graph.nodes), {})
    latest_chain = paths.chain(latest)
    window, anchor_state = _active_window(graph, latest)
    kept = _kept_fulls(graph, policy, latest, latest_chain, anchor_state)
    retained = set(window) | {st[0] for st in kept}
    if policy.keep_all_steps:
        retained |= set(paths.restorable_steps())
    allowed = (
        {f.id for f in kept.values()} | set(latest_chain) | {n.id for n in graph.trainer.values()}
    )
    if policy.keep_merged_deltas:
        allowed |= {n.id for n in graph.nodes.values() if n.merged and n.kind is not Kind.FULL}
    keep: set[str] = set(latest_chain) | _in_progress(graph, window)
    restricted = frozenset(i for i in graph.nodes if i not in allowed)
    retained_steps = []
    for step in sorted(retained):
        try:
            chain = paths.chain(step, restricted)
        except CheckpointNotFoundError:
            try:
                chain = paths.chain(step)
            except CheckpointNotFoundError:
                continue
        keep.update(chain)
        retained_steps.append(step)
    delete = _delete_reasons(graph, keep)
    held = _damage_holds(graph, paths, damaged or {}, delete)
    held.update((i, why) for i, why in quarantine_holds.items() if i in delete and i not in held)
    held.update(
        (i, f"{_problem(p)}; kept, and planned around: `deck verify --quarantine` decides")
        for i, p in (unusable or {}).items()
        if i in delete
    )
    for i in held:
        del delete[i]
    return RetentionPlan(
        latest=latest,
        window=sorted(window),
        retained_steps=retained_steps,
        kept_fulls=sorted(f.id for f in kept.values()),
        keep=keep | set(held),
        delete=delete,
        held=held,
    )


def _quarantine_holds(graph: LineageGraph) -> dict[str, str]:
    """Every checkpoint on the chain (were nothing quarantined) of a step that only quarantined
    checkpoints make restorable, with why."""
    if all(n.quarantined is None for n in graph.nodes.values()):
        return {}
    lifted = _Paths(graph.unmarked())
    lost = set(lifted.restorable_steps()) - set(_Paths(graph).restorable_steps())
    holds: dict[str, str] = {}
    for step in sorted(lost):
        chain = lifted.chain(step)
        bad = [graph.nodes[i] for i in chain if graph.nodes[i].quarantined is not None]
        for q in bad:
            holds.setdefault(
                q.id,
                f"quarantined ({q.quarantined}); it and the steps only it restores are kept to "
                f"be repaired (restore its files, then delete quarantine/{q.id}.json) or "
                "given up (`deck gc --drop-quarantined`)",
            )
        for i in chain:
            holds.setdefault(
                i, f"step {step} restores only through quarantined {bad[0].folder}, kept with it"
            )
    return holds


def _problem(p: str) -> str:
    return p if p.startswith("could not be read") else f"damaged ({p})"


def _damage_holds(
    graph: LineageGraph, paths: _Paths, damaged: Mapping[int, str], delete: dict[str, str]
) -> dict[str, str]:
    holds: dict[str, str] = {}
    if not damaged:
        return holds
    restorable, reached = set(paths.restorable_steps()), paths.best(frozenset())

    def complete(n: LineageNode) -> bool:
        if n.kind is Kind.FULL:
            return True
        return n.step in restorable if not n.merged else n.start in reached

    for d, problem in sorted(damaged.items()):
        fix = f"repair or delete {step_dir(d)}/{MANIFEST}"
        for n in graph.nodes.values():
            if n.id in delete and n.step >= d and not complete(n):
                why = f"may need step {d}, whose commit record is unreadable ({problem}); {fix}"
                holds.setdefault(n.id, why)
        fulls = [
            st[0] for st, fs in graph.fulls_at.items() if st[0] < d and any(f.usable for f in fs)
        ]
        for step in (s for s in graph.trainer if max(fulls, default=0) <= s < d):
            with contextlib.suppress(CheckpointNotFoundError):
                for i in paths.chain(step):
                    if i in delete:
                        why = f"step {d}, whose commit record is unreadable, may build on it; {fix}"
                        holds.setdefault(i, why)
    return holds


def _active_window(graph: LineageGraph, latest: int) -> tuple[list[int], StateKey | None]:
    window: list[int] = []
    node: LineageNode | None = graph.trainer[latest]
    while node is not None:
        window.append(node.step)
        if node.kind is Kind.FULL or any(f.usable for f in graph.fulls_at.get(node.state, ())):
            break
        if node.start is None:
            return window, None
        prev = graph.trainer_at(node.start)
        if prev is None:
            # The record before replaced (a rollback) or deleted: on through the usable merged
            # delta starting last that merged it, with the committed trainer steps it merged
            through = [
                m
                for m in graph.nodes.values()
                if m.kind is Kind.MERGED
                and m.usable
                and m.start
                and graph.trainer_at(m.start)
                and node.start[1] in _merged_ids(graph, m)
            ]
            if through:
                merged = max(through, key=lambda m: (m.start, m.id))
                assert merged.start is not None
                steps = {
                    graph.nodes[i].step
                    for i in _merged_ids(graph, merged)
                    if i in graph.nodes
                    and not graph.nodes[i].merged
                    and graph.trainer_at(graph.nodes[i].state)
                }
                window += sorted(steps - set(window), reverse=True)
                prev = graph.trainer_at(merged.start)
        node = prev
    return window, node.state if node is not None else None


def _merged_ids(graph: LineageGraph, merged: LineageNode) -> set[str]:
    """Every id ``merged`` merged, through the merged deltas it merged that are committed."""
    ids: set[str] = set()
    todo = list(merged.inputs)
    while todo:
        i = todo.pop()
        if i in ids:
            continue
        ids.add(i)
        n = graph.nodes.get(i)
        if n is not None and n.merged:
            todo += n.inputs
    return ids


def _kept_fulls(
    graph: LineageGraph,
    policy: RetentionPolicy,
    latest: int,
    latest_chain: list[str],
    anchor_state: StateKey | None,
) -> dict[StateKey, LineageNode]:
    fulls = [n for n in graph.nodes.values() if _eligible_full(graph, n)]
    by_state: dict[StateKey, LineageNode] = {}
    for f in sorted(fulls, key=lambda n: (n.merged, n.bytes, n.id)):
        by_state.setdefault(f.state, f)
    kept: dict[StateKey, LineageNode] = {}
    if anchor_state is not None and anchor_state in by_state:
        kept[anchor_state] = by_state[anchor_state]
    newest = sorted(by_state.values(), key=lambda n: (n.epoch, n.step), reverse=True)
    for f in newest[: policy.keep_last_fulls]:
        kept[f.state] = f
    if policy.keep_fulls_every:
        period: dict[int, LineageNode] = {}
        for f in sorted(by_state.values(), key=lambda n: (n.step, -n.epoch)):
            period.setdefault(f.step // policy.keep_fulls_every, f)
        for f in period.values():
            kept[f.state] = f
    for f in graph.fulls_at.get(graph.trainer[latest].state, ()):
        if f.id in latest_chain:
            kept[f.state] = f
    if policy.keep_all_steps and policy.chain_delta_budget is not None:
        since = 0
        budget = policy.chain_delta_budget
        for n in sorted(graph.trainer.values(), key=lambda n: (n.step, n.epoch)):
            anchor = by_state.get(n.state)
            if anchor is not None and (
                n.kind is Kind.FULL or anchor.state in kept or since >= budget * anchor.bytes
            ):
                kept[anchor.state] = anchor
                since = 0
            elif n.kind is not Kind.FULL:
                since += n.bytes
    return kept


def _in_progress(graph: LineageGraph, window: list[int]) -> set[str]:
    window_ids = {graph.trainer[s].id for s in window}
    consumed = {i for n in graph.nodes.values() for i in n.inputs if n.kind is Kind.MERGED}
    return {
        n.id
        for n in graph.nodes.values()
        if n.kind is Kind.MERGED and n.usable and n.state[1] in window_ids and n.id not in consumed
    }


def _delete_reasons(graph: LineageGraph, keep: set[str]) -> dict[str, str]:
    delete = {}
    for n in graph.nodes.values():
        if n.id in keep:
            continue
        if n.quarantined is not None:
            delete[n.id] = f"quarantined ({n.quarantined})"
        elif not n.merged:
            delete[n.id] = f"step {n.step} is not retained"
        else:
            delete[n.id] = f"{n.kind.value} checkpoint in no retained step's chain"
    return delete


def reference_takeovers(
    graph: LineageGraph, plan: RetentionPlan, doomed: Mapping[str, str]
) -> set[str]:
    """:func:`deck.ops.retention.plan.takeovers` as it was (a chain per doomed checkpoint and
    step it covers), with the trainer full such a chain starts from, which GC reads whole too
    since a damaged one took over from a deleted merger full (a fuzz-ops finding; this
    reference kept the deltas alone until make fuzz-gc drew a chain from a trainer full)."""
    gone = [i for i in doomed if graph.nodes[i].merged]
    if not gone:
        return set()
    paths = _Paths(graph)
    retained = sorted(plan.retained_steps)
    out: set[str] = set()
    for cid in gone:
        n = graph.nodes[cid]
        lo = bisect.bisect_left(retained, n.first_step)
        for step in retained[lo : bisect.bisect_right(retained, n.step)]:
            with contextlib.suppress(CheckpointNotFoundError):
                chain = paths.chain(step, frozenset(doomed))
                out.update(i for i in chain if not graph.nodes[i].merged)
    return out


@dataclass
class ReferenceMoment:
    """What the reference plans for one moment's lineage, part by part (for white-box tests of
    an incremental replay)."""

    latest: int | None
    window: list[int]
    anchor: StateKey | None
    kept_fulls: list[str]
    restricted: frozenset[str]  # what restricted chains may not use
    paths: dict[StateKey, tuple[str, ...]]  # the cheapest path into every state
    restricted_paths: dict[StateKey, tuple[str, ...]]
    protected: set[str]  # what the grace period protects for this moment


def reference_moment(graph: LineageGraph, policy: RetentionPolicy) -> ReferenceMoment:
    paths = _Paths(graph)
    # (what a quarantine holds is the plan's alone: a grace period protects no more for it)
    plan = reference_plan_lineage(graph, policy.model_copy(update={"drop_quarantined": True}))
    protected = set(plan.keep)
    for step in plan.retained_steps:
        protected.update(paths.chain(step))
    every = {st: b.path for st, b in paths.best(frozenset()).items()}
    if plan.latest is None:
        return ReferenceMoment(None, [], None, [], frozenset(), every, every, protected)
    latest_chain = paths.chain(plan.latest)
    window, anchor = _active_window(graph, plan.latest)
    kept = _kept_fulls(graph, policy, plan.latest, latest_chain, anchor)
    allowed = (
        {f.id for f in kept.values()} | set(latest_chain) | {n.id for n in graph.trainer.values()}
    )
    if policy.keep_merged_deltas:
        allowed |= {n.id for n in graph.nodes.values() if n.merged and n.kind is not Kind.FULL}
    restricted = frozenset(i for i in graph.nodes if i not in allowed)
    return ReferenceMoment(
        latest=plan.latest,
        window=sorted(window),
        anchor=anchor,
        kept_fulls=plan.kept_fulls,
        restricted=restricted,
        paths=every,
        restricted_paths={st: b.path for st, b in paths.best(restricted).items()},
        protected=protected,
    )


def reference_grace_protected(
    graph: LineageGraph,
    policy: RetentionPolicy,
    now: float | None,
    committed_at: Mapping[str, float | None],
) -> set[str]:
    """:func:`deck.ops.retention.plan.grace_protected` as it was: every moment of the grace
    period planned again from scratch."""
    if policy.grace_s <= 0:
        return set()
    if now is None:
        return set(graph.nodes)
    cutoff = now - policy.grace_s

    def when(cid: str) -> float:
        t = committed_at.get(cid)
        return now if t is None else t

    recent = [i for i in graph.nodes if when(i) > cutoff]
    protected = set(recent)
    # A timeline that saved steps again in the period, at or below a step an older timeline
    # holds: what the older ones hold from its first step on, and the chains of their steps
    # from its first recent one, stay (the records it replaced are gone: no moment sees them)
    for epoch in {n.epoch for n in graph.trainer.values()}:
        mine = [n for n in graph.trainer.values() if n.epoch == epoch]
        young = [n.step for n in mine if when(n.id) > cutoff]
        older = [n for n in graph.nodes.values() if n.epoch < epoch]
        if not young or all(n.step < min(young) for n in older):
            continue
        low = min(n.step for n in mine)
        held = [n for n in older if n.step >= low]
        protected |= {n.id for n in held}
        paths = _Paths(graph)
        steps = {n.step for n in older if not n.merged and n.step >= min(young)}
        for n in held:
            t = graph.trainer.get(n.start[0]) if n.start else None
            if t is not None and n.start is not None and t.id == n.start[1]:
                steps.add(t.step)
        for step in steps:
            with contextlib.suppress(CheckpointNotFoundError):
                protected.update(paths.chain(step))
    for moment in sorted({cutoff} | {when(i) for i in recent if when(i) <= now}):
        then = graph.as_of(moment, when)
        plan = reference_plan_lineage(then, policy.model_copy(update={"drop_quarantined": True}))
        protected |= plan.keep
        paths = _Paths(then)
        for step in plan.retained_steps:
            with contextlib.suppress(CheckpointNotFoundError):
                protected.update(paths.chain(step))
    return protected
