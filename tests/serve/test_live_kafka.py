"""Live apply (deck.serve.live) fed from a Kafka topic (deck.serve.live_kafka.KafkaSource), on a
real broker (Tansu): a 2-rank DMP DLRM publishes every 2 steps to a topic (a full every 4) and
checkpoints every 2 steps to files; rank 0 serves float, int8 and fp16 copies of its tables
twice, one set fed from the topic and one from the checkpoint files.

- after every published step both sets switched to it and are bitwise equal (and equal to
  ``restore(step)`` / TorchRec's quantize of it, built from scratch);
- the topic replayed into another one with a byte flipped in one of a full's segments, a
  garbage marker, another run's publishes in between, a delta whose parent was refused and
  markers of older steps again (a fresh source starts at the damaged newest full, then at the
  full before it): none of them reaches the served model (version and bytes stay,
  an ERROR line, ``on_fault`` told, the damaged and foreign messages quarantined); the next full
  moves it on, bitwise;
- a fresh model on the topic starts at its newest full (not its oldest message), applies the
  steps after it and rolls back to its kept versions (no further: the stream is not read
  backwards); a restarted one serves the newest step again after one whole version, reading
  of the rank partitions that full's rows only (where each rank recorded they begin); a
  quarantined message is one ERROR line, not two.

Outcomes are decided by what the topic holds (its end is the broker's end-of-partition event),
never by a sleep.
"""

from __future__ import annotations

import copy
import json
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from live_helpers import bitwise_diff, collection, reference, serving_models, state_diff

import deck
from deck.demo import ModelSpec, build_model, train_step
from deck.errors import CheckpointNotFoundError
from deck.format.stream import decode_marker, decode_segment, parse_kafka_uri
from deck.serve.live import LiveConfig, LiveFault, LiveModel
from deck.serve.live_kafka import KafkaSource
from deck.storage import LocalStorage
from deck.testing.dist_harness import run_ranks
from deck.testing.kafka_broker import TansuBroker
from deck.testing.kafka_stream import (
    RawMessage,
    SynthPublisher,
    create_topic,
    inject,
    produce_batch,
    read_partition,
)

pytestmark = pytest.mark.slow

SPEC = ModelSpec(num_tables=2, rows=200, dim=8, batch=16, sharding="table_wise")
LAST = 8
# How long a step's rows may take to show up after its marker: every row of these topics does
# show up, so this bounds a slow machine's reads, not a wait (5 s failed on a loaded 2-core VM)
WAIT_S = 120.0
PUBLISHED = list(range(0, LAST + 1, 2))  # fulls at 0, 4, 8
PARTITIONS = 3  # the control partition and one per rank


@pytest.fixture(scope="module")
def broker() -> Iterator[TansuBroker]:
    with TansuBroker() as b:
        yield b


def _served_equal(a: dict[str, torch.nn.Module], b: dict[str, torch.nn.Module]) -> list[str]:
    """Tables whose bytes differ between two sets of served models."""
    bad = []
    for kind, model in a.items():
        bad += state_diff(kind, collection(model).state_dict(), collection(b[kind]).state_dict())
    return bad


def _train(rank: int, world_size: int, topic_uri: str, tmp: str) -> None:
    model, opt = build_model(SPEC)
    config = deck.DeckConfig(
        uri=f"{tmp}/ckpt",
        delta_every_steps=2,
        publish=deck.PublishConfig(
            uri=topic_uri,
            state_uri=f"{tmp}/state",
            every_steps=2,
            full_every_steps=4,
            max_message_bytes=4096,  # table files travel in several segments
        ),
    )
    from_topic = serving_models(SPEC) if rank == 0 else {}
    from_files = serving_models(SPEC, seed=5) if rank == 0 else {}
    source = KafkaSource(topic_uri, wait_s=WAIT_S) if rank == 0 else None
    live_k = live_f = None
    try:
        with deck.enable(model, [opt], config) as ck:
            for step in range(0, LAST + 1):
                if step:
                    train_step(model, opt, SPEC, step)
                ck.step(step)
                if step % 2:
                    continue
                assert ck.flush()
                dist.barrier()
                if rank == 0:
                    assert source is not None
                    if live_k is None:
                        live_k = LiveModel(list(from_topic.values()), source)
                        live_f = LiveModel(list(from_files.values()), LocalStorage(f"{tmp}/ckpt"))
                    assert live_f is not None
                    kind = "full" if step % 4 == 0 else "delta"
                    assert [(s.step, s.kind) for s in live_k.poll()] == [(step, kind)], step
                    assert [s.step for s in live_f.poll()] == [step]
                    bad = _served_equal(from_topic, from_files)
                    assert not bad, (step, bad[:5])
                    bad = bitwise_diff(from_topic, reference(f"{tmp}/ckpt", step, SPEC))
                    assert not bad, (step, bad[:5])
                    assert not live_k.faults, live_k.faults
                dist.barrier()
    finally:
        if source is not None:
            source.close()


@pytest.fixture(scope="module")
def published(broker: TansuBroker, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(topic URI, folder with ckpt/ and state/)."""
    tmp = str(tmp_path_factory.mktemp("live-kafka"))
    topic_uri = broker.uri(f"live-{uuid.uuid4().hex[:10]}")
    run_ranks(_train, topic_uri, tmp)
    return topic_uri, tmp


def test_each_step_from_the_topic_is_bitwise_the_file_sources(
    published: tuple[str, str],
) -> None:
    # (the checks run in rank 0 while training, see _train)
    topic_uri, _ = published
    assert [m.step for m in _markers(topic_uri)] == PUBLISHED


# ---- a replayed, damaged topic ------------------------------------------------------------------
def _read_topic(topic_uri: str) -> dict[int, list[RawMessage]]:
    """Every message of every partition, in order (to the broker's end-of-partition event)."""
    return {p: read_partition(topic_uri, p) for p in range(PARTITIONS)}


def _markers(topic_uri: str) -> list[Any]:
    topic = parse_kafka_uri(topic_uri).topic
    return [
        decode_marker(h, v, topic, 0, i) for i, (_, v, h) in enumerate(_read_topic(topic_uri)[0])
    ]


def test_damaged_foreign_and_out_of_order_messages_never_reach_the_served_model(
    broker: TansuBroker,
    published: tuple[str, str],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic_uri, tmp = published
    original = _read_topic(topic_uri)
    markers = {m.step: original[0][i] for i, m in enumerate(_markers(topic_uri))}
    replay = broker.uri(f"replay-{uuid.uuid4().hex[:10]}")
    create_topic(replay, PARTITIONS)
    # Rank 1's partition, with one byte of the first segment of full 4's files flipped (its
    # checksum header is the original's: damage on the way).
    name = parse_kafka_uri(topic_uri).topic
    rank1 = list(original[2])
    for i, (key, value, headers) in enumerate(rank1):
        assert value is not None
        seg = decode_segment(headers, value, name, 2, i)
        if seg.key.startswith("step-000000000004/"):
            raw = bytearray(value)
            raw[len(raw) // 2] ^= 0x10
            rank1[i] = (key, bytes(raw), headers)
            break
    else:
        raise AssertionError("no segment of step 4 on partition 2")
    produce_batch(replay, 1, original[1])
    produce_batch(replay, 2, rank1)
    # Markers 0 and 2, a garbage marker, another run's full and delta, markers 4 and 6.
    produce_batch(replay, 0, [markers[0], markers[2]])
    bootstrap, rname = broker.bootstrap, parse_kafka_uri(replay).topic
    inject(bootstrap, rname, 0, b"{not a marker", [("deck", b"1"), ("type", b"marker")])
    other = SynthPublisher(replay, str(tmp_path / "other-state"), seed=7)
    other.publish("full")
    other.publish()
    other.close()
    produce_batch(replay, 0, [markers[4], markers[6]])

    served = serving_models(SPEC)
    faults: list[LiveFault] = []
    source = KafkaSource(replay, wait_s=WAIT_S, quarantine_dir=str(tmp_path / "q"))
    live = LiveModel(list(served.values()), source, LiveConfig(), on_fault=faults.append)
    try:
        with caplog.at_level(logging.ERROR, logger="deck"):
            assert [(s.step, s.kind) for s in live.poll()] == [(0, "full"), (2, "delta")]
        version = live.version
        assert live.step == 2 and not bitwise_diff(served, reference(f"{tmp}/ckpt", 2, SPEC))
        # A fresh source starts at the newest full (4: damaged), nothing servable from there,
        # so it reads again from the full before it (0): delta 2, garbage, the other run's 2
        # markers, (4 told already), delta 6 of the refused 4.
        assert [f.step for f in faults] == [4, -1, 1, 2, 6], faults
        assert faults[0].serving == (-1, "") and all(f.serving == version for f in faults[1:])
        assert all(f.uri == replay for f in faults), faults
        assert "damaged" in faults[1].error and "partition 0 offset 2" in faults[1].checkpoint
        assert all("foreign" in f.error and other.run in f.error for f in faults[2:4])
        assert "damaged" in faults[0].error and "quarantined" in faults[0].error
        assert "out of order" in faults[4].error and "delta of step 4" in faults[4].error
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        # one ERROR line per refused update, naming the quarantined message (not a second line
        # for its quarantining)
        assert len(errors) == 5, errors
        assert all("not applied" in e for e in errors), errors
        assert "serving step -1" in errors[0] and all("serving step 2" in e for e in errors[1:])
        assert "quarantined partition 2 offset" in errors[0], errors[0]
        assert all("quarantine.json" in errors[i] for i in (0, 1, 2, 3)), errors
        with open(tmp_path / "q" / "quarantine.json") as f:
            entries = json.load(f)["entries"]
        assert [(e["kind"], e["partition"]) for e in entries] == [
            ("poison", 2),
            ("poison", 0),
            ("foreign", 0),
            ("foreign", 0),
        ], entries
        # Nothing more on the topic: nothing changes, nothing is reported again.
        faults.clear()
        before = {k: copy.deepcopy(m.state_dict()) for k, m in served.items()}
        assert live.poll() == [] and live.version == version and not faults
        for kind, model in served.items():
            for key, value in model.state_dict().items():
                assert torch.equal(value, before[kind][key]), (kind, key)

        # The next full moves it on; markers of older steps after it (the delta 2, the full 4)
        # are out of order.
        produce_batch(replay, 0, [markers[8], markers[2], markers[4]])
        assert [(s.step, s.kind) for s in live.poll()] == [(8, "full")]
        assert not bitwise_diff(served, reference(f"{tmp}/ckpt", 8, SPEC))
        assert [f.step for f in faults] == [2, 4], faults
        assert all("out of order" in f.error and "served step 8" in f.error for f in faults)
        assert live.step == 8
    finally:
        source.close()


def test_a_fresh_model_starts_at_the_newest_full_and_rolls_back_to_kept_ones(
    broker: TansuBroker, published: tuple[str, str]
) -> None:
    """A serving process (re)started on a topic reads from the newest full of its markers, not
    from the topic's oldest message: it serves the newest step after one whole version and the
    deltas since; a restart does the same again."""
    topic_uri, tmp = published
    original = _read_topic(topic_uri)
    markers = {m.step: original[0][i] for i, m in enumerate(_markers(topic_uri))}
    replay = broker.uri(f"fresh-{uuid.uuid4().hex[:10]}")
    create_topic(replay, PARTITIONS)
    produce_batch(replay, 1, original[1])
    produce_batch(replay, 2, original[2])
    produce_batch(replay, 0, [markers[s] for s in (0, 2, 4, 6)])  # fulls at 0 and 4
    served = serving_models(SPEC, seed=9)
    source = KafkaSource(replay, wait_s=WAIT_S)
    live = LiveModel(list(served.values()), source, LiveConfig(keep_versions=2))
    try:
        # the full of step 4, then its delta; the full of step 0 and its delta are not read
        assert [(s.step, s.kind) for s in live.poll()] == [(4, "full"), (6, "delta")]
        assert not bitwise_diff(served, reference(f"{tmp}/ckpt", 6, SPEC))
        produce_batch(replay, 0, [markers[LAST]])
        assert [(s.step, s.kind) for s in live.poll()] == [(LAST, "full")]
        assert not bitwise_diff(served, reference(f"{tmp}/ckpt", LAST, SPEC))
        assert live.poll() == [] and not live.faults
        assert live.kept_steps() == [6, 4]
        switch = live.rollback(4)
        assert switch is not None and switch.kind == "rollback"
        assert not bitwise_diff(served, reference(f"{tmp}/ckpt", 4, SPEC))
        with pytest.raises(CheckpointNotFoundError, match="not read its topic backwards"):
            live.rollback(2)
        assert live.step == 4
    finally:
        source.close()
    # A restart: a new process's model (other random tables) serves the newest step again
    # after one whole version, reading of each rank partition that step's rows only (from the
    # start its rank recorded; the replay keeps the partitions' offsets).
    again = serving_models(SPEC, seed=11)
    source = KafkaSource(replay, wait_s=WAIT_S)
    live = LiveModel(list(again.values()), source)
    try:
        assert [(s.step, s.kind) for s in live.poll()] == [(LAST, "full")]
        assert not bitwise_diff(again, reference(f"{tmp}/ckpt", LAST, SPEC))
        assert not live.faults
        name = parse_kafka_uri(topic_uri).topic
        for p in (1, 2):
            keys = [decode_segment(h, v, name, p, i).key for i, (_, v, h) in enumerate(original[p])]
            newest = sum(k.startswith(f"step-{LAST:012d}/") for k in keys)
            assert source.readers[p].messages == newest < len(keys), (p, newest, len(keys))
    finally:
        source.close()
