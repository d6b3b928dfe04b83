"""An independent consumer of deck's Kafka stream, written from docs/format.md alone.

The consumer below uses no deck code: it reads the topic with confluent_kafka and the state URI
(a local directory) with plain json / numpy / xxhash, as a consumer in another language would,
following "Kafka stream", "Layout", "Chunk files", "Part manifest", "Commit record" and "Dense
and extra state". A 2-rank DMP publishes a full and deltas through a real broker (Tansu); the
weights the consumer rebuilds must equal the live model's bitwise at the last published step.
Only the trainer (the publisher under test) uses deck. Where the doc fell short, docs/format.md
was fixed to say what this consumer needed.
"""

from __future__ import annotations

import base64
import json
import struct
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import xxhash
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition
from safetensors.numpy import load_file
from safetensors.torch import save_file

import deck
from deck.demo import ModelSpec, build_model, train_step
from deck.testing.dist_harness import run_ranks
from deck.testing.kafka_broker import TansuBroker

pytestmark = pytest.mark.slow

# Two sharded tables and a data_parallel one (a tensor of the dense file). Column-wise: each
# rank holds columns c0 / c8 of every row, one chunk file each; table-wise: each rank holds
# whole tables, its chunks travel bundled. (Row-wise sharding has no CPU kernel.)
SHARDINGS = {"column_wise": 0, "table_wise": 64 * 1024}  # sharding -> StagingConfig.bundle_bytes
PUBLISH_EVERY = 2
LAST = 10  # the last published step: a full at 0, deltas at 2..10
CHUNK_BYTES = 16 * 1024  # 368 rows per chunk: a full shard of 1000 rows is three chunks
MAX_MESSAGE = 6000  # not a divisor of CHUNK_BYTES: files split into uneven segments
# The user state the trainer hands to deck: tuples, bytes and non-string keys, which the
# extra file's deck_tree must encode so that a consumer gets them back exactly.
USER_STATE = {"seen": (1, "a", None), "tag": b"\x00\xffdeck", "by_id": {7: [True, 2.5]}}


@pytest.fixture(scope="module")
def broker() -> Iterator[TansuBroker]:
    with TansuBroker() as b:
        yield b


# --- the publisher under test (deck) ---------------------------------------------------------


class _UserState:
    def state_dict(self) -> dict[str, Any]:
        return USER_STATE

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _spec(sharding: str) -> ModelSpec:
    return ModelSpec(
        num_tables=3, rows=1000, dim=16, batch=32, sharding=sharding, data_parallel_tables=(2,)
    )


def _train(rank: int, world_size: int, topic_uri: str, tmp: str, sharding: str) -> None:
    """Train and publish every PUBLISH_EVERY steps; save this rank's live tables at LAST."""
    spec = _spec(sharding)
    model, opt = build_model(spec)
    config = deck.DeckConfig(
        uri=f"{tmp}/ckpt",
        delta_every_steps=LAST,
        staging=deck.StagingConfig(
            chunk_bytes=CHUNK_BYTES, bundle_bytes=SHARDINGS[sharding], spool_dir=f"{tmp}/spool"
        ),
        publish=deck.PublishConfig(
            uri=topic_uri,
            state_uri=f"{tmp}/state",
            every_steps=PUBLISH_EVERY,
            max_message_bytes=MAX_MESSAGE,
        ),
    )
    with deck.enable(model, [opt], config, state=_UserState()) as ck:
        for step in range(0, LAST + 1):
            if step:
                train_step(model, opt, spec, step)
            ck.step(step)
        assert ck.flush()
        published = [(p.step, p.kind) for p in ck.published]
        assert published == [(0, "full")] + [(s, "delta") for s in range(2, LAST + 1, 2)]
        save_file(_live_tables(model), f"{tmp}/live-{rank}.safetensors")
        dist.barrier()


def _live_tables(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's embedding weights from TorchRec's own state_dict: each local shard of a
    sharded table as `<key>@<row offset>@<col offset>`, a data_parallel table whole."""
    live = {}
    for key, value in model.state_dict().items():
        if "embedding_bags" not in key:
            continue
        if hasattr(value, "local_shards"):
            for shard in value.local_shards():
                row, col = shard.metadata.shard_offsets
                live[f"{key}@{row}@{col}"] = shard.tensor.detach().clone().contiguous()
        else:
            live[f"{key}@0@0"] = value.detach().clone().contiguous()
    return live


# --- the consumer (docs/format.md only) ------------------------------------------------------


def xxh3(data: bytes) -> str:
    """XXH3-64 (seed 0) as the doc writes it: 16 lowercase hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


@dataclass(frozen=True)
class Message:
    partition: int
    offset: int
    key: bytes | None
    headers: dict[str, bytes]
    value: bytes


def read_topic(bootstrap: str, topic: str, timeout_s: float = 60.0) -> dict[int, list[Message]]:
    """Every message of every partition, in offset order. The publisher has finished, so reading
    each partition to its end first is what a live consumer that caught up would have seen. The
    end is librdkafka's end-of-partition event, not the high watermark: Tansu 0.6 counts a
    multi-message batch as one message there (docs/operations.md)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"wire-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    try:
        partitions = sorted(consumer.list_topics(topic, timeout=30).topics[topic].partitions)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        messages: dict[int, list[Message]] = {p: [] for p in partitions}
        at_end: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if at_end == set(partitions):
                return messages
            msg = consumer.poll(1.0)
            if msg is None:
                continue
            if msg.error() is not None:
                assert msg.error().code() == KafkaError._PARTITION_EOF, msg.error()
                at_end.add(msg.partition())
                continue
            headers = {k: v for k, v in msg.headers() or []}
            messages[msg.partition()].append(
                Message(msg.partition(), msg.offset(), msg.key(), headers, msg.value() or b"")
            )
        raise AssertionError(f"partitions {set(partitions) - at_end} never reached their end")
    finally:
        consumer.close()


def check_headers(msg: Message, kind: str) -> None:
    """`deck` (stream version 1), `type` and the value's `xxh3`, on every message."""
    assert msg.headers.get("deck") == b"1", (msg.partition, msg.offset, msg.headers)
    assert msg.headers.get("type") == kind.encode(), (msg.partition, msg.offset, msg.headers)
    assert msg.headers.get("xxh3") == xxh3(msg.value).encode(), (msg.partition, msg.offset)


def decode_marker(msg: Message) -> dict[str, Any]:
    check_headers(msg, "marker")
    assert msg.key == b"marker"
    marker = json.loads(msg.value.decode("utf-8"))
    assert list(marker) == sorted(marker), "marker keys are sorted"
    assert set(marker) == {"id", "run", "state_uri", "step", "world_size"}, marker
    return marker


def read_checked(path: Path, nbytes: int | None = None, checksum: str | None = None) -> bytes:
    """A file of the state URI, checked against the record that names it."""
    data = path.read_bytes()
    if nbytes is not None:
        assert len(data) == nbytes, (path, len(data), nbytes)
    if checksum is not None:
        assert xxh3(data) == checksum, path
    return data


def load_manifest(data: bytes) -> dict[str, Any]:
    """A commit record or part manifest: its `self_checksum` is the xxh3 of its own compact
    sorted-key JSON without that key ("Validation on read")."""
    record = json.loads(data)
    claimed = record.pop("self_checksum")
    compact = json.dumps(record, sort_keys=True, separators=(",", ":"))
    assert xxh3(compact.encode()) == claimed, "self_checksum"
    assert record["format_version"] == 1
    return record


def step_folder(state_uri: str, step: int) -> Path:
    return Path(state_uri) / f"step-{step:012d}"


# safetensors dtype names -> numpy; bfloat16 has no numpy type and is kept as its raw bits.
_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}  # fmt: skip


def decode_state_file(data: bytes) -> Any:
    """A dense / extra safetensors file: the `deck_tree` metadata with its markers resolved
    (`__tensor__` names a tensor of the body; `__tuple__`, `__bytes__`, `__dict__` as the doc
    says)."""
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    body = data[8 + header_len :]
    tree = json.loads(header.pop("__metadata__")["deck_tree"])
    tensors = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        array = np.frombuffer(body[start:end], dtype=_ST_DTYPES[info["dtype"]])
        tensors[name] = array.reshape(info["shape"])
    return _resolve(tree, tensors)


def _resolve(node: Any, tensors: dict[str, np.ndarray]) -> Any:
    if isinstance(node, list):
        return [_resolve(v, tensors) for v in node]
    if not isinstance(node, dict):
        return node
    if list(node) == ["__tensor__"]:
        return tensors[node["__tensor__"]]
    if list(node) == ["__tuple__"]:
        return tuple(_resolve(v, tensors) for v in node["__tuple__"])
    if list(node) == ["__bytes__"]:
        return base64.b64decode(node["__bytes__"])
    if list(node) == ["__dict__"]:
        return {_resolve(k, tensors): _resolve(v, tensors) for k, v in node["__dict__"]}
    assert not any(k.startswith("__") for k in node), f"unknown marker in {list(node)}"
    return {k: _resolve(v, tensors) for k, v in node.items()}


class RankPartition:
    """The segments of one rank's partition (`r + 1`), consumed marker by marker."""

    def __init__(self, rank: int, messages: list[Message]) -> None:
        self.rank = rank
        self.unread = iter(messages)
        self.kept: deque[Message] = deque()  # segments of later steps, waiting for their marker

    def _next(self) -> Message | None:
        return self.kept.popleft() if self.kept else next(self.unread, None)

    def take_files(self, step: int, wanted: set[str]) -> dict[str, bytes]:
        """The whole files named in `wanted` (keys `step-N/<id>/rank-R/...`), reading no further
        than their last segment. Segments of later steps are kept for their markers; the rest
        (failed publishes, replaced ids) are dropped."""
        parts: dict[str, list[bytes]] = {key: [] for key in wanted}
        sizes: dict[str, tuple[int, int]] = {}
        done: set[str] = set()
        later: list[Message] = []
        while done != wanted and (msg := self._next()) is not None:
            check_headers(msg, "seg")
            assert msg.key == str(self.rank).encode(), (msg.partition, msg.offset, msg.key)
            key = msg.headers["key"].decode("utf-8")
            if key not in wanted:
                if _step_of(key) > step:
                    later.append(msg)
                continue
            index, count = (int(x) for x in msg.headers["seg"].decode().split("/"))
            size = int(msg.headers["size"])
            assert sizes.setdefault(key, (count, size)) == (count, size), key
            assert index == len(parts[key]), f"{key}: segment {index} out of order"
            assert len(msg.value) <= MAX_MESSAGE, "a segment is at most max_message_bytes"
            parts[key].append(msg.value)
            if len(parts[key]) == count:
                done.add(key)
        self.kept.extendleft(reversed(later))  # they came before what is still kept
        assert done == wanted, f"rank {self.rank} step {step}: missing {sorted(wanted - done)}"
        files = {key: b"".join(parts[key]) for key in wanted}
        for key, data in files.items():
            assert len(data) == sizes[key][1], f"{key}: {len(data)} bytes, header says size"
        return files


def _step_of(key: str) -> int:
    folder = key.split("/", 1)[0]
    assert folder.startswith("step-") and len(folder) == 17, key
    return int(folder[len("step-") :])


def splitmix64_finalizer(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def check_row_index(index: dict[str, Any], ids: np.ndarray) -> None:
    """Every id lies in [min_id, max_id] and (when there is a filter) sets its k bloom bits."""
    assert index["min_id"] <= ids[0] and ids[-1] <= index["max_id"], index
    bits, k = index["bits"], index["k"]
    if bits == 0:
        assert k == 0 and index.get("bloom") is None
        assert len(ids) == index["max_id"] - index["min_id"] + 1, "no filter: ids are the range"
        return
    bloom = np.unpackbits(
        np.frombuffer(base64.b64decode(index["bloom"]), np.uint8), bitorder="little"
    )
    x = ids.astype(np.uint64)
    with np.errstate(over="ignore"):
        for i in range(k):
            z = splitmix64_finalizer(x + np.uint64(0x9E3779B97F4A7C15) * np.uint64(i + 1))
            pos = ((z >> np.uint64(32)) * np.uint64(bits)) >> np.uint64(32)
            assert bloom[pos.astype(np.int64)].all(), "an id's bloom bit is clear"


def decode_chunk(
    data: bytes, record: dict[str, Any], shard: dict[str, Any]
) -> dict[str, np.ndarray]:
    """A chunk file: raw little-endian segments on 64-byte boundaries, page-padded; `ids` first,
    then one segment per state of the shard, each with `rows` as its first dimension."""
    assert len(data) % 4096 == 0, "a chunk is zero-padded to a multiple of 4096 bytes"
    rows = record["rows"]
    names = [seg["name"] for seg in record["segments"]]
    assert names == ["ids", *shard["states"]], names
    arrays = {}
    end = 0
    for seg in record["segments"]:
        assert "encoding" not in seg, "the trainer's publishes are exact"
        dtype = np.dtype(seg["dtype"]).newbyteorder("<")
        offset, nbytes, shape = seg["offset"], seg["nbytes"], seg["shape"]
        assert offset % 64 == 0 and offset >= end, seg
        assert shape[0] == rows and nbytes == dtype.itemsize * int(np.prod(shape)), seg
        end = offset + nbytes
        assert end <= len(data), seg
        arrays[seg["name"]] = np.frombuffer(data, dtype, int(np.prod(shape)), offset).reshape(shape)
    assert not any(data[end:]), "zero padding after the last segment"
    ids = arrays["ids"]
    assert (np.diff(ids) > 0).all(), "ids strictly ascending"
    row_offset = shard["row_offset"]
    assert row_offset <= ids[0] and ids[-1] < row_offset + shard["rows"], "ids inside the shard"
    assert arrays["weight"].shape == (rows, shard["cols"])
    if "index" in record:
        check_row_index(record["index"], ids)
    return arrays


@dataclass
class Held:
    """The state the consumer serves: one publish step of one run."""

    step: int
    id: str
    # (table, col_offset, state) -> that column shard's state of every row of the table
    states: dict[tuple[str, int, str], np.ndarray] = field(default_factory=dict)
    shapes: dict[str, tuple[int, int]] = field(default_factory=dict)  # table -> (rows, cols)
    dense: dict[str, Any] = field(default_factory=dict)
    extra: dict[int, Any] = field(default_factory=dict)  # rank -> its extra tree

    def weight(self, table: str) -> np.ndarray:
        """The table's whole weight, its column shards side by side."""
        cols = sorted(c for (t, c, s) in self.states if t == table and s == "weight")
        return np.concatenate([self.states[(table, c, "weight")] for c in cols], axis=1)


def apply_step(
    held: Held | None,
    commit: dict[str, Any],
    parts: dict[int, dict[str, Any]],
    files: dict[int, dict[str, bytes]],
    folder: Path,
) -> Held:
    """A full replaces the held state; a delta applies onto it only when its parent / parent_id
    are the held step and id."""
    if commit["kind"] == "full":
        new = Held(commit["step"], commit["id"])
    else:
        assert commit["kind"] == "delta", commit["kind"]
        assert held is not None and (commit["parent"], commit["parent_id"]) == (held.step, held.id)
        states = {k: v.copy() for k, v in held.states.items()}
        new = Held(commit["step"], commit["id"], states, dict(held.shapes))
    filled: dict[tuple[str, int], np.ndarray] = {}  # a full must cover every row of its shards
    for rank, part in parts.items():
        for shard in part["shards"]:
            _apply_shard(new, shard, files[rank], commit, filled)
        if part["dense"] is not None:
            new.dense = decode_state_file(_state_file(folder, part["dense"]))
        new.extra[rank] = decode_state_file(_state_file(folder, part["extra"]))
    for (table, col), rows in filled.items():
        assert rows.all(), f"full of step {commit['step']}: {table} c{col} misses rows"
    return new


def _state_file(folder: Path, record: dict[str, Any]) -> bytes:
    return read_checked(folder / record["path"], record["nbytes"], record["checksum"])


def _apply_shard(
    held: Held,
    shard: dict[str, Any],
    files: dict[str, bytes],
    commit: dict[str, Any],
    filled: dict[tuple[str, int], np.ndarray],
) -> None:
    table, col = shard["table"], shard["col_offset"]
    shape = (shard["num_rows"], shard["num_cols"])
    assert held.shapes.setdefault(table, shape) == shape, table
    assert shard["full"] == (commit["kind"] == "full"), shard["table"]
    for record in shard["chunks"]:
        data = files[f"step-{commit['step']:012d}/{record['path']}"]
        if "offset" in record:  # a bundled chunk: its bytes of the bundle file
            data = data[record["offset"] : record["offset"] + record["nbytes"]]
        assert len(data) == record["nbytes"] and xxh3(data) == record["checksum"], record["path"]
        arrays = decode_chunk(data, record, shard)
        ids = arrays.pop("ids")
        for name, rows in arrays.items():
            key = (table, col, name)
            if key not in held.states:
                assert commit["kind"] == "full", f"delta names a shard its full did not: {key}"
                held.states[key] = np.zeros((shape[0], *rows.shape[1:]), rows.dtype)
            held.states[key][ids] = rows
        if shard["full"]:
            seen = filled.setdefault((table, col), np.zeros(shape[0], bool))
            seen[ids] = True
    if shard["full"]:
        seen = filled.setdefault((table, col), np.zeros(shape[0], bool))
        rows_of_shard = seen[shard["row_offset"] : shard["row_offset"] + shard["rows"]]
        assert rows_of_shard.all(), f"{table}: a full shard's chunks hold all its rows"


def read_part(folder: Path, entry: dict[str, Any], commit: dict[str, Any]) -> dict[str, Any]:
    """A rank's part manifest, checked against the commit record's entry for it. Paths in the
    records are relative to the step folder."""
    data = read_checked(folder / entry["path"], entry["nbytes"], entry["checksum"])
    part = load_manifest(data)
    assert part["ckpt_id"] == commit["id"] and part["rank"] == entry["rank"]
    assert (part["step"], part["world_size"]) == (commit["step"], commit["world_size"])
    return part


def table_file_keys(part: dict[str, Any], commit: dict[str, Any]) -> set[str]:
    """The stream keys of a part's table files (chunk files or bundles): `step-<12 digits>/`
    and the record's path, which starts `<id>/rank-<5 digits>/`."""
    folder = f"step-{commit['step']:012d}"
    keys = {f"{folder}/{chunk['path']}" for shard in part["shards"] for chunk in shard["chunks"]}
    prefix = f"{folder}/{commit['id']}/rank-{part['rank']:05d}/"
    assert all(key.startswith(prefix) for key in keys), keys
    return keys


def consume(bootstrap: str, topic: str) -> tuple[Held, list[int]]:
    """Apply every complete step of the newest marker's run, in marker order."""
    topic_messages = read_topic(bootstrap, topic)
    markers = [decode_marker(m) for m in topic_messages[0]]
    run = markers[-1]["run"]  # a fresh consumer serves the run of the newest marker
    streams: dict[int, RankPartition] = {}
    held: Held | None = None
    applied: list[int] = []
    for marker in markers:
        if marker["run"] != run:
            continue
        state_uri, step = marker["state_uri"], marker["step"]
        assert json.loads((Path(state_uri) / "_stream_run.json").read_text()) == {"run": run}
        folder = step_folder(state_uri, step)
        commit = load_manifest(read_checked(folder / "manifest.json"))
        if commit["id"] != marker["id"]:
            continue  # a later publish of the same step replaced it
        assert commit["step"] == step and commit["world_size"] == marker["world_size"]
        assert len(topic_messages) >= marker["world_size"] + 1, "partitions: world_size + 1"
        parts, files = {}, {}
        for entry in commit["ranks"]:
            rank = entry["rank"]
            parts[rank] = read_part(folder, entry, commit)
            stream = streams.setdefault(rank, RankPartition(rank, topic_messages[rank + 1]))
            files[rank] = stream.take_files(step, table_file_keys(parts[rank], commit))
        held = apply_step(held, commit, parts, files, folder)
        applied.append(step)
    assert held is not None, "no complete step on the topic"
    return held, applied


# --- the test ---------------------------------------------------------------------------------


def _live_weights(tmp: Path, world_size: int) -> dict[str, np.ndarray]:
    """Every table's whole weight, assembled from each rank's live shards."""
    shards: dict[str, dict[tuple[int, int], np.ndarray]] = {}
    for rank in range(world_size):
        for name, tensor in load_file(str(tmp / f"live-{rank}.safetensors")).items():
            key, row, col = name.rsplit("@", 2)
            shards.setdefault(key, {})[(int(row), int(col))] = tensor
    tables = {}
    for key, pieces in shards.items():
        rows = sorted({r for r, _ in pieces})
        cols = sorted({c for _, c in pieces})
        tables[key] = np.block([[pieces[(r, c)] for c in cols] for r in rows])
    return tables


@pytest.mark.parametrize("sharding", list(SHARDINGS))
def test_wire_consumer_rebuilds_live_weights(
    broker: TansuBroker, tmp_path: Path, sharding: str
) -> None:
    topic = f"wire-{sharding}"
    run_ranks(_train, broker.uri(topic), str(tmp_path), sharding)
    assert not list((tmp_path / "state").rglob("*.chunk")), "table files travel in the topic only"

    held, applied = consume(broker.bootstrap, topic)

    assert applied == list(range(0, LAST + 1, PUBLISH_EVERY))
    assert held.step == LAST
    live = _live_weights(tmp_path, world_size=2)
    for table, expected in live.items():
        # A sharded table's rows came through the topic; a data_parallel table is a plain
        # tensor of rank 0's dense file.
        got = held.weight(table) if table in held.shapes else held.dense[table]
        assert got.shape == expected.shape, table
        assert got.tobytes() == expected.tobytes(), f"{table} differs from the live model"
    assert len(held.shapes) == 2 and len(live) == 3
    for rank in (0, 1):
        assert held.extra[rank]["user"] == USER_STATE
