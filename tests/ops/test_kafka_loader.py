"""The Kafka loader (`deck follow kafka://`) against its hostile cases, one test per finding of
a long-job review (items 8-11), with synthetic publishers on the real sink and a real broker (Tansu):

- killed at every point of its state switch, it restarts and serves a committed step (8);
- a poison message on any partition is quarantined, the loader keeps serving and moves on at
  the next full (9);
- another run's markers on the topic are refused loudly; a fresh loader serves the newest run,
  one with state keeps its run (10);
- loader fulls are counted from the state on disk: a loader that keeps crashing still writes
  them (11).
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deck.errors import ConfigError
from deck.serve.kafka_follow import KafkaFollower, loader_fulls
from deck.storage import open_storage
from deck.testing.dist_harness import run_ranks
from deck.testing.kafka_broker import TansuBroker
from deck.testing.kafka_child import LoaderChildren, loader_from
from deck.testing.kafka_stream import (
    SynthPublisher,
    create_topic,
    differences,
    inject,
    produce_batch,
    read_output,
    read_partition,
)

pytestmark = pytest.mark.slow
SWITCH_POINTS = ("follow.state.before_switch", "follow.state.switched", "follow.state.written")


@pytest.fixture(scope="module")
def broker() -> Iterator[TansuBroker]:
    with TansuBroker() as b:
        yield b


@pytest.fixture(scope="module")
def children() -> Iterator[LoaderChildren]:
    with LoaderChildren() as c:
        yield c


def _topic(broker: TansuBroker) -> str:
    return broker.uri(f"t-{uuid.uuid4().hex[:10]}")


def _serves(out: str, pub: SynthPublisher, step: int) -> None:
    """The loader output in ``out`` is ``pub``'s committed ``step``, bitwise."""
    got = read_output(out)
    assert got is not None, f"{out}: no output"
    want_id, want = pub.expected(step)
    assert (got[0], got[1]) == (step, want_id), (got[:2], step)
    assert not differences(got[2], want), differences(got[2], want)
    with open(os.path.join(out, "state.json")) as f:
        assert json.load(f)["step"] == step


def _loader(topic: str, out: str, **kw: Any) -> KafkaFollower:
    return loader_from({"uri": topic, "out_dir": out, "wait_s": 5, **kw})  # type: ignore[no-any-return]


def _catch_up(topic: str, out: str, **kw: Any) -> KafkaFollower:
    kf = _loader(topic, out, **kw)
    try:
        kf.catch_up()
    finally:
        kf.close()
    return kf


def test_kill_at_every_switch_point_restarts(
    broker: TansuBroker, children: LoaderChildren, tmp_path: Path
) -> None:
    """Finding 8: SIGKILLed at each failpoint of the state switch (data written but not renamed,
    data renamed but state.json not, both renamed), on the 1st..3rd step it applies, a restarted
    loader resumes and serves the latest step; an unusable --out with a loader full restarts
    from the full."""
    topic = _topic(broker)
    pub = SynthPublisher(topic, str(tmp_path / "state"))
    steps = [pub.publish("full"), pub.publish(), pub.publish(), pub.publish()]
    for point in SWITCH_POINTS:
        for nth in (1, 2, 3):
            out = str(tmp_path / f"out-{point}-{nth}")
            what, where = children.run({"uri": topic, "out_dir": out}, f"{point}:{nth}")
            assert (what, where) == ("killed", f"{point}:{nth}"), (what, where)
            kf = _catch_up(topic, out)
            _serves(out, pub, steps[-1])
            # Killed before the rename, the nth step was not applied; after it, it was.
            held = nth - 1 if point == "follow.state.before_switch" else nth
            assert kf.stats.applied == steps[held:], (point, nth, kf.stats)

    # An --out whose data file is damaged: --full-uri is used although --out is not empty.
    fulls, out = str(tmp_path / "fulls"), str(tmp_path / "out-damaged")
    _catch_up(topic, out, full_uri=fulls, full_every=2)
    assert [f["step"] for f in loader_fulls(open_storage(fulls))] == [steps[1], steps[3]]
    with open(os.path.join(out, "state.safetensors"), "r+b") as f:
        f.truncate(100)
    kf = _catch_up(topic, out, full_uri=fulls)
    assert kf.stats.applied == [], kf.stats  # started from the full of the latest step
    _serves(out, pub, steps[-1])
    # The newest full's stream record damaged (storage is untrusted): the older full serves.
    for rec in Path(fulls, "stream").glob(f"{steps[3]:012d}-*.json"):
        rec.write_bytes(b'{"offsets": ')
    kf = _catch_up(topic, str(tmp_path / "out-older-full"), full_uri=fulls)
    assert kf.stats.applied == steps[2:], kf.stats
    _serves(str(tmp_path / "out-older-full"), pub, steps[-1])
    pub.close()


def test_poison_message_is_quarantined(
    broker: TansuBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding 9: garbage and a flipped byte on a partition other than the first (and a
    garbage marker on the first): recorded in quarantine.json with partition and offset, an
    ERROR line; the loader serves the last good step, skips the deltas that need the lost step
    and moves on at the next full; a fresh --out gets past the same messages."""
    topic = _topic(broker)
    bootstrap = broker.bootstrap
    name = topic.rsplit("/", 1)[1]
    pub = SynthPublisher(topic, str(tmp_path / "state"))
    s0, s1 = pub.publish("full"), pub.publish()
    inject(bootstrap, name, 2, b"\x00garbage\xff" * 10, [])
    inject(bootstrap, name, 0, b"{not a marker", [("deck", b"1"), ("type", b"marker")])
    pub.damage_next(2)
    s2 = pub.publish()  # one of rank 1's segments arrives damaged
    s3 = pub.publish()
    out = str(tmp_path / "out")
    with caplog.at_level(logging.WARNING, logger="deck"):
        kf = _catch_up(topic, out)
    assert kf.stats.applied == [s0, s1] and kf.stats.unproven == [s2, s3], kf.stats
    _serves(out, pub, s1)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("partition 2 offset" in e and "quarantined" in e for e in errors), errors
    assert any(f"serving step {s1} (and the deltas that build on it)" in e for e in errors), errors
    with open(os.path.join(out, "quarantine.json")) as f:
        entries = json.load(f)["entries"]
    assert {(e["partition"], e["kind"]) for e in entries} == {(0, "poison"), (2, "poison")}
    assert all(isinstance(e["offset"], int) and e["error"] for e in entries), entries

    s4, s5 = pub.publish("full"), pub.publish()
    kf = _catch_up(topic, out)
    assert kf.stats.applied == [s4, s5], kf.stats
    _serves(out, pub, s5)
    fresh = str(tmp_path / "fresh")
    kf = _catch_up(topic, fresh)
    assert kf.stats.applied == [s0, s1, s4, s5] and kf.stats.unproven == [s2, s3], kf.stats
    _serves(fresh, pub, s5)
    pub.close()


def test_a_running_loader_moves_on_at_the_next_full_after_stray_messages(
    broker: TansuBroker, tmp_path: Path
) -> None:
    """Messages that belong to no step on the rank partitions, read by a loader that keeps
    running: the next full and its deltas are applied (a break-it run: the running loader
    took an end of partition seen before the full's files for the end, skipped the full
    silently and every delta after it; a restarted one got past)."""
    topic = _topic(broker)
    name = topic.rsplit("/", 1)[1]
    pub = SynthPublisher(topic, str(tmp_path / "state"))
    s0, s1 = pub.publish("full"), pub.publish()
    out = str(tmp_path / "out")
    kf = _loader(topic, out)
    try:
        kf.catch_up()
        for p in (1, 2):
            inject(broker.bootstrap, name, p, b"garbage-not-deck", [])
        for _ in range(6):  # running: its readers fetch the stray messages meanwhile
            assert kf.poll(0.3) is None
        s2, s3 = pub.publish("full"), pub.publish()
        kf.catch_up()
    finally:
        kf.close()
    assert kf.stats.applied == [s0, s1, s2, s3], kf.stats
    _serves(out, pub, s3)
    pub.close()


def test_segments_of_far_later_steps_are_held_within_a_bound(
    broker: TansuBroker,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A break-it finding: valid segments of steps no marker of this run reaches (another run
    publishing higher steps, a forged flood) were kept for their markers without a bound, the
    loader's memory growing with them and nothing said. Held up to a cap, the farthest steps
    dropped first, said once; the run's own steps are applied all the same."""
    from deck.format.stream import rank_partition, segment_headers
    from deck.serve import kafka_follow

    cap = 64 << 10
    monkeypatch.setattr(kafka_follow, "AHEAD_MAX_BYTES", cap)
    topic = _topic(broker)
    name = topic.rsplit("/", 1)[1]
    pub = SynthPublisher(topic, str(tmp_path / "state"))
    s0, s1 = pub.publish("full"), pub.publish()
    out = str(tmp_path / "out")
    kf = _loader(topic, out)
    try:
        kf.catch_up()
        for i in range(12):
            data = bytes([i]) * (16 << 10)
            key = f"step-{10**11 + i:012d}/{i:016x}/rank-00000/t0.weight/c0-r0-000000.chunk"
            headers = segment_headers(key, 0, 1, len(data), memoryview(data))
            inject(broker.bootstrap, name, rank_partition(0), data, headers)
        s2, s3 = pub.publish(), pub.publish()
        with caplog.at_level(logging.WARNING, logger="deck"):
            kf.catch_up()
        held = kf.readers[rank_partition(0)].ahead
        assert 0 < sum(len(s.data) for s in held) <= cap, len(held)
        assert min(int(s.key[5:17]) for s in held) == 10**11  # (the nearest kept)
    finally:
        kf.close()
    assert kf.stats.applied == [s0, s1, s2, s3], kf.stats
    _serves(out, pub, s3)
    said = [r.getMessage() for r in caplog.records if "wait for their markers" in r.getMessage()]
    assert len(said) == 1 and f"partition {rank_partition(0)}" in said[0], said
    pub.close()


def test_foreign_stream_is_refused(
    broker: TansuBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding 10: another model's full at the head of the topic and markers in between are not
    served: a fresh loader serves the newest run, refusing the other's markers with an ERROR
    and a quarantine entry; a fresh run reusing the topic is refused by a loader holding the
    old run (it keeps serving it) and served by a fresh --out; --run pins a run."""
    topic = _topic(broker)
    other = SynthPublisher(topic, str(tmp_path / "other-state"), seed=7)
    pub = SynthPublisher(topic, str(tmp_path / "state"))
    other.publish("full")
    s0 = pub.publish("full")
    other.publish()
    s1 = pub.publish()
    assert pub.run != other.run
    out = str(tmp_path / "out")
    with caplog.at_level(logging.ERROR, logger="deck"):
        kf = _catch_up(topic, out)
    _serves(out, pub, s1)
    assert kf.stats.applied == [s0, s1] and len(kf.stats.foreign) == 2, kf.stats
    assert any(f"of run {other.run}" in r.getMessage() for r in caplog.records)
    with open(os.path.join(out, "quarantine.json")) as f:
        assert [e["kind"] for e in json.load(f)["entries"]] == ["foreign", "foreign"]

    # A fresh run (a new state URI) publishing to the same topic.
    new = SynthPublisher(topic, str(tmp_path / "new-state"), seed=3)
    n0 = new.publish("full")
    kf = _catch_up(topic, out)
    assert kf.stats.applied == [] and kf.stats.foreign == [n0], kf.stats
    _serves(out, pub, s1)  # still the run it served, said loudly
    fresh = str(tmp_path / "fresh")
    kf = _catch_up(topic, fresh)
    _serves(fresh, new, n0)
    assert kf.stats.applied == [n0], kf.stats
    pinned = str(tmp_path / "pinned")
    kf = _catch_up(topic, pinned, run=other.run)
    assert kf.stats.applied == [1, 2], kf.stats
    _serves(pinned, other, 2)
    with pytest.raises(ConfigError, match="serves run"):
        _loader(topic, out, run=new.run)
    for p in (pub, other, new):
        p.close()


def test_full_every_counts_from_disk(
    broker: TansuBroker, children: LoaderChildren, tmp_path: Path
) -> None:
    """Finding 11: a loader killed after every step it applies still writes a loader full every
    ``full_every`` applied steps (the count is in its state record, not in the process)."""
    topic = _topic(broker)
    pub = SynthPublisher(topic, str(tmp_path / "state"))
    steps = [pub.publish("full")] + [pub.publish() for _ in range(5)]
    out, fulls = str(tmp_path / "out"), str(tmp_path / "fulls")
    runs = 0
    while True:
        what, where = children.run(
            {"uri": topic, "out_dir": out, "full_uri": fulls, "full_every": 2},
            "kafka_follow.fetched:2",
        )
        runs += 1
        assert what in ("killed", "finished"), where
        if what == "finished":
            break
    assert runs == len(steps), runs  # one step applied per process
    assert [f["step"] for f in loader_fulls(open_storage(fulls))] == steps[1::2]
    _serves(out, pub, steps[-1])
    pub.close()


def test_stream_without_run_ids(broker: TansuBroker, tmp_path: Path) -> None:
    """A stream of a deck before run ids (markers without ``run``) is followed as before; once
    its publisher is upgraded (markers with a run), a loader holding the old state refuses the
    new markers until ``--run`` names the run, and then applies them onto what it holds."""
    topic = _topic(broker)
    pub = SynthPublisher(topic, str(tmp_path / "state"))
    pub.sink.run_id = lambda: None  # type: ignore[method-assign]  # an older deck's markers
    s1, s2 = pub.publish("full"), pub.publish()
    out = str(tmp_path / "out")
    kf = _catch_up(topic, out)
    assert kf.stats.applied == [s1, s2], kf.stats
    _serves(out, pub, s2)
    del pub.sink.run_id  # the upgraded publisher: its run, on the same state URI
    s3 = pub.publish()
    kf = _catch_up(topic, out)
    assert (kf.stats.applied, kf.stats.foreign) == ([], [s3]), kf.stats
    _serves(out, pub, s2)
    kf = _catch_up(topic, out, run=pub.run)
    assert kf.stats.applied == [s3], kf.stats
    _serves(out, pub, s3)
    pub.close()


def test_a_publisher_rollback_is_followed(broker: TansuBroker, tmp_path: Path) -> None:
    """Found by a helper: a trainer restored an older step and published on (a new timeline:
    its first publish a full at a lower step than the loader held); the loader dropped that
    full as "already held" and refused every later delta, serving the rolled-back model until
    the next full. A full published after the held step's marker, at a lower or equal step, is a
    rollback: the loader serves it, then the new timeline's deltas. Its Parquet output holds
    one timeline: the folders of the one left are moved aside (a break-it run: a consumer
    following the documented rule read the abandoned timeline's newest full)."""
    from deck.format.parquet import read_table

    topic = _topic(broker)
    pub = SynthPublisher(topic, str(tmp_path / "state"))
    pub.publish("full")
    for _ in range(4):
        pub.publish()
    out = str(tmp_path / "out")
    _catch_up(topic, out, parquet=True)
    _serves(out, pub, 5)
    old_ids = {s: pub.expected(s)[0] for s in range(2, 6)}
    pub.trainer.rollback(2)  # restore step 2, then train on: steps 3.. again
    s3 = pub.publish("full")  # a restored publisher's first publish is a full
    s4 = pub.publish()
    assert (s3, s4) == (3, 4)
    kf = _catch_up(topic, out, parquet=True)
    assert kf.stats.applied == [s3, s4], kf.stats
    _serves(out, pub, s4)
    kf = _catch_up(topic, out, parquet=True)  # a restart re-reads nothing it already applied
    assert kf.stats.applied == [], kf.stats
    _serves(out, pub, s4)
    root = Path(out, "parquet")
    names = ["000000000001-full", "000000000002-delta", "000000000003-full", "000000000004-delta"]
    assert sorted(p.name for p in root.iterdir()) == names
    for name, step in [(names[2], s3), (names[3], s4)]:
        for f in (root / name).iterdir():
            assert read_table(str(f))[0]["checkpoint"] == pub.expected(step)[0], (name, f)
    aside = Path(out, "parquet-rolled-back", f"{s3:012d}-{pub.expected(s3)[0]}")
    moved = sorted(p.name for p in aside.iterdir())
    assert moved == ["000000000003-delta", "000000000004-delta", "000000000005-delta"]
    for name in moved:
        for f in (aside / name).iterdir():
            assert read_table(str(f))[0]["checkpoint"] == old_ids[int(name[:12])], (name, f)
    pub.close()


def test_a_copy_of_an_old_marker_does_not_roll_serving_back(
    broker: TansuBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A break-it finding: a byte-identical copy of an old full's marker appended to the topic
    (a replay tool, a mirror's at-least-once delivery) was taken for the publisher's rollback:
    serving went back to that step. A rollback starts a newer epoch; a marker of the held
    timeline at a step not newer is a copy: ignored, the held step still served."""
    from confluent_kafka import Consumer, TopicPartition

    topic = _topic(broker)
    name = topic.rsplit("/", 1)[1]
    pub = SynthPublisher(topic, str(tmp_path / "state"))
    first = pub.publish("full")
    newest = [pub.publish() for _ in range(3)][-1]
    out = str(tmp_path / "out")
    _catch_up(topic, out)
    _serves(out, pub, newest)
    c = Consumer(
        {"bootstrap.servers": broker.bootstrap, "group.id": "copy", "enable.partition.eof": True}
    )
    try:
        c.assign([TopicPartition(name, 0, 0)])
        msg = c.poll(30)
        assert msg is not None and msg.error() is None and msg.offset() == 0
    finally:
        c.close()
    inject(broker.bootstrap, name, 0, msg.value(), msg.headers())  # the full of `first`, again
    with caplog.at_level(logging.WARNING, logger="deck"):
        kf = _catch_up(topic, out)
    assert kf.stats.applied == [] and kf.stats.skipped == [first], kf.stats
    _serves(out, pub, newest)
    assert any("is a copy of one of the held timeline" in r.getMessage() for r in caplog.records)
    after = pub.publish()  # and the stream goes on from the held step
    kf = _catch_up(topic, out)
    assert kf.stats.applied == [after], kf.stats
    _serves(out, pub, after)
    pub.close()


def test_a_running_loader_notices_a_recreated_topic(
    broker: TansuBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A break-it finding: a loader that kept running while the broker lost its data (the
    topic made again, its offsets from 0) waited silently, stale, for the new topic to pass its
    old offsets. The control partition's end before its position, and the held marker gone from
    its offset: it reads the new topic from its start and moves on at its first full."""
    topic = _topic(broker)
    pub = SynthPublisher(topic, str(tmp_path / "state"))
    pub.publish("full")
    held = [pub.publish() for _ in range(4)][-1]
    out = str(tmp_path / "out")
    kf = _loader(topic, out)
    try:
        kf.catch_up()
        _serves(out, pub, held)
        broker.restart()  # every topic gone
        pub.reconnect()
        full, delta = pub.publish("full"), pub.publish()  # two markers: below the old position
        with caplog.at_level(logging.ERROR, logger="deck"):
            kf.catch_up()
    finally:
        kf.close()
    assert kf.stats.applied[-2:] == [full, delta], kf.stats
    _serves(out, pub, delta)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("recreated or truncated while the loader ran" in m for m in said), said
    pub.close()


def test_a_replayed_topic_is_not_taken_for_a_recreated_one(
    broker: TansuBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A topic replayed by a tool that sends its markers in one batch: the end the broker lists
    lags behind the last of them (Tansu 0.6: a batch's first offset + 1), and a restarted
    loader holding the newest step took its marker's offset for one past the end, said the
    topic was recreated and read it again from its start. The fetch at that offset decides."""
    topic = _topic(broker)
    pub = SynthPublisher(topic, str(tmp_path / "state"))
    pub.publish("full")
    held = [pub.publish() for _ in range(3)][-1]
    replay = _topic(broker)
    create_topic(replay, 3)
    for p in (1, 2, 0):  # the rows before the markers that name them
        produce_batch(replay, p, read_partition(topic, p))
    out = str(tmp_path / "out")
    assert _catch_up(replay, out).stats.applied[-1] == held
    _serves(out, pub, held)
    with caplog.at_level(logging.WARNING, logger="deck"):
        kf = _catch_up(replay, out)
    assert kf.stats.applied == [] and kf.stats.skipped == [], kf.stats
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in said if "recreated" in m], said
    _serves(out, pub, held)
    pub.close()


def _publish_exact_then_quantized(rank: int, world_size: int, root: str, topic: str) -> None:
    """Steps 0..4 published exact, 5..8 by a restarted trainer with int8 publishing, then 9..12
    exact again (a full first: a new publisher's first publish); each returns its step's
    tables, compared by the caller through a fresh model."""
    import torch.distributed as dist

    import deck
    from deck.demo import ModelSpec, build_model, train_step

    spec = ModelSpec(num_tables=2, rows=100, dim=8, batch=8, sharding="table_wise")
    model, opt = build_model(spec)
    step = 0
    for quantize, steps in (("none", 5), ("int8", 4), ("none", 4)):
        config = deck.DeckConfig(
            uri=f"{root}/ck",
            lease_ttl_s=None,
            publish=deck.PublishConfig(
                uri=topic, state_uri=f"{root}/pub", every_steps=1, quantize=quantize
            ),
        )
        with deck.enable(model, [opt], config) as ck:
            if step:
                ck.restore()
            for _ in range(steps):
                if step:
                    train_step(model, opt, spec, step)
                ck.step(step)
                step += 1
            assert ck.flush()
    dist.barrier()


def test_a_quantized_stretch_is_skipped_by_once_as_by_the_service(
    broker: TansuBroker, tmp_path: Path
) -> None:
    """A break-it finding: `deck follow kafka:// --once` without --allow-quantized failed (exit
    2) at the first quantised step on every run, even after exact fulls followed, while the
    service skipped the stretch and moved on at the next full. --once now ends where the
    service does: the quantised steps skipped (ERROR naming the opt-in), the exact ones after
    the next full applied."""
    topic = _topic(broker)
    run_ranks(_publish_exact_then_quantized, str(tmp_path), topic)
    out = str(tmp_path / "out")
    kf = _catch_up(topic, out)
    assert kf.stats.applied[:5] == [0, 1, 2, 3, 4], kf.stats
    assert kf.stats.applied[-4:] == [9, 10, 11, 12], kf.stats
    assert {5, 6, 7, 8} <= set(kf.stats.unproven), kf.stats
    with open(os.path.join(out, "state.json")) as f:
        meta = json.load(f)
    assert meta["step"] == 12 and meta.get("quantized", []) == [], meta
    allowed = str(tmp_path / "allowed")
    kf = _catch_up(topic, allowed, allow_quantized=True)
    assert kf.stats.applied == list(range(13)), kf.stats


def test_a_topic_written_in_batches_with_copied_markers_is_read_to_its_end(
    broker: TansuBroker, tmp_path: Path
) -> None:
    """A break-it finding: a topic a mirror wrote in batches, each marker delivered twice
    (at-least-once): `deck follow --once` applied step 1, passed the copy of its marker over and
    stopped, "up to date", on every run (Tansu's ListOffsets counts a batch as one message, and
    the loader took that for the end). It reads to the topic's end and serves the newest step."""
    topic = _topic(broker)
    pub = SynthPublisher(topic, str(tmp_path / "state"))
    pub.publish("full")
    newest = [pub.publish() for _ in range(3)][-1]
    mirror = _topic(broker)
    create_topic(mirror, 3)
    for p in (1, 2):
        produce_batch(mirror, p, read_partition(topic, p))
    markers = read_partition(topic, 0)
    produce_batch(mirror, 0, [m for m in markers for _ in range(2)])  # one batch, each twice
    out = str(tmp_path / "out")
    kf = _catch_up(mirror, out)
    assert kf.stats.applied == [1, 2, 3, newest], kf.stats
    _serves(out, pub, newest)
    pub.close()


def test_damaged_files_of_a_step_at_the_state_uri_are_passed_over_until_a_full(
    broker: TansuBroker, tmp_path: Path
) -> None:
    """A break-it finding: a flipped byte in a delta's commit record at the state URI (or a
    rank part missing, or a damaged dense file) made `deck follow --once` fail at that step on
    every run, for good, though fulls came after it (the service went on). The step is passed
    over like one the loader cannot prove (ERROR), the deltas on it too, and the next full
    moves it on; what it held stays as it was meanwhile."""
    topic = _topic(broker)
    state = tmp_path / "state"
    pub = SynthPublisher(topic, str(state))
    pub.publish("full")
    pub.publish()
    pub.publish()
    full = pub.publish("full")
    newest = pub.publish()
    record = state / "step-000000000002" / "manifest.json"
    raw = bytearray(record.read_bytes())
    raw[len(raw) // 2] ^= 1
    record.write_bytes(bytes(raw))
    dense = next(state.glob("step-000000000005/*/rank-00000/dense.safetensors"))
    raw = bytearray(dense.read_bytes())
    raw[-3] ^= 1
    dense.write_bytes(bytes(raw))
    out = str(tmp_path / "out")
    for _ in range(2):  # (again: nothing new, nothing failed)
        kf = _catch_up(topic, out)
        _serves(out, pub, full)
    assert newest == 5
    later = pub.publish("full")
    kf = _catch_up(topic, out)
    assert kf.stats.applied == [later], kf.stats
    _serves(out, pub, later)
    pub.close()


def test_consumer_options_deck_sets_are_refused() -> None:
    """Extra consumer settings that would override what deck's reader relies on (the URI's
    brokers, the group it is given, offsets committed by hand, end-of-partition events, reading
    from the oldest message left) are refused, naming each and why."""
    from deck.format.stream import KafkaTarget
    from deck.serve.kafka_follow import consumer_conf

    target = KafkaTarget("h:1", "t")
    assert consumer_conf(target, "g", {"fetch.wait.max.ms": 10})["fetch.wait.max.ms"] == 10
    for key in ("bootstrap.servers", "group.id", "enable.partition.eof", "auto.offset.reset"):
        with pytest.raises(ConfigError, match=rf"consumer options of kafka://h:1/t: {key}: "):
            consumer_conf(target, "g", {key: "x"})
