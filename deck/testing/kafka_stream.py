"""Kafka streams for loader tests, without TorchRec: a synthetic publisher on the real sink, damage
and foreign messages, and the expected loader output.

- :class:`SynthPublisher`: :class:`deck.testing.synth.SynthTrainer` (2 ranks, 4 tables) whose
  storage is the real :class:`deck.trainer.kafka_sink.KafkaSinkStorage`: its checkpoints are
  published exactly as a trainer's publisher tenant publishes (rows to the topic in segments,
  commit records to the state URI, then the marker with the run id), and it remembers the exact
  state of every step. :meth:`SynthPublisher.damage_next` flips one byte of the next message it
  produces on a partition (the checksum header stays the original's: damage on the way).
- :func:`inject`: a raw message on any partition (garbage, a forged header set).
- :func:`expected_output`: the tensors ``state.safetensors`` must hold for a saved step.

Loader children killed at failpoints: :class:`deck.testing.kafka_child.LoaderChildren`.

Needs confluent-kafka and a broker (:class:`deck.testing.kafka_broker.TansuBroker`).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import torch
from safetensors import safe_open

from deck.format.stream import parse_kafka_uri
from deck.serve.follow import RECORD_KEY, STATE_FILE
from deck.storage import open_storage
from deck.testing.synth import LAYOUT, SynthTrainer
from deck.trainer.kafka_sink import KafkaSinkStorage

MAX_MESSAGE = 2048  # below the synthetic chunk size: files travel in several segments


class _DamagingSink(KafkaSinkStorage):
    """The real sink, but the next message produced on a chosen partition has one byte
    flipped after its checksum header was computed."""

    damage: set[int]

    def _produce(
        self, partition: int, msg_key: bytes, messages: list[tuple[Any, list[Any]]], what: str
    ) -> int | None:
        if partition in self.damage and messages:
            self.damage.discard(partition)
            value, headers = messages[0]
            raw = bytearray(bytes(value))
            raw[len(raw) // 2] ^= 0x10
            messages = [(bytes(raw), headers), *messages[1:]]
        return super()._produce(partition, msg_key, messages, what)


class SynthPublisher:
    """A synthetic 2-rank trainer publishing through the real Kafka sink (see the module doc)."""

    def __init__(
        self,
        topic_uri: str,
        state_dir: str,
        seed: int = 0,
        world_size: int = 2,
        timeout_s: float = 20.0,
    ):
        self.topic_uri = topic_uri
        self.state_dir = state_dir
        self.world_size = world_size
        self.timeout_s = timeout_s  # the sink's (a trainer's upload_timeout_s)
        self.trainer = SynthTrainer(self._sink(), world_size=world_size, seed=seed)

    def _sink(self) -> _DamagingSink:
        sink = _DamagingSink(
            open_storage(self.state_dir),
            parse_kafka_uri(self.topic_uri),
            self.world_size,
            max_message_bytes=MAX_MESSAGE,
            timeout_s=self.timeout_s,
        )
        sink.damage = set()
        sink.ensure_topic()  # as open_kafka_sink does when a publisher starts
        return sink

    @property
    def sink(self) -> _DamagingSink:
        s = self.trainer.storage
        assert isinstance(s, _DamagingSink)
        return s

    def reconnect(self) -> None:
        """A new sink (producer) after the broker restarted, as a restarted publisher has (it
        creates the topic again)."""
        self.sink.close()
        self.trainer.storage = self._sink()

    @property
    def run(self) -> str:
        return self.sink.run_id()

    def publish(self, kind: str = "delta", rows: int = 12) -> int:
        """Train one step and publish it (a full when ``kind`` is "full" or it is the first);
        returns the step."""
        self.trainer.train(1, rows=rows)
        self.trainer.save(kind)
        return self.trainer.step

    def damage_next(self, partition: int) -> None:
        """Flip a byte of the next message this publisher produces on ``partition``."""
        self.sink.damage.add(partition)

    def expected(self, step: int) -> tuple[str, dict[str, torch.Tensor]]:
        """(checkpoint id, tensors of the loader output) of saved ``step``."""
        saved = self.trainer.saved[step]
        return saved.id, expected_output(saved.state, step)

    def close(self) -> None:
        self.sink.close()


def expected_output(state: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """The tensors ``deck follow`` writes for a synthetic trainer's saved ``state`` (its names:
    ``model.<table>``, ``optim.state.<table>.<short>.momentum1``, ``model.mlp``); rowwise states
    of column-split tables are one block per column shard, in column order."""
    out: dict[str, torch.Tensor] = {}
    for table, num_rows, num_cols, places, _ in LAYOUT:
        w = torch.full((num_rows, num_cols), float("nan"))
        col_shards = sorted({p[3] for p in places})
        mom = torch.full((len(col_shards) * num_rows,), float("nan"))
        for _, row_off, rows, col_off, cols in places:
            key = f"{table}|{row_off}|{col_off}"
            w[row_off : row_off + rows, col_off : col_off + cols] = state[f"{key}|weight"]
            base = col_shards.index(col_off) * num_rows + row_off
            mom[base : base + rows] = state[f"{key}|momentum1"]
        short = table.split(".")[0]
        out[f"model.{table}"] = w
        out[f"optim.state.{table}.{short}.momentum1"] = mom
    out["model.mlp"] = torch.full((3,), float(step))
    return out


def read_output(out_dir: str) -> tuple[int, str, dict[str, torch.Tensor]] | None:
    """(step, checkpoint id, tensors) of the loader output's data file (the atomic switch), or
    None when there is none."""
    path = os.path.join(out_dir, STATE_FILE)
    if not os.path.exists(path):
        return None
    with safe_open(path, "pt") as f:
        md = f.metadata()
        assert RECORD_KEY in md, f"{path}: no state record in its metadata"
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    return int(md["step"]), md["checkpoint"], tensors


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ bitwise (NaN never equals: an unfilled element shows up)."""
    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k].contiguous(), b[k].contiguous()
        if x.shape != y.shape or not torch.equal(x.view(torch.int32), y.view(torch.int32)):
            bad.append(k)
    return bad


def inject(bootstrap: str, topic: str, partition: int, value: bytes, headers: list[Any]) -> None:
    """Produce one raw message (acknowledged before returning)."""
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
    p.produce(topic, value=value, partition=partition, headers=headers)
    if p.flush(30) != 0:
        raise RuntimeError(f"kafka topic {topic} partition {partition}: inject not acknowledged")


RawMessage = tuple[bytes | None, bytes | None, list[Any]]  # key, value, headers


def read_partition(topic_uri: str, partition: int) -> list[RawMessage]:
    """Every message of a partition from offset 0, in order, to the broker's end-of-partition
    event (the index in the list is the offset on a topic nothing was deleted from)."""
    from confluent_kafka import Consumer, TopicPartition

    target = parse_kafka_uri(topic_uri)
    c = Consumer(
        {
            "bootstrap.servers": target.bootstrap,
            "group.id": f"test-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    got: list[RawMessage] = []
    try:
        c.assign([TopicPartition(target.topic, partition, 0)])
        while True:
            msg = c.poll(10)
            if msg is None:
                raise RuntimeError(f"{topic_uri} partition {partition}: no message nor end in 10 s")
            err = msg.error()
            if err is not None:
                if err.code() != -191:  # _PARTITION_EOF
                    raise RuntimeError(f"{topic_uri} partition {partition}: {err}")
                return got
            got.append((msg.key(), msg.value(), list(msg.headers() or [])))
    finally:
        c.close()


def produce_batch(topic_uri: str, partition: int, messages: list[RawMessage]) -> None:
    """Produce ``messages`` to ``partition`` in order, flushed once (so they travel in one
    batch, as a replay or mirror tool sends them), acknowledged before returning."""
    from confluent_kafka import Producer

    target = parse_kafka_uri(topic_uri)
    p = Producer({"bootstrap.servers": target.bootstrap, "acks": "all"})
    for key, value, headers in messages:
        p.produce(target.topic, value=value, key=key, partition=partition, headers=headers)
    if p.flush(30) != 0:
        raise RuntimeError(f"{topic_uri} partition {partition}: not acknowledged")


def create_topic(topic_uri: str, partitions: int) -> None:
    """Create the topic with ``partitions`` partitions (replication 1)."""
    from confluent_kafka.admin import AdminClient, NewTopic

    target = parse_kafka_uri(topic_uri)
    admin = AdminClient({"bootstrap.servers": target.bootstrap})
    admin.create_topics([NewTopic(target.topic, partitions, 1)])[target.topic].result(timeout=30)
