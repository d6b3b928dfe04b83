"""Retention and garbage collection: what stays restorable, and deleting everything else.

Retention rules (:class:`RetentionPolicy`; docs/operations.md, "Retention and GC"):

- ``keep_all_steps`` (the default): every trainer checkpoint that is restorable now stays
  restorable (IncrCP's "recover any checkpoint"), through the kept fulls and the trainer's
  deltas, with a full kept wherever the deltas since the previous one add up to
  ``chain_delta_budget`` fulls (so old steps restore from a bounded chain). GC deletes what the
  merger superseded (merged deltas consumed by the next layer, merger fulls no longer needed)
  and orphans. Deleting training history is an operator's decision, as in Orbax's and
  torchsnapshot's defaults, never the library's.
- Bounded (``keep_all_steps=False``, DECK fig. 9) keeps only:

  - **the active window**: the newest restorable trainer checkpoint ("latest"), every trainer
    checkpoint between it and its newest full (a merger full or the trainer's), and the
    checkpoints of latest's cheapest chain: every step of the window restores, the latest
    fastest;
  - **rollback fulls**: the newest ``keep_last_fulls`` fulls, and with ``keep_fulls_every = N``
    the oldest full of every N-step period, each with the trainer checkpoint of its step (whose
    folder holds that step's dense and extra state).

Everything committed that no retained step needs is deleted -- only ever because something
committed replaces it, and never what the lineage *grace_s* seconds ago needed (a trainer that
just restored, or a restore in progress, may still be reading it). Deleting a checkpoint removes
its ``manifest.json`` first, so a crash mid-way leaves an orphan folder, never a broken record.

Orphans: attempt folders no record references (failed or crashed saves, merger attempts),
uncommitted step folders once a later step is committed, uncommitted merger folders, and
partition records of committed merger checkpoints -- all only once every file in them is older
than ``grace_s`` (their writer may still be running).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import Field

from deck.config import Settings
from deck.errors import CheckpointNotFoundError, DeckError, NotFoundError
from deck.failpoints import failpoint
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
from deck.read.catalog import ManifestSet, read_manifests, read_rank_manifests
from deck.read.lineage import LineageGraph, LineageNode, build_graph
from deck.storage import Storage
from deck.storage.base import get_bounded
from deck.storage.local import TEMP_PREFIX

logger = logging.getLogger(__name__)


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
    grace_s: float = Field(
        default=3600.0,
        ge=0,
        description="Nothing committed in the last S seconds, nothing the lineage needed S seconds "
        "ago, and no orphan with a file younger than S is deleted. Must exceed the longest "
        "restore and the time between a restore and the next checkpoint.",
        json_schema_extra={"cli": "deck gc --grace S"},
    )
    verify_replacements: bool = Field(
        default=False,
        description="Before deleting what a kept merger checkpoint replaces, re-read that "
        "checkpoint's files and check their checksums. False: check that every file it names "
        "exists with its recorded size (no chunk is read). Either way a damaged replacement is "
        "kept, and so is what it replaces.",
        json_schema_extra={"cli": "deck gc --verify-replacements"},
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


def _eligible_full(graph: LineageGraph, n: LineageNode) -> bool:
    """A full that can be a rollback point: usable, and the trainer checkpoint of its state is
    still there (a merger full of an abandoned timeline whose step was saved again is not)."""
    return n.kind is Kind.FULL and n.usable and graph.trainer_at(n.state) is not None


def plan_retention(
    manifests: ManifestSet, policy: RetentionPolicy, *, unusable: dict[str, str] | None = None
) -> RetentionPlan:
    """Apply ``policy`` to the committed lineage (no grace period: see :func:`collect_garbage`).

    Guarantees: every step in ``retained_steps`` restores through checkpoints in ``keep``; the
    latest restorable step's cheapest chain, the active window and the merger's work in progress
    are kept; ``delete`` holds every other checkpoint, with why. Nothing restorable: keeps all.

    Cannot read is unknown, never absent: an unreadable trainer commit record
    (``manifests.damaged``) keeps what it may be needed for -- every checkpoint at or after its
    step without a complete chain (a later delta may build on it), and the chains of the steps
    before it back to a full (it may build on them); ``unusable`` (id -> problem: checkpoints
    found damaged) are planned around like quarantined ones but kept themselves. ``held`` says
    what either kept that the rules alone would delete, and why.
    """
    if unusable:
        manifests = _marked(manifests, unusable)
    graph = build_graph(manifests)
    latest = graph.latest()
    if latest is None:
        # Nothing is restorable: deleting could only make matters worse.
        return RetentionPlan(None, [], [], [], set(graph.nodes), {})
    latest_chain = [m.id for m in graph.chain(latest)]
    window, anchor_state = _active_window(graph, latest)
    kept = _kept_fulls(graph, policy, latest, latest_chain, anchor_state)

    retained = set(window) | {st[0] for st in kept}
    if policy.keep_all_steps:
        retained |= set(graph.restorable_steps())
    # Steps outside the latest's chain restore through kept fulls, trainer checkpoints and the
    # latest chain's merged deltas; only when that is impossible do they keep more.
    allowed = (
        {f.id for f in kept.values()} | set(latest_chain) | {n.id for n in graph.trainer.values()}
    )
    keep: set[str] = set(latest_chain) | _in_progress(graph, window)
    retained_steps = _add_chains(graph, sorted(retained), allowed, keep)
    delete = _delete_reasons(graph, keep)
    held = _damage_holds(graph, manifests.damaged, delete)
    held.update(
        (i, f"damaged ({p}); kept, and planned around: `deck verify --quarantine` decides")
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


def _marked(manifests: ManifestSet, unusable: dict[str, str]) -> ManifestSet:
    """``manifests`` with the ``unusable`` ids marked like quarantined ones (in memory only)."""
    return ManifestSet(
        manifests,
        manifests.merged,
        {**manifests.quarantined, **unusable},
        uri=manifests.uri,
        damaged=manifests.damaged,
        damaged_merged=manifests.damaged_merged,
    )


def _damage_holds(
    graph: LineageGraph, damaged: dict[int, str], delete: dict[str, str]
) -> dict[str, str]:
    """Which of ``delete`` the unreadable trainer commit records ``damaged`` (step -> problem)
    may be needed for, with why: at or after such a step, every checkpoint whose chain is not
    complete without it; before it, the chains of the readable steps back to the newest full
    (its epoch and parent cannot be read, so every timeline counts)."""
    holds: dict[str, str] = {}
    if not damaged:
        return holds
    restorable, reached = set(graph.restorable_steps()), graph.best_paths()

    def complete(n: LineageNode) -> bool:  # it has what it applies on
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
                for m in graph.chain(step):
                    if m.id in delete:
                        why = f"step {d}, whose commit record is unreadable, may build on it; {fix}"
                        holds.setdefault(m.id, why)
    return holds


def _active_window(graph: LineageGraph, latest: int) -> tuple[list[int], tuple[int, str] | None]:
    """The trainer steps from ``latest`` back along parent links to the newest state with a
    usable full, newest first; and that state (None when the walk found none)."""
    window: list[int] = []
    node: LineageNode | None = graph.trainer[latest]
    while node is not None:
        window.append(node.step)
        if node.kind is Kind.FULL or any(f.usable for f in graph.fulls_at.get(node.state, ())):
            break
        node = graph.trainer_at(node.start) if node.start is not None else None
    return window, node.state if node is not None else None


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
    graph: LineageGraph, steps: list[int], allowed: set[str], keep: set[str]
) -> list[int]:
    """Add to ``keep`` the chain of each of ``steps`` -- through ``allowed`` checkpoints where
    possible, else the cheapest -- and return the steps that have one (the others are logged)."""
    restricted = [i for i in graph.nodes if i not in allowed]
    retained_steps = []
    for step in steps:
        try:
            chain = graph.chain(step, exclude=restricted)
        except CheckpointNotFoundError:
            try:
                chain = graph.chain(step)
            except CheckpointNotFoundError as e:
                logger.warning("retention: step %d is not restorable, not retained: %s", step, e)
                continue
        keep.update(m.id for m in chain)
        retained_steps.append(step)
    return retained_steps


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


# ---- garbage collection ------------------------------------------------------------------------


@dataclass
class GcReport:
    """What :func:`collect_garbage` deleted (or would delete, with ``dry_run``)."""

    dry_run: bool
    latest: int | None = None
    retained_steps: list[int] = field(default_factory=list)
    deleted: list[tuple[str, str]] = field(default_factory=list)  # (folder, why)
    orphans: list[tuple[str, str]] = field(default_factory=list)  # (prefix, why)
    files: int = 0
    bytes: int = 0
    errors: list[str] = field(default_factory=list)
    # (folder, why): what the rules alone would delete, kept because something is damaged
    kept: list[tuple[str, str]] = field(default_factory=list)


def file_age_s(storage: Storage, key: str, now: float) -> float | None:
    """Seconds since ``key`` was last written, when the backend tells (local files, fsspec
    stores reporting a modification / creation time); None otherwise (the file is then kept)."""
    modified = storage.modified(key)
    return None if modified is None else now - modified


def _old_enough(storage: Storage, keys: list[str], grace_s: float, now: float) -> bool:
    """Whether every file under a prefix is older than the grace period (unknown: no)."""
    if grace_s <= 0:
        return True
    for k in keys:
        age = file_age_s(storage, k, now)
        if age is None or age < grace_s:
            return False
    return True


def _referenced(storage: Storage, m: CheckpointManifest) -> set[str] | None:
    """Every key a committed checkpoint's records name (None when they cannot be read)."""
    try:
        parts = read_rank_manifests(storage, m)
    except DeckError:
        return None
    keys = {f"{m.folder}/{MANIFEST}"} | {f"{m.folder}/{r.path}" for r in m.ranks}
    for p in parts:
        for rec in p.shards:
            keys.update(f"{m.folder}/{c.path}" for c in rec.chunks)
        for f in (p.dense, p.extra):
            if f is not None:
                keys.add(f"{m.folder}/{f.path}")
    return keys


def collect_garbage(
    storage: Storage,
    policy: RetentionPolicy | None = None,
    *,
    dry_run: bool = False,
    now: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> GcReport:
    """Apply ``policy`` at ``storage``: delete checkpoints no retained step needs, then orphans.

    Guarantees: every step retained now, and every checkpoint the lineage needed
    ``policy.grace_s`` seconds ago, stays restorable; nothing committed less than ``grace_s`` ago
    is deleted; a checkpoint's ``manifest.json`` goes before its files. Nothing is deleted
    because of what cannot be read: an unreadable commit record keeps its folder and what it
    may be needed for (:func:`plan_retention`), and a kept merger checkpoint that replaces
    something deleted is first checked intact (``policy.verify_replacements``), else it and what
    it replaces stay; ``report.kept`` says what was kept for which damage. A failed deletion, of
    a checkpoint or an orphan, is recorded in ``report.errors`` and the run goes on. Safe to run
    next to the trainer and merger workers, and to rerun after a crash. ``dry_run`` only
    reports. ``progress(folder)`` is called before each checkpoint is deleted.
    """
    gc = _Collector(
        storage,
        policy if policy is not None else RetentionPolicy(),
        dry_run=dry_run,
        now=time.time() if now is None else now,
        progress=progress,
    )
    gc.delete_checkpoints()
    gc.collect_orphans()
    gc.finish()
    report = gc.report
    logger.info(
        "deck gc at %s: %s %d checkpoint(s) and %d orphan folder(s), %.1f MiB",
        storage.uri,
        "would delete" if dry_run else "deleted",
        len(report.deleted),
        len(report.orphans),
        report.bytes / 2**20,
    )
    return report


def _protected_ids(
    manifests: ManifestSet, plan: RetentionPlan, policy: RetentionPolicy, now: float
) -> set[str]:
    """Ids GC must keep whatever ``plan`` says can go: what the plan keeps, what the lineage as
    it was ``grace_s`` ago kept (a restore may still be reading it), and everything committed
    within ``grace_s``."""
    protected = set(plan.keep)
    if policy.grace_s > 0:
        cutoff = now - policy.grace_s
        old = ManifestSet(
            {s: m for s, m in manifests.items() if m.created_unix <= cutoff},
            {i: m for i, m in manifests.merged.items() if m.created_unix <= cutoff},
            manifests.quarantined,
            uri=manifests.uri,
        )
        protected |= plan_retention(old, policy).keep
        protected |= {m.id for m in manifests.all() if m.created_unix > cutoff}
    return protected


def _replacements(graph: LineageGraph, keep: set[str], doomed: dict[str, str]) -> set[str]:
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


def _by_prefix(keys: list[str]) -> dict[str, list[str]]:
    """``keys`` grouped by the folder that owns them: a top-level name (a step folder, the
    quarantine folder), or ``merged/<name>`` for a merger checkpoint."""
    groups: dict[str, list[str]] = {}
    for k in keys:
        head, _, rest = k.partition("/")
        if head == MERGED_ROOT:
            head = f"{head}/{rest.partition('/')[0]}"
        groups.setdefault(head, []).append(k)
    return groups


class _Collector:
    """One GC run at a store: the listing, the retention plan and the protected ids are taken
    once, at the start; each step appends what it deleted (or would delete) to :attr:`report`."""

    def __init__(
        self,
        storage: Storage,
        policy: RetentionPolicy,
        *,
        dry_run: bool,
        now: float,
        progress: Callable[[str], None] | None,
    ) -> None:
        self.storage = storage
        self.policy = policy
        self.dry_run = dry_run
        self.now = now
        self.progress = progress
        keys = storage.list("")
        self.manifests = read_manifests(storage, keys)
        self.graph = build_graph(self.manifests)
        self.by_prefix = _by_prefix(keys)
        # id -> why, for every checkpoint this run deletes
        plan, self.doomed = self._checked_plan(set(keys))
        self.report = GcReport(
            dry_run=dry_run, latest=plan.latest, retained_steps=plan.retained_steps
        )
        self.report.kept = [(self._label(i), why) for i, why in sorted(plan.held.items())]

    def _doomed(self, plan: RetentionPlan) -> dict[str, str]:
        """id -> why, for every checkpoint of ``plan.delete`` that the grace period allows."""
        protected = _protected_ids(self.manifests, plan, self.policy, self.now)
        return {cid: why for cid, why in plan.delete.items() if cid not in protected}

    def _checked_plan(self, listing: set[str]) -> tuple[RetentionPlan, dict[str, str]]:
        """The retention plan and what it deletes now, once every kept merger checkpoint that
        replaces something deleted is found intact (:meth:`_damage`); a damaged one is planned
        around and kept, like everything it replaces (``held`` says why)."""
        plan = plan_retention(self.manifests, self.policy)
        doomed = first = self._doomed(plan)
        bad: dict[str, str] = {}
        checked: set[str] = set()
        while doomed:
            found = {}
            for cid in sorted(_replacements(self.graph, plan.keep, doomed) - checked):
                checked.add(cid)
                problems = self._damage(self.graph.nodes[cid].manifest, listing)
                if problems:
                    found[cid] = problems[0]
            if not found:
                break
            bad.update(found)
            plan = plan_retention(self.manifests, self.policy, unusable=bad)
            doomed = self._doomed(plan)
        if bad:
            names = "; ".join(f"{self.graph.nodes[i].folder}: {p}" for i, p in sorted(bad.items()))
            for cid in sorted(set(first) - set(doomed) - set(bad)):
                plan.held.setdefault(cid, f"what would replace it is damaged ({names})")
        return plan, doomed

    def _damage(self, m: CheckpointManifest, listing: set[str]) -> list[str]:
        """Problems of checkpoint ``m``'s files: sizes (or checksums with
        ``verify_replacements``)."""
        # Imported here: the chunk decoder needs torch, which `deck gc` otherwise does not load.
        from deck.read.verify import check_files, verify_checkpoint

        if self.policy.verify_replacements:
            return verify_checkpoint(self.storage, m).problems
        return check_files(self.storage, m, listing)

    def _label(self, cid: str) -> str:
        """How the report names checkpoint ``cid``: its folder (a trainer one: with its id)."""
        n = self.graph.nodes[cid]
        return n.folder if n.merged else f"{n.folder} (id {cid})"

    def size(self, keys: list[str]) -> int:
        """Bytes of ``keys`` (files that vanished or cannot be sized count 0)."""
        total = 0
        for k in keys:
            with contextlib.suppress(DeckError, OSError):
                total += self.storage.size(k)
        return total

    def delete_checkpoints(self) -> None:
        """Delete every checkpoint no retained step needs, oldest step first: its
        ``manifest.json``, then its files. A failure is recorded in the report, not raised."""
        for cid, why in sorted(self.doomed.items(), key=lambda kv: self.graph.nodes[kv[0]].step):
            n = self.graph.nodes[cid]
            if n.merged:
                files = self.by_prefix.get(n.folder, [])
            else:
                prefix = f"{n.folder}/{cid}/"
                files = [k for k in self.by_prefix.get(n.folder, []) if k.startswith(prefix)]
                files.append(f"{n.folder}/{MANIFEST}")
            self.report.deleted.append((self._label(cid), why))
            self.report.files += len(files)
            self.report.bytes += self.size(files)
            if self.progress:
                self.progress(n.folder)
            if self.dry_run:
                continue
            try:
                failpoint("gc.checkpoint.before_delete")
                _delete_checkpoint(self.storage, n)
                failpoint("gc.checkpoint.after_delete")
            except DeckError as e:
                self.report.errors.append(f"{n.folder}: {e}")

    def collect_orphans(self) -> None:
        """Delete files no committed record references, each group only once every file in it
        is older than the grace period (its writer may still be running). A failure is
        recorded in the report, not raised, and the other groups go on."""
        latest_step = max((m.step for m in self.manifests.values()), default=-1)
        for prefix, keys in sorted(self.by_prefix.items()):
            try:
                if prefix.startswith(f"{MERGED_ROOT}/"):
                    self._merged_orphans(prefix, keys)
                elif (step := parse_step_dir(prefix)) is not None:
                    self._step_orphans(prefix, keys, step, latest_step)
                elif prefix == QUARANTINE_ROOT:
                    self._quarantine_orphans(keys)
            except (DeckError, OSError) as e:
                self.report.errors.append(f"{prefix}: {e}")

    def _merged_orphans(self, prefix: str, keys: list[str]) -> None:
        """A merger folder: all of it when uncommitted, else the files its records do not name."""
        parsed = parse_merged_dir(prefix.partition("/")[2])
        if parsed is None:
            return
        m = self.manifests.merged.get(parsed[0])
        if m is not None and m.id in self.doomed:
            return  # deleted with its record by delete_checkpoints
        if m is None:
            problem = self.manifests.damaged_merged.get(parsed[0])
            if problem is not None:  # cannot read is unknown: a person decides
                self.report.kept.append((f"{prefix}/", f"commit record unreadable ({problem})"))
            elif f"{prefix}/{MANIFEST}" not in keys:
                self._orphan(prefix + "/", keys, "uncommitted merger folder")
            return
        refs = _referenced(self.storage, m)
        if refs is None:
            return
        stale = [k for k in keys if k not in refs]
        if stale:
            why = "partition records / attempt files no record references"
            self._orphan_files(prefix, stale, why)

    def _step_orphans(self, prefix: str, keys: list[str], step: int, latest_step: int) -> None:
        """A step folder's attempt folders that its committed record does not name, or all of
        them when the step is uncommitted and a later step is committed."""
        m = self.manifests.get(step)
        if step in self.manifests.damaged:
            # Cannot read is unknown: the folder may hold the only copy of a checkpoint.
            why = f"commit record unreadable ({self.manifests.damaged[step]}); repair or delete it"
            self.report.kept.append((f"{prefix}/", why))
            return
        attempts: dict[str, list[str]] = {}
        for k in keys:
            rest = k[len(prefix) + 1 :]
            if rest == MANIFEST or "/" not in rest:
                continue
            attempts.setdefault(rest.partition("/")[0], []).append(k)
        for aid, aks in sorted(attempts.items()):
            if m is not None and aid == m.id:
                continue  # the committed attempt (kept, or deleted with its record)
            if m is None and step >= latest_step:
                continue  # may be a checkpoint still being uploaded: keep it
            why = (
                "attempt folder no record references"
                if m is not None
                else "uncommitted checkpoint older than a committed later step"
            )
            self._orphan(f"{prefix}/{aid}/", aks, why)

    def _quarantine_orphans(self, keys: list[str]) -> None:
        """Quarantine records of checkpoints that are gone (or go in this run)."""
        for k in keys:
            qid = k.rpartition("/")[2].removesuffix(".json")
            if qid not in self.graph.nodes or qid in self.doomed:
                self.report.orphans.append((k, "quarantine record of a deleted checkpoint"))
                self.report.files += 1
                if not self.dry_run:
                    self.storage.delete(k)

    def finish(self) -> None:
        """Local stores: prune abandoned temp files and empty folders. Then drop the quarantine
        records of deleted checkpoints: the merger may rebuild the same id, and an old record
        must not outlive the checkpoint it was about."""
        if self.dry_run:
            return
        self.report.files += _prune_local(self.storage, "", self.policy.grace_s, self.now)
        for cid in self.doomed:
            if cid in self.manifests.quarantined:
                key = f"{QUARANTINE_ROOT}/{cid}.json"
                try:
                    self.storage.delete(key)
                except DeckError as e:  # recorded like the deletions of checkpoints
                    self.report.errors.append(f"{key}: {e}")

    def _orphan(self, prefix: str, keys: list[str], why: str) -> None:
        """Delete the orphan folder ``prefix`` (only ``keys``, the files listed) when every one
        of them is older than the grace period."""
        if not _old_enough(self.storage, keys, self.policy.grace_s, self.now):
            return
        self.report.orphans.append((prefix, why))
        self.report.files += len(keys)
        self.report.bytes += self.size(keys)
        if self.dry_run:
            return
        # Only the files we saw: a writer that started after the listing keeps its new files.
        failpoint("gc.orphan.before_delete")
        for k in keys:
            self.storage.delete(k)
            failpoint("gc.orphan.after_delete_file")
        _prune_local(self.storage, prefix, self.policy.grace_s, self.now)

    def _orphan_files(self, folder: str, keys: list[str], why: str) -> None:
        """Delete those of ``keys`` (stray files in a committed folder) older than the grace
        period."""
        old = [k for k in keys if _old_enough(self.storage, [k], self.policy.grace_s, self.now)]
        if not old:
            return
        self.report.orphans.append((f"{folder}/ ({len(old)} file(s))", why))
        self.report.files += len(old)
        self.report.bytes += self.size(old)
        if not self.dry_run:
            for k in old:
                self.storage.delete(k)


def _delete_checkpoint(storage: Storage, n: LineageNode) -> None:
    """Uncommit (delete ``manifest.json``), then delete the checkpoint's files."""
    man = f"{n.folder}/{MANIFEST}"
    if n.merged:
        storage.delete(man)
        failpoint("gc.checkpoint.after_uncommit")
        # Partition records first: a merger rebuilding this id must not trust stale ones.
        storage.delete_prefix(f"{n.folder}/parts/")
        storage.delete_prefix(f"{n.folder}/")
        return
    # A trainer step folder is shared by every save of that step: only delete the record if it
    # is still this checkpoint's (the trainer may have saved the step again meanwhile), and only
    # this checkpoint's own attempt folder.
    try:
        current = load_model(CheckpointManifest, get_bounded(storage, man), storage.describe(man))
    except NotFoundError:
        current = None
    if current is not None and current.id == n.id:
        storage.delete(man)
    failpoint("gc.checkpoint.after_uncommit")
    storage.delete_prefix(f"{n.folder}/{n.id}/")


def _prune_local(storage: Storage, prefix: str, grace_s: float, now: float) -> int:
    """Local stores: delete abandoned temp files (a crashed put's ``.tmp-*``, which ``list``
    never reports) and empty directories under ``prefix``, both only once unchanged for the
    grace period (a writer creates a directory just before writing into it)."""
    root = storage.local_path()
    if root is None:
        return 0
    parts = [p for p in prefix.split("/") if p]
    top = os.path.join(root, *parts)
    # os.walk lists the top folder through a link (it never follows links below it): a prefix
    # that resolves elsewhere holds a link, and nothing outside the root is touched.
    if os.path.realpath(top) != os.path.join(os.path.realpath(root), *parts):
        logger.warning("deck gc: %s resolves outside %s through a link; not pruned", top, root)
        return 0
    removed = 0
    for dirpath, _dirs, files in os.walk(top, topdown=False):
        for f in files:
            if not f.startswith(TEMP_PREFIX):
                continue
            path = os.path.join(dirpath, f)
            with contextlib.suppress(OSError):
                if grace_s <= 0 or now - os.stat(path).st_mtime >= grace_s:
                    os.unlink(path)
                    removed += 1
        if dirpath != root:
            with contextlib.suppress(OSError):
                if grace_s <= 0 or now - os.stat(dirpath).st_mtime >= grace_s:
                    os.rmdir(dirpath)  # only succeeds when empty
    return removed
