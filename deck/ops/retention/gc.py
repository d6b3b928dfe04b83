"""Garbage collection: apply a retention plan at a store (``deck gc``; the rules:
:mod:`deck.ops.retention`).

One run (:func:`collect_garbage`) lists the store and reads its commit records once, builds the
lineage graph once, asks the pure plan (:mod:`deck.ops.retention.plan`) what can go, checks the
checkpoints it is about to rely on, and deletes: checkpoints (``manifest.json`` first), orphans,
quarantine records of what is gone, and what interrupted writes left
(:meth:`deck.storage.Storage.prune_temps`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial

from deck.errors import CheckpointNotFoundError, DeckError, NotFoundError
from deck.failpoints import failpoint
from deck.format.commit_log import CATALOG_ROOT, LOG_ROOT, Hint, append_hints, record_key_kind
from deck.format.epochs import (
    EPOCH_ROOT,
    witness_body,
    witness_key,
    witnesses_in,
)
from deck.format.manifest import (
    MANIFEST,
    MERGED_ROOT,
    PARTS_DIR,
    QUARANTINE_ROOT,
    CheckpointManifest,
    QuarantineRecord,
    load_model,
    parse_merged_dir,
    parse_step_dir,
    steps_text,
)
from deck.ops.retention.clock import CLOCK_DIR, delete_stale_markers, read_store_clock
from deck.ops.retention.plan import (
    RetentionPlan,
    RetentionPolicy,
    grace_protected,
    plan_lineage,
    replaced_by_a_rollback,
    replacements,
    takeovers,
)
from deck.ops.retention.view import StoreView, commit_times, newest_view, whole_view
from deck.read.catalog import (
    ManifestSet,
    overlapped,
    read_rank_manifests,
    refresh_catalog,
    repair_catalog,
)
from deck.read.lineage import LineageNode, PathLink, build_graph, keep_chain, unrecorded_epoch
from deck.read.verify import check_files, verify_checkpoint
from deck.storage import Storage
from deck.storage.base import MAX_RECORD_BYTES, get_bounded

logger = logging.getLogger(__name__)

__all__ = ["GcReport", "collect_garbage", "file_age_s"]


@dataclass
class GcReport:
    """What :func:`collect_garbage` deleted (or would delete, with ``dry_run``)."""

    dry_run: bool
    # The lowest step whose folders the run looked at (None: the whole store)
    floor: int | None = None
    latest: int | None = None
    committed: int = 0  # trainer checkpoints committed at the start of the run
    retained_steps: list[int] = field(default_factory=list)
    deleted: list[tuple[str, str]] = field(default_factory=list)  # (folder, why)
    orphans: list[tuple[str, str]] = field(default_factory=list)  # (prefix, why)
    files: int = 0
    bytes: int = 0
    errors: list[str] = field(default_factory=list)
    # (folder, why): what the rules alone would delete, kept because something is damaged
    kept: list[tuple[str, str]] = field(default_factory=list)
    # (folder, why): what the rules would delete, kept because a writer was at work on it during
    # this run (a save, a merger commit); no damage, the next run decides
    busy: list[tuple[str, str]] = field(default_factory=list)
    # (folder, why): what lacks a chain above a run's floor: kept for a run over the whole store
    # to decide (a record it did not read may be what the chain needs)
    left: list[tuple[str, str]] = field(default_factory=list)
    # (folder, why): merger checkpoints uncommitted for the rules, whose files wait for the grace
    # period (a restore started before may be reading them: see GC_RETIRED)
    retired: list[tuple[str, str]] = field(default_factory=list)
    # Seconds until the checkpoints of the rules are deleted again, while a run's retirement is
    # younger than the grace period (None: none is)
    retire_wait_s: float | None = None
    # What the rules would delete but the grace period holds back (a later run deletes it)
    grace_held: int = 0  # checkpoints
    grace_held_orphans: int = 0  # orphan folders or stray files
    # This host's clock minus the store's, as measured by the run (None: not measured)
    clock_skew_s: float | None = None


def file_age_s(storage: Storage, key: str, now: float) -> float | None:
    """Seconds since ``key`` was last written, when the backend tells (local files, fsspec
    stores reporting a modification / creation time); None otherwise (the file is then kept)."""
    modified = storage.modified(key)
    return None if modified is None else now - modified


def _old_enough(times: Iterable[float | None], grace_s: float, now: float | None) -> bool:
    """Whether every one of a group's file ``times`` (the store's clock, like ``now``) is older
    than the grace period (unknown: no)."""
    if grace_s <= 0:
        return True
    return now is not None and all(t is not None and now - t >= grace_s for t in times)


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
    local_clock: Callable[[], float] = time.time,
    whole: bool = False,
) -> GcReport:
    """Apply ``policy`` at ``storage``: delete checkpoints no retained step needs, then orphans.

    Guarantees: every step retained now, and every checkpoint the lineage needed
    ``policy.grace_s`` seconds ago, stays restorable; nothing committed less than ``grace_s`` ago
    is deleted; a checkpoint's ``manifest.json`` goes before its files. Nothing is deleted
    because of what cannot be read: an unreadable commit record keeps its folder and what it
    may be needed for (:func:`~deck.ops.retention.plan.plan_lineage`), and a kept merger
    checkpoint that replaces something deleted is first checked intact
    (``policy.verify_replacements``), and so are, by their checksums, the trainer deltas that
    take over a deleted merger checkpoint's steps; else it and what it replaces stay;
    ``report.kept`` says
    what was kept for which damage, ``report.busy`` what was kept because a writer was at
    work on it during the run. A failed deletion, of a checkpoint or an orphan, is recorded
    in ``report.errors`` and the run goes on. Last, what interrupted writes left is pruned
    (:meth:`deck.storage.Storage.prune_temps`, with the grace period). Safe to run next to the
    trainer and merger workers, and to rerun after a crash. ``dry_run`` only reports.
    ``progress(folder)`` is called before each checkpoint is deleted.

    Time: every age is taken on the store's clock (:mod:`deck.ops.retention.clock`: the
    times the store gives its files and commit records, against a marker object the run writes
    and deletes, in a dry run too), never on this host's (``local_clock``) nor a writer's. A
    host whose clock is further than ``policy.max_clock_skew_s`` from the store's is refused
    with :class:`ClockSkewError` before anything is deleted. ``now`` (the store's time) skips
    the marker: for tests and tools that already know it. What the run deletes as no record's
    (an attempt or merger folder, stray files) is re-listed, and its step's or folder's
    record read again, right before it goes: a save or merger commit that landed during the
    run keeps it.

    Reach: where the store keeps a catalog with segments, the run plans from the folders of
    the newest steps only, down to the highest step at which that plan decides about each of
    them what a plan of every record decides (:mod:`deck.ops.retention.view`), so its cost
    follows the grace period and the newest fulls, not the history's length; what it leaves
    below that step (old orphans, a full that fell out of ``keep_last_fulls`` and no rule
    keeps, damage found there) waits for a run with ``whole`` (``deck gc --whole``), which
    lists the whole store, reads every commit record and repairs the catalog from them.
    ``report.floor`` says which one ran (None: the whole store).
    """
    policy = policy if policy is not None else RetentionPolicy()
    if not holds_a_store(storage):
        # A mistyped URI (a parent folder, another tool's): not even the clock marker is written
        # there, nor a temp file deleted that some other writer's put is still filling.
        return GcReport(dry_run=dry_run)
    skew = None
    if now is None:
        clock = read_store_clock(
            storage, max_skew_s=policy.max_clock_skew_s, local_clock=local_clock
        )
        now, skew = clock.now, clock.skew_s
    with warned_once(_READERS):
        report = _collect(storage, policy, dry_run=dry_run, now=now, progress=progress, whole=whole)
    report.clock_skew_s = None if skew is None else -skew
    return report


def holds_a_store(storage: Storage) -> bool:
    """Whether anything deck writes lies at the top of ``storage``: a catalog (one short
    listing), else a name of deck's in the top folder (listed only where no catalog is)."""
    if storage.list_dir(f"{CATALOG_ROOT}/"):
        return True
    tops = (MERGED_ROOT, QUARANTINE_ROOT, LOG_ROOT, EPOCH_ROOT)
    return any(
        name.rstrip("/") in tops or parse_step_dir(name.rstrip("/")) is not None
        for name in storage.list_dir("")
    )


# The loggers whose warnings (a step that is not restorable, a skipped merged checkpoint) a GC
# run would otherwise repeat once per moment of the grace period it replays.
_READERS = ("deck.read.lineage", "deck.read.catalog", "deck.ops.retention.plan")
# Put in a trainer checkpoint's attempt folder before its record goes when no step above it stays
# committed, or when a committed delta names it as its parent: a run stopped part way leaves a
# record-less attempt folder, which looks like a save still uploading (at or above the newest
# committed step) or like a lost record (a parent), both kept, unless it says GC was deleting it
# (an orphan then, like any other).
GC_DELETING = "gc-deleting"
# A merger checkpoint the rules delete but which is on the chain restores pick (so a restore
# may have started on it a moment ago, and one always may: the grace period alone would keep it
# for ever) is *retired*: this marker goes into its folder, then its record (readers pick other
# chains from then on); its files go as an orphan's once the marker is older than the grace
# period. The lineage a run replays lacks what was retired, so the moments before a retirement
# are not replayed as they were: while RETIRE_MARK (put before a run's first retirement and
# after each) is
# younger than the grace period, no run deletes or retires a checkpoint.
GC_RETIRED = "gc-retired"
RETIRE_MARK = f"{CLOCK_DIR}/{GC_RETIRED}"
_RETIRED_NOTE = b"deck gc retired merger checkpoints; their files go after the grace period\n"
# How far in the store's future (by the run's reading of the store's clock) a file's time may lie
# before the run takes it for a time copied from elsewhere, not one the store gave it
FUTURE_SLACK_S = 60.0
_QUARANTINE_NAME = re.compile(rf"{QUARANTINE_ROOT}/[0-9a-f]{{16}}\.json")


class _Once(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, int, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


@contextlib.contextmanager
def warned_once(names: tuple[str, ...]) -> Iterator[None]:
    """Inside the block, each distinct message of the loggers ``names`` is logged once."""
    once, loggers = _Once(), [logging.getLogger(n) for n in names]
    for lg in loggers:
        lg.addFilter(once)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(once)


def _collect(
    storage: Storage,
    policy: RetentionPolicy,
    *,
    dry_run: bool,
    now: float | None,
    progress: Callable[[str], None] | None,
    whole: bool,
) -> GcReport:
    view = None
    if not whole:
        cutoff = None
        if policy.grace_s > 0:  # (a store that tells no times: everything is in the period)
            cutoff = now - policy.grace_s if now is not None else -math.inf
        view = newest_view(
            storage,
            keep_last_fulls=policy.keep_last_fulls,
            keep_fulls_every=policy.keep_fulls_every,
            cutoff=cutoff,
            now=now,
        )
    gc = _Collector(
        storage,
        policy,
        view if view is not None else whole_view(storage),
        dry_run=dry_run,
        now=now,
        progress=progress,
    )
    gc.delete_checkpoints()
    gc.collect_orphans()
    gc.finish()
    # Only a run that read every record can tell the catalog what it lacks; a run of the
    # newest steps leaves new catalogs to the merger's passes (writing one here would read every
    # record through the catalog), its deletions logged for readers
    whole_run = not dry_run and gc.floor is None
    if whole_run and repair_catalog(storage, gc.manifests, gc.keys, gc.pending_commits()) is None:
        refresh_catalog(storage)
    if whole_run:
        _witness_newest_epoch(storage, gc.manifests, gc.keys)
    report = gc.report
    # One INFO line per run that found something (`deck merge --follow --gc` runs it after
    # every poll); a run with nothing to do is DEBUG.
    logger.log(
        logging.INFO
        if report.deleted or report.orphans or report.kept or report.busy or report.retired
        else logging.DEBUG,
        "deck gc at %s: %s %d checkpoint(s) and %d orphan folder(s), %.1f MiB%s",
        storage.uri,
        "would delete" if dry_run else "deleted",
        len(report.deleted),
        len(report.orphans),
        report.bytes / 2**20,
        f"; retired {len(report.retired)} merger checkpoint(s) restores read lately (their "
        f"files go, and no checkpoint is deleted, for the next {policy.grace_s:g} s)"
        if report.retired
        else "",
    )
    return report


def _witness_newest_epoch(storage: Storage, manifests: ManifestSet, keys: list[str]) -> None:
    """Put the witness of the newest epoch of ``manifests`` (every record, read after the
    listing ``keys``) where no witness that new is listed: a store a deck before witnesses
    wrote (deck.format.epochs), whose restores read every record until one is there. A failure
    is logged, never raised (it costs readers time only)."""
    newest = max((m.epoch for m in manifests.values()), default=None)
    witnessed = witnesses_in(keys)
    if newest is None or (witnessed and witnessed[-1] >= newest):
        return
    first = min(m.step for m in manifests.values() if m.epoch == newest)
    try:
        storage.put(witness_key(newest), witness_body(newest, first))
    except (DeckError, OSError) as e:
        logger.warning("could not put the epoch witness at %s: %s", storage.uri, e)


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
    """One GC run at a store: the listing, the lineage graph, the retention plan and the
    protected ids are taken once, at the start (ages on the store's clock: ``now`` and the
    listing's times; None when the store tells none); each step appends what it deleted (or
    would delete) to :attr:`report`."""

    def __init__(
        self,
        storage: Storage,
        policy: RetentionPolicy,
        view: StoreView,
        *,
        dry_run: bool,
        now: float | None,
        progress: Callable[[str], None] | None,
    ) -> None:
        self.storage = storage
        self.policy = policy
        self.dry_run = dry_run
        self.now = now
        self.progress = progress
        self.floor = view.floor
        self.times = dict(view.listing)
        keys = [k for k, _ in view.listing]
        self.keys = keys
        self.manifests = view.manifests
        self.graph = build_graph(self.manifests)  # the one graph of the run, never changed
        self._broken: list[int] | None = None  # (see _broken_steps)
        # checkpoint id -> the committed trainer checkpoints naming it as their parent
        self.children: dict[str, list[CheckpointManifest]] = {}
        for m in self.manifests.values():
            if m.parent_id is not None:
                self.children.setdefault(m.parent_id, []).append(m)
        self.by_prefix = _by_prefix(keys)
        self.tombstones = _tombstones(keys)
        self.committed_at = commit_times(self.graph, self.times)
        self.protected = grace_protected(self.graph, policy, now, self.committed_at)
        self.retire_wait = self._retire_wait()
        # id -> why, for every checkpoint this run takes out of the lineage: deletes, or retires
        # (those of them the grace period protects: their files stay, see GC_RETIRED)
        plan, self.doomed = self._checked_plan(set(keys))
        self.retiring = {cid for cid in self.doomed if cid in self.protected}
        self._keep_staying_chains()
        self.report = GcReport(
            floor=view.floor,
            dry_run=dry_run,
            latest=plan.latest,
            retained_steps=plan.retained_steps,
            committed=len(self.manifests),
        )
        self.report.kept = [
            (self._label(i), why) for i, why in sorted(plan.held.items()) if i not in plan.unread
        ]
        self.report.left = [(self._label(i), plan.held[i]) for i in sorted(plan.unread)]
        self.report.retire_wait_s = self.retire_wait
        self.report.grace_held = sum(
            1
            for cid in plan.delete
            if cid not in plan.keep
            and cid not in self.doomed
            and (cid in self.protected or self.retire_wait is not None)
        )

    def _keep_staying_chains(self) -> None:
        """Retire nothing that a trainer step staying committed after this run (one the grace
        period holds) restores only through: it waits for the run that deletes those steps (a
        break-it finding: retiring it left them without a chain, `broken` in ls, and a delta
        among them whose parent this run deleted kept as a lost record's by every later run)."""
        if not self.retiring:
            return
        gone = frozenset(self.doomed)
        staying = [s for s, n in self.graph.trainer.items() if n.id not in gone]
        restorable = set(self.graph.chain_ways(staying, frozenset()))
        lost = restorable - set(self.graph.chain_ways(restorable, gone))
        needed: set[str] = set()
        walked: set[PathLink] = set()
        for way in self.graph.chain_ways(lost, gone - self.retiring).values():
            keep_chain(way, needed, walked)
        for cid in needed & self.retiring:
            del self.doomed[cid]
            self.retiring.discard(cid)

    def _retire_wait(self) -> float | None:
        """Seconds until a run's retirement (RETIRE_MARK) is older than the grace period, or
        None when none is younger (or the grace period is 0)."""
        if self.policy.grace_s <= 0 or RETIRE_MARK not in self.times:
            return None
        stamp = self.times[RETIRE_MARK]
        if stamp is None or self.now is None:
            return self.policy.grace_s
        if stamp - self.now > FUTURE_SLACK_S:
            # Dated in the store's future (copied with its times from a host whose clock was
            # ahead, or the store's clock stepped back): a break-it finding, it held every
            # deletion for years. Written again now, it holds them one grace period from here,
            # which is at least what the retirement it marks needs.
            logger.warning(
                "%s is dated %.0f s in the store's future: %s",
                self.storage.describe(RETIRE_MARK),
                stamp - self.now,
                "a run without --dry-run writes it again, so its grace period starts then"
                if self.dry_run
                else "written again now; its grace period starts from this run",
            )
            if not self.dry_run:
                self.storage.put(RETIRE_MARK, _RETIRED_NOTE)
            return self.policy.grace_s
        left = self.policy.grace_s - (self.now - stamp)
        return left if left > 0 else None

    def _doomed(self, plan: RetentionPlan) -> dict[str, str]:
        """id -> why, for every checkpoint of ``plan.delete`` that the grace period allows to
        go, or to retire (a merger checkpoint it protects that was not committed within it)."""
        if self.retire_wait is not None:
            return {}
        return {
            cid: why
            for cid, why in plan.delete.items()
            if cid not in plan.keep
            and (
                cid not in self.protected or (self.graph.nodes[cid].merged and not self._young(cid))
            )
        }

    def _checked_plan(self, listing: set[str]) -> tuple[RetentionPlan, dict[str, str]]:
        """The retention plan and what it deletes now, once every kept merger checkpoint that
        replaces something deleted is found intact (:meth:`_damage`); a damaged or unreadable
        one is planned around and kept, like everything it replaces (``held`` says why). What
        cannot be trusted only ever keeps more: a checkpoint is deleted only if the first plan
        deletes it too (planning around one, e.g. a delta that could not be read, may move the
        latest step and the window and would otherwise delete what the first plan kept)."""
        plan = plan_lineage(
            self.graph,
            self.policy,
            damaged=self.manifests.damaged,
            unread_below=self.floor,
            deleted=self.tombstones,
        )
        doomed = first = self._doomed(plan)
        retained = set(plan.retained_steps)  # every plan's chains stay: see above
        bad: dict[str, str] = {}
        checked: set[str] = set()
        while doomed:
            found = {}
            whole = takeovers(self.graph, plan, doomed) - checked
            for cid in sorted((replacements(self.graph, plan.keep, doomed) | whole) - checked):
                checked.add(cid)
                m = self.graph.nodes[cid].manifest
                problems = self._damage(m, listing, checksums=cid in whole)
                if problems:
                    found[cid] = problems[0]
            if not found:
                break
            bad.update(found)
            plan = plan_lineage(
                self.graph,
                self.policy,
                damaged=self.manifests.damaged,
                unusable=bad,
                unread_below=self.floor,
                deleted=self.tombstones,
            )
            doomed = {cid: why for cid, why in self._doomed(plan).items() if cid in first}
            retained |= set(plan.retained_steps)
        if bad:
            names = "; ".join(f"{self.graph.nodes[i].folder}: {p}" for i, p in sorted(bad.items()))
            for cid in sorted(set(first) - set(doomed) - set(bad)):
                plan.held.setdefault(
                    cid, f"what would replace it is damaged or unreadable ({names})"
                )
            # The first plan's steps whose every chain needs what was found bad are not retained
            retained = {s for s in retained if self._has_chain(s, bad)}
        plan.retained_steps = sorted(retained)
        return plan, doomed

    def _has_chain(self, step: int, bad: Mapping[str, str]) -> bool:
        try:
            self.graph.chain(step, exclude=bad)
        except CheckpointNotFoundError:
            return False
        return True

    def _damage(
        self, m: CheckpointManifest, listing: set[str], *, checksums: bool = False
    ) -> list[str]:
        """Problems of checkpoint ``m``'s files: sizes (or checksums with ``checksums`` or
        ``verify_replacements``)."""
        if checksums or self.policy.verify_replacements:
            # What storage can damage (sizes, checksums, layouts), not decoded: deck gc runs
            # without torch (whose import would be most of a run's time)
            report = verify_checkpoint(self.storage, m, decode=False)
            # What cannot be read holds too, said as such (a read error is not damage)
            return report.problems + [f"could not be read: {p}" for p in report.unreadable]
        return check_files(self.storage, m, listing)

    def _label(self, cid: str) -> str:
        """How the report names checkpoint ``cid``: its folder (a trainer one: with its id)."""
        n = self.graph.nodes[cid]
        return n.folder if n.merged else f"{n.folder} (id {cid})"

    def size(self, keys: list[str]) -> int:
        """Bytes of ``keys`` (files that vanished or cannot be sized count 0)."""
        total = 0
        # One request per file: overlapped on a remote store (each pays a round trip)
        for _, got in overlapped(self.storage, self.storage.size, keys):
            if isinstance(got, int):
                total += got
            elif not isinstance(got, (DeckError, OSError)):
                raise got
        return total

    def delete_checkpoints(self) -> None:
        """Delete every checkpoint no retained step needs, oldest step first: its
        ``manifest.json``, then its files. A failure is recorded in the report, not raised; a
        trainer checkpoint whose step a trainer began saving again during this run is kept
        (:func:`_delete_checkpoint`)."""
        if not self.dry_run and self.doomed:
            try:  # one log entry for the whole run's records, before any goes
                append_hints(self.storage, self._doomed_hints())
            except DeckError as e:
                self.report.errors.append(f"{e} (nothing deleted)")
                return
        # Newest first (at a step, the trainer's before the merger's): a run that stops part
        # way (killed, a store error) leaves only older checkpoints of those it meant to
        # delete, each still restorable from what is older still; oldest first left deltas
        # whose parent was gone, which ls and verify reported as broken steps
        # (Retirements last: until what goes now is gone, a restore must not pick a chain
        # through it for want of what is retired)
        order = sorted(
            self.doomed, key=lambda c: (c in self.retiring, _newest_first(self.graph.nodes[c]))
        )
        # The newest step that stays committed: a checkpoint above it, once uncommitted, would
        # look like a save in progress (see GC_DELETING)
        head = max((m.step for m in self.manifests.values() if m.id not in self.doomed), default=-1)
        spared: dict[str, str] = {}  # what a checkpoint kept as busy restores through
        for cid in order:
            why = self.doomed[cid]
            n = self.graph.nodes[cid]
            if cid in spared:
                self.report.busy.append((self._label(cid), spared[cid]))
                continue
            if cid in self.retiring:
                self._retire(n, why)
                continue
            listed = self.by_prefix.get(n.folder, [])
            if n.merged:
                files = listed
            else:
                prefix = f"{n.folder}/{cid}/"
                files = [k for k in listed if k.startswith(prefix)]
                files.append(f"{n.folder}/{MANIFEST}")
            size = self.size(files)
            if self.dry_run and self.progress:
                self.progress(n.folder)
            if not self.dry_run:
                try:
                    failpoint("gc.checkpoint.before_delete")
                    kept = _delete_checkpoint(
                        self.storage,
                        n,
                        _attempts(n.folder, listed),
                        self.progress,
                        mark=n.step >= head,
                        # (a parent of a delta that stays: once uncommitted, it would look
                        # like a lost record, and that delta, broken for good if what else
                        # it restored through goes (another GC run retiring it, a break-it
                        # finding), would be kept as damage for ever)
                        tombstone=bool(self._staying_children(cid)),
                    )
                    failpoint("gc.checkpoint.after_delete")
                except DeckError as e:
                    self.report.errors.append(f"{n.folder}: {e}")
                    kept = None
                if kept:
                    self.report.busy.append((self._label(cid), kept))
                    # (a break-it finding: an S3 folder marker in a step folder read as a save
                    # that began, and the run kept that step but deleted its parent, leaving it
                    # broken for good)
                    spared.update(self._chain_of(n))
                    continue
            self.report.deleted.append((self._label(cid), why))
            self.report.files += len(files)
            self.report.bytes += size

    def _chain_of(self, n: LineageNode) -> dict[str, str]:
        """What trainer checkpoint ``n``, kept as busy, restores through, with why it stays."""
        try:
            chain = self.graph.chain(n.step)
        except DeckError:
            return {}
        why = f"on the chain of step {n.step}, which a save that began keeps; the next run decides"
        return {m.id: why for m in chain if m.id != n.id}

    def _retire(self, n: LineageNode, why: str) -> None:
        """Retire merger checkpoint ``n`` (see GC_RETIRED): its marker, then its record and
        partition records (a merger rebuilding the id must not trust those); its files stay."""
        if self.progress:
            self.progress(n.folder)
        if not self.dry_run:
            try:
                self.storage.put(f"{n.folder}/{GC_RETIRED}", _RETIRED_NOTE)
                if not self.report.retired:  # (later ones: the last one's put is as recent)
                    self.storage.put(RETIRE_MARK, _RETIRED_NOTE)
                failpoint("gc.retire.before_uncommit")
                self.storage.delete(f"{n.folder}/{MANIFEST}")
                failpoint("gc.checkpoint.after_uncommit")
                self.storage.delete_prefix(f"{n.folder}/{PARTS_DIR}/")
                self.storage.put(RETIRE_MARK, _RETIRED_NOTE)
            except DeckError as e:
                self.report.errors.append(f"{n.folder}: {e}")
                return
        self.report.retired.append(
            (
                self._label(n.id),
                f"{why}; restores read it lately: its files wait for the grace period",
            )
        )

    def pending_commits(self) -> list[Hint]:
        """The commits the listing shows begun and not committed: attempt folders of a step
        whose record names another id (or none), merger folders without a record (but those
        GC retired)."""
        hints = []
        for prefix, keys in self.by_prefix.items():
            if prefix.startswith(f"{MERGED_ROOT}/"):
                parsed = parse_merged_dir(prefix.partition("/")[2])
                record = f"{prefix}/{MANIFEST}"
                retired = f"{prefix}/{GC_RETIRED}" in keys  # (no commit begun)
                if parsed is not None and record not in keys and not retired:
                    hints.append(Hint(key=record, op="commit", id=parsed[0]))
            elif (step := parse_step_dir(prefix)) is not None:
                m = self.manifests.get(step)
                for attempt in _attempts(prefix, keys):
                    aid = attempt.rstrip("/")
                    if _hint_id(aid) == aid and (m is None or m.id != aid):
                        hints.append(Hint(key=f"{prefix}/{MANIFEST}", op="commit", id=aid))
        return hints

    def _doomed_hints(self) -> list[Hint]:
        """What readers through a catalog must read again after the deletions: the record of
        every checkpoint that goes, and its quarantine record."""
        hints = []
        for cid in self.doomed:
            key = f"{self.graph.nodes[cid].folder}/{MANIFEST}"
            hints.append(Hint(key=key, op="delete", id=cid))
            if cid in self.manifests.quarantined:
                hints.append(Hint(key=f"{QUARANTINE_ROOT}/{cid}.json", op="delete", id=cid))
        return hints

    def collect_orphans(self) -> None:
        """Delete files no committed record references, each group only once every file in it
        is older than the grace period (its writer may still be running). A failure is
        recorded in the report, not raised, and the other groups go on."""
        unrecorded = self._unrecorded_from()
        latest_step = min(max((m.step for m in self.manifests.values()), default=-1), unrecorded)
        for prefix, keys in sorted(self.by_prefix.items()):
            try:
                if prefix.startswith(f"{MERGED_ROOT}/"):
                    self._merged_orphans(prefix, keys)
                elif (step := parse_step_dir(prefix)) is not None:
                    self._step_orphans(prefix, keys, step, latest_step, unrecorded)
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
        marker = f"{prefix}/{GC_RETIRED}"
        if m is None:
            problem = self.manifests.damaged_merged.get(parsed[0])
            if problem is not None:  # cannot read is unknown: a person decides
                self.report.kept.append((f"{prefix}/", f"commit record unreadable ({problem})"))
            elif f"{prefix}/{MANIFEST}" not in keys:
                record = f"{prefix}/{MANIFEST}"
                broken = [s for s in self._broken_steps() if s >= parsed[1]]
                if broken and marker not in keys:
                    # (a break-it finding: a merger full whose record was lost, the only copy of
                    # the steps below it once GC had deleted them, went as "uncommitted")
                    self.report.kept.append(
                        (
                            f"{prefix}/",
                            f"no commit record ({record}), while committed step(s) "
                            f"{steps_text(broken)} cannot be restored: if it was committed, its "
                            "record was lost; put it back from a backup, or delete the folder "
                            "by hand",
                        )
                    )
                    return
                self._orphan(
                    prefix + "/",
                    keys,
                    "retired by GC" if marker in keys else "uncommitted merger folder",
                    lambda: "committed during this run" if self.storage.exists(record) else None,
                    Hint(key=record, op="abandon", id=parsed[0]),
                )
            return
        refs = _referenced(self.storage, m)
        if refs is None:
            return
        stale = [k for k in keys if k not in refs]
        if marker in keys and not _old_enough(
            [self.times.get(marker)], self.policy.grace_s, self.now
        ):
            # Committed again since GC retired it (a rollback made the merger rebuild the id):
            # the retired build's files are what restores begun before may be reading (a
            # break-it finding deleted them as strays, by their own old times)
            self.report.grace_held_orphans += bool(stale)
            return
        if stale:
            why = "partition records / attempt files no record references"
            self._orphan_files(prefix, stale, why, m)

    def _step_orphans(
        self, prefix: str, keys: list[str], step: int, latest_step: float, unrecorded: float
    ) -> None:
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
            marker = f"{prefix}/{aid}/{GC_DELETING}"
            deleting = marker in aks
            staying = self._staying_children(aid)
            if m is None and staying and deleting:
                # GC's tombstone of a parent it deleted (what else stays of it: a run stopped
                # part way)
                if left := [k for k in aks if k != marker]:
                    self._orphan(
                        f"{prefix}/{aid}/",
                        left,
                        "a checkpoint a GC run stopped part way was deleting",
                        partial(self._names, prefix, aid),
                        Hint(key=f"{prefix}/{MANIFEST}", op="abandon", id=_hint_id(aid)),
                        aged=[],
                    )
                continue
            if m is None and staying and not deleting:
                # A committed delta that stays builds on it: its record is lost, not never
                # written (a trainer commits a delta after its parent; GC marks what it
                # deletes under a record that stays)
                self.report.kept.append(
                    (
                        f"{prefix}/{aid}/",
                        f"the parent of committed step {min(staying)}, but its commit record "
                        f"{prefix}/{MANIFEST} is missing (or not a regular file): restore it from a backup (or delete "
                        "the steps built on it by hand)",
                    )
                )
                continue
            if (
                m is not None
                and staying
                and not deleting
                and not replaced_by_a_rollback(
                    m.epoch, [c.epoch for c in self.children[aid] if c.id not in self.doomed]
                )
            ):
                self.report.kept.append(
                    (
                        f"{prefix}/{aid}/",
                        f"the parent of committed step {min(staying)}, but its commit record "
                        f"{prefix}/{MANIFEST} names checkpoint {m.id} of epoch {m.epoch}, no "
                        "newer than what builds on this one (not a rollback's save: another "
                        "job's record, or damage): put its own record back from a backup",
                    )
                )
                continue
            if m is None and step >= latest_step and not deleting:
                continue  # may be a checkpoint still being uploaded: keep it
            if m is not None and step >= unrecorded and not deleting:
                # A save of the epoch no record holds yet, over an older timeline's record:
                # its restart commits it from the spool, or its record was lost (a break-it
                # finding: a rollback's first save, killed before its record, was deleted as
                # an attempt no record references, and the restart refused the latest)
                continue
            if m is not None and not deleting and self._young(m.id):
                # The step was saved again lately (a rollback's newer timeline): a restore
                # started before may be reading the attempt its record replaced
                self.report.grace_held_orphans += 1
                continue
            why = (
                "a checkpoint a GC run stopped part way was deleting"
                if deleting
                else "attempt folder no record references"
                if m is not None
                else "uncommitted checkpoint older than a committed later step"
            )
            abandon = Hint(key=f"{prefix}/{MANIFEST}", op="abandon", id=_hint_id(aid))
            self._orphan(
                f"{prefix}/{aid}/",
                aks,
                why,
                partial(self._names, prefix, aid),
                abandon,
                # (GC's own marker is as young as the run that stopped: what it marks was
                # doomed past the grace period then)
                aged=[k for k in aks if not k.endswith(f"/{GC_DELETING}")] if deleting else aks,
            )

    def _unrecorded_from(self) -> float:
        """Where the newest epoch witnessed began, when no commit record of it is there (its
        first save crashed before its record, or the record was lost: uncommitted attempts
        from there on are kept, as saves that may still be committing); else no bound. A
        break-it finding: a rollback's first full whose record was lost was deleted as "older
        than a committed later step", a step of the timeline the rollback had left."""
        witnessed = witnesses_in(self.keys)
        try:
            begun = unrecorded_epoch(
                self.storage, witnessed[-1] if witnessed else None, self.manifests.values()
            )
        except DeckError as e:  # (a witness that cannot be read now: every attempt is kept)
            self.report.errors.append(f"{e} (uncommitted attempts kept)")
            return 0

        if begun is None:
            return float("inf")
        return 0 if begun[1] is None else begun[1]  # (unknown: every attempt is kept)

    def _young(self, cid: str) -> bool:
        """Whether checkpoint ``cid`` was committed within the grace period (or when is not
        known)."""
        grace = self.policy.grace_s
        return grace > 0 and not _old_enough([self.committed_at.get(cid)], grace, self.now)

    def _broken_steps(self) -> list[int]:
        """The committed trainer steps no rollback left that cannot be restored (quarantine
        marks aside): damage, for which no folder that may hold a lost record goes."""
        if self._broken is None:
            self._broken = sorted(self.graph.unmarked().unrestorable())
        return self._broken

    def _staying_children(self, cid: str) -> list[int]:
        """The steps of the committed trainer deltas naming ``cid`` as their parent that this
        run does not delete."""
        return [c.step for c in self.children.get(cid, ()) if c.id not in self.doomed]

    def _names(self, folder: str, aid: str) -> str | None:
        """Why attempt ``aid`` of step folder ``folder`` is no orphan any more: the step's
        record, read again now, names it (or cannot be read); else None."""
        record = f"{folder}/{MANIFEST}"
        try:
            current = self._record(record)
        except DeckError as e:
            return f"its step's commit record cannot be read now ({e})"
        if current is not None and current.id == aid:
            return "committed during this run"
        return None

    def _record(self, key: str) -> CheckpointManifest | None:
        """The commit record at ``key`` as it is now (None: there is none)."""
        data = self.storage.get_or_none(key, MAX_RECORD_BYTES)
        if data is None:
            return None
        return load_model(CheckpointManifest, data, self.storage.describe(key))

    def _quarantine_orphans(self, keys: list[str]) -> None:
        """Quarantine records of checkpoints that are gone (or go in this run)."""
        for k in keys:
            if not k.startswith(f"{QUARANTINE_ROOT}/"):
                continue  # an object named like the folder, beside it: not in deck's folder
            qid = k.rpartition("/")[2].removesuffix(".json")
            if not _QUARANTINE_NAME.fullmatch(k):
                # (quarantine/ is deck's: a file there that no quarantine could have written)
                why = "not a quarantine record (a stray file)"
            elif qid not in self.graph.nodes or qid in self.doomed:
                kept = self._quarantines_another(k, qid)
                if kept is not None:
                    self.report.kept.append((k, kept))
                    continue
                why = "quarantine record of a deleted checkpoint"
            else:
                continue
            self.report.orphans.append((k, why))
            self.report.files += 1
            if not self.dry_run:
                if record_key_kind(k) is not None:  # (a stray file there is no record)
                    append_hints(self.storage, [Hint(key=k, op="delete", id=_hint_id(qid))])
                self.storage.delete(k)

    def _quarantines_another(self, key: str, named: str) -> str | None:
        """Why the quarantine record ``key``, named for a checkpoint that is gone, is kept: it
        cannot be read, or it quarantines another checkpoint, which stays (readers go by what
        a record says: a break-it finding, GC deleted one that restores still honoured, "of a
        deleted checkpoint"). None: it is that checkpoint's, or one that is gone too."""
        try:
            data = self.storage.get_or_none(key, MAX_RECORD_BYTES)
            q = None if data is None else load_model(QuarantineRecord, data, key)
        except DeckError as e:
            return f"quarantine record that cannot be read ({e}); repair or delete it"
        if q is None or q.id == named or q.id not in self.graph.nodes or q.id in self.doomed:
            return None
        return (
            f"quarantines checkpoint {q.id} ({q.folder}), which stays, though its name says "
            f"{named}: restores honour it; rename it to {QUARANTINE_ROOT}/{q.id}.json, or "
            "delete it to lift that quarantine"
        )

    def finish(self) -> None:
        """Prune what interrupted writes left in the whole store (:meth:`_prune`). Then drop the
        quarantine records of deleted checkpoints: the merger may rebuild the same id, and an old record
        must not outlive the checkpoint it was about."""
        if self.dry_run:
            return
        if self.now is not None:
            delete_stale_markers(
                self.storage,
                # (the retire mark: put again by this run maybe, and harmless once old)
                [(k, self.times[k]) for k in self.by_prefix.get(CLOCK_DIR, []) if k != RETIRE_MARK],
                self.now,
                max(self.policy.grace_s, 3600.0),
            )
        if self.floor is None:
            self.report.files += len(self._prune(""))
        else:  # the folders it looked at
            for prefix in sorted(self.by_prefix):
                if prefix.startswith(f"{MERGED_ROOT}/") or parse_step_dir(prefix) is not None:
                    self.report.files += len(self._prune(f"{prefix}/"))
        for cid in self.doomed:  # (announced in the log with the checkpoints)
            if cid in self.manifests.quarantined:
                key = f"{QUARANTINE_ROOT}/{cid}.json"
                try:
                    self.storage.delete(key)
                except DeckError as e:  # recorded like the deletions of checkpoints
                    self.report.errors.append(f"{key}: {e}")

    def _prune(self, prefix: str) -> list[str]:
        """The store's :meth:`~deck.storage.Storage.prune_temps` under the folder ``prefix``
        with the grace period: temp files of crashed puts and empty folders, each only once
        unchanged that long (a writer creates a folder just before writing into it). Nothing
        when the store tells no times (ages unknown)."""
        if self.now is None and self.policy.grace_s > 0:
            return []
        return self.storage.prune_temps(prefix, self.policy.grace_s, now=self.now)

    def _still_orphans(
        self, prefix: str, keys: list[str], claimed: Callable[[], str | None]
    ) -> str | None:
        """Why the orphan files ``keys`` under ``prefix`` must stay after all, asked right before
        they go (the plan is a listing old): the folder listed again differs (a writer is at
        work in it), or ``claimed()`` -- the record read again -- names it now."""
        fresh = self.storage.list_modified(prefix)
        if {k for k, _ in fresh} != set(keys) or any(self.times.get(k) != t for k, t in fresh):
            return "written to during this run"
        return claimed()

    def _orphan(
        self,
        prefix: str,
        keys: list[str],
        why: str,
        claimed: Callable[[], str | None],
        abandon: Hint,
        aged: list[str] | None = None,
    ) -> None:
        """Delete the orphan folder ``prefix`` (only ``keys``, the files listed) when every one
        of them (of ``aged``, when given) is older than the grace period and it is still no
        record's (``claimed``: see :meth:`_still_orphans`)."""
        ages = keys if aged is None else aged
        if not _old_enough((self.times.get(k) for k in ages), self.policy.grace_s, self.now):
            self.report.grace_held_orphans += 1
            return
        kept = self._still_orphans(prefix, keys, claimed)
        if kept is not None:
            self.report.busy.append((prefix, kept))
            return
        self.report.orphans.append((prefix, why))
        self.report.files += len(keys)
        self.report.bytes += self.size(keys)
        if self.dry_run:
            return
        # Only the files we saw: a writer that started after the listing keeps its new files.
        # Readers through a catalog stop waiting for the commit these files were for.
        append_hints(self.storage, [abandon])
        failpoint("gc.orphan.before_delete")
        # A merger folder's partition records go first, then its record is looked for once
        # more: a merger pass resuming the item from them (reusing their chunks, which may be
        # as old as they are) has either committed by then (the rest stays) or finds one gone
        # right before it commits (deck.merge.build: it builds the item again, in files this
        # run did not list). Deleting everything it listed, GC deleted the chunks of an item
        # committed meanwhile.
        parts = [k for k in keys if f"/{PARTS_DIR}/" in k]
        for k in [*parts, *[k for k in keys if f"/{PARTS_DIR}/" not in k]]:
            self.storage.delete(k)
            failpoint("gc.orphan.after_delete_file")
            if parts and k == parts[-1] and (kept := claimed()) is not None:
                self.report.busy.append((prefix, kept))
                return
        # The folders its deletions emptied go now, fresh as the deletions made them: no writer
        # fills an attempt folder no record references once all its files are that old (a new
        # file a writer put there since the listing keeps its folder: only empty ones go).
        self.storage.prune_temps(
            prefix, self.policy.grace_s, now=self.now, folders_older_than_s=0.0
        )

    def _orphan_files(self, folder: str, keys: list[str], why: str, m: CheckpointManifest) -> None:
        """Delete those of ``keys`` (stray files in the committed folder of ``m``) older than
        the grace period, unless the folder's record changed since the plan read it (a merger
        committed it again: its new files are no strays)."""
        old = [k for k in keys if _old_enough([self.times.get(k)], self.policy.grace_s, self.now)]
        self.report.grace_held_orphans += len(old) < len(keys)
        if not old:
            return
        try:
            current = self._record(f"{folder}/{MANIFEST}")
        except DeckError as e:
            self.report.kept.append((f"{folder}/", f"its commit record cannot be read now ({e})"))
            return
        if current != m:
            self.report.busy.append((f"{folder}/", "committed again during this run"))
            return
        self.report.orphans.append((f"{folder}/ ({len(old)} file(s))", why))
        self.report.files += len(old)
        self.report.bytes += self.size(old)
        if not self.dry_run:
            for k in old:
                self.storage.delete(k)


def _hint_id(name: str) -> str:
    """A log hint's id for a file named ``name``: its checkpoint id, or a placeholder when the
    name holds none (a stray file: any id makes readers read the key again)."""
    return name if re.fullmatch(r"[0-9a-f]{16}", name) else "0" * 16


def _attempts(folder: str, keys: list[str]) -> set[str]:
    """The attempt folders (``<id>/``) among the listed ``keys`` of step folder ``folder``."""
    return {k[len(folder) + 1 :].partition("/")[0] + "/" for k in keys if k.count("/") >= 2}


def _tombstones(keys: Iterable[str]) -> frozenset[str]:
    """The ids of the trainer checkpoints whose attempt folders among ``keys`` hold
    :data:`GC_DELETING`: deleted by GC (or being deleted by a run that stopped)."""
    out = set()
    for k in keys:
        folder, _, rest = k.partition("/")
        aid, _, name = rest.partition("/")
        if name == GC_DELETING and parse_step_dir(folder) is not None:
            out.add(aid)
    return frozenset(out)


def _newest_first(n: LineageNode) -> tuple[int, bool, int]:
    return (-n.step, n.merged, -n.layer)


def _delete_checkpoint(
    storage: Storage,
    n: LineageNode,
    attempts: set[str],
    progress: Callable[[str], None] | None,
    *,
    mark: bool = False,
    tombstone: bool = False,
) -> str | None:
    """Uncommit (delete ``manifest.json``), then delete the checkpoint's files; returns why it
    kept the checkpoint instead, or None. ``progress(folder)`` is called once it is decided,
    before anything is deleted (a break-it finding: a cron log of stderr said "deleting" a step
    the run then kept). ``mark``: a trainer checkpoint's attempt folder first gets
    :data:`GC_DELETING` (no step above it stays committed); ``tombstone``: and keeps it
    (committed deltas that stay name it as their parent).

    A trainer step folder is shared by every save of that step (a trainer that rolled back saves
    it again), and no store deletes conditionally, so the record is re-checked and kept: the
    folder is listed again *before* the record is read, and a save that began since GC listed
    (an attempt folder not in ``attempts``: a trainer writes its parts before their record) keeps
    this checkpoint whole until the next run; a record that names another checkpoint already is
    left alone. The record is then deleted only while it holds the bytes read
    (:meth:`~deck.storage.Storage.delete_if`): a save committed after that read keeps its
    record. Where that delete is not atomic (object stores) what remains is a save that
    commits between the read and the delete, one request apart."""
    man = f"{n.folder}/{MANIFEST}"
    if n.merged:
        if progress:
            progress(n.folder)
        storage.delete(man)
        failpoint("gc.checkpoint.after_uncommit")
        # Partition records first: a merger rebuilding this id must not trust stale ones.
        storage.delete_prefix(f"{n.folder}/parts/")
        storage.delete_prefix(f"{n.folder}/")
        return None
    began = sorted({a for a in storage.list_dir(f"{n.folder}/") if a.endswith("/")} - attempts)
    try:
        raw = get_bounded(storage, man)
        current = load_model(CheckpointManifest, raw, storage.describe(man))
    except NotFoundError:
        current = None
    ours = current is not None and current.id == n.id
    if ours and began:
        return (
            f"its step folder holds attempt folder(s) {', '.join(began)} this run had not "
            f"listed (a save of step {n.step} may have begun, or one left them empty); the next "
            "run decides"
        )
    if progress:
        progress(n.folder)
    if ours:
        if mark or tombstone:
            storage.put(f"{n.folder}/{n.id}/{GC_DELETING}", b"deck gc deletes this checkpoint\n")
        # (False: a save of this step committed since the read; its record stays, and this
        # checkpoint, no longer committed, goes)
        storage.delete_if(man, raw)
    failpoint("gc.checkpoint.after_uncommit")
    if tombstone:
        marker = f"{n.folder}/{n.id}/{GC_DELETING}"
        for k in storage.list(f"{n.folder}/{n.id}/"):
            if k != marker:
                storage.delete(k)
    else:
        storage.delete_prefix(f"{n.folder}/{n.id}/")
    return None
