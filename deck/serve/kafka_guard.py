"""What the Kafka loader does with messages it cannot use: the quarantine log and run identity.

- A **poison message** (garbage, a flipped byte, a message of another producer: anything that
  fails :func:`deck.format.stream.decode_marker` / :func:`~deck.format.stream.decode_segment`)
  is skipped and recorded in ``<out>/quarantine.json`` (:class:`QuarantineLog`), naming topic,
  partition, offset and why, with an ERROR line. The step it belonged to cannot be proven and is
  not applied; the loader keeps serving what it holds until the next full it can prove.
- A **foreign marker** (another run's: :attr:`deck.format.stream.Marker.run`) is refused the
  same way (recorded with ``"kind": "foreign"``): the loader serves one run.
- :func:`newest_run`: the run of the newest readable marker of the topic, which a loader that
  starts with no state and no ``--run`` adopts.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import xxhash

from deck.errors import CorruptCheckpointError, StorageError
from deck.format.jsonio import load_json
from deck.format.stream import (
    CONTROL_PARTITION,
    CorruptStreamError,
    KafkaTarget,
    decode_marker,
    offsets_error,
)
from deck.storage.atomic import atomic_write

logger = logging.getLogger(__name__)

QUARANTINE = "quarantine.json"
MAX_ENTRIES = 1000  # the log keeps the newest entries: a flood of garbage cannot fill the disk
SCAN_BACK = 200  # markers read backwards from the end of the control partition to find a run


@dataclass(frozen=True)
class Quarantined:
    """One skipped message."""

    kind: str  # "poison" (undecodable) or "foreign" (another run's marker)
    partition: int
    offset: int
    digest: str  # xxh3 of the value (tells apart a recreated topic's message at the same offset)
    error: str


class QuarantineLog:
    """``<out>/quarantine.json``: ``{"topic": ..., "entries": [{kind, partition, offset, digest,
    error}, ...]}``, oldest first, rewritten atomically on every new entry (entries are rare).
    Without ``out_dir`` the entries are only kept in memory (and logged)."""

    def __init__(
        self, out_dir: str | None, topic: str, who: str = "deck follow", *, log: bool = True
    ) -> None:
        # out_dir None: entries are kept in memory and logged, no file (a live model's source)
        self.path = None if out_dir is None else os.path.join(out_dir, QUARANTINE)
        self.topic = topic
        self.who = who
        # log False: the caller reports each entry itself (a live model logs the update it
        # refused, naming the message: one ERROR line, not two)
        self.log = log
        self.entries: list[Quarantined] = []
        if self.path is None:
            return
        try:
            with open(self.path, "rb") as f:
                doc = load_json(f.read(), self.path, "deck follow quarantine log")
            self.entries = [Quarantined(**e) for e in doc["entries"]]
        except FileNotFoundError:
            pass
        except (CorruptCheckpointError, KeyError, TypeError) as e:
            logger.warning("%s: %s unreadable (%s): starting a new one", who, self.path, e)

    def recorded(self) -> str:
        """Where entries are recorded, for a message (empty when only in memory)."""
        return "" if self.path is None else f" (recorded in {self.path})"

    def add(self, kind: str, partition: int, offset: int, value: bytes | None, error: str) -> bool:
        """Record a skipped message (once per partition, offset and content) and log it as an
        ERROR (unless made with ``log=False``); returns whether it was new."""
        digest = xxhash.xxh3_64_hexdigest(value or b"")
        entry = Quarantined(kind, partition, offset, digest, error[:500])
        if self.log:
            logger.error(
                "%s: kafka topic %s partition %d offset %d %s: %s%s",
                self.who,
                self.topic,
                partition,
                offset,
                "skipped (another run's marker)" if kind == "foreign" else "quarantined",
                error,
                self.recorded(),
            )
        if any(
            (e.partition, e.offset, e.digest) == (partition, offset, digest) for e in self.entries
        ):
            return False
        self.entries = [*self.entries, entry][-MAX_ENTRIES:]
        if self.path is not None:
            doc = {"topic": self.topic, "entries": [e.__dict__ for e in self.entries]}
            atomic_write(self.path, json.dumps(doc, indent=1).encode())
        return True


def watermarks(c: Any, tp: Any, target: KafkaTarget) -> tuple[int, int]:
    """The partition's oldest and next offsets, asked of the broker (not a cached answer)."""
    try:
        low, high = c.get_watermark_offsets(tp, timeout=10, cached=False)
    except Exception as e:
        raise offsets_error(target.topic, target.bootstrap, e) from e
    return int(low), int(high)


def newest_run(conf: dict[str, Any], target: KafkaTarget) -> tuple[bool, str | None]:
    """``(found, run)`` of the newest readable marker among the last :data:`SCAN_BACK` messages
    of the control partition (``run`` None: a marker of a deck before run ids); ``(False,
    None)`` when there is none. Undecodable messages are passed over (the loader quarantines
    them when it reads them in order)."""
    from confluent_kafka import Consumer, TopicPartition

    tp = TopicPartition(target.topic, CONTROL_PARTITION)
    c = Consumer({**conf, "enable.auto.commit": False})
    try:
        low, high = watermarks(c, tp, target)
        # Read forward from a bounded window before the end: one assign, no seeks back.
        start = max(int(low), int(high) - SCAN_BACK)
        if start >= high:
            return False, None
        c.assign([TopicPartition(target.topic, CONTROL_PARTITION, start)])
        found: tuple[bool, str | None] = (False, None)
        position = start
        while position < high:
            msg: Any = c.poll(10)
            if msg is None:
                raise StorageError(
                    f"kafka topic {target.topic} partition 0: no message at offset {position} "
                    f"below the end {high} within 10 s"
                )
            err = msg.error()
            if err is not None and err.code() == -191:
                # _PARTITION_EOF: the end a fetch finds, below the listed one (a break-it
                # finding: a topic deleted and made again on a live Tansu lists an end past its
                # last message; this was a StorageError, and a loader never started)
                break
            if err is not None:
                raise StorageError(f"kafka topic {target.topic} partition 0: {err}")
            position = int(msg.offset() or 0) + 1
            try:
                m = decode_marker(
                    msg.headers(), msg.value(), target.topic, CONTROL_PARTITION, msg.offset()
                )
            except CorruptStreamError:
                continue
            found = (True, m.run)
        return found
    finally:
        c.close()


def marker_at(conf: dict[str, Any], target: KafkaTarget, offset: int) -> tuple[str, Any]:
    """What the control partition holds at ``offset``: ``("marker", Marker)``, ``("other",
    None)`` (an undecodable message, or no message at that offset), ``("gone", None)`` (below
    the oldest message: retention) or ``("beyond", None)`` (at or past the end: the topic was
    recreated or truncated). The end is the one a fetch at ``offset`` finds, not the listed
    one, which may lag behind the last message (Tansu 0.6 lists a batch's first offset + 1)."""
    from confluent_kafka import Consumer, TopicPartition

    tp = TopicPartition(target.topic, CONTROL_PARTITION)
    c = Consumer(
        {
            **conf,
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
        }
    )
    try:
        low, high = watermarks(c, tp, target)
        if offset < low:
            return "gone", None
        # From the last message listed (or the offset, if below it) forward: a message at the
        # offset, or the fetch's end-of-partition event before it, whatever the listed end.
        c.assign([TopicPartition(target.topic, CONTROL_PARTITION, min(offset, max(low, high - 1)))])
        while True:
            msg: Any = c.poll(10)
            err = msg.error() if msg is not None else None
            if msg is not None and err is not None and err.code() == -191:
                if msg.offset() <= offset:
                    return "beyond", None
                continue
            if msg is None or err is not None:
                raise StorageError(
                    f"kafka topic {target.topic} partition 0: cannot read offset {offset}: "
                    f"{err if err is not None else 'timed out'}"
                )
            if msg.offset() < offset:
                continue
            if msg.offset() > offset:
                return "other", None  # no message at that offset (a gap the broker left)
            try:
                return "marker", decode_marker(
                    msg.headers(), msg.value(), target.topic, CONTROL_PARTITION, offset
                )
            except CorruptStreamError:
                return "other", None
    finally:
        c.close()
