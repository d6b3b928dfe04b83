"""Merger workers: hierarchical merging of deltas and new fulls, off the training path.

A merger worker is a plain CPU process pointed at the checkpoint URI (``deck merge URI``). It
reads committed checkpoints only and writes only under ``merged/``; the trainer never waits for
it and never reads anything it is writing.

What it builds (DECK sec. 3.3; docs/operations.md, "Merger workers"):

- **Merged deltas, stride s.** Counting the deltas of a timeline from their full (positions
  1, 2, ...), every aligned block of ``s**L`` positions becomes one merged delta of layer ``L``,
  made from the ``s`` items of layer ``L - 1`` in it (layer 0: the trainer's deltas). Rows are
  merged newest-wins, as sorted streams (one chunk per input in memory), and written sorted by
  global row id in chunks like the trainer's.
- **New fulls** (:class:`~deck.merge.policy.FullPolicy`): after ``every`` deltas, or when the
  bytes a restore reads on top of the full (the "live" chain) pass ``max_live_fraction`` of a
  full (DECK eq. 2, dynamic form), or by an IncrCP-style cost rule, a merger full of that state
  is built from the full plus its chain. The next deltas count their positions from it; the
  trainer never takes another full. When several fulls are planned in a row (a merger that fell
  behind), only the newest is built, from the newest committed full and the chain across the
  skipped ones.

What gets built is a pure function of the committed trainer checkpoints (and, for the dynamic
rule, of the sizes of committed merged deltas), and every merged checkpoint's id is a hash of
its inputs. So workers agree without talking, and a rerun after a crash finds the same work.

The pieces, one module each:

- :mod:`deck.merge.policy`: :class:`~deck.merge.policy.MergeConfig`, ``FullPolicy`` and DECK's
  sizing formulas;
- :mod:`deck.merge.plan`: what to build next (:func:`~deck.merge.plan.plan`);
- :mod:`deck.merge.stream`: the newest-wins merge of one partition's rows;
- :mod:`deck.merge.build`: one item's partitions and its commit
  (:class:`~deck.merge.build.ItemBuilder`);
- this module: the worker loop (:class:`MergeWorker`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from deck.errors import CorruptCheckpointError, MergeError, NotFoundError, StorageError
from deck.format.manifest import MANIFEST, PARTS_DIR, CheckpointManifest, load_model
from deck.merge.build import ItemBuilder, WorkStats
from deck.merge.plan import Plan, PlannedItem, plan
from deck.merge.policy import MergeConfig
from deck.merge.stream import InputDamaged
from deck.read.catalog import (
    ManifestSet,
    manifest_keys,
    quarantine,
    read_manifests,
    refresh_catalog,
)
from deck.read.lineage import LineageGraph, build_graph
from deck.storage import Storage
from deck.storage.base import get_bounded
from deck.storage.outage import Waiting
from deck.units import human_bytes

logger = logging.getLogger(__name__)


def _record_state(storage: Storage, m: CheckpointManifest) -> str:
    """``m``'s commit record now: ``committed`` (still ``m``: a missing file of it is damage,
    since GC deletes the record first), ``gone`` (no record, or another checkpoint's: the view
    that planned with ``m`` is stale), or ``unknown`` (unreadable: neither)."""
    try:
        data = get_bounded(storage, f"{m.folder}/{MANIFEST}")
        return (
            "committed"
            if load_model(CheckpointManifest, data, storage.describe(m.folder)).id == m.id
            else "gone"
        )
    except NotFoundError:
        return "gone"
    except (CorruptCheckpointError, StorageError):
        return "unknown"


def _same_records(a: ManifestSet, b: ManifestSet) -> bool:
    return (
        dict(a) == dict(b)
        and a.merged == b.merged
        and a.quarantined == b.quarantined
        and a.damaged.keys() == b.damaged.keys()
        and a.damaged_merged.keys() == b.damaged_merged.keys()
    )


@dataclass
class PassResult:
    """One pass of a worker over the plan."""

    stats: WorkStats
    ready: int  # items whose inputs were committed
    waiting: int  # of those, items whose missing partitions belong to other workers
    wanted: int  # items the policy wants that are not committed
    progressed: bool  # this worker wrote something, or the lineage changed during the pass
    fingerprint: str  # changes whenever any worker commits or finishes a partition


ProgressFn = Callable[[str, WorkStats], None]


class MergeWorker:
    """One merger worker (one process) on one URI.

    Every method runs in the thread that calls it (the process's main thread under
    ``deck merge``); one worker is not meant to be shared between threads. In order:

    1. ``MergeWorker(storage, config, after_pass=..., progress=...)``, once per process
       (``deck merge`` makes one per worker process, ``--workers K`` K of them).
    2. :meth:`run_once` (catch up, then return) or :meth:`follow` (until ``stop`` is set, e.g.
       by a signal handler; checked between passes) call :meth:`run_pass` again and again.
    3. :meth:`run_pass` lists the committed checkpoints, plans (:func:`deck.merge.plan.plan`),
       and for each ready item makes an :class:`~deck.merge.build.ItemBuilder` that builds this
       worker's partitions and tries the commit. ``progress("partition" | "commit", stats)`` is
       called after each finished partition and each commit; ``after_pass(manifests)`` (GC under
       ``deck merge --gc``) at the end of every pass.

    Workers on other processes or hosts run the same loop on the same URI; they meet only
    through committed files (see :mod:`deck.merge.build`). Every operation is idempotent; a
    worker killed at any moment is restarted by running it again. An item that fails is
    retried at once a few times, then with a growing pause (``failures``).
    """

    def __init__(
        self,
        storage: Storage,
        config: MergeConfig | None = None,
        *,
        after_pass: Callable[[ManifestSet], None] | None = None,
        progress: ProgressFn | None = None,
    ):
        self.storage = storage
        self.config = config or MergeConfig()
        self.after_pass = after_pass
        self.progress = progress
        self.failures: dict[str, int] = {}
        # The last error of the store an item failed on (``deck merge --once`` exits 2 with it
        # when work is left: the store is down, or refuses writes)
        self.storage_error: StorageError | None = None
        self._retry_at: dict[str, float] = {}
        self.max_failures = 3
        # A follower waiting this long for other workers' partitions, with nothing of anyone's
        # changing, says so at WARNING (a worker stopped with SIGSTOP, hung, or never started on
        # another host held merging silently: "waiting for other workers" only at DEBUG)
        self.stall_warn_s = 600.0
        # Items whose folder holds an unreadable commit record (id -> problem): skipped, never
        # rebuilt over it, never counted as progress (logged once).
        self.damaged: dict[str, str] = {}
        self._seen_committed: set[str] = set()  # items found committed after a listing
        self._last: ManifestSet | None = None
        self._plan: tuple[LineageGraph, Plan] | None = None
        self._committed = ""  # the ids of the planned graph's checkpoints, sorted and joined
        # A pass planned with a record that was gone (a stale catalog, or one GC deleted since):
        # passes read every record until the catalog agrees with them again.
        self._distrust_catalog = False
        self._went_stale: set[str] = set()  # items planned with a gone input (once each)

    @property
    def damaged_records(self) -> dict[int, str]:
        """The trainer commit records the last pass could not read (step -> problem): what
        builds on them is not merged."""
        return dict(self._last.damaged) if self._last is not None else {}

    def run_pass(self) -> PassResult:
        """Everything this worker can do now: every ready item's own partitions and commits."""
        t0 = time.perf_counter()
        manifests = self._read()
        graph, p = self._planned(manifests)
        # What every worker can see of everyone's progress: committed checkpoints and the
        # finished partitions of the items that can be built now. A worker waiting for others
        # watches it change.
        parts = [k for it in p.ready for k in self.storage.list(f"{it.folder}/{PARTS_DIR}/")]
        fingerprint = xxhash.xxh3_64_hexdigest("|".join([self._committed, *parts]).encode())
        stats = WorkStats()
        waiting = 0
        progressed = False
        for item in p.ready:
            if item.id in manifests.damaged_merged:
                self._skip_damaged(item, manifests.damaged_merged[item.id], stats)
                continue
            if time.monotonic() < self._retry_at.get(item.id, 0.0):
                continue  # failed repeatedly: back off (it may be a lasting storage problem)
            item_progressed, item_waiting = self._work_on(item, graph, stats)
            progressed = progressed or item_progressed
            waiting += item_waiting
        # (The records as this pass read them: a catalog of them is as correct as a later one.)
        refresh_catalog(self.storage, manifests)
        if self.after_pass is not None:
            self.after_pass(read_manifests(self.storage) if progressed else manifests)
        stats.seconds = time.perf_counter() - t0
        # One INFO line per pass that did something (an idle follow() polls quietly)
        logger.log(
            logging.INFO if progressed else logging.DEBUG,
            "deck merge pass at %s: %d committed (%s), %d partition(s), %s read, "
            "%s written, %.2f s; %d ready, %d waiting for other workers, %d failed",
            self.storage.uri,
            stats.items_committed,
            ", ".join(stats.committed) or "-",
            stats.partitions,
            human_bytes(stats.bytes_read),
            human_bytes(stats.bytes_written),
            stats.seconds,
            len(p.ready),
            waiting,
            len(stats.failed),
        )
        return PassResult(
            stats=stats,
            ready=len(p.ready),
            waiting=waiting,
            wanted=sum(1 for it in p.wanted if it.id not in graph.nodes),
            progressed=progressed,
            fingerprint=fingerprint,
        )

    def _read(self) -> ManifestSet:
        """The committed records: taken up from the last pass's read (only what was committed
        since is read and parsed); every record while the catalog is distrusted."""
        manifests = read_manifests(self.storage, previous=self._last)
        if manifests.index is None or manifests.index.catalog is None:
            self._distrust_catalog = False  # (no catalog was read: that was every record)
        if not self._distrust_catalog:
            return manifests
        truth = read_manifests(self.storage, manifest_keys(self.storage))
        if _same_records(manifests, truth):
            self._distrust_catalog = False
            logger.info(
                "deck merge: the catalog at %s agrees with every record again", self.storage.uri
            )
            return manifests
        return truth

    def _planned(self, manifests: ManifestSet) -> tuple[LineageGraph, Plan]:
        """The lineage graph and plan of ``manifests``: the last pass's when the records read
        are the same bytes (a graph and a plan are functions of the records alone), so a pass
        with nothing new costs its reads, not a node per checkpoint of the history."""
        last, self._last = self._last, manifests
        if self._plan is not None and (
            manifests is last
            or (
                last is not None
                and manifests.index is not None
                and last.index is not None
                and manifests.index.records == last.index.records
            )
        ):
            return self._plan
        graph = build_graph(manifests)
        self._plan = (graph, plan(graph, self.config))
        self._committed = "|".join(sorted(graph.nodes))
        return self._plan

    def _work_on(
        self, item: PlannedItem, graph: LineageGraph, stats: WorkStats
    ) -> tuple[bool, bool]:
        """Build this worker's partitions of ``item`` and try its commit. Returns (progressed:
        something was written or the lineage changed, waiting: partitions of other workers are
        missing)."""
        progressed = False
        try:
            inputs = [graph.nodes[i].manifest for i in item.inputs]
            b = ItemBuilder(self.storage, item, inputs, self.config)
            if b.committed():
                # Committed by another worker since this pass listed the store: the plan is
                # stale (items built on it may be ready now), so this pass counts as progress --
                # once: a record still missing from the next listing is not a race but unreadable.
                if item.id in self._seen_committed:
                    if self._through_catalog():
                        # A catalog that leaves the record out (forged, or damaged in a way its
                        # checksums cannot see): plan again from every record
                        self._distrust(
                            f"{item.describe()} is committed ({self.storage.describe(b.folder)}) "
                            "but the catalog does not hold its record"
                        )
                        return True, False
                    why = f"{self.storage.describe(b.folder)}: its record exists but is not listed"
                    self._skip_damaged(item, why, stats)
                    return False, False
                self._seen_committed.add(item.id)
                return True, False
            for part in b.mine():
                before = stats.partitions
                b.build_partition(part, stats)
                if stats.partitions != before:
                    progressed = True
                    if self.progress:
                        self.progress("partition", stats)
            if not b.try_commit(stats):
                return progressed, True
            # Committed by this call, or by another worker during it (its record stands): either
            # way the lineage changed, so items built on it may be ready now -- progress, or a
            # single worker would stop with work left. Another's record counts once, as above.
            progressed = True
            if item.id not in stats.committed:
                self._seen_committed.add(item.id)
            elif self.progress:
                self.progress("commit", stats)
        except InputDamaged as e:
            state = _record_state(self.storage, e.manifest)
            if state == "gone" and item.id not in self._went_stale:
                # Planned from a view that still held the input (a catalog that is stale or
                # forged, or GC deleted it since): not a failure; plan again from every record.
                self._went_stale.add(item.id)
                self._distrust(
                    f"{item.describe()} was planned with "
                    f"{self.storage.describe(e.manifest.folder)}, which is no longer committed "
                    f"({e.error})"
                )
                return True, False
            self._fail(item, str(e), stats)
            if state == "committed":
                quarantine(self.storage, e.manifest, f"found by the merger: {e.error}")
                progressed = True
        except (MergeError, CorruptCheckpointError) as e:
            self._fail(item, str(e), stats)
        except StorageError as e:
            # Transient or not, nothing was committed: try again next pass.
            self.storage_error = e
            self._fail(item, f"storage error: {e}", stats)
        return progressed, False

    def _through_catalog(self) -> bool:
        """Whether this pass planned from a read through a catalog not checked against every
        record."""
        last = self._last
        return (
            not self._distrust_catalog
            and last is not None
            and last.index is not None
            and last.index.catalog is not None
        )

    def _distrust(self, why: str) -> None:
        """Read every commit record from the next pass on, until the catalog agrees with them
        (said once while distrusted)."""
        if not self._distrust_catalog:
            logger.warning(
                "deck merge: %s; reading every commit record at %s until the catalog agrees "
                "with them",
                why,
                self.storage.uri,
            )
        self._distrust_catalog = True

    def _skip_damaged(self, item: PlannedItem, why: str, stats: WorkStats) -> None:
        """``item``'s folder has a commit record that cannot be read: "cannot read" is
        "unknown", so it is neither done nor redone over (a person decides); it counts as a
        failure of the pass, never as progress, and is logged once per worker."""
        stats.failed[item.id] = f"unreadable commit record: {why}"
        if item.id not in self.damaged:
            self.damaged[item.id] = why
            logger.error(
                "deck merge: %s is skipped: its commit record is unreadable (%s); inspect it, "
                "then delete its folder to have it rebuilt",
                item.describe(),
                why,
            )

    def _fail(self, item: PlannedItem, why: str, stats: WorkStats) -> None:
        n = self.failures[item.id] = self.failures.get(item.id, 0) + 1
        stats.failed[item.id] = why
        if n >= self.max_failures:
            # Retried at once a few times (a transient error), then with a growing pause.
            self._retry_at[item.id] = time.monotonic() + min(3600.0, 60.0 * 2 ** (n - 3))
        logger.warning("deck merge: %s failed (attempt %d): %s", item.describe(), n, why)

    def run_once(self, wait_s: float = 60.0, poll_s: float = 0.2) -> tuple[WorkStats, int]:
        """Catch up: passes until every checkpoint the policy wants is committed, or nothing
        changes (no commit, no finished partition, by any worker) for ``wait_s`` seconds --
        other workers may still be building what the next items need. A single worker
        (``num_workers == 1``) stops as soon as a pass does nothing. Returns the summed stats
        and the number of wanted items left uncommitted."""
        total = WorkStats()
        last_change = time.monotonic()
        seen = ""
        while True:
            r = self.run_pass()
            total.add(r.stats)
            if r.progressed:
                last_change, seen = time.monotonic(), r.fingerprint
                continue
            if r.wanted == 0:
                return total, 0
            if r.fingerprint != seen:
                last_change, seen = time.monotonic(), r.fingerprint
            if self.config.num_workers == 1 or time.monotonic() - last_change >= wait_s:
                if self.config.num_workers > 1:
                    logger.warning(
                        "deck merge: %d checkpoint(s) still wait for inputs or partitions of "
                        "other workers after %.0f s without progress; run the other workers "
                        "(worker_index 0..%d), all with the same merge policy (--stride, "
                        "--full-*: a worker plans its items from it, and one with another "
                        "policy waits for partitions of items no other worker plans)",
                        r.wanted,
                        wait_s,
                        self.config.num_workers - 1,
                    )
                elif r.wanted and (r.waiting or self.failures or self.damaged):
                    logger.warning(
                        "deck merge: %d checkpoint(s) could not be built (see the errors above)",
                        r.wanted,
                    )
                return total, r.wanted
            time.sleep(poll_s)

    def follow(self, stop: threading.Event, poll_s: float = 5.0) -> WorkStats:
        """Keep merging as the trainer commits, until ``stop`` is set. A pass the store fails
        (an outage, a read-only bucket) is said once per distinct problem and tried again after
        a pause that doubles up to 60 s: a service outlives the store's outages (it exited
        with status 2 after the store was down for a minute)."""
        total = WorkStats()
        waiting = Waiting(f"deck merge {self.storage.uri}", poll_s, logger, max_s=60.0)
        stalled: tuple[str, float] | None = None  # (fingerprint, since) while waiting for others
        said = False
        while not stop.is_set():
            try:
                r = self.run_pass()
            except StorageError as e:
                stop.wait(waiting.failed(e))
                continue
            waiting.ok()
            total.add(r.stats)
            same = stalled is not None and stalled[0] == r.fingerprint
            if not (r.waiting and same) or r.progressed:
                stalled = (r.fingerprint, time.monotonic()) if r.waiting else None
                said = False
            elif (
                stalled is not None
                and not said
                and time.monotonic() - stalled[1] >= self.stall_warn_s
            ):
                said = True
                logger.warning(
                    "deck merge: worker %d of %d has waited %.0f s for other workers' "
                    "partitions of %d checkpoint(s) at %s, and none of theirs has appeared: is "
                    "a worker stopped, hung or not started (every index 0..%d must run)?",
                    self.config.worker_index,
                    self.config.num_workers,
                    time.monotonic() - stalled[1],
                    r.waiting,
                    self.storage.uri,
                    self.config.num_workers - 1,
                )
            if not r.progressed:
                stop.wait(poll_s)
        return total
