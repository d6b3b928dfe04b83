"""Which published checkpoints a live model applies next: the publish URI's lineage, read as
``deck follow`` reads it (committed records, the cheapest chain of the newest step).

Guarantees: a plan moves the served step backwards only to follow a newer timeline (the trainer
restarted or rolled back since the served checkpoint, which may still be committed on its older
timeline or have had its step re-saved by the newer one: the newest step is planned whole), and
never to a step of an older timeline than the served one; any other newest step at or below the
served one (the served folder deleted, a store restored from an older copy) is left alone and
reported once as a
:class:`SourceFault`, which the live model logs and passes to its ``on_fault``; a
delta is planned only onto the exact state it was written on (step and id); a checkpoint the
caller marked bad is never planned again (``exclude``), so a damaged delta is skipped until a
chain around it exists (the next full, or a merged checkpoint covering it).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Protocol

from deck.errors import CheckpointNotFoundError
from deck.format.manifest import MANIFEST, CheckpointManifest, step_dir
from deck.read.catalog import ManifestSet, read_manifests
from deck.read.lineage import LineageGraph, build_graph, cheapest_chain, confirmed
from deck.read.window import ask_newest
from deck.storage import Storage

logger = logging.getLogger(__name__)

State = tuple[int, str]  # (step, trainer checkpoint id): a served version
KEEP_PLANNED = 256  # versions whose epoch a source remembers (the served one among them)


@dataclass(frozen=True)
class Plan:
    """The next version: apply ``chain`` (oldest first). ``whole``: it starts with a full and
    gives the complete state (the served rows are compared and only those that differ are
    written); otherwise it applies onto the served state (a delta or merged delta)."""

    chain: tuple[CheckpointManifest, ...]
    whole: bool
    # The served version is of an older timeline (the trainer restarted or rolled back since):
    # this whole version of the newer timeline replaces it, though its step may be lower
    timeline: bool = False

    @property
    def state(self) -> State:
        s = self.chain[-1].state
        return (int(s[0]), str(s[1]))

    @property
    def step(self) -> int:
        return int(self.chain[-1].step)

    @property
    def record(self) -> str:
        """The key of the commit record (``manifest.json``) of the version's last checkpoint."""
        return f"{self.chain[-1].folder}/{MANIFEST}"


@dataclass(frozen=True)
class SourceFault:
    """An update a source passed over without planning it (out of order; for a Kafka source
    also a damaged or foreign message): the served version stays."""

    step: int  # the update's step (-1: unknown, e.g. a message that does not decode)
    checkpoint: str  # the checkpoint's folder, or where the message was
    error: str


class PlannedEpochs:
    """The epoch of each version a source planned lately (checkpoint id -> epoch, the newest
    :data:`KEEP_PLANNED`): the served version's timeline, which its commit record may no longer
    tell (a newer timeline re-saved its step, or GC)."""

    def __init__(self) -> None:
        self._by_id: dict[str, int] = {}

    def remember(self, plan: Plan) -> None:
        self._by_id.pop(plan.state[1], None)
        self._by_id[plan.state[1]] = int(plan.chain[-1].epoch)
        while len(self._by_id) > KEEP_PLANNED:
            del self._by_id[next(iter(self._by_id))]

    def get(self, cid: str) -> int | None:
        return self._by_id.get(cid)


def saved_at(storage: Storage, step: int) -> str | None:
    """The id of the trainer checkpoint committed at ``step`` now, by its commit record (None:
    none is, or its record is damaged: nothing to tell). A read error is raised."""
    m = read_manifests(storage, [f"{step_dir(step)}/{MANIFEST}"]).get(step)
    return None if m is None else m.id


class LiveSource(Protocol):
    """Where a :class:`deck.serve.live.LiveModel` gets its versions: :class:`PublishSource`
    (a publish URI's files) or :class:`deck.serve.live_kafka.KafkaSource` (a Kafka topic)."""

    @property
    def uri(self) -> str: ...

    @property
    def storage(self) -> Storage: ...

    def next_plans(self, served: State | None, exclude: frozenset[str]) -> list[Plan]: ...

    def take_faults(self) -> list[SourceFault]: ...

    def committed_at(self, plan: Plan) -> float: ...

    def chain_to(self, step: int, exclude: frozenset[str] = frozenset()) -> Plan: ...

    def saved_at(self, step: int) -> str | None: ...


def committed_at(storage: Storage, plan: Plan) -> float:
    """When ``plan``'s version was committed: the file time of its commit record on the
    store's clock (the moment the publisher's commit landed), or, on a store that tells no
    times, the record's own ``created_unix`` (the publisher's clock, taken as it built the
    record)."""
    t = storage.modified(plan.record)
    return float(plan.chain[-1].created_unix) if t is None else t


class PublishSource:
    """The published checkpoints at ``storage`` (a publish URI, or any deck checkpoint URI)."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self._uri = storage.uri
        self._last: ManifestSet | None = None  # the last read (maybe of the newest records)
        self._whole: ManifestSet | None = None  # the last read of every record
        self._said_behind: State | None = None
        self._said_damaged: set[tuple[int, str]] = set()
        self._said_unrestorable: set[str] = set()  # checkpoint ids
        self._faults: list[SourceFault] = []
        self._found = False  # a poll found a committed step here
        self._said_empty = False
        self._said_stuck: frozenset[str] = frozenset()  # refused ids last said to hold steps
        self._epochs = PlannedEpochs()

    @property
    def uri(self) -> str:
        return self._uri

    @property
    def storage(self) -> Storage:
        return self._storage

    def take_faults(self) -> list[SourceFault]:
        """The updates passed over since the last call (each reported once)."""
        out, self._faults = self._faults, []
        return out

    def _graph(self, manifests: ManifestSet) -> LineageGraph | None:
        self._last = manifests
        if manifests.window is None:
            self._whole = manifests
        if not manifests:
            return None
        graph = build_graph(manifests, self.uri)
        latest = graph.latest(log=False)  # (steps passed over: _unrestorable says so once)
        if latest is None:
            return None
        # The records, not a catalog's copy, and every step folder above the latest and the
        # newest epoch witnessed, as a restore of the latest does (a break-it finding: with
        # the newest log entries lost a live model stayed a step behind, or, after a rollback,
        # on the abandoned timeline)
        checked = confirmed(self.storage, manifests, latest, latest=True)
        return graph if checked is manifests else build_graph(checked, self.uri)

    def next_plans(self, served: State | None, exclude: frozenset[str]) -> list[Plan]:
        """The versions after ``served``, in order, one per checkpoint of the newest step's
        chain after the served state (or one whole version when the chain does not pass
        through it). Empty when nothing newer is restorable without ``exclude``."""
        plans = self._next_plans(served, exclude)
        for plan in plans:
            self._epochs.remember(plan)
        return plans

    def saved_at(self, step: int) -> str | None:
        """The trainer checkpoint committed at ``step`` now (:func:`saved_at`)."""
        return saved_at(self.storage, step)

    def _next_plans(self, served: State | None, exclude: frozenset[str]) -> list[Plan]:
        # From the newest part of a long history, as a restore of the latest plans: a poll
        # costs what is new, not every record the publisher wrote
        return ask_newest(
            self.storage, lambda ms: self._plans_from(ms, served, exclude), self._whole
        )

    def _plans_from(
        self, manifests: ManifestSet, served: State | None, exclude: frozenset[str]
    ) -> list[Plan]:
        graph = self._graph(manifests)
        self._damaged(served)
        self._empty(graph is None)
        if graph is None:
            return []
        self._unrestorable(graph, served)
        served_epoch = self._served_epoch(graph, served)
        # Newest first as restore() takes the latest: by timeline, then step. A step of an
        # older timeline than the served one is never planned (a break-it finding: steps above
        # a restart's first full, left by the older timeline, were taken by step alone, and the
        # model swapped between the two timelines at every version).
        # (steps taken one by one, down to the served one: a windowed read holds no others)
        order = sorted(graph.trainer, key=lambda s: (graph.trainer[s].epoch, s), reverse=True)
        for i, step in enumerate(s for s in order if graph.restorable(s)):
            epoch = graph.trainer[step].epoch
            if served_epoch is not None and epoch < served_epoch:
                return []
            newer = served_epoch is not None and epoch > served_epoch
            if served is not None and not newer and step < served[0]:
                if i == 0:  # the newest step is older than the served one
                    # (only through refused checkpoints: nothing to report)
                    with contextlib.suppress(CheckpointNotFoundError):
                        self._behind(cheapest_chain(graph, step, exclude=exclude)[-1], served)
                return []
            try:
                chain = cheapest_chain(graph, step, exclude=exclude)
            except CheckpointNotFoundError:
                node = graph.trainer.get(step)
                if node is not None and node.id not in exclude:  # (not itself the refused one)
                    self._stuck(step, exclude)
                continue  # through a bad checkpoint: an older step may still be newer than ours
            if newer:  # (the restart or rollback's step, whole, though it may be lower)
                return [Plan(tuple(chain), whole=True, timeline=True)]
            return self._plans(chain, served)
        return []

    def _stuck(self, step: int, exclude: frozenset[str]) -> None:
        """A newer step whose every chain goes through a refused checkpoint: said once per set
        of refused checkpoints (a break-it finding: the deltas after a refused step were passed
        over without a word, the model silently stale until the next full)."""
        if exclude and exclude != self._said_stuck:
            self._said_stuck = exclude
            logger.warning(
                "deck live: %s: step %d builds on a refused checkpoint (the ERROR above): "
                "the served version stays until a full (or a merger checkpoint) gives a chain "
                "around it, where that checkpoint alone was refused (a served model that does "
                "not fit the published one refuses every step: build it as the trainer did)",
                self.uri,
                step,
            )

    def _served_epoch(self, graph: LineageGraph, served: State | None) -> int | None:
        """The served version's timeline: its checkpoint's epoch in ``graph``, or as planned
        (its record may be gone: a newer timeline re-saved its step, or GC); None when not
        known (nothing served)."""
        if served is None:
            return None
        node = graph.nodes.get(served[1])
        return self._epochs.get(served[1]) if node is None else int(node.epoch)

    def _plans(self, chain: list[CheckpointManifest], served: State | None) -> list[Plan]:
        last = chain[-1]
        if served is not None and last.state == served:
            return []
        held = [i for i, m in enumerate(chain) if m.state == served]
        if held:
            plans, parent = [], served
            for m in chain[held[-1] + 1 :]:
                if m.state == parent:
                    continue  # a trainer checkpoint after the merger checkpoint of its state
                plans.append(Plan((m,), whole=False))
                parent = m.state
            return plans
        if served is not None and last.step <= served[0]:
            self._behind(last, served)
            return []
        return [Plan(tuple(chain), whole=True)]

    def _empty(self, empty: bool) -> None:
        """A URI with nothing committed (a publisher not started yet, or a typo'd URI that
        will never hold anything): one WARNING at the first such poll, one INFO when a step
        shows up after it."""
        if not empty:
            if self._said_empty and not self._found:
                logger.info("deck live: %s: a committed step is there now", self.uri)
            self._found = True
            return
        if self._found or self._said_empty:
            return
        self._said_empty = True
        logger.warning(
            "deck live: nothing is published at %s: no committed step there (no "
            "step-*/manifest.json, no catalog); polling on. If this lasts, check the URI: it "
            "is the publisher's PublishConfig.uri (or a checkpoint URI)",
            self.uri,
        )

    def _damaged(self, served: State | None) -> None:
        """A commit record newer than the served step that cannot be read: reported once (its
        step is not applied, nor anything built on it, until it is repaired or a newer full
        comes)."""
        damaged = self._last.damaged if self._last is not None else {}
        for step, problem in sorted(damaged.items()):
            if (served is None or step > served[0]) and (step, problem) not in self._said_damaged:
                self._said_damaged.add((step, problem))
                self._faults.append(
                    SourceFault(
                        step,
                        step_dir(step),
                        f"damaged commit record: {problem}; step {step} (and what builds on "
                        "it) is left alone until it is repaired or a newer full is published",
                    )
                )

    def _unrestorable(self, graph: LineageGraph, served: State | None) -> None:
        """A committed step newer than the served one whose chain is not all there (a delta on
        a state this URI does not hold: another job's, or a parent missing or quarantined):
        reported once per checkpoint; it is applied if its chain is completed."""
        above = -1 if served is None else served[0]
        # (what a trainer's restore would do instead is no advice to a serving process)
        for step, why in graph.unrestorable(above, advice=False).items():
            node = graph.trainer[step]
            if node.id in self._said_unrestorable:
                continue
            self._said_unrestorable.add(node.id)
            self._faults.append(
                SourceFault(
                    step,
                    node.folder,
                    f"{why} (at {self.uri}: is another job publishing there?); it is left "
                    "alone, and applied only if the checkpoints its chain needs appear",
                )
            )

    def _behind(self, last: CheckpointManifest, served: State) -> None:
        """The newest checkpoint offered is not after the served one: reported once."""
        if self._said_behind == last.state:
            return
        self._said_behind = last.state
        self._faults.append(
            SourceFault(
                last.step,
                last.folder,
                f"out of order: the newest step at {self.uri} is {last.step} (checkpoint "
                f"{last.state[1]}), not after the served step {served[0]} (checkpoint "
                f"{served[1]}); it is left alone",
            )
        )

    def committed_at(self, plan: Plan) -> float:
        """When ``plan``'s version was committed (:func:`committed_at`)."""
        return committed_at(self.storage, plan)

    def chain_to(self, step: int, exclude: frozenset[str] = frozenset()) -> Plan:
        """A whole version of committed ``step`` (its cheapest chain from a full): what a
        rollback further back than the kept versions restores from storage."""
        graph = self._graph(read_manifests(self.storage, previous=self._whole))
        if graph is None:
            if not self._last:
                raise CheckpointNotFoundError(f"no committed checkpoints at {self.uri}")
            # Committed, none restorable: the chain's own error says what the step lacks
            graph = build_graph(self._last, self.uri)
        plan = Plan(tuple(cheapest_chain(graph, step, exclude=exclude)), whole=True)
        self._epochs.remember(plan)
        return plan
