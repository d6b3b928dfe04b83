"""The retention plan: which steps stay restorable under a :class:`RetentionPolicy`, and which
checkpoints can go (the rules: :mod:`deck.ops.retention`; docs/operations.md, "Retention and GC").

Pure: functions of the lineage graph (:class:`deck.read.lineage.LineageGraph`), the policy and
a clock value; nothing here reads or deletes anything. :mod:`deck.ops.retention.gc` builds the
graph once per run, asks these functions, checks what it is about to rely on, and deletes.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import Field

from deck.config import Settings
from deck.errors import CheckpointNotFoundError
from deck.format.manifest import MANIFEST, QUARANTINE_ROOT, Kind, step_dir
from deck.ops.retention.active import active_window
from deck.ops.retention.grace import replay_protected
from deck.read.catalog import ManifestSet
from deck.read.lineage import (
    ChainWay,
    LineageGraph,
    LineageNode,
    PathLink,
    build_graph,
    keep_chain,
)

logger = logging.getLogger(__name__)

__all__ = [
    "RetentionPlan",
    "RetentionPolicy",
    "grace_protected",
    "plan_lineage",
    "plan_retention",
    "replacements",
    "takeovers",
]


class RetentionPolicy(Settings):
    """What GC keeps (the rules: docs/operations.md, "Retention and GC").

    Validated like :class:`deck.DeckConfig`: an invalid value raises
    :class:`deck.errors.ConfigError` naming the field; unknown fields are refused.
    """

    keep_last_fulls: int = Field(
        default=2,
        ge=1,
        description="The newest fulls kept for rollback, each with the trainer checkpoint of its "
        "step.",
        json_schema_extra={"cli": "deck gc --keep-last-fulls K"},
    )
    keep_fulls_every: Annotated[int, Field(ge=1)] | None = Field(
        default=None,
        description="Also keep the oldest full of every N-step period (rolling back past bad data "
        "found late, DECK fig. 9). None: off.",
        json_schema_extra={"constraints": ">= 1 or None", "cli": "deck gc --keep-fulls-every N"},
    )
    keep_all_steps: bool = Field(
        default=True,
        description="Every step that is restorable now stays restorable (superseded merged deltas "
        "and merger fulls still go). False: only the active window and the rollback fulls stay "
        "(DECK fig. 9), bounding storage.",
        json_schema_extra={"cli": "deck gc --no-keep-all-steps"},
    )
    chain_delta_budget: Annotated[float, Field(gt=0)] | None = Field(
        default=4.0,
        description="With keep_all_steps: also keep a full wherever the trainer's deltas since "
        "the previous kept full add up to this many fulls' bytes, so that restoring any past step "
        "reads at most about 1 + this many fulls. None: only the fulls the other rules keep "
        "(least storage, old steps replay every delta since them).",
        json_schema_extra={"constraints": "> 0 or None", "cli": "deck gc --chain-delta-budget F"},
    )
    keep_merged_deltas: bool = Field(
        default=True,
        description="Merged deltas on a retained step's cheapest chain (through the kept fulls) "
        "stay, so restoring an old step reads as few checkpoints as it did. False: only those "
        "on the newest step's chain and in progress stay; old steps restore through the "
        "trainer's deltas (least storage).",
        json_schema_extra={"cli": "deck gc --no-keep-merged-deltas"},
    )
    grace_s: float = Field(
        default=3600.0,
        ge=0,
        description="Nothing committed in the last S seconds, nothing the lineage needed S seconds "
        "ago, and no orphan with a file younger than S is deleted. Must exceed the longest "
        "restore and the time between a restore and the next checkpoint.",
        json_schema_extra={"cli": "deck gc --grace S"},
    )
    max_clock_skew_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = Field(
        default=900.0,
        description="GC measures every age on the store's clock (the times the store gives its "
        "files, against a marker GC writes); when this host's clock is further than S seconds "
        "from the store's, GC refuses to delete anything (a store that keeps times its clients "
        "send would otherwise mix clocks). None: no bound.",
        json_schema_extra={"constraints": ">= 0 or None", "cli": "deck gc --max-clock-skew S"},
    )
    drop_quarantined: bool = Field(
        default=False,
        description="Delete quarantined checkpoints, and the steps that restore only through "
        "them. False: a quarantine never makes GC delete more -- a quarantined checkpoint and "
        "what only it made restorable stay (reported as kept) until it is repaired or given up "
        "with this.",
        json_schema_extra={"cli": "deck gc --drop-quarantined"},
    )
    verify_replacements: bool = Field(
        default=True,
        description="Before deleting what a kept merger checkpoint replaces, re-read that "
        "checkpoint's files and check their checksums: it becomes the only copy of those "
        "steps (each is read once, when what it replaces goes). False: only check that every "
        "file it names exists with its recorded size (no chunk is read; a flipped byte is not "
        "seen). Either way a damaged replacement is kept, and so is what it replaces. The "
        "trainer checkpoints (deltas, and the full they start from) that take over the steps "
        "of a deleted merger checkpoint are always checked by their checksums (once: when it "
        "goes).",
        json_schema_extra={"cli": "deck gc --no-verify-replacements"},
    )


@dataclass
class RetentionPlan:
    """Which steps stay restorable, which checkpoints they need, and what can go."""

    latest: int | None
    window: list[int]  # trainer steps of the active window
    retained_steps: list[int]  # every step that stays restorable
    kept_fulls: list[str]  # ids of the fulls kept for rollback / the window
    keep: set[str]  # ids of every checkpoint kept
    delete: dict[str, str]  # id -> why it can go
    # id -> why it is kept although the rules alone would delete it (damage: see plan_retention)
    held: dict[str, str] = field(default_factory=dict)
    # ids of ``held`` kept only because records below ``unread_below`` were not read (no damage)
    unread: set[str] = field(default_factory=set)


def _eligible_full(graph: LineageGraph, n: LineageNode) -> bool:
    """A full that can be a rollback point: usable, and the trainer checkpoint of its state is
    still there (a merger full of an abandoned timeline whose step was saved again is not)."""
    return n.kind is Kind.FULL and n.usable and graph.trainer_at(n.state) is not None


def plan_retention(
    manifests: ManifestSet, policy: RetentionPolicy, *, unusable: dict[str, str] | None = None
) -> RetentionPlan:
    """:func:`plan_lineage` of the lineage graph of ``manifests`` (what
    :func:`deck.read.catalog.read_manifests` returned), with its unreadable trainer commit
    records (``manifests.damaged``)."""
    return plan_lineage(
        build_graph(manifests), policy, damaged=manifests.damaged, unusable=unusable
    )


def plan_lineage(
    graph: LineageGraph,
    policy: RetentionPolicy,
    *,
    damaged: Mapping[int, str] | None = None,
    unusable: Mapping[str, str] | None = None,
    unread_below: int | None = None,
    deleted: Container[str] = frozenset(),
) -> RetentionPlan:
    """Apply ``policy`` to the committed lineage ``graph`` (no grace period: see
    :func:`grace_protected`). Pure: reads nothing, and ``graph`` is unchanged.

    Guarantees: every step in ``retained_steps`` restores through checkpoints in ``keep``; the
    latest restorable step's cheapest chain, the active window and the merger's work in progress
    are kept; ``delete`` holds every other checkpoint, with why. Nothing restorable: keeps all.

    Cannot read is unknown, never absent: an unreadable trainer commit record (``damaged``: step
    -> problem) keeps what it may be needed for -- every checkpoint at or after its step without
    a complete chain (a later delta may build on it), and the chains of the steps before it back
    to a full (it may build on them); ``unusable`` (id -> problem: checkpoints found damaged)
    are planned around like quarantined ones but kept themselves. ``held`` says what either kept
    that the rules alone would delete, and why. ``unread_below``: ``graph`` holds the records
    of the steps at and above it only (GC of the newest steps); one below may be unreadable, so
    every checkpoint here without a complete chain is kept as for damage. ``deleted``: ids of
    trainer checkpoints a GC run deleted while committed deltas named them as their parent
    (their folders keep GC's tombstone): a step whose chain lacks one is not damage (a record
    to put back), and goes when the rules delete it.
    """
    original = graph
    if unusable:
        graph = graph.marked(unusable)
    latest = graph.latest()
    if latest is None:
        # Nothing is restorable: deleting could only make matters worse.
        return RetentionPlan(None, [], [], [], set(graph.nodes), {})
    latest_chain = [m.id for m in graph.chain(latest)]
    window, anchor_state = _active_window(graph, latest)
    kept = _kept_fulls(graph, policy, latest, latest_chain, anchor_state)

    retained = set(window) | {st[0] for st in kept}
    # Every step's cheapest chain, once (no copy of one): the restorable steps, and the chain
    # of a step that has no restricted one
    cheapest = graph.chain_ways(sorted(graph.trainer), frozenset())
    if policy.keep_all_steps:
        retained |= set(cheapest)
    # Steps outside the latest's chain restore through kept fulls, trainer checkpoints and
    # merged deltas (with keep_merged_deltas; else only the latest chain's); only when that is
    # impossible do they keep more.
    allowed = (
        {f.id for f in kept.values()} | set(latest_chain) | {n.id for n in graph.trainer.values()}
    )
    if policy.keep_merged_deltas:
        allowed |= {n.id for n in graph.nodes.values() if n.merged and n.kind is not Kind.FULL}
    keep: set[str] = set(latest_chain) | _in_progress(graph, window)
    retained_steps = _add_chains(graph, sorted(retained), allowed, keep, cheapest)
    delete = _delete_reasons(graph, keep)
    held = _damage_holds(graph, damaged or {}, delete)
    if not policy.drop_quarantined:
        # (the restorable steps of the graph without ``unusable`` marks: found above when none)
        restorable = set(cheapest) if graph is original else None
        for i, why in _quarantine_holds(original, restorable).items():
            if i in delete:
                held.setdefault(i, why)
    unread: set[str] = set()
    if unread_below is not None:
        why = (
            f"no complete chain; a commit record below step {unread_below}, which this run did "
            "not read, may be what it needs (`deck gc --whole` decides)"
        )
        unread = {i for i in _incomplete(graph, delete) if i not in held}
        held.update((i, why) for i in unread)
    left = graph.abandoned()
    if any(s not in cheapest and s not in left for s in graph.trainer):
        # (only where a step no rollback left has no chain: the walk is not paid by a whole
        # lineage)
        for i, why in _broken_chain_holds(original, delete, deleted).items():
            held.setdefault(i, why)
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
        unread=unread,
    )


def _quarantine_holds(graph: LineageGraph, restorable: set[int] | None) -> dict[str, str]:
    """The checkpoints of the steps only a quarantined checkpoint makes restorable -- each such
    step's chain were nothing quarantined, that checkpoint included -- with why: a quarantine
    (damage found) must not make GC delete what an intact copy of it would let restore, so a
    repair stays possible (``drop_quarantined`` gives them up). ``restorable``: the steps of
    ``graph`` that restore as it is, if known."""
    marked = [n.step for n in graph.nodes.values() if n.quarantined is not None]
    if not marked:
        return {}
    if restorable is None:
        restorable = set(_restorable(graph))
    # (a chain only reaches forward: no step before the first quarantined one passes through it)
    first = min(marked)
    candidates = [s for s in graph.trainer if s >= first and s not in restorable]
    if not candidates:
        return {}
    lifted = graph.unmarked()
    holds: dict[str, str] = {}
    for step in sorted(lifted.chain_ways(candidates, frozenset())):
        chain = lifted.chain(step)
        bad = [graph.nodes[m.id] for m in chain if graph.nodes[m.id].quarantined is not None]
        for q in bad:
            holds.setdefault(
                q.id,
                f"quarantined ({q.quarantined}); it and the steps only it restores are kept to "
                f"be repaired (restore its files, then delete {QUARANTINE_ROOT}/{q.id}.json) or "
                "given up (`deck gc --drop-quarantined`)",
            )
        why = f"step {step} restores only through quarantined {bad[0].folder}, kept with it"
        for m in chain:
            holds.setdefault(m.id, why)
    return holds


def _problem(p: str) -> str:
    """How a held checkpoint's problem reads: a read error is not called damage."""
    return p if p.startswith("could not be read") else f"damaged ({p})"


def _damage_holds(
    graph: LineageGraph,
    damaged: Mapping[int, str],
    delete: dict[str, str],
    *,
    state: str = "unreadable",
) -> dict[str, str]:
    """Which of ``delete`` the trainer commit records ``damaged`` (step -> problem), in
    ``state`` (unreadable; missing, or another checkpoint's: put back from a backup), may be
    needed for, with why: at or after such a step, every checkpoint whose chain is not complete without it; before it, the chains of the
    readable steps back to the newest full (its epoch and parent cannot be read, so every
    timeline counts)."""
    holds: dict[str, str] = {}
    if not damaged:
        return holds
    incomplete = _incomplete(graph, delete)
    for d, problem in sorted(damaged.items()):
        record = f"{step_dir(d)}/{MANIFEST}"
        fix = (
            f"repair or delete {record}"
            if state == "unreadable"
            else f"restore {record} from a backup"
        )
        for n in graph.nodes.values():
            if n.id in incomplete and n.step >= d:
                why = f"may need step {d}, whose commit record is {state} ({problem}); {fix}"
                holds.setdefault(n.id, why)
        fulls = [
            st[0] for st, fs in graph.fulls_at.items() if st[0] < d and any(f.usable for f in fs)
        ]
        for step in (s for s in graph.trainer if max(fulls, default=0) <= s < d):
            with contextlib.suppress(CheckpointNotFoundError):
                for m in graph.chain(step):
                    if m.id in delete:
                        why = f"step {d}, whose commit record is {state}, may build on it; {fix}"
                        holds.setdefault(m.id, why)
    return holds


def _broken_chain_holds(
    graph: LineageGraph, delete: dict[str, str], deleted: Container[str] = frozenset()
) -> dict[str, str]:
    """Which of ``delete`` belong to the steps no rollback left whose chain lacks a trainer
    checkpoint no record stands for any more (no commit record at its step at all: lost, not
    replaced by a newer timeline's save), with why: damage, as `deck verify` says, never made
    by deck (a trainer commits a delta after its parent; GC deletes the newest first), so kept
    with what they build on until repaired (a break-it finding: one lost manifest.json made GC
    delete every step after it, and its files)."""
    lost: dict[int, int] = {}  # broken step -> the step whose record is gone
    # trainer checkpoint id -> the step of the lost record its parent links reach, or None
    # (ascending steps: a walk stops at the first checkpoint already walked)
    reach: dict[str, int | None] = {}
    for step in sorted(graph.unmarked().unrestorable()):
        child = graph.trainer[step]
        walked, start, found = [child.id], child.start, None
        while start is not None:
            if start[1] in reach:
                found = reach[start[1]]
                break
            n = graph.trainer_at(start)
            if n is None:
                other = graph.trainer.get(start[0])
                if start[1] in deleted:  # (by GC: nothing to put back)
                    pass
                elif other is None or not replaced_by_a_rollback(other.epoch, [child.epoch]):
                    found = start[0]
                break
            walked.append(n.id)
            child, start = n, n.start
        reach.update((i, found) for i in walked)
        if found is not None:
            lost[step] = found
    if not lost:
        return {}
    holds: dict[str, str] = {}
    for d in sorted(set(lost.values()), reverse=True):  # (the nearest one is said)
        if d in graph.trainer:  # (a record no rollback's save can have replaced)
            problem = f"epoch {graph.trainer[d].epoch}, no newer than what builds on it"
            state = "another checkpoint's (another job's record, or damage)"
        else:
            problem, state = "a committed delta builds on it", "missing (or not a regular file)"
        for i, why in _damage_holds(graph, {d: problem}, delete, state=state).items():
            holds.setdefault(i, why)
    return holds


def replaced_by_a_rollback(epoch: int, built_on: Iterable[int]) -> bool:
    """Whether a commit record of ``epoch`` can have replaced, by a rollback's save of its step,
    the record the checkpoints of epochs ``built_on`` build on: only a newer epoch saves a step
    again. One no newer is another job's record copied in, or damage (a break-it finding: such
    a record made GC delete the deltas built on the one it replaced, and their parent's
    files, as a rollback's leftovers)."""
    return all(epoch > e for e in built_on)


def _incomplete(graph: LineageGraph, ids: Iterable[str]) -> set[str]:
    """Those of ``ids`` that lack what they apply on (a trainer delta whose step has no chain, a
    merged delta whose start no path reaches)."""
    restorable, reached = set(_restorable(graph)), graph.best_paths()
    out = set()
    for i in ids:
        n = graph.nodes[i]
        if n.kind is Kind.FULL:
            continue
        if not (n.step in restorable if not n.merged else n.start in reached):
            out.add(i)
    return out


def _active_window(graph: LineageGraph, latest: int) -> tuple[list[int], tuple[int, str] | None]:
    """The trainer steps of the active window (:func:`deck.ops.retention.active.active_window`),
    newest first; and the state it ends at."""
    window, anchor = active_window(graph, graph.trainer[latest])
    return [n.step for n in window], anchor


def _kept_fulls(
    graph: LineageGraph,
    policy: RetentionPolicy,
    latest: int,
    latest_chain: list[str],
    anchor_state: tuple[int, str] | None,
) -> dict[tuple[int, str], LineageNode]:
    """The fulls kept, one per state: the window's, the newest ``keep_last_fulls``, the oldest
    of every ``keep_fulls_every`` period, those in the chain of ``latest``, and with ``keep_all_steps`` those
    that bound old steps' chains to ``chain_delta_budget``."""
    fulls = [n for n in graph.nodes.values() if _eligible_full(graph, n)]
    by_state: dict[tuple[int, str], LineageNode] = {}
    for f in sorted(fulls, key=lambda n: (n.merged, n.bytes, n.id)):
        by_state.setdefault(f.state, f)  # one full per state: the trainer's, else the smallest
    kept: dict[tuple[int, str], LineageNode] = {}
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
        _keep_budget_fulls(graph, by_state, kept, policy.chain_delta_budget)
    return kept


def _keep_budget_fulls(
    graph: LineageGraph,
    by_state: dict[tuple[int, str], LineageNode],
    kept: dict[tuple[int, str], LineageNode],
    budget: float,
) -> None:
    """Add to ``kept`` the fulls that bound every past step's chain: walking up the steps, a
    full is kept where the deltas since the last kept one pass ``budget`` fulls' bytes (the
    first full at or after that point; the merger only ever builds fulls of newer states, so
    the choice is stable across runs)."""
    since = 0
    for n in sorted(graph.trainer.values(), key=lambda n: (n.step, n.epoch)):
        anchor = by_state.get(n.state)
        if anchor is not None and (
            n.kind is Kind.FULL or anchor.state in kept or since >= budget * anchor.bytes
        ):
            kept[anchor.state] = anchor
            since = 0
        elif n.kind is not Kind.FULL:
            since += n.bytes


def _in_progress(graph: LineageGraph, window: list[int]) -> set[str]:
    """Merged deltas of the window that no committed merged delta consumes yet: the merger's
    work in progress (inputs of the next layer), kept until their consumer is committed."""
    window_ids = {graph.trainer[s].id for s in window}
    consumed = {i for n in graph.nodes.values() for i in n.inputs if n.kind is Kind.MERGED}
    return {
        n.id
        for n in graph.nodes.values()
        if n.kind is Kind.MERGED and n.usable and n.state[1] in window_ids and n.id not in consumed
    }


def _add_chains(
    graph: LineageGraph,
    steps: list[int],
    allowed: set[str],
    keep: set[str],
    cheapest: Mapping[int, ChainWay],
) -> list[int]:
    """Add to ``keep`` the chain of each of ``steps`` -- through ``allowed`` checkpoints where
    possible, else the cheapest (``cheapest``: every step's, by step) -- and return the steps
    that have one (the others are logged).

    Every step's restricted chain at once (one computation of the paths), each chain walked
    only up to the first link an earlier one walked (O(checkpoints) in all, not steps x chain
    length)."""
    restricted = frozenset(i for i in graph.nodes if i not in allowed)
    ways = dict(cheapest) if not restricted else graph.chain_ways(steps, restricted)
    out = []
    walked: set[PathLink] = set()
    for step in steps:
        way = ways.get(step) or cheapest.get(step)
        if way is None:
            try:
                graph.chain(step)  # (raises, saying why)
            except CheckpointNotFoundError as e:
                logger.warning("retention: step %d is not restorable, not retained: %s", step, e)
            continue
        keep_chain(way, keep, walked)
        out.append(step)
    return out


def _restorable(graph: LineageGraph) -> list[int]:
    """:meth:`LineageGraph.restorable_steps` without copying a chain per step."""
    return sorted(graph.chain_ways(graph.trainer, frozenset()))


def _delete_reasons(graph: LineageGraph, keep: set[str]) -> dict[str, str]:
    """Why each checkpoint not in ``keep`` can go, by id."""
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


def grace_protected(
    graph: LineageGraph,
    policy: RetentionPolicy,
    now: float | None,
    committed_at: Mapping[str, float | None],
) -> set[str]:
    """Ids GC keeps whatever a plan says can go: everything committed in the last
    ``policy.grace_s`` seconds before ``now``, and for the lineage as it was at each moment of
    that period (its start and each commit since), what its plan kept and the cheapest chain of
    each step it retained -- the chain a restore started then reads. Empty without a grace
    period.

    ``now`` and ``committed_at`` (id -> when the store wrote its commit record) are on one
    clock, the store's: a record's own ``created_unix`` is its writer's clock and is not used.
    A checkpoint whose commit time is unknown counts as just committed, and with ``now`` None
    (a store that tells no times) everything is protected."""
    if policy.grace_s <= 0:
        return set()
    if now is None:
        return set(graph.nodes)

    def when(cid: str) -> float:
        t = committed_at.get(cid)
        return now if t is None else t

    # Replayed commit by commit, each moment's plan from the last one's (deck.ops.retention.
    # grace): O(what each commit changes), where planning every moment again was O(n) each.
    protected = replay_protected(graph, policy, now, when)
    return protected | abandoned_in_period(graph, now - policy.grace_s, when)


def abandoned_in_period(
    graph: LineageGraph, cutoff: float, when: Callable[[str], float]
) -> set[str]:
    """What older timelines hold that a restore started in the grace period (after ``cutoff``)
    may be reading, where a newer timeline saved steps again in it: for each timeline with a
    record committed then at a step an older timeline holds a checkpoint at or above, every
    checkpoint of the older timelines from the newer one's first step on, the cheapest chains
    of the trainer steps those apply on, and of their trainer steps at or above that record's.

    Until the newer timeline saved such a step, the older one's record of it was there, and a
    restore of it (or of the latest, before the rollback) may have started; the records saved
    again are gone, so a replay of those moments (:func:`replay_protected`) cannot see what
    they kept. They stay for the grace period instead, as docs/operations.md says of a
    rollback's abandoned steps: once the newer timeline's saves are past every step the older
    ones hold, nothing here is kept any more."""
    first: dict[int, int] = {}  # epoch -> its lowest trainer step
    recent: dict[int, int] = {}  # epoch -> its lowest trainer step committed after ``cutoff``
    for n in graph.trainer.values():
        first[n.epoch] = min(first.get(n.epoch, n.step), n.step)
        if when(n.id) > cutoff:
            recent[n.epoch] = min(recent.get(n.epoch, n.step), n.step)
    out: set[str] = set()
    for epoch, step in recent.items():
        older = [n for n in graph.nodes.values() if n.epoch < epoch]
        if not any(n.step >= step for n in older):
            continue  # (saves past every step the older timelines hold: nothing replaced)
        held = [n for n in older if n.step >= first[epoch]]
        out.update(n.id for n in held)
        # ... and the chains they apply on (the full an abandoned merged delta starts from) and
        # of the older steps still committed
        below = {t.step for n in held if n.start and (t := graph.trainer_at(n.start))}
        below |= {n.step for n in older if not n.merged and n.step >= step}
        walked: set[PathLink] = set()
        for way in graph.chain_ways(sorted(below), frozenset()).values():
            keep_chain(way, out, walked)
    return out


def replacements(graph: LineageGraph, keep: set[str], doomed: Mapping[str, str]) -> set[str]:
    """The kept merger checkpoints that make a doomed one redundant: merger fulls at or after
    its step, merged deltas whose steps cover it (timelines not told apart: more is checked)."""
    steps = sorted(graph.nodes[i].step for i in doomed)
    out = set()
    for cid in keep:
        n = graph.nodes.get(cid)
        if n is None or not n.merged or not n.usable:
            continue
        # the first doomed step the checkpoint covers (a full: every step up to its own)
        lo = 0 if n.kind is Kind.FULL else bisect.bisect_left(steps, n.first_step)
        if lo < len(steps) and steps[lo] <= n.step:
            out.add(cid)
    return out


def takeovers(graph: LineageGraph, plan: RetentionPlan, doomed: Mapping[str, str]) -> set[str]:
    """The kept trainer checkpoints that become the only way to a retained step when the doomed
    merger checkpoints go: that step's chain without them (its full and its deltas), for every
    retained step a doomed merged delta covers or a doomed merger full is at. Each is read
    whole when what it takes over from goes: a full too (a fuzz finding: a trainer full with a
    flipped byte took over from a merger full that was deleted, and the steps after it lost
    their only intact chain)."""
    gone = [i for i in doomed if graph.nodes[i].merged]
    if not gone:
        return set()
    retained = sorted(plan.retained_steps)
    steps: set[int] = set()
    for cid in gone:
        n = graph.nodes[cid]
        lo = bisect.bisect_left(retained, n.first_step)
        steps.update(retained[lo : bisect.bisect_right(retained, n.step)])
    # Each step's chain once (several doomed checkpoints cover it), the excluded set made once
    # (not per chain: a first GC of a long history dooms thousands)
    exclude = frozenset(doomed)
    on_chains: set[str] = set()
    walked: set[PathLink] = set()
    for step in sorted(steps):
        way = graph.chain_way(step, exclude)
        if way is not None:
            keep_chain(way, on_chains, walked)
    return {i for i in on_chains if not graph.nodes[i].merged}
