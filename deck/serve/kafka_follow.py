"""``deck follow kafka://host:port/topic``: the loading service of a Kafka publisher.

One consumer per partition (all in one process, polled by the loop that applies the steps: a
step needs every rank's rows anyway, so applying is sequential; each consumer reads only what
the next marker needs, which bounds memory to about one step's rows). For each marker of the
control partition, in order (a marker of another run than the one served, ``--run`` or the
held state's or the newest marker's at start, is refused):

1. read the step's commit record and rank manifests from the state URI the marker names;
2. pull each rank's table files of that step from its partition (segments checksummed; files
   of steps without a marker -- failed publishes -- are dropped as they pass). A partition
   without a resume point (a fresh loader) is opened at where the step's segments begin, as
   the publisher recorded it beside the rank manifest (:func:`recorded_start`), not at its
   oldest message; a hint only: should the step's files not all be found from there, the
   partition is read again from its oldest message (:class:`PartitionReader`);
3. a full is materialised, a delta of the held state is applied onto it -- the same
   :class:`deck.serve.follow.Follower` and output (``state.safetensors`` + ``state.json``) as
   ``deck follow`` of a directory, reading through :class:`StreamView`;
4. the state record (in ``state.safetensors``' metadata: one rename switches data and record,
   :func:`deck.serve.follow.read_state`) holds the resume point: the stream offsets after the
   step, the marker applied, the run, the steps applied since the last loader full; then the
   consumer group's offsets are committed (for lag monitoring: the resume point is the one
   written with the state, so a crash between the two re-reads a step and skips it as held);
5. every ``full_every`` applied steps (counted in the state record), the held state is written
   to ``full_uri`` as a deck full checkpoint with the stream offsets it covers (a "loader
   full", :mod:`deck.serve.kafka_full`):
   ``deck verify`` checks it, a trainer restores from it (``DeckConfig(uri=full_uri)``), and a
   loader whose ``--out`` holds no usable state starts from the newest one of its run and reads
   the stream after its offsets, so recovery never replays the topic from its start.

With ``parquet`` (``--format parquet``) the same Parquet output as ``deck follow --format
parquet`` of a directory is written beside the state (:class:`deck.serve.parquet_output.ParquetOutput`):
a full folder when a full is materialised, a delta folder of the changed rows per applied step.

Nothing the topic holds stops the loader for good (docs/reliability.md, "The Kafka loader
against a hostile topic"): a
message that fails to decode is quarantined (:mod:`deck.serve.kafka_guard`, ``<out>/quarantine.json``),
a marker of another run is refused, a step whose rows cannot all be read and a delta whose
parent is not the held state (retention removed earlier messages, a publish whose marker was
lost, a quarantined step) are skipped: the loader keeps serving what it holds, says so in an
ERROR line, and moves on at the next full it can prove.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deck.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DeckError,
    NotFoundError,
    StorageError,
    UnsupportedError,
)
from deck.failpoints import failpoint
from deck.format.manifest import MANIFEST, CheckpointManifest, Kind, load_model, step_dir
from deck.format.quantize import QuantizedStateError
from deck.format.stream import (
    CONSUMER_SETS,
    CONTROL_PARTITION,
    MAX_START_BYTES,
    CorruptStreamError,
    KafkaTarget,
    Marker,
    Segment,
    StepStart,
    StreamGapError,
    decode_marker,
    decode_segment,
    decode_start,
    is_stream_file,
    kafka_client_log,
    options_deck_sets,
    parse_kafka_uri,
    rank_partition,
    start_key,
    valid_run,
)
from deck.read.catalog import read_manifests, read_rank_manifests
from deck.serve.follow import Follower, FollowUpdate, state_record
from deck.serve.kafka_full import newest_loader_full, stream_record_path, write_loader_full
from deck.serve.kafka_guard import QuarantineLog, marker_at, newest_run, watermarks
from deck.serve.output import parquet_outputs
from deck.storage import Storage, open_storage
from deck.storage.base import get_bounded, names_after
from deck.storage.outage import Waiting
from deck.storage.wrapper import StorageWrapper

logger = logging.getLogger(__name__)

# How long a reader opened at a recorded start at or past the partition's listed end waits for
# the message there before it reads from the oldest one instead. The record may be right (the
# listed end may lag: docs/operations.md, the Tansu quirk); a broker that offers nothing past
# the real end (Tansu) sends no end-of-partition event to say it is wrong.
HINT_WAIT_S = 2.0
# The bytes of later steps' segments a partition's reader keeps for their markers. A publisher
# has a few checkpoints in flight at most; another run publishing higher steps to the topic, or
# a forged flood, would otherwise grow the loader's memory without end (a break-it finding).
AHEAD_MAX_BYTES = 1 << 30


class _Named(StorageWrapper):
    """A store read under another URI's name: a loader full materialised as the topic's state."""

    def __init__(self, inner: Storage, uri: str) -> None:
        super().__init__(inner)
        self._uri = uri

    @property
    def uri(self) -> str:
        return self._uri


class StreamView(StorageWrapper):
    """The state URI as :class:`Follower` reads it: table files come from the rows pulled off the
    stream (:attr:`files`), and only the steps in :attr:`visible` are listed."""

    def __init__(self, state: Storage, uri: str) -> None:
        super().__init__(state)
        self._uri = uri
        self.files: dict[str, bytes] = {}
        self.visible: set[int] = set()

    @property
    def uri(self) -> str:
        return self._uri

    def local_path(self, path: str = "") -> str | None:
        return None

    iter_get = Storage.iter_get
    get_many = Storage.get_many
    get_or_none = Storage.get_or_none
    map_file = Storage.map_file

    def _held(self, path: str) -> bytes:
        data = self.files.get(path)
        if data is None:
            raise NotFoundError(f"{self._uri}: {path} is not among the rows pulled off the stream")
        return data

    def get(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        if is_stream_file(path):
            return self._held(path)[start:end]
        return self.inner.get(path, start, end)

    def size(self, path: str) -> int:
        return len(self._held(path)) if is_stream_file(path) else self.inner.size(path)

    def exists(self, path: str) -> bool:
        return path in self.files if is_stream_file(path) else self.inner.exists(path)

    def list_dir(self, prefix: str = "") -> list[str]:
        if prefix:
            return self.inner.list_dir(prefix)
        return [f"{step_dir(s)}/" for s in sorted(self.visible)]

    def list_dir_after(self, prefix: str, after: str) -> list[str]:
        return names_after(self.list_dir(prefix), after)

    def put(self, path: str, data: bytes | bytearray | memoryview) -> None:
        raise StorageError(f"{self._uri}: the loader's view is read-only")

    def delete(self, path: str) -> None:
        raise StorageError(f"{self._uri}: the loader's view is read-only")


def _step_of(key: str) -> tuple[int, str]:
    """(step, checkpoint id) of a stream file key ``step-N/<id>/rank-.../...``."""
    head, ckpt_id = key.split("/", 2)[:2]
    return int(head[5:]), ckpt_id


class PartitionReader:
    """One partition's consumer, read on demand; messages read past the current need wait in
    :attr:`ahead`.

    ``offset``: where it reads from (a resume point: a step whose files are not all found
    past it is read again from the oldest message, once). ``first``: where the step the
    reader is opened for begins on the partition, as its
    publisher recorded it (:func:`recorded_start`). A hint, so past ``offset`` only: the reader
    starts there, :attr:`hint` holds it until the first message read proves it (that message is
    at its offset and a segment of its step and rank) and :attr:`rewind_to` keeps ``offset``,
    where :func:`pull_files` reads from again if it does not, or if a step's files are not all
    found from there (a forged, stale or foreign record). No upper bound is checked here: the
    partition's end that ListOffsets lists may lag (see :meth:`at_end`); an offset past the real
    end reads nothing and reaches an end, which rewinds."""

    def __init__(
        self,
        conf: dict[str, Any],
        target: KafkaTarget,
        partition: int,
        offset: int,
        first: StepStart | None = None,
    ):
        from confluent_kafka import Consumer

        self.target, self.topic, self.partition = target, target.topic, partition
        self.consumer = Consumer(conf)
        low, _ = self.watermarks()
        # Retention removed messages the loader needs: it reads from the oldest one left and
        # (the follower's business) waits for a full it can prove.
        self.gap: str | None = None
        if offset < low:
            self.gap = (
                f"partition {partition}: the loader needs offset {offset} but the oldest "
                f"message is {low} (retention removed {low - offset})"
            )
            offset = low
        self.rewind_to: int | None = None
        self.hint: StepStart | None = None
        if first is not None and first.offset > offset:
            self.rewind_to, self.hint, offset = offset, first, first.offset
        elif offset > low:
            # A resume point saved after a recorded start can lie past segments of later
            # steps (publishes interleaved on the partition, a forged record): a step whose
            # files are not all found from it is read again from the oldest message, once.
            self.rewind_to = low
        self.messages = 0  # messages read, and their value bytes: what a start costs
        self.bytes = 0
        self.ahead: list[Segment] = []
        self.said_ahead = False  # (the cap on :attr:`ahead` reached: said once)
        self.position = offset
        self.eof: int | None = None
        self.consumer.assign([self._at(offset)])

    def _at(self, offset: int) -> Any:
        from confluent_kafka import TopicPartition

        return TopicPartition(self.topic, self.partition, offset)

    def rewind(self, why: str) -> None:
        """Read again from :attr:`rewind_to` (once): the recorded start the reader began at
        was wrong (``why``)."""
        assert self.rewind_to is not None
        logger.warning(
            "deck follow: kafka topic %s partition %d: %s: reading the partition again from "
            "offset %d",
            self.topic,
            self.partition,
            why,
            self.rewind_to,
        )
        offset, self.rewind_to, self.hint, self.ahead = self.rewind_to, None, None, []
        self.position = offset
        self.eof = None
        # A seek, not a new assignment: librdkafka drops what it fetched before the seek.
        self.consumer.seek(self._at(offset))

    def watermarks(self) -> tuple[int, int]:
        return watermarks(self.consumer, self._at(0), self.target)

    def poll(self, timeout: float) -> Any | None:
        msg = self.consumer.poll(timeout)
        if msg is None:
            return None
        err = msg.error()
        if err is not None:
            if err.code() == -191:  # _PARTITION_EOF: a fetch found nothing past this offset
                self.eof = int(msg.offset() or 0)
                return None
            raise StorageError(f"kafka topic {self.topic} partition {self.partition}: {err}")
        self.position = int(msg.offset() or 0) + 1
        self.messages += 1
        self.bytes += len(msg.value() or b"")
        return msg

    def at_end(self) -> bool:
        """A fetch since :attr:`eof` was last cleared reached the end at this position. The
        fetch response's high watermark is exact; the ListOffsets one :meth:`watermarks` reads
        is not always (Tansu 0.6 reports a multi-message batch's first offset + 1)."""
        return self.eof is not None and self.eof >= self.position

    def end_confirmed(self) -> bool:
        """:meth:`at_end`, and the broker lists nothing past that end. An end event queued
        before messages that arrived since (a previous step's pull waited at the end) says
        nothing about them: it is dropped here, so a reader with a rewind armed does not read
        the whole partition again on it. One ListOffsets request, made only when a rewind
        would otherwise follow."""
        if not self.at_end():
            return False
        assert self.eof is not None
        if self.eof < self.watermarks()[1]:
            self.eof = None
            return False
        return True

    def drained(self) -> bool:
        """Nothing more to read now: :meth:`end_confirmed`, or the position at the high
        watermark (which never lies past the end, so this never waits for messages that do not
        exist). Not a bare :meth:`at_end`: on a loaded host the end event of a fetch made before
        the newest messages arrived can come after the caller cleared :attr:`eof`, and a live
        source then passed the newest marker by for a poll (seen as a flaky test). The high
        watermark is the larger of the broker's ListOffsets answer and the last fetch
        response's (a break-it finding: Tansu's ListOffsets counts a batch as one message, and
        `deck follow --once` of a topic a mirror wrote in batches stopped at its first step,
        "up to date", once a copy of a marker was passed over)."""
        return self.end_confirmed() or self.position >= max(
            self.watermarks()[1], self._fetched_high()
        )

    def _fetched_high(self) -> int:
        """The high watermark of the last fetch response (-1: none yet)."""
        try:
            return int(self.consumer.get_watermark_offsets(self._at(0), cached=True)[1])
        except Exception:  # (no fetch answered yet: nothing cached)
            return -1

    def resume_offset(self) -> int:
        return min([s.offset for s in self.ahead], default=self.position)

    def commit(self, offset: int) -> None:
        from confluent_kafka import TopicPartition

        try:
            self.consumer.commit(
                offsets=[TopicPartition(self.topic, self.partition, offset)], asynchronous=False
            )
        except Exception as e:  # the resume point is state.json's; the group's is for lag
            logger.warning("deck follow: committing offsets of partition %d: %s", self.partition, e)

    def close(self) -> None:
        self.consumer.close()


class _StreamFollower(Follower):
    """A Follower whose state.json also records the stream offsets after its step."""

    stream: dict[str, Any]

    def sidecar_extra(self) -> dict[str, Any]:
        return {"stream": self.stream}


class UnprovableStepError(StreamGapError):
    """A marked step's rows cannot all be read (a message of its partition was quarantined, or
    retention removed them): the step is skipped, not applied."""


def consumer_conf(
    target: KafkaTarget, group: str, options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The consumer settings of a stream reader: ``group`` (offsets are committed by hand, for
    lag monitoring), end-of-partition events, a bounded prefetch; ``options`` added last (none
    of those deck sets: :class:`ConfigError`)."""
    problem = options_deck_sets(options or {}, CONSUMER_SETS)
    if problem is not None:
        raise ConfigError(f"consumer options of {target.uri}: {problem}")
    return {
        "bootstrap.servers": target.bootstrap,
        "group.id": group,
        "logger": kafka_client_log(),
        "enable.auto.commit": False,
        # End-of-partition events tell "nothing more" exactly (see PartitionReader.at_end).
        "enable.partition.eof": True,
        # An offset retention removed since it was chosen (a seek back, a resume point) reads
        # from the oldest message left, whose rows are checked like any others; librdkafka's
        # default would jump to the end and lose the step.
        "auto.offset.reset": "earliest",
        # librdkafka prefetches: bound it, a reader holds about one step anyway.
        "queued.max.messages.kbytes": 16384,
        **(options or {}),
    }


# Steps of left timelines remembered (see KafkaFollower._rollback_around): a rollback leaves at
# most the steps its publisher had gone past, and the loader meets them once
LEFT_KEPT = 4096


def marker_manifest(view: StreamView, marker: Marker) -> CheckpointManifest | None:
    """The commit record ``marker`` names, at the state URI ``view`` reads; None (logged) when
    that step's record is missing or is another checkpoint's (replaced by a later publish of the
    same step, a rollback: its own marker follows)."""
    m = record_at(view, marker.step)
    if m is None or m.id != marker.ckpt_id:
        logger.warning(
            "deck follow: marker of step %d (%s) names no commit record at %s: skipped",
            marker.step,
            marker.ckpt_id,
            view.describe(f"{step_dir(marker.step)}/{MANIFEST}"),
        )
        return None
    return m


def record_at(view: StreamView, step: int) -> CheckpointManifest | None:
    """The commit record of trainer step ``step`` at the state URI ``view`` reads; None when
    there is none."""
    key = f"{step_dir(step)}/{MANIFEST}"
    try:
        return load_model(CheckpointManifest, get_bounded(view, key), view.describe(key))
    except NotFoundError:
        return None


def recorded_start(view: Storage, manifest: CheckpointManifest, rank: int) -> StepStart | None:
    """Where ``rank``'s segments of the step of ``manifest`` begin on its partition, as its
    publisher recorded it at the state URI (:class:`deck.format.stream.StepStart`); None when
    there is no usable record (a publisher before them: the partition is read from its oldest
    message). A usable record is still only a hint (see :class:`PartitionReader`)."""
    key = start_key(manifest.step, manifest.id, rank)
    try:
        raw = view.get_or_none(key, MAX_START_BYTES)
        if raw is None:
            logger.info(
                "deck follow: %s: no recorded start of rank %d's rows (a publisher before "
                "them): its partition is read from its oldest message",
                view.describe(key),
                rank,
            )
            return None
        return decode_start(raw, manifest.step, manifest.id, rank)
    except (ValueError, CorruptCheckpointError) as e:
        logger.warning(
            "deck follow: %s: not used (%s): rank %d's partition is read from its oldest message",
            view.describe(key),
            e,
            rank,
        )
        return None


def pull_files(
    reader: PartitionReader,
    rank: int,
    marker: Marker,
    need: set[str],
    quarantine: QuarantineLog,
    poisoned: set[int],
    wait_s: float,
) -> dict[str, bytes]:
    """The files ``need`` of ``rank`` (all of the marker's step), off its partition ``reader``.

    Every segment is checksummed (:func:`deck.format.stream.decode_segment`); one that fails is
    quarantined and its partition added to ``poisoned``. Segments of later steps wait in
    ``reader.ahead`` for their markers; those of unmarked (failed) publishes are dropped. A
    reader opened at a recorded start (:attr:`PartitionReader.rewind_to`) whose first message
    is not the step's segment there, or that reaches an end with a file incomplete, reads the
    partition again from where it would have begun. Raises
    :class:`UnprovableStepError` when a file cannot be completed: the partition held a
    quarantined message and reached its end, or after ``wait_s`` nothing more is there."""
    pieces: dict[str, dict[int, bytes]] = {}
    counts: dict[str, int] = {}
    keep: list[Segment] = []
    kept = [0]  # bytes in ``keep``

    def take(seg: Segment) -> None:
        step, _ = _step_of(seg.key)
        if step > marker.step:
            keep.append(seg)  # a later step's: its marker comes later
            kept[0] += len(seg.data)
            if kept[0] > AHEAD_MAX_BYTES:
                kept[0] = shed(reader, keep, marker)
        elif seg.key in need:
            pieces.setdefault(seg.key, {})[seg.seg] = seg.data
            counts[seg.key] = seg.segs
        # else: a publish that never got a marker (failed), or older than held: dropped

    def complete() -> bool:
        return all(len(pieces.get(k, ())) == counts.get(k, -1) for k in need)

    def rewind(why: str) -> None:
        reader.rewind(why)
        pieces.clear()
        keep.clear()
        kept[0] = 0

    ahead, reader.ahead = reader.ahead, []
    for seg in ahead:
        take(seg)
    deadline = time.monotonic() + wait_s
    hint_deadline = time.monotonic() + min(wait_s, HINT_WAIT_S)
    while not complete():
        msg = reader.poll(0.2)
        if msg is not None:
            try:
                seg = decode_segment(
                    msg.headers(), msg.value(), reader.topic, reader.partition, msg.offset()
                )
            except CorruptStreamError as e:
                quarantine.add("poison", reader.partition, int(msg.offset()), msg.value(), str(e))
                poisoned.add(reader.partition)
                continue
            hint, reader.hint = reader.hint, None
            if hint is not None and not hint.begins(int(msg.offset()), seg.key):
                rewind(
                    f"offset {msg.offset()} ({seg.key}) is not where the recorded start of "
                    f"step {hint.step} ({hint.ckpt_id}) says its rows begin ({hint.offset})"
                )
                continue
            take(seg)
            continue
        bad = reader.partition in poisoned
        # Segments are acknowledged before their marker is produced: once a fetch after the
        # marker was read reached the end, what is missing is not coming. A reader that began
        # at a recorded start reads from where it would have begun instead (the record may
        # lie; the files found are checked whatever their offsets). A quarantined message
        # explains it at once; otherwise wait_s allows for a lagging broker.
        waited = time.monotonic() > deadline and reader.drained()
        if reader.rewind_to is not None and (waited or reader.end_confirmed()):
            rewind(f"the files of step {marker.step} are not all after the recorded start")
            continue
        if reader.hint is not None and time.monotonic() > hint_deadline and reader.drained():
            rewind(f"nothing at the recorded start {reader.hint.offset} (past the end?)")
            continue
        # Confirmed, not a bare at_end(): an end event queued behind a stray message, before
        # this step's files arrived, made a running loader skip a good full.
        if (bad and reader.end_confirmed()) or waited:
            missing = sorted(k for k in need if len(pieces.get(k, ())) != counts.get(k, -1))
            reader.ahead = keep  # later steps' segments stay for their markers
            raise UnprovableStepError(
                f"partition {reader.partition} lacks {len(missing)} of rank {rank}'s "
                f"files (first: {missing[0]}): "
                + ("it held a quarantined message" if bad else "retention removed them?")
            )
    reader.ahead = keep
    return {k: b"".join(v[i] for i in range(counts[k])) for k, v in pieces.items()}


def shed(reader: PartitionReader, keep: list[Segment], marker: Marker) -> int:
    """Cut ``keep`` (later steps' segments, in place) to :data:`AHEAD_MAX_BYTES`, the farthest
    steps dropped first: the next step's files are what a publisher sends next, far-off steps
    are most likely not this run's. A step whose segment was dropped cannot be proven from the
    stream: the loader moves on at the next full, as after a lost message. Returns the bytes
    left."""
    keep.sort(key=lambda s: (_step_of(s.key)[0], s.offset))
    total, cut = 0, len(keep)
    for i, s in enumerate(keep):
        if total + len(s.data) > AHEAD_MAX_BYTES:
            cut = i
            break
        total += len(s.data)
    dropped = keep[cut:]
    del keep[cut:]
    if dropped and not reader.said_ahead:
        reader.said_ahead = True
        logger.warning(
            "deck follow: kafka topic %s partition %d: over %d MiB of segments of steps after "
            "step %d wait for their markers (steps %d-%d); those of the farthest steps are "
            "dropped (another run publishing higher steps to this topic, or messages not a "
            "publisher's?); a step that needed them is passed by until the next full. Said once",
            reader.topic,
            reader.partition,
            AHEAD_MAX_BYTES >> 20,
            marker.step,
            _step_of(dropped[0].key)[0],
            _step_of(dropped[-1].key)[0],
        )
    return total


@dataclass
class KafkaFollowStats:
    """What a loader did since it started."""

    applied: list[int] = field(default_factory=list)  # steps applied (in order)
    skipped: list[int] = field(default_factory=list)  # markers of steps already held
    fulls: list[str] = field(default_factory=list)  # loader fulls written (keys)
    unproven: list[int] = field(default_factory=list)  # steps not applied: rows lost/damaged
    foreign: list[int] = field(default_factory=list)  # markers of another run, refused


class KafkaFollower:
    """The materialised state of a Kafka publish topic in ``out_dir`` (see the module doc)."""

    def __init__(
        self,
        uri: str,
        out_dir: str,
        *,
        state_uri: str | None = None,
        open_store: Callable[[str], Storage] = open_storage,
        group: str | None = None,
        full_store: Storage | None = None,
        full_every: int = 0,
        consumer_options: dict[str, Any] | None = None,
        allow_quantized: bool = False,
        parquet: bool = False,
        wait_s: float = 10.0,
        run: str | None = None,
    ):
        self.target = parse_kafka_uri(uri)
        if run is not None and not valid_run(run):
            raise ConfigError(f"run {run!r}: a run identity is 1-64 of [0-9a-zA-Z._-]")
        self.out_dir = out_dir
        self.state_uri = state_uri
        # Opens the state URI the markers name (or ``state_uri``): the caller's credentials
        self.open_store = open_store
        self.allow_quantized = allow_quantized
        self.parquet = parquet  # also write deck follow's Parquet output (deck.serve.output)
        self.wait_s = wait_s  # how long a rank's rows may take to show up after their marker
        self.full_every = full_every
        self.full_store = full_store  # where loader fulls go (None: none are written)
        if full_every < 0:
            raise ConfigError(f"full_every must be >= 0 (0: no loader fulls), got {full_every}")
        if full_every and self.full_store is None:
            raise ConfigError(
                "full_every needs full_store (--full-uri: where the loader's fulls go)"
            )
        self.conf = consumer_conf(
            self.target, group or f"deck-follow-{self.target.topic}", consumer_options
        )
        if os.path.exists(out_dir) and not os.path.isdir(out_dir):
            raise ConfigError(f"--out {out_dir} is not a directory: name a folder for the state")
        os.makedirs(out_dir, exist_ok=True)
        self.quarantine = QuarantineLog(out_dir, self.target.topic)
        self.stats = KafkaFollowStats()
        # Why the loader waits for a full it can prove (a quarantined message, a recreated or
        # retention-trimmed topic, a delta whose parent it never held); None: it does not.
        self._lost: str | None = None
        # Deltas skipped as steps of a timeline the publisher left by a rollback (the newest
        # LEFT_KEPT): a delta on one of them is of that timeline too
        self._left: dict[tuple[int, str], None] = {}
        self._poisoned: set[int] = set()  # partitions with a quarantined message
        record = self._record()
        held_run = ((record or {}).get("stream") or {}).get("run")
        if run is not None and held_run is not None and held_run != run:
            raise ConfigError(
                f"out_dir {out_dir} serves run {held_run}, not {run}; use another directory "
                "to follow that run"
            )
        record = self._restore_full(record, run)
        self._held_at_start = (
            None if record is None else (int(record["step"]), str(record["checkpoint"]))
        )
        stream = (record or {}).get("stream") or {}
        held_run = stream.get("run")
        # The run served: pinned (--run), else the held state's, else adopted at the first
        # poll (the newest marker's run). A held state of a deck before run ids: None.
        self.run: str | None = run or held_run
        self._run_known = run is not None or record is not None
        self._state_given = state_uri is not None  # --state-uri: markers' URIs are not used
        self.offsets: dict[int, int] = self._saved_offsets(record)
        self._state_fixed = self.state_uri is not None
        # The held step's marker (offset, step, id, epoch), as the state record says
        held_marker = stream.get("marker")
        self._held_marker: dict[str, Any] | None = (
            held_marker if isinstance(held_marker, dict) else None
        )
        self._kept_at: tuple[int, int] | None = None  # (position, end) found kept
        self._check_resume_point(stream)
        self.readers: dict[int, PartitionReader] = {}
        self.follower: _StreamFollower | None = None
        self.view: StreamView | None = None
        # Steps applied since the newest loader full, from the state record (on disk), so a
        # loader that keeps crashing still writes its recovery points.
        self._since_full = int(stream.get("since_full", 0))
        if record is not None and self._since_full and self.full_store is not None:
            newest = newest_loader_full(self.full_store)
            if newest is not None and newest[0].step == int(record["step"]):
                self._since_full = 0
        self._last: tuple[CheckpointManifest, list[Any]] | None = None  # for write_full

    # ---- start ------------------------------------------------------------------------------
    def held(self) -> tuple[int, str] | None:
        """(step, checkpoint id) of the state ``out_dir`` holds now, or None."""
        record = self._record()
        return None if record is None else (int(record["step"]), str(record["checkpoint"]))

    def _record(self) -> dict[str, Any] | None:
        """The held state's record (from the data file: the one atomic switch), or None when
        ``out_dir`` holds no usable state (then a loader full, if any, is started from)."""
        try:
            return state_record(self.out_dir)
        except (OSError, ValueError, KeyError, TypeError, DeckError) as e:
            logger.warning(
                "deck follow: the state in %s is unusable (%s): starting without it",
                self.out_dir,
                e,
            )
            return None

    def _check_resume_point(self, stream: dict[str, Any]) -> None:
        """The marker of the held step must still be where the state record says: otherwise
        the topic was recreated or truncated (a broker that lost its data), the saved offsets
        mean nothing, and the loader reads the topic from its start, waiting for a full."""
        mk = stream.get("marker")
        if not isinstance(mk, dict) or not self.offsets:
            return
        if not all(isinstance(mk.get(k), t) for k, t in (("offset", int), ("step", int))):
            return  # a damaged record: the readers' offsets are all there is to go by
        what, m = marker_at(self.conf, self.target, int(mk["offset"]))
        if what == "gone":  # retention: the reader's own check reports what it still needs
            return
        if what == "marker" and (m.step, m.ckpt_id) == (mk["step"], mk["id"]):
            return
        logger.error(
            "deck follow: kafka topic %s partition 0 offset %s no longer holds the marker of the "
            "held step %s (%s): the topic was recreated or truncated; reading it from its start "
            "and serving step %s until a full the loader can prove",
            self.target.topic,
            mk["offset"],
            mk["step"],
            what,
            mk["step"],
        )
        self.offsets = {}
        self._lost = "the topic was recreated or truncated"

    def _saved_offsets(self, meta: dict[str, Any] | None) -> dict[int, int]:
        if meta is None:
            return {}
        stream = meta.get("stream") or {}
        if meta.get("uri") != self.target.uri:
            raise ConfigError(
                f"out_dir {self.out_dir} follows {meta.get('uri')}, not {self.target.uri}; use "
                "another directory"
            )
        self.state_uri = self.state_uri or stream.get("state_uri")
        return {int(p): int(o) for p, o in stream.get("offsets", {}).items()}

    def _restore_full(
        self, record: dict[str, Any] | None, run: str | None
    ) -> dict[str, Any] | None:
        """An ``out_dir`` without a usable state, or with an older one of the same run, starts
        from the newest loader full at ``full_uri`` of that run, if any: its state is
        materialised (as from any full) with its stream offsets as the resume point. Returns
        the state record then held."""
        if self.full_store is None:
            return record
        found = newest_loader_full(self.full_store)
        if found is None:
            return record
        m, stream = found
        if record is not None:
            held_run = (record.get("stream") or {}).get("run")
            if stream.get("run") != held_run or int(record["step"]) >= m.step:
                return record  # only a newer full of the run held replaces the held state
        elif run is not None and stream.get("run") != run:
            logger.error(
                "deck follow: the newest loader full at %s (step %d) is of run %s, not %s: "
                "not started from",
                self.full_store.uri,
                m.step,
                stream.get("run"),
                run,
            )
            return record
        if stream.get("topic") != self.target.topic:
            raise ConfigError(
                f"full_uri {self.full_store.uri}: its newest loader full (step {m.step}) was "
                f"written from topic {stream.get('topic')!r}, not {self.target.topic!r}; use the "
                "full_uri of this topic's loader"
            )
        fol = _StreamFollower(
            _Named(self.full_store, self.target.uri),
            self.out_dir,
            allow_quantized=self.allow_quantized,
            outputs=parquet_outputs(self.parquet, self.out_dir, self.target.uri),
        )
        fol.stream = {**stream, "since_full": 0}
        fol.materialise(m.step)
        logger.info(
            "deck follow: started from the loader full %s", self.full_store.describe(m.folder)
        )
        return self._record()

    def _reader(self, partition: int, first: StepStart | None = None) -> PartitionReader:
        r = self.readers.get(partition)
        if r is None:
            offset = self.offsets.get(partition, 0)
            r = PartitionReader(self.conf, self.target, partition, offset, first)
            self.readers[partition] = r
            if r.gap is not None:
                self._lose(r.gap)
        return r

    def _open(self, marker: Marker) -> _StreamFollower:
        # Until a marker's commit record was found at its state URI (or the URI was given or
        # held), each marker's own URI is tried: a stray marker cannot pin a wrong one.
        if self.follower is None or not self._state_fixed:
            state_uri = (self._state_fixed and self.state_uri) or marker.state_uri
            self.view = StreamView(self.open_store(state_uri), self.target.uri)
            self.follower = _StreamFollower(
                self.view,
                self.out_dir,
                allow_quantized=self.allow_quantized,
                outputs=parquet_outputs(self.parquet, self.out_dir, self.target.uri),
            )
            self.state_uri = state_uri
        return self.follower

    # ---- one step ---------------------------------------------------------------------------
    def poll(self, timeout: float = 1.0) -> FollowUpdate | None:
        """Apply the next marked step if one arrives within ``timeout``; None otherwise."""
        if not self._run_known:
            self._adopt_run()
        ctl = self._reader(CONTROL_PARTITION)
        msg = ctl.poll(timeout)
        if msg is None:
            self._check_topic_kept(ctl)
            return None
        try:
            marker = decode_marker(
                msg.headers(), msg.value(), self.target.topic, CONTROL_PARTITION, msg.offset()
            )
        except CorruptStreamError as e:
            self.quarantine.add("poison", CONTROL_PARTITION, int(msg.offset()), msg.value(), str(e))
            self._lose(f"the message at partition 0 offset {msg.offset()} was quarantined")
            return None
        for p, r in self.readers.items():
            if p != CONTROL_PARTITION:
                r.eof = None  # an end seen before this marker says nothing about its rows
        if self._run_known and marker.run != self.run:
            self.quarantine.add(
                "foreign",
                CONTROL_PARTITION,
                marker.offset,
                msg.value(),
                f"marker of step {marker.step} ({marker.ckpt_id}) of run {marker.run}, but "
                f"this loader serves run {self.run}; to follow run {marker.run}, start a "
                f"loader on another --out with --run {marker.run}",
            )
            self.stats.foreign.append(marker.step)
            return None
        return self._apply_marker(marker)

    @property
    def _held_epoch(self) -> int | None:
        """The held step's epoch (None: a record of a deck before epochs were kept, where a
        copy of an old full is taken for a rollback as it was then)."""
        epoch = (self._held_marker or {}).get("epoch")
        return epoch if isinstance(epoch, int) else None

    def _check_topic_kept(self, ctl: PartitionReader) -> None:
        """While idle: the control partition's end lies before where the loader reads (a
        broker that lost its data, a topic deleted and made again while the loader ran) and
        the held step's marker is no longer at its offset: the topic was recreated. Read it
        from its start then, waiting for a full the loader can prove, as at start; else the
        loader would wait, silently stale, for the new topic to pass its old offsets. The
        end listed is checked first (one request): a broker's listed end may lag behind the
        last message read, so the marker decides (once per position and end: a lag lasts
        until the next message). Nothing held: nothing to be stale, nothing checked."""
        end = ctl.watermarks()[1]
        mk = self._held_marker
        if ctl.position <= end or mk is None or not isinstance(mk.get("offset"), int):
            return
        if self._kept_at == (ctl.position, end):
            return
        what, m = marker_at(self.conf, self.target, int(mk["offset"]))
        if what == "gone" or (
            what == "marker" and (m.step, m.ckpt_id) == (mk.get("step"), mk.get("id"))
        ):
            self._kept_at = (ctl.position, end)  # the listed end lagged (or retention)
            return
        held = self.follower.state if self.follower is not None else self._held_at_start
        logger.error(
            "deck follow: kafka topic %s partition 0 ends at offset %d, before the loader's "
            "position %d: the topic was recreated or truncated while the loader ran; reading "
            "it from its start and serving step %s until a full the loader can prove",
            self.target.topic,
            end,
            ctl.position,
            held[0] if held else "(none)",
        )
        for r in self.readers.values():
            r.close()
        self.readers, self.offsets = {}, {}
        self._lost = "the topic was recreated or truncated"

    def _adopt_run(self) -> None:
        """A loader with no state and no ``--run`` serves the run of the newest marker of the
        topic (a fresh run reusing a topic wins over an older one, and a stray full of another
        model at the head of the topic is not served); with no marker yet, the run of the
        first full it applies."""
        found, run = newest_run(self.conf, self.target)
        if found:
            self.run, self._run_known = run, True
            logger.info("deck follow: serving run %s (the newest marker's)", run)

    def _rollback_around(self, delta: CheckpointManifest) -> str | None:
        """How a publisher's rollback explains that ``delta``'s parent is not held (said
        instead of lost messages), or None: ``delta`` is of a newer timeline than the held
        step, or of one the publisher left (its parent step was published again since, or is
        itself such a step)."""
        if self._held_epoch is not None and delta.epoch > self._held_epoch:
            return "builds on a step of its new timeline this loader never held"
        assert self.view is not None and delta.parent is not None
        parent = (delta.parent, delta.parent_id or "")
        if parent in self._left:
            why = f"is of a timeline it left, as its parent step {delta.parent} is"
        else:
            try:
                now = record_at(self.view, delta.parent)
            except CorruptCheckpointError:
                return None
            if now is None or now.id == delta.parent_id or now.epoch <= delta.epoch:
                return None
            why = (
                f"is of a timeline it left: its parent step {delta.parent} was published again "
                f"(epoch {now.epoch})"
            )
        self._left[(delta.step, delta.id)] = None
        while len(self._left) > LEFT_KEPT:
            del self._left[next(iter(self._left))]
        return why

    def _lose(self, why: str) -> None:
        if self._lost is None:
            held = self.follower.state if self.follower is not None else self._held_at_start
            logger.error(
                "deck follow: kafka topic %s: %s; serving step %s (and the deltas that build on "
                "it); a step that does not waits for a full the loader can prove",
                self.target.topic,
                why,
                held[0] if held else "(none)",
            )
        self._lost = why

    def _apply_marker(self, marker: Marker) -> FollowUpdate | None:
        fol = self._open(marker)
        assert self.view is not None
        held = fol.state
        if held is not None and (marker.step, marker.ckpt_id) == held:
            # Re-read after a crash between the switch and the offsets: nothing to change.
            self.stats.skipped.append(marker.step)
            return None
        # A marker read after the held one (the loader resumes past it) at a step not newer is
        # the publisher's rollback (a restore, then a new timeline): its full replaces the held
        # state; its deltas wait for that full (below).
        rollback = held is not None and marker.step <= held[0]
        if self._state_fixed and not self._state_given and marker.state_uri != self.state_uri:
            self.quarantine.add(
                "poison",
                CONTROL_PARTITION,
                marker.offset,
                None,
                f"marker of step {marker.step} ({marker.ckpt_id}) names the state URI "
                f"{marker.state_uri}, but run {self.run}'s state is at {self.state_uri}",
            )
            return None
        try:
            manifest = self._manifest(marker)
        except CorruptCheckpointError as e:
            self._damaged(marker, e)
            return None
        if manifest is None:
            return None
        self._state_fixed = True
        if rollback and self._held_epoch is not None and manifest.epoch <= self._held_epoch:
            # A rollback starts a newer epoch; within one, steps only go forward: this is a
            # copy of a marker already passed (a replay, a mirror's at-least-once delivery)
            logger.warning(
                "deck follow: kafka topic %s: the marker at offset %d (step %d, %s, epoch %d) "
                "is a copy of one of the held timeline (step %s, epoch %d): ignored",
                self.target.topic,
                marker.offset,
                marker.step,
                marker.ckpt_id,
                manifest.epoch,
                held[0] if held else None,
                self._held_epoch,
            )
            self.stats.skipped.append(marker.step)
            return None
        if rollback and manifest.kind is Kind.FULL:
            logger.warning(
                "deck follow: kafka topic %s: the publisher rolled back: step %d (%s, a full of a "
                "new timeline) replaces the held step %s",
                self.target.topic,
                marker.step,
                marker.ckpt_id,
                held,
            )
        if manifest.kind is Kind.DELTA and held != (manifest.parent, manifest.parent_id):
            # Its parent was never applied here (the head of the topic is gone, a step was
            # quarantined, a publish lost its marker): waiting cannot bring it back, and a
            # restart would meet the same delta, so it is skipped until a full.
            rolled = self._rollback_around(manifest)
            if rolled is not None:
                # (a break-it finding: a publisher's rollback was said as lost messages)
                logger.warning(
                    "deck follow: kafka topic %s: the publisher rolled back: step %d (epoch %d) %s",
                    self.target.topic,
                    marker.step,
                    manifest.epoch,
                    rolled,
                )
            else:
                self._lose(
                    f"step {marker.step} (marker at offset {marker.offset}) is a delta of step "
                    f"{manifest.parent} ({manifest.parent_id}), but the loader holds "
                    f"{held or 'nothing'}: the messages between are gone (retention, a "
                    "quarantined message) or were never marked"
                )
            logger.warning(
                "deck follow: kafka topic %s: step %d (a delta of step %s) skipped: the loader "
                "holds %s and waits for a full it can prove",
                self.target.topic,
                marker.step,
                manifest.parent,
                held or "nothing",
            )
            self.stats.unproven.append(marker.step)
            return None
        t0 = time.perf_counter()
        try:
            parts = read_rank_manifests(self.view, manifest)
        except CorruptCheckpointError as e:
            self._damaged(marker, e)
            return None
        files = {f"{manifest.folder}/{c.path}" for p in parts for sh in p.shards for c in sh.chunks}
        try:
            for rank in range(manifest.world_size):
                mine = {k for k in files if f"/rank-{rank:05d}/" in k}
                if mine:  # else its reader opens at the first step it has rows of
                    self.view.files.update(self._pull(rank, marker, manifest, mine))
        except UnprovableStepError as e:
            self.view.files.clear()
            self.stats.unproven.append(marker.step)
            self._lose(f"step {marker.step} ({marker.ckpt_id}) cannot be applied: {e}")
            return None
        failpoint("kafka_follow.fetched")
        fol.stream = self._stream_record(marker, manifest.epoch, self._since_full + 1)
        try:
            if manifest.kind is Kind.FULL:
                self.view.visible = {marker.step}
                update = fol.materialise(marker.step)
            else:
                update = fol.apply([manifest], parts)
        except QuantizedStateError as e:
            # (refused before anything changed) Skipped like a step it cannot prove, so that
            # --once ends where the service would, not failing at this step on every run
            self.stats.unproven.append(marker.step)
            self._lose(f"step {marker.step} ({marker.ckpt_id}) is not applied: {e}")
            return None
        except CorruptCheckpointError as e:  # (the held state is back as it was: Follower)
            self._damaged(marker, e)
            return None
        finally:
            self.view.files.clear()
        update.seconds = time.perf_counter() - t0
        failpoint("kafka_follow.written")
        for p, off in fol.stream["offsets"].items():
            self._reader(int(p)).commit(int(off))
        self.stats.applied.append(marker.step)
        self._held_marker = fol.stream["marker"]
        self._last = (manifest, parts)
        self._since_full += 1
        if manifest.kind is Kind.FULL and self._lost is not None:
            logger.warning(
                "deck follow: kafka topic %s: moved on at the full of step %d (was: %s)",
                self.target.topic,
                marker.step,
                self._lost,
            )
            self._lost = None
        if not self._run_known:
            self.run, self._run_known = marker.run, True
        if self.full_every and self._since_full >= self.full_every:
            self.write_full()
        return update

    def _damaged(self, marker: Marker, e: CorruptCheckpointError) -> None:
        """Step ``marker`` is passed over: its records at the state URI are damaged. Skipped
        like a step the loader cannot prove, until a full (a break-it finding: `--once` failed
        at it on every run for good, a cron's loader serving the step before for ever)."""
        self.stats.unproven.append(marker.step)
        self._lose(f"step {marker.step} ({marker.ckpt_id}) cannot be applied: {e}")

    def _manifest(self, marker: Marker) -> CheckpointManifest | None:
        assert self.view is not None
        return marker_manifest(self.view, marker)

    def _pull(
        self, rank: int, marker: Marker, manifest: CheckpointManifest, need: set[str]
    ) -> dict[str, bytes]:
        """The files ``need`` of ``rank`` (all of the marker's step), off its partition. A
        partition with no resume point (a fresh loader, a rank first seen) is opened at the
        step's recorded start: the segments before it are of steps the loader never applies
        (another run's, deltas of a parent it never held, failed publishes)."""
        p = rank_partition(rank)
        first: StepStart | None = None
        if p not in self.readers and p not in self.offsets:
            assert self.view is not None
            first = recorded_start(self.view, manifest, rank)
        reader = self._reader(p, first)
        return pull_files(reader, rank, marker, need, self.quarantine, self._poisoned, self.wait_s)

    def _stream_record(self, marker: Marker, epoch: int, since_full: int) -> dict[str, Any]:
        """The resume point written with the state: offsets after the step, the marker applied
        (to recognise a recreated topic), the run, and the steps since the last loader full."""
        # A partition not read since the start (its rank had no rows since) keeps its offset.
        offsets = {str(p): o for p, o in self.offsets.items()}
        offsets.update({str(p): r.resume_offset() for p, r in self.readers.items()})
        offsets[str(CONTROL_PARTITION)] = marker.offset + 1
        return {
            "topic": self.target.topic,
            "state_uri": self.state_uri,
            "offsets": offsets,
            "run": marker.run,
            "marker": {
                "offset": marker.offset,
                "step": marker.step,
                "id": marker.ckpt_id,
                "epoch": epoch,
            },
            "since_full": since_full,
        }

    # ---- loader fulls -----------------------------------------------------------------------
    def write_full(self) -> str | None:
        """Write the held state as a deck full at ``full_uri`` with its stream offsets
        (:func:`deck.serve.kafka_full.write_loader_full`); returns its folder."""
        fol, last = self.follower, self._last
        if self.full_store is None or fol is None or last is None or self.view is None:
            return None
        if fol.encodings:
            raise UnsupportedError(
                f"kafka topic {self.target.topic}: the loader holds weights dequantised from "
                f"{sorted(fol.encodings)}; a loader full would not be the trained state: "
                "drop full_uri or publish without quantize"
            )
        m, parts = last
        folder = write_loader_full(
            self.full_store, self.view.inner, m, parts, fol.targets(), fol.stream
        )
        self.stats.fulls.append(folder)
        self._since_full = 0
        return folder

    # ---- loops ------------------------------------------------------------------------------
    def catch_up(self, on_update: Callable[[FollowUpdate], None] | None = None) -> int:
        """Apply every marker in the topic now; returns how many steps were applied."""
        n = 0
        self._reader(CONTROL_PARTITION).eof = None  # only an end reached in this catch-up counts
        while True:
            update = self.poll(0.5)
            if update is not None:
                n += 1
                if on_update is not None:
                    on_update(update)
            elif self._reader(CONTROL_PARTITION).drained():  # (a new one after a recreation)
                return n

    def close(self) -> None:
        for r in self.readers.values():
            r.close()
        self.readers = {}


def follow_kafka(
    uri: str,
    out_dir: str,
    *,
    once: bool = False,
    on_update: Callable[[FollowUpdate], None] | None = None,
    poll_s: float = 2.0,
    **kwargs: Any,
) -> KafkaFollower:
    """Run the Kafka loading service (see the module doc): with ``once``, apply what the topic
    holds and return; otherwise follow it until interrupted."""
    kf = KafkaFollower(uri, out_dir, **kwargs)
    try:
        if once:
            kf.catch_up(on_update)
            return kf
        waiting = Waiting(f"deck follow {uri}", poll_s, logger)
        while True:
            try:
                update = kf.poll(1.0)
                waiting.ok()
            except ConfigError:
                raise  # waiting does not fix it
            except DeckError as e:  # the broker or the state URI is down, the topic not there yet
                time.sleep(waiting.failed(e))
                continue
            if update is not None and on_update is not None:
                on_update(update)
    finally:
        kf.close()


def loader_fulls(store: Storage) -> list[dict[str, Any]]:
    """The stream records of the loader fulls at ``store`` (step, offsets), oldest first."""
    out = []
    for m in sorted(read_manifests(store).values(), key=lambda m: m.step):
        with contextlib.suppress(NotFoundError):
            rec = json.loads(store.get(stream_record_path(m.step, m.id)))
            out.append({"step": m.step, "checkpoint": m.id, **rec})
    if not out:
        raise CheckpointNotFoundError(f"no loader fulls at {store.uri}")
    return out
