"""Commit records read through the catalog and the commit log, and catalogs written.

:func:`read_indexed` gives what reading every record gives (the bytes of each record key
present), reading only the newest catalog, the log entries after it and the records their
hints name; None when no catalog can be used (none yet, damaged, or the log behind it is not
whole), and the caller then reads every record. :func:`compact` writes a new catalog when
enough entries have piled up, and prunes what the catalogs before it made unnecessary.
Format: :mod:`deck.format.commit_log`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from deck.errors import CorruptCheckpointError, DeckError
from deck.format.commit_log import (
    CATALOG_ROOT,
    FORMAT_VERSION,
    LOG_ROOT,
    Catalog,
    Hint,
    catalog_key,
    encode_catalog,
    keeps_log,
    listed_seqs,
    log_key,
    read_catalog,
    read_log_entry,
    record_key_kind,
)
from deck.format.manifest import CheckpointManifest, QuarantineRecord, load_model
from deck.storage import Storage

logger = logging.getLogger(__name__)

# A catalog is written once this many log entries follow the newest one (or a thousandth of the
# records it holds, whichever is more: its size grows with the history, its readers' savings do
# not).
CATALOG_EVERY = 64
# Catalogs kept: the newest and the one before it (a reader that listed just before a new one
# was written still finds the log entries after its catalog).
_KEEP_CATALOGS = 2

RecordBytes = bytes | CorruptCheckpointError
# Reads the current bytes of each key: (key, bytes, the error that refused them, or None when
# there is no record), in the keys' order.
ReadKeys = Callable[[list[str]], Iterable[tuple[str, RecordBytes | None]]]


@dataclass
class IndexedRead:
    """What a read through the index found.

    ``records``: every record key present with its bytes (or the error that refused reading
    it: too large, a link); ``seq``: the newest log entry it covers; ``recheck``: hints whose
    change had not shown yet; ``catalog``: the newest catalog's number (None: none, a whole
    read from the log's first entry on); ``since``: log entries after it."""

    seq: int
    records: dict[str, RecordBytes]
    recheck: list[Hint] = field(default_factory=list)
    since: int = 0
    catalog: int | None = None
    # Keys whose record could not be held as text: read every time (a catalog's `unreadable`).
    unreadable: set[str] = field(default_factory=set)


_warned: set[tuple[str, str]] = set()


def _fall_back(storage: Storage, what: str, problem: object = None) -> None:
    """Say once per URI and kind of problem (``what``) that reads there go back to every
    record."""
    if (storage.uri, what) not in _warned:
        _warned.add((storage.uri, what))
        detail = f" ({problem})" if problem is not None else ""
        logger.warning("%s%s: reading every commit record at %s instead", what, detail, storage.uri)


def read_indexed(
    storage: Storage, read_keys: ReadKeys, previous: IndexedRead | None = None
) -> IndexedRead | None:
    """The records through the newest usable catalog (see the module doc); None when none can
    be used. ``read_keys(keys)``: the current bytes of each of ``keys`` (None: absent).
    ``previous``: this reader's last read of the same store, taken up from where it ended (only
    the log entries since, no catalog) while those entries are all still there.

    A damaged newest catalog is passed by for the one before it (the log after that one is
    kept until a catalog after the damaged one is written), so one damaged file costs one
    catalog's worth of log entries, and the next catalog written replaces it."""
    if not keeps_log(storage):
        return None
    for _ in range(3):
        catalogs = listed_seqs(storage, CATALOG_ROOT)
        if not catalogs:
            return None
        # Entries after the older of the last two catalogs are never pruned before a newer
        # catalog is listed: a previous read from there on needs no catalog.
        floor = catalogs[-2] if len(catalogs) > 1 else 0
        if previous is not None and previous.seq >= floor:
            start: IndexedRead | None = previous
            passed: list[int] = []
        else:
            found = _newest_readable(storage, catalogs)
            if found is None:
                _fall_back(storage, "no catalog is readable", catalog_key(catalogs[-1]))
                return None
            start, passed = _from_catalog(found[0]), found[1]
        assert start is not None
        base = start.seq
        logged = [s for s in listed_seqs(storage, LOG_ROOT) if s > base]
        if listed_seqs(storage, CATALOG_ROOT)[-1:] != catalogs[-1:]:
            continue  # a newer catalog (which may have pruned the log after ours): again
        if logged != list(range(base + 1, base + 1 + len(logged))) or (
            passed and (not logged or logged[-1] < passed[-1])
        ):
            _fall_back(storage, "the commit log after the catalog has a gap", catalog_key(base))
            return None
        hints = list(start.recheck)
        for s in logged:
            try:
                hints += read_log_entry(storage, s).hints
            except CorruptCheckpointError as e:
                _fall_back(storage, "commit log entry unusable", e)
                return None
        records = dict(start.records)
        again = sorted({h.key for h in hints} | start.unreadable)
        for key, data in read_keys(again):
            if data is None:
                records.pop(key, None)
            else:
                records[key] = data
        seq = logged[-1] if logged else base
        return IndexedRead(
            seq=seq,
            records=records,
            recheck=unresolved(hints, records),
            since=seq - catalogs[-1],
            catalog=catalogs[-1],
            unreadable={k for k in again if k in records and _as_text(records[k]) is None},
        )
    return None


def _from_catalog(catalog: Catalog) -> IndexedRead:
    records: dict[str, RecordBytes] = {k: v.encode() for k, v in catalog.records}
    for key in catalog.unreadable:
        records.pop(key, None)
    return IndexedRead(
        seq=catalog.seq,
        records=records,
        recheck=list(catalog.recheck),
        catalog=catalog.seq,
        unreadable=set(catalog.unreadable),
    )


def _newest_readable(storage: Storage, catalogs: list[int]) -> tuple[Catalog, list[int]] | None:
    """The newest of ``catalogs`` that reads, and the newer ones passed by as damaged (each
    logged once per URI); None when none reads."""
    passed: list[int] = []
    for seq in reversed(catalogs):
        try:
            return read_catalog(storage, seq), passed
        except CorruptCheckpointError as e:
            if (storage.uri, str(seq)) not in _warned:
                _warned.add((storage.uri, str(seq)))
                logger.warning("catalog unusable, an older one is read instead: %s", e)
            passed.insert(0, seq)
    return None


def _as_text(data: RecordBytes) -> str | None:
    """A record's bytes as the text a catalog holds; None when they cannot be (refused when
    read, or not UTF-8)."""
    if isinstance(data, CorruptCheckpointError):
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


def _record_id(key: str, data: RecordBytes | None) -> str | None:
    """The id of the record ``data`` at ``key``; None when absent or unreadable."""
    if data is None or isinstance(data, CorruptCheckpointError):
        return None
    try:
        if record_key_kind(key) == (None, None):
            return load_model(QuarantineRecord, data, key).id
        return load_model(CheckpointManifest, data, key).id
    except DeckError:
        return None


def unresolved(hints: Iterable[Hint], records: Mapping[str, RecordBytes]) -> list[Hint]:
    """The hints whose change ``records`` (the bytes of each key read after the hints were
    listed) does not show yet: a commit whose record is not there with its id, a delete whose
    record is still there with its id. An abandon drops the commit of its id and key."""
    hints = list(dict.fromkeys(hints))
    abandoned = {(h.key, h.id) for h in hints if h.op == "abandon"}
    out = []
    for h in hints:
        if h.op == "abandon" or (h.key, h.id) in abandoned:
            continue
        there = _record_id(h.key, records.get(h.key))
        if (h.op == "commit") == (there != h.id):
            out.append(h)
    return out


def compact(storage: Storage, read: IndexedRead, *, force: bool = False) -> int | None:
    """Write catalog ``read.seq`` from ``read`` when enough log entries follow the newest
    catalog (or ``force``), then prune: catalogs before the last two, and log entries the
    older of those covers. Its number, or None when none was written. ``read`` must come from
    :func:`read_indexed` or :func:`whole_read` of this store, just before."""
    if not keeps_log(storage) or read.seq == read.catalog:
        return None
    due = max(CATALOG_EVERY, len(read.records) // 1000)
    if not force and read.since < due:
        return None
    texts: list[tuple[str, str]] = []
    unreadable: list[str] = []
    for key in sorted(read.records):
        text = _as_text(read.records[key])
        if text is None:
            unreadable.append(key)
        else:
            texts.append((key, text))
    catalog = Catalog(
        format_version=FORMAT_VERSION,
        seq=read.seq,
        records=tuple(texts),
        recheck=tuple(read.recheck),
        unreadable=tuple(unreadable),
    )
    storage.put(catalog_key(read.seq), encode_catalog(catalog))
    catalogs = listed_seqs(storage, CATALOG_ROOT)
    if len(catalogs) > _KEEP_CATALOGS:
        floor = catalogs[-_KEEP_CATALOGS]
        for seq in catalogs[:-_KEEP_CATALOGS]:
            storage.delete(catalog_key(seq))
        for seq in listed_seqs(storage, LOG_ROOT):
            if seq > floor:
                break
            storage.delete(log_key(seq))
    logger.info(
        "catalog %d written at %s: %d record(s), %d to read again",
        read.seq,
        storage.uri,
        len(texts),
        len(catalog.recheck) + len(unreadable),
    )
    return read.seq


def whole_read(
    storage: Storage, logged: list[int], records: dict[str, RecordBytes]
) -> IndexedRead | None:
    """An :class:`IndexedRead` from a read of every record, made after listing the log
    (``logged``, its entries then): usable for a first catalog only while the log is whole from
    its first entry (no catalog ever pruned it), so that every hint not yet shown is known."""
    if not keeps_log(storage) or listed_seqs(storage, CATALOG_ROOT):
        return None
    if logged != list(range(1, len(logged) + 1)):
        return None
    hints: list[Hint] = []
    for s in logged:
        try:
            hints += read_log_entry(storage, s).hints
        except CorruptCheckpointError:
            return None
    return IndexedRead(
        seq=logged[-1] if logged else 0,
        records=records,
        recheck=unresolved(hints, records),
        since=len(logged),
    )
