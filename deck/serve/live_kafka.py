"""A Kafka topic as the source of a live serving model: :class:`KafkaSource`.

::

    source = KafkaSource("kafka://broker:9092/recsys-publish")
    live = LiveModel([float_model, quant_model], source, LiveConfig())
    live.poll()                  # every marked step since the served one, one switch each
    ...
    source.close()

The topic a ``PublishConfig(uri="kafka://...")`` publisher writes is read the way ``deck
follow kafka://`` reads it (:mod:`deck.serve.kafka_follow`: the markers of the control
partition in order, each step's rank manifests at the state URI the marker names, its table
files pulled off the rank partitions, every segment checksummed) and each marked step becomes
one version of the live model: a full a whole version (only the rows that differ are
written), a delta one applied onto the served state. The rows are then read and checked whole
by the live model as from a publish URI (:mod:`deck.serve.live_read`), so each applied step is
bitwise the step the file source gives.

What never reaches the served model (each one a :class:`deck.serve.live_source.SourceFault`:
the live model logs an ERROR, tells ``on_fault`` and keeps its version):

- **damaged**: a message that does not decode (quarantined as by ``deck follow``,
  :class:`deck.serve.kafka_guard.QuarantineLog`, in ``quarantine_dir`` when given), or a step
  whose table files cannot all be pulled and checked;
- **foreign**: a marker of another run than the one served (``run``, else the newest marker's
  when the source starts), or naming another state URI;
- **out of order**: a marker at or before the served step of its timeline or an older one (a
  copy, a replay), or a delta whose parent is not the served version (its parent was refused,
  or the model was rolled back): the model moves on at the next full of the topic. A full of a
  newer timeline at or before the served step is the publisher's rollback: offered as a whole
  version of that timeline (``Plan.timeline``), as ``deck follow`` follows it.

A topic recreated while serving (its control partition ending before the source's position,
the marker offered last gone from its offset) is read again from its newest full (an ERROR).

Where a source starts: the served state is the serving process's memory, so a source keeps
no offsets; a (re)started process serving nothing starts at the newest full of its run's
markers (its commit record says it is a full) and applies it whole, then the deltas and fulls
after it: it serves the newest step after one whole version, whatever the topic's length.
Should nothing be servable from there (that full damaged or refused), it starts again at the
full before (up to :data:`START_FULLS`), last at the topic's oldest message. Each rank
partition is read from where the first step whose rows the source reads begins: the offset
its publisher recorded beside the rank manifest (:class:`deck.format.stream.StepStart`), so a
restart reads the control partition's markers and about one full's rows, not the topic. That
offset is a hint, never trusted: the first message read there must be a segment of that step
and rank at that very offset, the segments read from it are checked as any (key, checksum, the
rank manifest's records), and should the first message not be that one or the step's files not
all be found from there (a forged, stale or foreign record, an offset past the end) the
partition is read again from its oldest message, as it is for a step without a record (a
publisher before them). A bad record costs reading the partition, never a wrong row. A rollback reaches the kept versions
only (``LiveConfig.keep_versions``): the stream is not read backwards.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

from deck.errors import CheckpointNotFoundError, ConfigError
from deck.format.manifest import CheckpointManifest, Kind
from deck.format.stream import (
    CONTROL_PARTITION,
    CorruptStreamError,
    Marker,
    decode_marker,
    parse_kafka_uri,
    rank_partition,
    valid_run,
)
from deck.read.catalog import read_rank_manifests
from deck.serve.kafka_follow import (
    PartitionReader,
    StreamView,
    UnprovableStepError,
    consumer_conf,
    marker_manifest,
    pull_files,
    recorded_start,
)
from deck.serve.kafka_guard import QuarantineLog, marker_at, newest_run
from deck.serve.live_source import (
    Plan,
    PlannedEpochs,
    SourceFault,
    State,
    committed_at,
    saved_at,
)
from deck.storage import Storage, open_storage

logger = logging.getLogger(__name__)

# The newest fulls a source serving nothing may start from, in turn (each found by reading the
# commit records of the markers back to it), before it reads from the topic's oldest message.
START_FULLS = 3
# Markers read back from the control partition's end first when a source starts (then 4x more
# each time until START_FULLS fulls are found)
START_WINDOW = 256


class KafkaSource:
    """The marked steps of a Kafka publish topic, for :class:`deck.serve.live.LiveModel` (see
    the module doc). ``state_uri``: read the commit records there instead of at the URI the
    markers name; ``open_store`` opens it (the caller's credentials); ``run``: serve this run
    only; ``quarantine_dir``: where ``quarantine.json`` goes (None: logged only); ``wait_s``: how
    long a step's rows may take to show up after its marker."""

    def __init__(
        self,
        uri: str,
        *,
        state_uri: str | None = None,
        open_store: Callable[[str], Storage] = open_storage,
        run: str | None = None,
        group: str | None = None,
        consumer_options: dict[str, Any] | None = None,
        quarantine_dir: str | None = None,
        wait_s: float = 10.0,
        poll_timeout_s: float = 0.5,
    ) -> None:
        self.target = parse_kafka_uri(uri)
        if run is not None and not valid_run(run):
            raise ConfigError(f"run {run!r}: a run identity is 1-64 of [0-9a-zA-Z._-]")
        topic = self.target.topic
        self.conf = consumer_conf(self.target, group or f"deck-live-{topic}", consumer_options)
        if quarantine_dir is not None:
            os.makedirs(quarantine_dir, exist_ok=True)
        # Its entries are not logged on their own: each is in the ERROR line of the update the
        # live model refuses (one line per refused update).
        self.quarantine = QuarantineLog(quarantine_dir, topic, who="deck live", log=False)
        self.open_store = open_store
        self.wait_s, self.poll_timeout_s = wait_s, poll_timeout_s
        self.run, self.run_known = run, run is not None
        self.state_uri = state_uri
        self.state_given = state_uri is not None  # markers' state URIs are not used
        self.state_fixed = state_uri is not None  # a marker's record was found there
        self.view: StreamView | None = None
        self.readers: dict[int, PartitionReader] = {}
        self.poisoned: set[int] = set()  # partitions with a quarantined message
        self.pending: Plan | None = None  # the plan last offered (its files in the view)
        self.offered: Marker | None = None  # the marker of the plan last offered
        self.kept_at: tuple[int, int] | None = None  # (position, end) found not recreated
        self.faults: list[SourceFault] = []
        self.said_waiting = False
        self.unreadable: set[str] = set()  # steps whose rows could not all be pulled (told once)
        # Where a source serving nothing reads markers from, in turn (see _start_offsets)
        self.starts: list[int] = []
        self.start: int | None = None
        self.scanned = 0  # markers read to find where the last start began
        self.epochs = PlannedEpochs()

    @property
    def uri(self) -> str:
        return self.target.uri

    @property
    def storage(self) -> Storage:
        """The state URI with the offered step's table files (what the live model reads)."""
        if self.view is None:
            raise CheckpointNotFoundError(f"{self.uri}: no marked step read yet")
        return self.view

    def take_faults(self) -> list[SourceFault]:
        """The messages passed over since the last call (each reported once)."""
        out, self.faults = self.faults, []
        return out

    # ---- the next step ----------------------------------------------------------------------
    def next_plans(self, served: State | None, exclude: frozenset[str]) -> list[Plan]:
        """The next marked step after ``served`` the model can apply (one plan), or none when
        the topic holds nothing more now. Every message passed over on the way is a fault
        (:meth:`take_faults`). A plan offered before and neither applied (``served``) nor
        refused (``exclude``), e.g. its read failed on a store error, is offered again."""
        p = self.pending
        if p is not None and served != p.state and p.chain[-1].id not in exclude:
            return [p]
        self.pending = None
        if self.view is not None:
            self.view.files.clear()
        if not self.run_known:
            found, run = newest_run(self.conf, self.target)
            if found:
                self.run, self.run_known = run, True
                logger.info("deck live: %s: serving run %s (the newest marker's)", self.uri, run)
        if CONTROL_PARTITION not in self.readers and served is None:
            self.starts = self._start_offsets()
            self._control(self.starts.pop(0))
        ctl = self._control()
        ctl.eof = None  # only an end reached in this call counts
        while True:
            msg = ctl.poll(self.poll_timeout_s)
            if msg is None:
                if not ctl.drained():
                    continue
                if served is not None and self._recreated(ctl):
                    self.close()
                    self.starts = self._start_offsets()
                    ctl = self._control(self.starts.pop(0))
                    ctl.eof = None
                    continue
                if served is not None or not self.starts:
                    return []
                # Nothing servable from the full started at (it was refused): an older one.
                start = self.starts.pop(0)
                logger.warning(
                    "deck live: %s: nothing could be served from the full at offset %d of "
                    "partition %d; reading from offset %d",
                    self.uri,
                    ctl.position if self.start is None else self.start,
                    CONTROL_PARTITION,
                    start,
                )
                self.close()
                ctl = self._control(start)
                ctl.eof = None
                continue
            plan = self._plan(msg, served, exclude)
            if plan is not None:
                self.pending = plan
                return [plan]

    def _recreated(self, ctl: PartitionReader) -> bool:
        """While idle: the control partition ends before where the source reads (a broker
        that lost its data, a topic deleted and made again while serving) and the marker of
        the step offered last is no longer at its offset: the topic was recreated, and the
        source would otherwise wait, silently stale, for it to pass its old offsets. The
        listed end is checked first (one request); a broker's listed end may lag behind the
        last message read, so the marker decides, once per position and end."""
        end = ctl.watermarks()[1]
        mk = self.offered
        if ctl.position <= end or mk is None or self.kept_at == (ctl.position, end):
            return False
        what, m = marker_at(self.conf, self.target, mk.offset)
        if what == "gone" or (what == "marker" and (m.step, m.ckpt_id) == (mk.step, mk.ckpt_id)):
            self.kept_at = (ctl.position, end)  # the listed end lagged (or retention)
            return False
        logger.error(
            "deck live: %s: kafka topic %s partition %d ends at offset %d, before the source's "
            "position %d: the topic was recreated or truncated while serving; reading it from "
            "its newest full, and the served version stays until a step after it",
            self.uri,
            self.target.topic,
            CONTROL_PARTITION,
            end,
            ctl.position,
        )
        self.offered = None
        return True

    def _where(self, offset: int) -> str:
        return f"kafka topic {self.target.topic} partition {CONTROL_PARTITION} offset {offset}"

    def _fault(self, step: int, where: str, error: str) -> None:
        self.faults.append(SourceFault(step, where, error))

    def _plan(self, msg: Any, served: State | None, exclude: frozenset[str]) -> Plan | None:
        offset = int(msg.offset())
        topic = self.target.topic
        try:
            marker = decode_marker(msg.headers(), msg.value(), topic, CONTROL_PARTITION, offset)
        except CorruptStreamError as e:
            self.quarantine.add("poison", CONTROL_PARTITION, offset, msg.value(), str(e))
            self._fault(
                -1, self._where(offset), f"damaged: {e}; quarantined{self.quarantine.recorded()}"
            )
            return None
        if self.run_known and marker.run != self.run:
            why = (
                f"foreign: marker of step {marker.step} ({marker.ckpt_id}) of run {marker.run}, "
                f"but this source serves run {self.run}"
            )
            self.quarantine.add("foreign", CONTROL_PARTITION, offset, msg.value(), why)
            self._fault(marker.step, self._where(offset), why + self.quarantine.recorded())
            return None
        if marker.ckpt_id in exclude or (marker.step, marker.ckpt_id) == served:
            return None  # refused already / served already
        if self.state_fixed and not self.state_given and marker.state_uri != self.state_uri:
            why = (
                f"foreign: marker of step {marker.step} ({marker.ckpt_id}) names the state URI "
                f"{marker.state_uri}, but this source's state is at {self.state_uri}"
            )
            self.quarantine.add("poison", CONTROL_PARTITION, offset, None, why)
            self._fault(marker.step, self._where(offset), why + self.quarantine.recorded())
            return None
        try:
            view = self._open(marker)
        except ConfigError as e:  # a state URI this host cannot open: never the served one
            why = f"marker of step {marker.step} ({marker.ckpt_id}): {e}"
            self.quarantine.add("poison", CONTROL_PARTITION, offset, None, why)
            self._fault(marker.step, self._where(offset), why + self.quarantine.recorded())
            return None
        manifest = marker_manifest(view, marker)
        if manifest is None:
            return None  # replaced by a later publish of its step: its own marker follows
        self.state_fixed = True
        where = f"{manifest.folder} ({self._where(offset)})"
        # At or before the served step: a full of a newer timeline is the publisher's rollback
        # (a restore, then a new timeline), which replaces the served version as deck follow's
        # does (a break-it finding: both fulls after a rollback were refused as out of order
        # and the abandoned timeline served until the topic passed its step); anything else
        # there is a copy, a replay or an older timeline
        timeline = served is not None and marker.step <= served[0]
        served_epoch = None if served is None else self.epochs.get(served[1])
        if timeline and not (
            manifest.kind is Kind.FULL
            and served_epoch is not None
            and manifest.epoch > served_epoch
        ):
            assert served is not None
            self._fault(
                marker.step,
                where,
                f"out of order: step {marker.step} ({marker.ckpt_id}, epoch {manifest.epoch}) is "
                f"not after the served step {served[0]} ({served[1]}"
                + (f", epoch {served_epoch})" if served_epoch is not None else ")")
                + ", nor a full of a newer timeline",
            )
            return None
        if manifest.kind is Kind.DELTA and served != (manifest.parent, manifest.parent_id):
            if served is None:
                if not self.said_waiting:
                    logger.warning(
                        "deck live: %s: step %d is a delta and nothing is served yet: waiting "
                        "for a full",
                        self.uri,
                        marker.step,
                    )
                    self.said_waiting = True
                return None
            self._fault(
                marker.step,
                where,
                f"out of order: step {marker.step} is a delta of step {manifest.parent} "
                f"({manifest.parent_id}), not of the served step {served[0]} ({served[1]}); "
                "the model moves on at the next full",
            )
            return None
        if marker.ckpt_id in self.unreadable:
            return None  # reported when first read
        parts = read_rank_manifests(view, manifest)
        files = {f"{manifest.folder}/{c.path}" for p in parts for sh in p.shards for c in sh.chunks}
        for p, r in self.readers.items():
            if p != CONTROL_PARTITION:
                r.eof = None  # an end seen before this marker says nothing about its rows
        known = len(self.quarantine.entries)
        try:
            for rank in range(manifest.world_size):
                mine = {k for k in files if f"/rank-{rank:05d}/" in k}
                if not mine:
                    continue  # its reader opens at the first step it has rows of
                reader = self._rank_reader(view, manifest, rank)
                got = pull_files(
                    reader, rank, marker, mine, self.quarantine, self.poisoned, self.wait_s
                )
                view.files.update(got)
        except UnprovableStepError as e:
            view.files.clear()
            self.unreadable.add(marker.ckpt_id)
            new = self.quarantine.entries[known:]
            said = "".join(
                f"; quarantined partition {q.partition} offset {q.offset}: {q.error}" for q in new
            )
            self._fault(
                marker.step,
                where,
                f"damaged: step {marker.step} cannot be read: {e}{said}"
                + (self.quarantine.recorded() if new else ""),
            )
            return None
        if not self.run_known:
            self.run, self.run_known = marker.run, True
        self.offered = marker
        plan = Plan((manifest,), whole=manifest.kind is Kind.FULL, timeline=timeline)
        self.epochs.remember(plan)
        return plan

    def _control(self, offset: int = 0) -> PartitionReader:
        r = self.readers.get(CONTROL_PARTITION)
        if r is None:
            r = PartitionReader(self.conf, self.target, CONTROL_PARTITION, offset)
            self.readers[CONTROL_PARTITION] = r
            self.start = r.position
        return r

    def _rank_reader(
        self, view: StreamView, manifest: CheckpointManifest, rank: int
    ) -> PartitionReader:
        """``rank``'s partition reader; opened for the step of ``manifest`` (the first one
        whose rows this source reads) at its recorded start, else at the oldest message."""
        p = rank_partition(rank)
        r = self.readers.get(p)
        if r is None:
            r = PartitionReader(self.conf, self.target, p, 0, recorded_start(view, manifest, rank))
            self.readers[p] = r
        return r

    def _start_offsets(self) -> list[int]:
        """Where a source serving nothing reads markers from: the newest marker of its run
        whose step is a full; should nothing from there be served (that full refused), the one
        before (up to :data:`START_FULLS` fulls); last the oldest message. The markers are
        read back from the partition's end in windows growing fourfold (the first
        :data:`START_WINDOW` messages) until those fulls are found or the oldest message is
        reached, so a restart reads the markers since the fulls it starts at, not the topic's;
        and the commit records of the newest ones down to each full (the rank partitions are
        opened later, at the recorded start of the step first read: :meth:`_rank_reader`)."""
        probe = PartitionReader(self.conf, self.target, CONTROL_PARTITION, 0)
        try:
            low, high = probe.watermarks()
        finally:
            probe.close()
        fulls: list[Marker] = []
        self.scanned = 0
        window, stop, begin = START_WINDOW, None, max(low, high - START_WINDOW)
        while True:
            for marker in reversed(self._markers(begin, stop)):
                if len(fulls) < START_FULLS and self._is_start(marker):
                    fulls.append(marker)
            if len(fulls) == START_FULLS or begin <= low:
                break
            window *= 4
            stop, begin = begin, max(low, high - window)
        if fulls and fulls[0].offset > low:
            logger.info(
                "deck live: %s: starting at the newest full, step %d (marker at offset %d of "
                "partition %d)",
                self.uri,
                fulls[0].step,
                fulls[0].offset,
                CONTROL_PARTITION,
            )
        starts = [m.offset for m in fulls]
        return starts if starts and starts[-1] == low else [*starts, low]

    def _markers(self, begin: int, stop: int | None) -> list[Marker]:
        """The readable markers at offsets ``begin`` up to ``stop`` (None: to the partition's
        end: its end-of-partition event, since the high watermark the broker lists may lag
        behind a batch; without one, after 20 empty polls at or past it), read by a consumer
        of their own. Undecodable ones are passed over (quarantined when read in order)."""
        scan = PartitionReader(self.conf, self.target, CONTROL_PARTITION, begin)
        found: list[Marker] = []
        idle = 0
        try:
            while not (scan.at_end() if stop is None else scan.position >= stop):
                msg = scan.poll(self.poll_timeout_s)
                if msg is None:
                    idle += 1
                    if idle >= 20 and scan.drained():
                        break
                    continue
                offset = int(msg.offset())
                if stop is not None and offset >= stop:
                    break
                with contextlib.suppress(CorruptStreamError):
                    topic = self.target.topic
                    found.append(
                        decode_marker(msg.headers(), msg.value(), topic, CONTROL_PARTITION, offset)
                    )
        finally:
            self.scanned += scan.messages
            scan.close()
        return found

    def _is_start(self, marker: Marker) -> bool:
        """Whether a source may start at ``marker``: a full of its run (and state URI)."""
        if self.run_known and marker.run != self.run:
            return False
        # (a state URI is held against markers only once a record was found there: a stray
        # marker read first must not make every real one look foreign)
        if self.state_fixed and not self.state_given and marker.state_uri != self.state_uri:
            return False
        try:
            view = self._open(marker)
        except ConfigError:  # a URI this host cannot open: reported if read in order
            return False
        manifest = marker_manifest(view, marker)
        return manifest is not None and manifest.kind is Kind.FULL

    def _open(self, marker: Marker) -> StreamView:
        # Until a marker's commit record was found at its state URI (or one was given), each
        # marker's own URI is tried: a stray marker cannot pin a wrong one.
        if self.view is None or not self.state_fixed:
            state_uri = (self.state_fixed and self.state_uri) or marker.state_uri
            self.view = StreamView(self.open_store(state_uri), self.target.uri)
            self.state_uri = state_uri
        return self.view

    # ---- the rest of the source protocol ------------------------------------------------------
    def committed_at(self, plan: Plan) -> float:
        """When ``plan``'s step was committed: its commit record's file time at the state URI
        (:func:`deck.serve.live_source.committed_at`)."""
        return committed_at(self.storage, plan)

    def chain_to(self, step: int, exclude: frozenset[str] = frozenset()) -> Plan:
        """Not possible from a topic: a rollback reaches the kept versions only."""
        raise CheckpointNotFoundError(
            f"{self.uri}: step {step} is not among the kept versions, and a Kafka source does "
            "not read its topic backwards; keep more versions (LiveConfig.keep_versions)"
        )

    def saved_at(self, step: int) -> str | None:
        """The trainer checkpoint committed at ``step`` now, at the state URI
        (:func:`deck.serve.live_source.saved_at`); None before any marked step was read."""
        return None if self.view is None else saved_at(self.view, step)

    def close(self) -> None:
        """Close the partition consumers (when the model is done with this source)."""
        for r in self.readers.values():
            r.close()
        self.readers = {}
