"""The Kafka sink of a publisher tenant (``PublishConfig.uri = "kafka://host:port/topic"``).

The publisher's save protocol, stager, spool and commit thread are the file publisher's,
unchanged: :class:`KafkaSinkStorage` is the destination they write to. It routes

- table files (chunks, bundles: :func:`deck.format.stream.is_stream_file`) to the topic, partition
  ``rank + 1``, key = rank, in segments of at most ``max_message_bytes``; a ``put`` returns once
  the broker acknowledged every segment (``acks=all``, idempotent producer), so a rank's part
  manifest -- written after its files -- means its rows are in the topic;
- everything else (dense and user state, rank manifests, the commit record) to ``state_uri``;
- after rank 0's commit record (written only once every rank's part manifest is at the state URI)
  a marker to partition 0. So a marker follows every rank's acknowledged rows, without a
  collective: the commit thread learns it from the part manifests, as for files;
- before a rank's part manifest, its :class:`deck.format.stream.StepStart` at the state URI:
  the lowest offset the broker acknowledged for the step's segments on its partition, so a
  reader starting at that step seeks there rather than reading the partition from its start.
  Each rank knows only its own offsets, and writes them beside its own manifest: no rank reads
  another's records to publish.

Why a Storage and not a second pipeline: the stall, the memory bound (chunk buffers, spool),
back-pressure (an upload thread waits for its acks), retries until ``upload_timeout_s`` and "a
failed publish makes the next one a full" all stay exactly those of a file publish.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from typing import Any

from deck.config import PublishConfig
from deck.errors import ConfigError, CorruptCheckpointError, NotFoundError, StorageError
from deck.format.jsonio import load_json
from deck.format.stream import (
    CONTROL_PARTITION,
    RUN_FILE,
    KafkaTarget,
    MessageTooLargeError,
    StepStart,
    commit_step,
    file_attempt,
    file_step,
    is_stream_file,
    kafka_client_log,
    marker_headers,
    marker_value,
    new_run_id,
    parse_kafka_uri,
    part_manifest_of,
    rank_of,
    rank_partition,
    segment_headers,
    split,
    valid_run,
)
from deck.storage import Storage
from deck.storage.base import get_bounded
from deck.storage.wrapper import StorageWrapper
from deck.trainer.coordination import Coordinator

logger = logging.getLogger(__name__)
_HEADER_SLACK = 4096  # headers and record overhead on top of a segment
# How long the topic's lookup waits for the brokers' metadata (librdkafka retries meanwhile)
METADATA_TIMEOUT_S = 10.0
# How long the first TCP connection to each bootstrap address may take before it counts as
# unreachable (a refused one fails at once)
CONNECT_TIMEOUT_S = 5.0
# The longest one attempt to deliver a file's messages may take (librdkafka's message.timeout.ms,
# unless PublishConfig.kafka sets it): then a new producer tries again, within upload_timeout_s
ATTEMPT_TIMEOUT_S = 60.0
# Publish attempts whose first offsets are held until their part manifest is written: an attempt
# that failed before it never writes one, and only the newest this many are kept for it.
STARTS_KEPT = 256


def _kafka() -> Any:
    try:
        import confluent_kafka
    except ImportError as e:  # pragma: no cover - the optional extra is missing
        raise ConfigError(
            "a kafka:// publish uri needs confluent-kafka: pip install confluent-kafka==2.16.1 (or, in deck's repository, pip install -e '.[kafka]')"
        ) from e
    return confluent_kafka


class KafkaSinkStorage(StorageWrapper):
    """``state`` for everything but table files and markers, which go to ``target``'s topic."""

    def __init__(
        self,
        state: Storage,
        target: KafkaTarget,
        world_size: int,
        *,
        max_message_bytes: int = 1_000_000,
        producer_options: dict[str, Any] | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        super().__init__(state)
        self.target = target
        self.world_size = world_size
        self.max_message_bytes = max_message_bytes
        self.timeout_s = timeout_s
        self._conf: dict[str, Any] = {
            "bootstrap.servers": target.bootstrap,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 2,
            "message.max.bytes": max_message_bytes + _HEADER_SLACK,
            # A put fails (and is retried by the stager with a new producer, then fails the
            # publish) rather than waiting forever on an unreachable broker; each attempt at
            # most ATTEMPT_TIMEOUT_S (a break-it finding: a broker restarted in 3 s had lost the
            # producer's id, which librdkafka retried for the whole upload_timeout_s, an hour,
            # without a word, while every later publish queued behind it)
            "message.timeout.ms": int(min(timeout_s, ATTEMPT_TIMEOUT_S) * 1000),
            "logger": kafka_client_log(),
            **(producer_options or {}),
        }
        self._lock = threading.Lock()
        self._producer = _kafka().Producer(self._conf)
        self._admin_conf: dict[str, Any] = {
            "bootstrap.servers": target.bootstrap,
            "logger": kafka_client_log(),
        }
        self._topic_ok = False
        self._run: str | None = None
        # (step, id, rank) of a publish attempt -> the lowest offset acknowledged for its segments
        self._starts: dict[tuple[int, str, int], int] = {}

    def __repr__(self) -> str:
        return f"KafkaSinkStorage({self.target.uri}, state={self.inner!r})"

    # Table files are not at the state URI: nobody may map or copy them from there.
    @property
    def lists_table_files(self) -> bool:
        return False  # they went to the topic

    def local_path(self, path: str = "") -> str | None:
        return None

    iter_get = Storage.iter_get
    get_many = Storage.get_many
    get_or_none = Storage.get_or_none
    map_file = Storage.map_file

    def put(self, path: str, data: bytes | bytearray | memoryview) -> None:
        if is_stream_file(path):
            self._produce_file(path, data)
            return
        part = part_manifest_of(path)
        start = None if part is None else self._start_of(part)
        if start is not None:  # before the manifest: whoever reads the manifest finds it
            self.inner.put(start.key(), start.encode())
        self.inner.put(path, data)
        if part is not None:
            with self._lock:
                self._starts.pop(part, None)
        step = commit_step(path)
        if step is None:
            return
        try:
            self._produce_marker(path, step)
        except StorageError:
            # No marker, no commit: a loader would never apply it, and a later delta of it
            # must not commit either (its parent check reads this record).
            try:
                self.inner.delete(path)
            except Exception as e:  # the marker's error below is the one to report
                logger.warning(
                    "deck: could not delete %s after its commit marker failed: %s",
                    self.inner.describe(path),
                    e,
                )
            raise

    def ensure_topic(self) -> None:
        """Create the topic with ``world_size + 1`` partitions if missing (rank 0); a topic with
        fewer partitions is a ConfigError naming it. StorageError when the broker is down."""
        if self._topic_ok:
            return
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient(self._admin_conf)
        need = self.world_size + 1
        topic = self.target.topic
        try:
            md = admin.list_topics(topic, timeout=METADATA_TIMEOUT_S)
            have = md.topics.get(topic)
            if have is None or have.error is not None or not have.partitions:
                logger.info(
                    "deck: Kafka publisher: creating topic %s on %s (%d partitions)",
                    topic,
                    self.target.bootstrap,
                    need,
                )
                futures = admin.create_topics([NewTopic(topic, need, 1)])
                try:
                    futures[topic].result(timeout=30)
                except Exception as e:  # e.g. created meanwhile by someone else: listed below
                    logger.debug("deck: creating kafka topic %s: %s", topic, e)
                md = admin.list_topics(topic, timeout=METADATA_TIMEOUT_S)
                have = md.topics.get(topic)
        except Exception as e:
            raise StorageError(
                f"{self.target.uri}: no answer from the brokers at {self.target.bootstrap} "
                f"within {METADATA_TIMEOUT_S:.0f} s: {e}"
            ) from e
        count = 0 if have is None else len(have.partitions)
        if count < need:
            raise ConfigError(
                f"{self.target.uri}: the topic has {count} partitions; a publisher of "
                f"{self.world_size} ranks needs {need} (partition 0 for markers, rank r on r+1): "
                "add partitions or use another topic"
            )
        self._topic_ok = True

    def _produce_file(self, key: str, data: bytes | bytearray | memoryview) -> None:
        rank = rank_of(key)
        pieces = split(data, self.max_message_bytes)
        size = sum(len(p) for p in pieces)
        first = self._produce(
            rank_partition(rank),
            str(rank).encode(),
            [(p, segment_headers(key, i, len(pieces), size, p)) for i, p in enumerate(pieces)],
            key,
        )
        attempt = file_attempt(key)
        if attempt is not None and first is not None:
            self._note_start((*attempt, rank), first)

    def _note_start(self, part: tuple[int, str, int], offset: int) -> None:
        """Lower the first offset of the attempt ``part`` to ``offset`` (files are produced by
        several upload threads, in no set order)."""
        with self._lock:
            held = self._starts.pop(part, offset)
            self._starts[part] = min(held, offset)  # re-inserted: the newest attempt is last
            while len(self._starts) > STARTS_KEPT:
                del self._starts[next(iter(self._starts))]

    def _start_of(self, part: tuple[int, str, int]) -> StepStart | None:
        """The first offset record of the attempt ``part`` (None: no segment of it was
        produced by this sink, e.g. a rank without rows in the step)."""
        with self._lock:
            offset = self._starts.get(part)
        return None if offset is None else StepStart(*part, offset)

    def run_id(self) -> str:
        """The publishing run's identity (:data:`deck.format.stream.RUN_FILE` at the state URI,
        created once when missing). Only the committing rank produces markers, so only it
        creates the file: no race between ranks. A trainer resuming on the same state URI keeps
        its run; a fresh state URI is a new run."""
        if self._run is None:
            try:
                raw = get_bounded(self.inner, RUN_FILE)
                run = load_json(raw, self.inner.describe(RUN_FILE), "stream run record")["run"]
                if not isinstance(run, str) or not valid_run(run):
                    raise CorruptCheckpointError(
                        f"{self.inner.describe(RUN_FILE)}: bad run {run!r}"
                    )
            except NotFoundError:
                run = new_run_id()
                self.inner.put(RUN_FILE, json.dumps({"run": run}).encode())
            except (KeyError, TypeError) as e:
                raise CorruptCheckpointError(f"{self.inner.describe(RUN_FILE)}: {e}") from e
            self._run = run
        return self._run

    def _produce_marker(self, path: str, step: int) -> None:
        record = get_bounded(self.inner, path)
        ckpt_id = str(json.loads(record)["id"])
        value = marker_value(step, ckpt_id, self.inner.uri, self.world_size, self.run_id())
        self._produce(CONTROL_PARTITION, b"marker", [(value, marker_headers(value))], path)

    def _produce(
        self, partition: int, msg_key: bytes, messages: list[tuple[Any, list[Any]]], what: str
    ) -> int | None:
        """Produce ``messages`` in order and wait for the broker's acks; returns the lowest
        offset acknowledged (None if the broker named none). StorageError (so the stager
        retries, then fails the publish) on any delivery error or timeout."""
        self.ensure_topic()
        producer = self._producer
        done = threading.Event()
        left = [len(messages)]
        errors: list[str] = []
        too_large: list[int] = []
        offsets: list[int] = []
        lock = threading.Lock()

        def delivered(err: Any, msg: Any) -> None:
            with lock:
                if err is not None:
                    errors.append(str(err))
                    if _too_large(err):
                        too_large.append(len(msg.value() or b""))
                elif msg.offset() is not None and msg.offset() >= 0:
                    offsets.append(int(msg.offset()))
                left[0] -= 1
                if left[0] == 0:
                    done.set()

        for value, headers in messages:
            while True:
                try:
                    producer.produce(
                        self.target.topic,
                        value=bytes(value),
                        key=msg_key,
                        partition=partition,
                        headers=headers,
                        on_delivery=delivered,
                    )
                    break
                except BufferError:  # the local queue is full: back-pressure
                    producer.poll(0.05)
                except Exception as e:  # KafkaException: e.g. a message over message.max.bytes
                    if _too_large(getattr(e, "args", [None])[0]):
                        raise self._too_large_error(partition, what, len(value), e) from e
                    raise StorageError(
                        f"{self.target.uri} partition {partition}: cannot produce {what}: {e}"
                    ) from e
        waited = 0.0
        while not done.is_set():
            producer.poll(0.05)
            waited += 0.05
            if waited > self._conf["message.timeout.ms"] / 1000 + 30:  # librdkafka's first
                break
        if too_large:  # the broker's limit: retrying sends the same bytes again
            self._reset(producer)
            raise self._too_large_error(partition, what, too_large[0], errors[0])
        if errors or not done.is_set():
            # A new producer for the retry: after timeouts an idempotent producer's epoch may be
            # fenced by the broker for good (seen with Tansu: PRODUCER_FENCED on every send).
            self._reset(producer)
            raise StorageError(
                f"{self.target.uri} partition {partition}: {what} not acknowledged: "
                f"{errors[0] if errors else 'timed out'}"
            )
        return min(offsets, default=None)

    def _too_large_error(
        self, partition: int, what: str, size: int, cause: object
    ) -> MessageTooLargeError:
        step = file_step(what)
        return MessageTooLargeError(
            f"kafka topic {self.target.topic} partition {partition}, step "
            f"{step if step is not None else '?'}: a message of {size} bytes ({what}) is larger "
            f"than the producer or broker accepts (producer message.max.bytes="
            f"{self._conf.get('message.max.bytes')}, PublishConfig.max_message_bytes="
            f"{self.max_message_bytes}): {cause}. Lower PublishConfig.max_message_bytes below "
            "both the producer's and the broker's message.max.bytes (topic max.message.bytes), "
            "or raise those"
        )

    def _reset(self, failed: Any) -> None:
        with self._lock:
            if self._producer is failed:  # once, whichever upload thread saw it first
                self._producer = _kafka().Producer(self._conf)

    def close(self) -> None:
        """Deliver what is queued (bounded by the timeout)."""
        self._producer.flush(5)


def _too_large(err: Any) -> bool:
    """Whether a librdkafka error says a message exceeds a size limit (producer or broker)."""
    if err is None or not hasattr(err, "code"):
        return False
    return bool(err.code() == _kafka().KafkaError.MSG_SIZE_TOO_LARGE)


def unreachable(bootstrap: str, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """None when a TCP connection to one of the ``host:port`` addresses of ``bootstrap`` opens;
    else why each failed (``host:port: Connection refused``, ...). A refused or unresolvable
    address answers at once, where librdkafka retries it until its metadata timeout."""
    failures = []
    for address in bootstrap.split(","):
        host, _, port = address.strip().rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                return None
        except (OSError, ValueError) as e:
            failures.append(f"{address.strip()}: {getattr(e, 'strerror', None) or e}")
    return "; ".join(failures)


def reopen_kafka_sink(
    cfg: PublishConfig, state: Storage, world_size: int, timeout_s: float
) -> KafkaSinkStorage:
    """The sink :func:`open_kafka_sink` opened, opened again by a rank's staging process over
    that process's own state store, with a producer of its own: no collective (every rank
    agreed on the sink at ``enable``); the topic was found or created then (rank 0 checks it
    again before its first marker, as in the training process)."""
    return KafkaSinkStorage(
        state,
        parse_kafka_uri(cfg.uri),
        world_size,
        max_message_bytes=cfg.max_message_bytes,
        producer_options=cfg.kafka,
        timeout_s=timeout_s,
    )


def open_kafka_sink(
    cfg: PublishConfig, state: Storage, world_size: int, timeout_s: float
) -> KafkaSinkStorage:
    """The publisher's destination for a kafka:// ``cfg.uri`` over ``state`` (its state_uri),
    once a broker answered and the topic is there (created if missing). Called by every rank
    when the checkpointer is built, together: the ranks agree on the outcome (a rank that
    cannot reach the brokers fails ``deck.enable`` on every rank, naming them), since a rank
    that went on alone would wait in the next collective for the others forever."""
    target = parse_kafka_uri(cfg.uri)
    coord = Coordinator()
    if coord.rank == 0:
        logger.info(
            "deck: Kafka publisher: connecting to %s for topic %s (up to %.0f s)",
            target.bootstrap,
            target.topic,
            CONNECT_TIMEOUT_S + METADATA_TIMEOUT_S,
        )
    started = time.monotonic()
    sink: KafkaSinkStorage | None = None
    error: Exception | None = None
    try:
        why = unreachable(target.bootstrap)
        if why is not None:
            raise StorageError(f"{target.uri}: cannot connect to the brokers ({why})")
        sink = KafkaSinkStorage(
            state,
            target,
            world_size,
            max_message_bytes=cfg.max_message_bytes,
            producer_options=cfg.kafka,
            timeout_s=timeout_s,
        )
        sink.ensure_topic()
    except StorageError as e:
        error = StorageError(
            f"deck.enable: the Kafka publisher (DeckConfig.publish) cannot start: {e}. "
            f"Start a broker at {target.bootstrap} or correct the host:port in "
            "PublishConfig.uri; nothing was published or checkpointed"
        )
        error.__cause__ = e
    except Exception as e:  # a topic with too few partitions, bad producer settings, ...
        error = e
    try:
        coord.agree_on_failure(error, "deck.enable: the Kafka publisher")
    except BaseException:
        if sink is not None:
            sink.close()
        raise
    assert sink is not None  # no error on any rank
    if coord.rank == 0:
        logger.info(
            "deck: Kafka publisher: topic %s on %s ready (%.1f s)",
            target.topic,
            target.bootstrap,
            time.monotonic() - started,
        )
    return sink
