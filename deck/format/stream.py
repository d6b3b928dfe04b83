"""deck's stream format: a publish chain carried by a Kafka topic (``kafka://host:port/topic``).

Pure data, no Kafka client: the trainer's sink (``deck.trainer.kafka_sink``) encodes, the loading
service (``deck.serve.kafka_follow``) decodes. Layout of the topic:

- partition 0 is the **control** partition: one marker per committed publish, produced by rank 0
  right after the step's commit record (``step-N/manifest.json``) is at the state URI, i.e. after
  every rank's rows were acknowledged by the broker;
- partition ``rank + 1`` holds that rank's table files (deck chunk files and bundles, exactly
  the bytes the file publisher writes, checksummed per chunk in the rank manifest), split into
  segments of at most ``max_message_bytes``; the message key is the rank;
- beside each rank manifest at the state URI, that rank's :class:`StepStart` (a record with its
  own ``format_version``): the lowest offset of the step's segments on its partition, where a
  reader that starts at this step begins instead of the partition's oldest message. A hint,
  never trusted: what is read from there is checked as any segment is, and a step whose files
  are not all found from there is read again from the oldest message.

Every message carries the xxh3 of its value in a header, so a damaged message is refused where it
is read (topic, partition, offset), before its bytes reach a chunk decoder.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import xxhash

from deck.errors import ConfigError, CorruptCheckpointError, DeckError, StorageError
from deck.format.manifest import step_dir

STREAM_VERSION = b"1"
START_VERSION = 1
"""The ``format_version`` of :class:`StepStart` records this deck writes and reads (a record of
another version is not used: its partition is read from the oldest message)."""
MAX_START_BYTES = 4096  # a StepStart record is about 100 bytes; a larger one is not read
CONTROL_PARTITION = 0
RUN_FILE = "_stream_run.json"
"""At the state URI: ``{"run": "<id>"}``, the publishing run's identity, created by the first
marker's producer when missing; every marker carries it (``"run"``)."""
_RUN = re.compile(r"[0-9A-Za-z._\-]{1,64}")
_RANK_PART = re.compile(r"/rank-(\d{5})/")
_COMMIT = re.compile(r"^step-(\d{12})/manifest\.json$")
_PART = re.compile(r"^step-(\d{12})/([0-9a-f]{16})/rank-(\d{5})\.json$")


class CorruptStreamError(CorruptCheckpointError):
    """A message of the stream fails its checksum or cannot be decoded."""


class MessageTooLargeError(ConfigError):
    """A stream message is larger than the producer or the broker accepts (``message.max.bytes``):
    waiting does not fix it, so the publish fails at once, naming topic, partition and step."""


class StreamGapError(DeckError):
    """The stream lacks messages a step needs (retention removed them, or a publish failed)."""


@dataclass(frozen=True)
class KafkaTarget:
    """A parsed ``kafka://host:port[,host:port...]/topic`` URI."""

    bootstrap: str
    topic: str

    @property
    def uri(self) -> str:
        return f"kafka://{self.bootstrap}/{self.topic}"


_BROKERS = "the brokers are the kafka:// URI's"
# librdkafka settings deck's clients set themselves, and why: given as extra options they
# would override them (a break-it finding: a publisher's bootstrap.servers sent every publish to
# another broker while each error named the URI's; acks=0 went unrefused)
PRODUCER_SETS = {
    "bootstrap.servers": _BROKERS,
    "metadata.broker.list": _BROKERS,
    "acks": "a publish commits only segments every in-sync replica acknowledged (acks=all)",
    "request.required.acks": "a publish commits only acknowledged segments (acks=all)",
    "enable.idempotence": "a retried segment must not be written twice (idempotence)",
    "message.max.bytes": "set PublishConfig.max_message_bytes instead",
}
CONSUMER_SETS = {
    "bootstrap.servers": _BROKERS,
    "metadata.broker.list": _BROKERS,
    "group.id": "pass the reader's group argument instead",
    "enable.auto.commit": "offsets are committed once a step is applied, by hand",
    "enable.partition.eof": "the reader needs end-of-partition events to know a step is whole",
    "auto.offset.reset": "an offset retention removed must read from the oldest message left",
}


def options_deck_sets(options: Mapping[str, Any], sets: Mapping[str, str]) -> str | None:
    """What is wrong with ``options``, extra librdkafka settings, when they name one deck sets
    itself (``sets``: setting -> why); None when they name none."""
    taken = [k for k in options if k in sets]
    if not taken:
        return None
    why = "; ".join(f"{k}: {sets[k]}" for k in taken)
    them = "it" if len(taken) == 1 else "them"
    return f"{', '.join(taken)}: deck sets {them} ({why}); leave {them} out"


class _DemotedLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    def log(self, level: int, msg: object, *args: object, **kwargs: object) -> None:
        self.logger.debug(msg, *args)


def kafka_client_log() -> logging.LoggerAdapter:  # type: ignore[type-arg]
    """The ``logger`` for deck's Kafka clients (confluent-kafka's config key): librdkafka's own
    lines (an unreachable broker logs one per retry, hundreds while deck waits) go to the
    ``deck.kafka.client`` logger at DEBUG; deck reports what failed once, in its own error."""
    return _DemotedLog(logging.getLogger("deck.kafka.client"), {})


def offsets_error(topic: str, bootstrap: str, e: Exception) -> StorageError:
    """The error for a failed offsets query of ``topic``, saying what to do."""
    text = str(e)
    if "UNKNOWN_PARTITION" in text or "UNKNOWN_TOPIC" in text:
        why = (
            "the topic does not exist (yet): a publisher creates it when it starts "
            "(deck.enable with PublishConfig(uri='kafka://...')); start the trainer first"
        )
    elif "ALL_BROKERS_DOWN" in text or "TRANSPORT" in text or "TIMED_OUT" in text:
        why = f"no broker answers at {bootstrap}; is it running, and is the address right?"
    else:
        why = "see the broker's error"
    return StorageError(f"kafka topic {topic} at {bootstrap}: cannot read offsets ({why}): {text}")


def parse_kafka_uri(uri: str) -> KafkaTarget:
    """The brokers and topic of ``uri``; ConfigError naming it when malformed."""
    parts = urlsplit(uri)
    topic = parts.path.strip("/")
    # The scheme chose this parser (deck.schemes); what follows it is checked here.
    if not parts.netloc or not re.fullmatch(r"[A-Za-z0-9._\-]+", topic):
        raise ConfigError(
            f"{uri!r}: a Kafka publish URI is kafka://host:port[,host:port]/topic (topic: "
            "letters, digits, . _ -)"
        )
    return KafkaTarget(parts.netloc, topic)


def rank_partition(rank: int) -> int:
    """The partition of a rank's table files (partition 0 carries the markers)."""
    return rank + 1


def is_stream_file(key: str) -> bool:
    """Whether a publish file travels through the stream (table chunks and bundles) rather
    than the state URI (dense and user state, rank manifests, commit records)."""
    return key.endswith(".chunk") or (
        "/rank-" in key and key.rsplit("/", 1)[-1].startswith("bundle-")
    )


def rank_of(key: str) -> int:
    """The rank whose part a stream file belongs to (from its ``rank-NNNNN`` folder)."""
    m = _RANK_PART.search(key)
    if m is None:
        raise DeckError(f"{key}: not a file of a rank's part")
    return int(m.group(1))


def file_step(key: str) -> int | None:
    """The step of a publish file key (``step-N/...``), else None."""
    m = re.match(r"^step-(\d{12})/", key)
    return int(m.group(1)) if m else None


def commit_step(key: str) -> int | None:
    """The step of a trainer commit record key (``step-N/manifest.json``), else None."""
    m = _COMMIT.match(key)
    return int(m.group(1)) if m else None


def file_attempt(key: str) -> tuple[int, str] | None:
    """(step, checkpoint id) of a rank's publish file key ``step-N/<id>/rank-.../...``."""
    m = re.match(r"^step-(\d{12})/([0-9a-f]{16})/rank-\d{5}/", key)
    return (int(m.group(1)), m.group(2)) if m else None


def part_manifest_of(key: str) -> tuple[int, str, int] | None:
    """(step, checkpoint id, rank) of a rank manifest key ``step-N/<id>/rank-<r>.json``."""
    m = _PART.match(key)
    return (int(m.group(1)), m.group(2), int(m.group(3))) if m else None


@dataclass(frozen=True)
class StepStart:
    """Where rank ``rank``'s segments of the publish ``(step, ckpt_id)`` begin on its partition:
    the lowest offset the broker acknowledged for one of them. Written by the rank's sink at the
    state URI (:meth:`key`) before its rank manifest, so it is there when the marker is."""

    step: int
    ckpt_id: str
    rank: int
    offset: int

    def key(self) -> str:
        return start_key(self.step, self.ckpt_id, self.rank)

    def begins(self, offset: int, key: str) -> bool:
        """Whether the message at ``offset``, a segment of the file ``key``, is where this
        record says the rows begin: the lowest offset of the attempt's segments is one."""
        return (
            offset == self.offset
            and file_attempt(key) == (self.step, self.ckpt_id)
            and rank_of(key) == self.rank
        )

    def encode(self) -> bytes:
        return json.dumps(
            {
                "format_version": START_VERSION,
                "step": self.step,
                "id": self.ckpt_id,
                "rank": self.rank,
                "offset": self.offset,
            },
            sort_keys=True,
        ).encode()


def start_key(step: int, ckpt_id: str, rank: int) -> str:
    """The key of rank ``rank``'s :class:`StepStart` of the publish ``(step, ckpt_id)``."""
    return f"{step_dir(step)}/{ckpt_id}/stream-{rank:05d}.json"


def decode_start(raw: bytes, step: int, ckpt_id: str, rank: int) -> StepStart:
    """The :class:`StepStart` in ``raw``, which must be the one of rank ``rank`` of ``(step,
    ckpt_id)`` (a record copied from elsewhere is refused); ValueError saying why not."""
    try:
        d = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from e
    if not isinstance(d, dict) or d.get("format_version") != START_VERSION:
        raise ValueError(f"not a version {START_VERSION} stream start record")
    offset = d.get("offset")
    # bool is an int in Python; an offset is a plain non-negative integer
    if type(offset) is not int or offset < 0:
        raise ValueError(f"offset {offset!r} is not an offset")
    if (d.get("step"), d.get("id"), d.get("rank")) != (step, ckpt_id, rank):
        raise ValueError(
            f"it is the record of step {d.get('step')!r} ({d.get('id')!r}) rank "
            f"{d.get('rank')!r}, not of step {step} ({ckpt_id}) rank {rank}"
        )
    return StepStart(step, ckpt_id, rank, offset)


def _digest(data: bytes | memoryview) -> bytes:
    return xxhash.xxh3_64_hexdigest(data).encode()


def segment_headers(key: str, seg: int, segs: int, size: int, data: memoryview) -> list[Any]:
    """Kafka headers of segment ``seg`` of ``segs`` of the file ``key`` (``size`` bytes)."""
    return [
        ("deck", STREAM_VERSION),
        ("type", b"seg"),
        ("key", key.encode()),
        ("seg", b"%d/%d" % (seg, segs)),
        ("size", b"%d" % size),
        ("xxh3", _digest(data)),
    ]


def marker_value(
    step: int, ckpt_id: str, state_uri: str, world_size: int, run: str | None = None
) -> bytes:
    """The value of a step's marker (JSON: where its commit record and state are, and the
    publishing run's identity ``run``: :data:`RUN_FILE`)."""
    d: dict[str, Any] = {
        "step": step,
        "id": ckpt_id,
        "state_uri": state_uri,
        "world_size": world_size,
    }
    if run is not None:
        d["run"] = run
    return json.dumps(d, sort_keys=True).encode()


def new_run_id() -> str:
    """A fresh run identity: 32 hex digits (128 random bits)."""
    return secrets.token_hex(16)


def valid_run(run: str) -> bool:
    """Whether ``run`` has the form of a run identity (1-64 of ``[0-9a-zA-Z._-]``)."""
    return bool(_RUN.fullmatch(run))


def marker_headers(value: bytes) -> list[Any]:
    return [("deck", STREAM_VERSION), ("type", b"marker"), ("xxh3", _digest(value))]


@dataclass(frozen=True)
class Marker:
    step: int
    ckpt_id: str
    state_uri: str
    world_size: int
    offset: int
    run: str | None = None  # the publishing run (None: a stream of a deck before run ids)


@dataclass(frozen=True)
class Segment:
    key: str
    seg: int
    segs: int
    size: int
    data: bytes
    offset: int


def _where(topic: str, partition: int, offset: int) -> str:
    return f"kafka topic {topic} partition {partition} offset {offset}"


def _checked(
    headers: list[Any] | None, value: bytes | None, topic: str, partition: int, offset: int
) -> dict[str, bytes]:
    h = {k: bytes(v) for k, v in headers or () if v is not None}
    where = _where(topic, partition, offset)
    if h.get("deck") != STREAM_VERSION:
        raise CorruptStreamError(
            f"{where}: not a deck stream message (version {h.get('deck')!r}); is another "
            "producer writing to this topic?"
        )
    if value is None or h.get("xxh3") != _digest(value):
        raise CorruptStreamError(
            f"{where}: the message fails its checksum (damaged on the way or on the broker, "
            "or not a publisher's); a step that needs it cannot be applied from the stream: "
            "the loader moves on at the next full publish (or restore it from its full, the "
            "follower's full_uri)"
        )
    return h


def decode_marker(
    headers: list[Any] | None, value: bytes | None, topic: str, partition: int, offset: int
) -> Marker:
    """A checked marker; CorruptStreamError naming the topic, partition and offset otherwise."""
    h = _checked(headers, value, topic, partition, offset)
    try:
        if h.get("type") != b"marker":
            raise ValueError(f"type {h.get('type')!r} on the control partition")
        d = json.loads(value or b"")
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        run = d.get("run")
        if run is not None and not (isinstance(run, str) and valid_run(run)):
            raise ValueError(f"run {run!r} is not a run identity")
        step = int(d["step"])
        if step < 0 or not isinstance(d["id"], str) or not isinstance(d["state_uri"], str):
            raise ValueError("step, id or state_uri of the wrong type")
        return Marker(step, d["id"], d["state_uri"], int(d["world_size"]), offset, run)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptStreamError(f"{_where(topic, partition, offset)}: bad marker: {e}") from e


def decode_segment(
    headers: list[Any] | None, value: bytes | None, topic: str, partition: int, offset: int
) -> Segment:
    """A checked file segment; CorruptStreamError naming the topic, partition and offset."""
    h = _checked(headers, value, topic, partition, offset)
    try:
        if h.get("type") != b"seg":
            raise ValueError(f"type {h.get('type')!r} on a rank partition")
        seg, segs = (int(x) for x in h["seg"].split(b"/"))
        key = h["key"].decode()
        if not 0 <= seg < segs or file_step(key) is None:
            raise ValueError(f"segment {seg}/{segs} of {key!r}")
        return Segment(key, seg, segs, int(h["size"]), value or b"", offset)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptStreamError(f"{_where(topic, partition, offset)}: bad segment: {e}") from e


def split(data: bytes | bytearray | memoryview, max_bytes: int) -> list[memoryview]:
    """``data`` in pieces of at most ``max_bytes`` (one empty piece for an empty file)."""
    view = memoryview(data).cast("B")
    if max_bytes < 1:
        raise ConfigError(f"max_message_bytes must be positive, got {max_bytes}")
    return [view[i : i + max_bytes] for i in range(0, max(len(view), 1), max_bytes)] or [view]
