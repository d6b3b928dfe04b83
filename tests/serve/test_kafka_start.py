"""Where a (re)started reader of a Kafka publish topic begins on the rank partitions, on a real
broker (Tansu), with a synthetic 2-rank publisher on the real sink:

- a restarted :class:`deck.serve.live_kafka.KafkaSource` reads each rank partition from where
  the newest full's rows begin (the offset its publisher recorded beside the rank manifest), so
  the messages it reads are that step's and the later ones', not the topic's, and serves the
  newest step bitwise;
- a forged, damaged, out-of-range or foreign record (one whose offset is not exactly where the
  step's rows begin) never makes it serve a wrong row: it reads the partition from its oldest
  message instead, and serves the same bytes;
- steps without records (a publisher before them) are read from the oldest message, as before;
- a fresh ``deck follow`` loader (:class:`deck.serve.kafka_follow.KafkaFollower`) on a topic an
  older run filled reads the rank partitions from the served run's first step, and a forged
  record costs it a read from the oldest message, not a row.

Rows are checked by materialising what the source offers with ``deck follow``'s
:class:`deck.serve.follow.Follower` and comparing with the publisher's exact state.
"""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from deck.format.stream import (
    CONTROL_PARTITION,
    decode_segment,
    marker_headers,
    marker_value,
    parse_kafka_uri,
    rank_partition,
    start_key,
)
from deck.read.catalog import read_rank_manifests
from deck.serve import live_kafka
from deck.serve.follow import Follower
from deck.serve.kafka_follow import KafkaFollower, PartitionReader
from deck.serve.live_kafka import KafkaSource
from deck.serve.live_source import Plan
from deck.testing.kafka_broker import TansuBroker
from deck.testing.kafka_stream import (
    SynthPublisher,
    differences,
    inject,
    read_output,
    read_partition,
)

pytestmark = pytest.mark.slow

STEPS = 24  # published steps: fulls at the 1st, 9th and 17th, deltas between
FULL_EVERY = 8
WAIT_S = 60.0  # bounds a slow machine's reads: every row of these topics does show up
RANKS = (0, 1)


@pytest.fixture(scope="module")
def broker() -> Iterator[TansuBroker]:
    with TansuBroker() as b:
        yield b


@dataclass
class Topic:
    uri: str
    pub: SynthPublisher
    steps: list[int]
    segments: dict[int, list[tuple[int, str]]]  # partition -> (offset, file key) of each message

    def fulls(self) -> list[int]:
        return [s for i, s in enumerate(self.steps) if i % FULL_EVERY == 0]

    def count(self, partition: int, steps: set[int]) -> int:
        """How many messages of ``partition`` are segments of this publisher's ``steps``."""
        ids = {self.pub.expected(s)[0] for s in steps}
        return sum(key.split("/")[1] in ids for _, key in self.segments[partition])


def _segments(uri: str, partition: int) -> list[tuple[int, str]]:
    """(offset, file key) of every message of a rank partition (to its end-of-partition event)."""
    topic = parse_kafka_uri(uri).topic
    return [
        (offset, decode_segment(headers, value, topic, partition, 0).key)
        for offset, (_, value, headers) in enumerate(read_partition(uri, partition))
    ]


@pytest.fixture(scope="module")
def topic(broker: TansuBroker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topic]:
    uri = broker.uri(f"start-{uuid.uuid4().hex[:10]}")
    pub = SynthPublisher(uri, str(tmp_path_factory.mktemp("start") / "state"))
    steps = [pub.publish("full" if i % FULL_EVERY == 0 else "delta") for i in range(STEPS)]
    yield Topic(uri, pub, steps, {r + 1: _segments(uri, r + 1) for r in RANKS})
    pub.close()


@dataclass
class Served:
    steps: list[int]  # the steps the source offered, in order, each applied
    read: dict[int, int]  # rank partition -> messages the source read
    faults: list[Any]
    scanned: int  # markers read to find where to start


def _serve(t: Topic, out: str, **kw: Any) -> Served:
    """A fresh source on ``t``, every step it offers applied in ``out`` as the live model
    would (a full whole, a delta onto the served step), until the topic holds no more."""
    source = KafkaSource(t.uri, wait_s=WAIT_S, **kw)
    try:
        steps = _Applier(source, out).catch_up()
        read = {p: r.messages for p, r in source.readers.items() if p != CONTROL_PARTITION}
        return Served(steps, read, source.take_faults(), source.scanned)
    finally:
        source.close()


class _Applier:
    """Applies what a source offers in ``out`` as the live model would (a full whole, a delta
    onto the served step)."""

    def __init__(self, source: KafkaSource, out: str) -> None:
        self.source, self.out = source, out
        self.follower: Follower | None = None
        self.served: tuple[int, str] | None = None
        self.plans: list[Plan] = []  # every plan offered

    def catch_up(self) -> list[int]:
        """The steps offered and applied until the topic holds no more now."""
        steps = []
        while plans := self.source.next_plans(self.served, frozenset()):
            (plan,) = plans
            self.plans.append(plan)
            m = plan.chain[-1]
            view = self.source.storage
            self.follower = self.follower or Follower(view, self.out)
            if plan.whole:
                view.visible = {m.step}
                self.follower.materialise(m.step)
            else:
                self.follower.apply([m], read_rank_manifests(view, m))
            self.served = m.state
            steps.append(m.step)
        return steps


def _serves(out: str, t: Topic, step: int) -> None:
    got = read_output(out)
    assert got is not None, f"{out}: no output"
    want_id, want = t.pub.expected(step)
    assert (got[0], got[1]) == (step, want_id), (got[:2], step)
    assert not differences(got[2], want), differences(got[2], want)[:5]


def _state_copy(t: Topic, tmp_path: Path) -> Path:
    """A copy of the publisher's state URI (the source reads it with ``state_uri=``)."""
    copy = tmp_path / "state"
    shutil.copytree(t.pub.state_dir, copy)
    return copy


def _record(state: Path, t: Topic, step: int, rank: int) -> Path:
    return state / start_key(step, t.pub.expected(step)[0], rank)


def test_a_restart_reads_the_rank_partitions_from_the_newest_full(
    topic: Topic, tmp_path: Path
) -> None:
    newest = topic.fulls()[-1]
    after = {s for s in topic.steps if s >= newest}
    for attempt in range(2):  # a restart does the same again
        out = str(tmp_path / f"out-{attempt}")
        got = _serve(topic, out)
        assert got.steps == sorted(after) and not got.faults, got
        _serves(out, topic, topic.steps[-1])
        # each partition: the newest full's and the later deltas' segments, nothing before
        for p in (1, 2):
            assert got.read[p] == topic.count(p, after), (p, got.read)
            assert got.read[p] < len(topic.segments[p]) / 2, (p, got.read)


@pytest.mark.parametrize("fulls", [1, 2])
def test_a_restart_reads_the_markers_back_to_the_fulls_it_may_start_at(
    topic: Topic, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fulls: int
) -> None:
    """The control partition is read back from its end in growing windows (here 2, 8, 32
    markers) until the fulls a start may fall back to are found, not from its oldest message:
    with one full wanted, the 8 newest markers (the newest full is 8 from the end); with two,
    the window reaching the one before (32: the whole topic of 24)."""
    monkeypatch.setattr(live_kafka, "START_WINDOW", 2)
    monkeypatch.setattr(live_kafka, "START_FULLS", fulls)
    out = str(tmp_path / "out")
    got = _serve(topic, out)
    assert got.steps == [s for s in topic.steps if s >= topic.fulls()[-1]], got
    assert not got.faults, got
    _serves(out, topic, topic.steps[-1])
    assert got.scanned == (8 if fulls == 1 else STEPS), got


def _past_the_step(t: Topic, p: int, step: int) -> int:
    """The offset after the first segment of ``step``: its first file misses a segment there."""
    ckpt_id = t.pub.expected(step)[0]
    return next(off for off, key in t.segments[p] if key.split("/")[1] == ckpt_id) + 1


FORGED: dict[str, Any] = {
    "past the end": lambda t, p, step, rec: {**rec, "offset": 10**9},
    "before the step": lambda t, p, step, rec: {**rec, "offset": rec["offset"] - 10},
    "inside the step": lambda t, p, step, rec: {**rec, "offset": _past_the_step(t, p, step)},
    "the last message": lambda t, p, step, rec: {**rec, "offset": t.segments[p][-1][0]},
    "another step's": lambda t, p, step, rec: {**rec, "step": step - 1},
    "a bool": lambda t, p, step, rec: {**rec, "offset": True},
    "a newer version": lambda t, p, step, rec: {**rec, "format_version": 2},
    "garbage": lambda t, p, step, rec: b"\x00{not json",
}


@pytest.mark.parametrize("forgery", sorted(FORGED))
def test_a_forged_start_record_costs_a_read_from_the_oldest_message_never_a_row(
    topic: Topic, tmp_path: Path, forgery: str
) -> None:
    newest = topic.fulls()[-1]
    state = _state_copy(topic, tmp_path)
    for rank in RANKS:
        path = _record(state, topic, newest, rank)
        forged = FORGED[forgery](topic, rank + 1, newest, json.loads(path.read_bytes()))
        path.write_bytes(forged if isinstance(forged, bytes) else json.dumps(forged).encode())
    out = str(tmp_path / "out")
    got = _serve(topic, out, state_uri=str(state))
    assert got.steps == [s for s in topic.steps if s >= newest] and not got.faults, got
    _serves(out, topic, topic.steps[-1])
    for p in (1, 2):  # read from the oldest message (after the forged offset, where it read)
        assert got.read[p] >= len(topic.segments[p]), (p, got.read)


def test_steps_without_records_are_read_from_the_oldest_message(
    topic: Topic, tmp_path: Path
) -> None:
    """A topic a deck before the records published: the source serves it as before."""
    state = _state_copy(topic, tmp_path)
    for step in topic.steps:
        for rank in RANKS:
            _record(state, topic, step, rank).unlink()
    out = str(tmp_path / "out")
    got = _serve(topic, out, state_uri=str(state))
    assert got.steps == [s for s in topic.steps if s >= topic.fulls()[-1]], got
    _serves(out, topic, topic.steps[-1])
    assert all(got.read[p] == len(topic.segments[p]) for p in (1, 2)), got.read


@pytest.mark.parametrize("record", ["recorded", "forged"])
def test_a_fresh_loader_reads_the_served_runs_rows_only(
    broker: TansuBroker, tmp_path: Path, record: str
) -> None:
    """``deck follow`` from an empty --out on a topic another run filled first: it serves the
    newest run, and opens each rank partition at that run's first step (the older run's
    segments are not read); a forged record costs a read from the oldest message."""
    uri = broker.uri(f"runs-{uuid.uuid4().hex[:10]}")
    old = SynthPublisher(uri, str(tmp_path / "old-state"), seed=3)
    for i in range(STEPS):
        old.publish("full" if i % FULL_EVERY == 0 else "delta")
    old.close()
    pub = SynthPublisher(uri, str(tmp_path / "state"), seed=4)
    steps = [pub.publish("full"), pub.publish(), pub.publish()]
    t = Topic(uri, pub, steps, {r + 1: _segments(uri, r + 1) for r in RANKS})
    if record == "forged":  # the first step's records point at the second step's rows
        for rank in RANKS:
            path = _record(Path(pub.state_dir), t, steps[0], rank)
            second = json.loads(_record(Path(pub.state_dir), t, steps[1], rank).read_bytes())
            path.write_bytes(
                json.dumps({**json.loads(path.read_bytes()), "offset": second["offset"]}).encode()
            )
    out = str(tmp_path / "out")
    kf = KafkaFollower(uri, out, wait_s=WAIT_S)
    try:
        kf.catch_up()
        read = {p: r.messages for p, r in kf.readers.items() if p != CONTROL_PARTITION}
    finally:
        kf.close()
        pub.close()
    assert kf.stats.applied == steps, kf.stats
    _serves(out, t, steps[-1])
    for p in (1, 2):
        mine = t.count(p, set(steps))
        if record == "recorded":
            assert read[p] == mine, (p, read, mine)
        else:  # the first step's files are not found from there: read again from the oldest
            assert read[p] > len(t.segments[p]), (p, read)


@pytest.mark.parametrize("restart", [True, False])
def test_a_loader_resumed_past_later_steps_rows_reads_them_from_the_oldest_message(
    broker: TansuBroker, tmp_path: Path, restart: bool
) -> None:
    """Found by trying to break the recorded starts: step 1's record points at exact copies of
    its segments sent again after steps 2 and 3 (a start that proves itself; what publishes
    interleaved on a partition, or a forged record, give). A fresh loader applies step 1 from
    there. Restarted, it resumed past the segments of steps 2 and 3 and took them for lost
    (applied nothing more until the next full); it now reads a step whose files are not all
    after its resume point again from the oldest message, as a reader does in memory."""
    uri = broker.uri(f"resume-{uuid.uuid4().hex[:10]}")
    pub = SynthPublisher(uri, str(tmp_path / "state"), seed=5)
    steps = [pub.publish("full"), pub.publish(), pub.publish()]
    target = parse_kafka_uri(uri)
    first_id = pub.expected(steps[0])[0]
    for rank in RANKS:
        p = rank_partition(rank)
        copies = [
            m
            for m in read_partition(uri, p)
            if dict(m[2])["key"].decode().split("/")[1] == first_id
        ]
        for _, value, headers in copies:
            inject(target.bootstrap, target.topic, p, value, headers)
        moved = len(read_partition(uri, p)) - len(copies)
        path = Path(pub.state_dir) / start_key(steps[0], first_id, rank)
        path.write_bytes(json.dumps({**json.loads(path.read_bytes()), "offset": moved}).encode())
    out = str(tmp_path / "out")
    t = Topic(uri, pub, steps, {})
    kf = KafkaFollower(uri, out, wait_s=WAIT_S)
    try:
        if restart:
            try:
                assert kf.poll(WAIT_S) is not None  # step 1, from the recorded start
            finally:
                kf.close()
            kf = KafkaFollower(uri, out, wait_s=WAIT_S)
        kf.catch_up()
    finally:
        kf.close()
        pub.close()
    assert kf.stats.applied == (steps[1:] if restart else steps), kf.stats
    _serves(out, t, steps[-1])


def test_an_end_event_from_before_a_steps_rows_does_not_make_a_resumed_loader_read_again(
    broker: TansuBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """A resumed loader keeps a rewind armed (a later step's rows may lie before its resume
    point). librdkafka can hand over an end-of-partition event it queued before the next
    step's rows were fetched; the poll after it can time out while they are in flight. That
    stale end made the loader read the whole partition again (once per restart). It now asks
    the broker whether anything lies past the end before it reads again. The event order is
    forced: each reader's first poll delivers an end at its position and nothing else."""
    uri = broker.uri(f"stale-end-{uuid.uuid4().hex[:10]}")
    pub = SynthPublisher(uri, str(tmp_path / "state"), seed=7)
    steps = [pub.publish("full"), pub.publish()]
    out = str(tmp_path / "out")
    kf = KafkaFollower(uri, out, wait_s=WAIT_S)
    try:
        kf.catch_up()
    finally:
        kf.close()
    steps.append(pub.publish())
    real_poll = PartitionReader.poll
    ended: set[int] = set()

    def poll(self: PartitionReader, timeout: float) -> Any:
        if self.partition != CONTROL_PARTITION and self.partition not in ended:
            ended.add(self.partition)
            self.eof = self.position
            return None
        return real_poll(self, timeout)

    monkeypatch.setattr(PartitionReader, "poll", poll)
    kf = KafkaFollower(uri, out, wait_s=WAIT_S)
    try:
        caplog.set_level("WARNING", logger="deck")
        kf.catch_up()
        read = {p: r.messages for p, r in kf.readers.items() if p != CONTROL_PARTITION}
        armed = {p: r.rewind_to for p, r in kf.readers.items() if p != CONTROL_PARTITION}
    finally:
        kf.close()
        pub.close()
    assert kf.stats.applied == steps[2:], kf.stats
    assert ended == {rank_partition(r) for r in RANKS}
    assert not [r for r in caplog.records if "reading the partition again" in r.getMessage()]
    assert all(a is not None for a in armed.values()), armed
    segs = {r + 1: _segments(uri, rank_partition(r)) for r in RANKS}
    new_id = pub.expected(steps[2])[0]
    assert read == {p: sum(k.split("/")[1] == new_id for _, k in s) for p, s in segs.items()}
    _serves(out, Topic(uri, pub, steps, segs), steps[2])


@pytest.mark.parametrize("state", ["file:///nonexistent/deck-stray-state", "nope://x/y"])
def test_a_stray_marker_of_the_run_naming_another_state_uri_costs_no_start(
    broker: TansuBroker, tmp_path: Path, state: str
) -> None:
    """Found by trying to break the windowed start: one marker of the served run at the
    partition's end naming another state URI (a folder without the record, or a scheme this
    host cannot open). The first pinned the source's state URI to it, so every real marker
    looked foreign and each restart read the whole topic from its oldest message; the second
    raised from every start. Now it is no start, and reported when read in order."""
    uri = broker.uri(f"stray-{uuid.uuid4().hex[:10]}")
    pub = SynthPublisher(uri, str(tmp_path / "state"), seed=9)
    steps = [pub.publish("full" if i in (0, 10) else "delta", rows=4) for i in range(12)]
    target = parse_kafka_uri(uri)
    stray = marker_value(50, "e" * 16, state, 2, pub.run)
    inject(target.bootstrap, target.topic, CONTROL_PARTITION, stray, marker_headers(stray))
    t = Topic(uri, pub, steps, {r + 1: _segments(uri, r + 1) for r in RANKS})
    try:
        out = str(tmp_path / "out")
        got = _serve(t, out)
    finally:
        pub.close()
    assert got.steps == steps[10:], got
    assert [f.step for f in got.faults] == [50], got.faults
    _serves(out, t, steps[-1])
    for p in (1, 2):
        assert got.read[p] == t.count(p, set(steps[10:])), got.read


def test_a_serving_source_notices_a_recreated_topic(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A source that kept serving while the broker lost its data (the topic made again, its
    offsets from 0) waited silently, stale, for the new topic to pass its old offsets. The
    control partition's end before its position and the last offered marker gone from its
    offset: it reads the new topic from its newest full and serves the steps after, bitwise."""
    with TansuBroker() as own:
        uri = own.uri(f"recreated-{uuid.uuid4().hex[:10]}")
        pub = SynthPublisher(uri, str(tmp_path / "state"))
        try:
            pub.publish("full")
            held = [pub.publish() for _ in range(4)][-1]
            source = KafkaSource(uri, wait_s=WAIT_S)
            out = str(tmp_path / "out")
            try:
                applier = _Applier(source, out)
                assert applier.catch_up()[-1] == held
                own.restart()  # every topic gone
                pub.reconnect()
                full, delta = pub.publish("full"), pub.publish()  # below the old position
                with caplog.at_level(logging.ERROR, logger="deck"):
                    assert applier.catch_up() == [full, delta]
                assert source.take_faults() == []
            finally:
                source.close()
            got = read_output(out)
            assert got is not None and (got[0], got[1]) == (delta, pub.expected(delta)[0])
            assert not differences(got[2], pub.expected(delta)[1])
            said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
            assert any("recreated or truncated while serving" in m for m in said), said
        finally:
            pub.close()


def test_a_serving_source_follows_a_publisher_rollback(
    broker: TansuBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Break-it finding: a trainer restored an older step and published on (a new timeline, its
    first publish a full at a step at or below the served one); a live model fed from the topic
    refused that full and the next as out of order and served the abandoned timeline's step
    until the topic passed it, where ``deck follow`` of the same topic followed the rollback.
    A full of a newer timeline at or below the served step is offered as a whole version of
    that timeline (the live model drops its kept versions and says so), then its deltas."""
    pub = SynthPublisher(broker.uri(f"rollback-{uuid.uuid4().hex[:10]}"), str(tmp_path / "state"))
    source = KafkaSource(pub.topic_uri, wait_s=WAIT_S)
    try:
        pub.publish("full")
        held = [pub.publish() for _ in range(4)][-1]
        applier = _Applier(source, str(tmp_path / "out"))
        assert applier.catch_up()[-1] == held
        pub.trainer.rollback(2)  # restore step 2, then train on: steps 3.. again
        full, delta = pub.publish("full"), pub.publish()
        assert full < held
        with caplog.at_level(logging.ERROR, logger="deck"):
            assert applier.catch_up() == [full, delta]
        assert source.take_faults() == [] and not caplog.records
        assert [(p.step, p.whole, p.timeline) for p in applier.plans[-2:]] == [
            (full, True, True),
            (delta, False, False),
        ]
        got = read_output(str(tmp_path / "out"))
        assert got is not None and (got[0], got[1]) == (delta, pub.expected(delta)[0])
        assert not differences(got[2], pub.expected(delta)[1])
    finally:
        source.close()
        pub.close()


def test_a_fresh_loader_starts_where_the_listed_end_is_past_the_last_message(
    broker: TansuBroker, tmp_path: Path
) -> None:
    """A break-it finding: on a topic whose control partition lists an end past its last
    readable message (there: deleted and made again on a live Tansu; here, deterministically, a
    transaction's commit marker, which occupies the last offset and is never delivered), a
    fresh loader's look for the newest run met the fetch's end-of-partition event before the
    listed end and raised it (`deck follow --once` exit 2 with librdkafka's _PARTITION_EOF, a
    service never served). That event is the end now: the loader serves the newest step."""
    from confluent_kafka import Producer

    uri = broker.uri(f"txend-{uuid.uuid4().hex[:10]}")
    pub = SynthPublisher(uri, str(tmp_path / "state"))
    steps = [pub.publish("full"), pub.publish()]
    tx = Producer({"bootstrap.servers": broker.bootstrap, "transactional.id": uuid.uuid4().hex})
    tx.init_transactions(30)
    tx.begin_transaction()
    tx.produce(parse_kafka_uri(uri).topic, value=b"not a marker", partition=CONTROL_PARTITION)
    tx.commit_transaction(30)
    kf = KafkaFollower(uri, str(tmp_path / "out"), wait_s=WAIT_S)
    try:
        kf.catch_up()
    finally:
        kf.close()
        pub.close()
    assert kf.stats.applied == steps, kf.stats


def test_a_fresh_loader_says_a_publishers_rollback_as_one(
    broker: TansuBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A break-it finding: a fresh loader reading a topic whose publisher rolled back (steps
    0-4, then a restore of step 1 and steps 2-3 again) met the left timeline's step 4, whose
    parent's record the new step 3 replaced, and logged an ERROR blaming retention ("the
    messages between are gone"). It is a WARNING that says the publisher rolled back now; the
    loader serves the new timeline's newest step all the same."""
    pub = SynthPublisher(broker.uri(f"left-{uuid.uuid4().hex[:10]}"), str(tmp_path / "state"))
    pub.publish("full")
    for _ in range(4):
        pub.publish()
    pub.trainer.rollback(1)  # restore step 1, then train on: steps 2.. again
    new = [pub.publish(), pub.publish()]
    kf = KafkaFollower(pub.topic_uri, str(tmp_path / "out"), wait_s=WAIT_S)
    try:
        with caplog.at_level(logging.WARNING, logger="deck"):
            kf.catch_up()
    finally:
        kf.close()
        pub.close()
    assert kf.stats.applied[-2:] == new, kf.stats
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert "the publisher rolled back: step 4 (epoch 0) is of a timeline it left" in caplog.text
    got = read_output(str(tmp_path / "out"))
    assert got is not None and (got[0], got[1]) == (new[-1], pub.expected(new[-1])[0])
