"""The commit log and the catalog: an index of a URI's commit records, so that reading them
costs what changed since the last catalog, not every record the job ever wrote.

The records (``manifest.json`` of each checkpoint, ``quarantine/<id>.json``) stay the truth.
The index only says where to look (spec: docs/format.md, "Commit log and catalog"):

- ``_log/<seq:020d>.json``: a :class:`LogEntry`, created (never replaced) by a writer right
  before it writes or deletes the records its hints name. Sequence numbers are taken with an
  atomic create-if-absent, each after the one before it exists, so the log has no holes: a
  reader that lists it sees every hint written before its listing.
- ``_catalog/<seq:020d>.json.z``: a :class:`Catalog`, every record's bytes as read after log
  entry ``seq`` was listed, plus the hints whose change had not shown yet (``recheck``). The
  records of checkpoints are in segments (``_catalog/segments/<checksum>.json.z``, a
  :class:`Segment` each, named by the checksum of its content and shared by the catalogs that
  hold the same records), cut by the step their key names, so that a reader that plans one
  chain reads the segments it reaches back to, not the whole history.

A reader takes the newest catalog, the log entries after it, and reads again every key those
hints and ``recheck`` name: the result is what reading every record gives. Only stores with an
atomic create (:attr:`deck.storage.Storage.atomic_create`: local disks, S3) keep a log; on
others every reader reads every record, as before.
"""

from __future__ import annotations

import itertools
import re
import threading
import zlib
from collections.abc import Iterable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deck.errors import CorruptCheckpointError, StorageError
from deck.failpoints import failpoint
from deck.format.checksum import checksum
from deck.format.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    MERGED_NAME_PATTERN,
    MERGED_ROOT,
    QUARANTINE_ROOT,
    dump_model,
    load_model,
    parse_merged_dir,
)
from deck.storage import Storage
from deck.storage.base import MAX_RECORD_BYTES, get_bounded

LOG_ROOT = "_log"
CATALOG_ROOT = "_catalog"
SEGMENT_ROOT = f"{CATALOG_ROOT}/segments"
# ASCII digits, whole names (no trailing newline): anything else there is not deck's.
_LOG_NAME = re.compile(r"([0-9]{20})\.json")
_RECORD_KEY = re.compile(
    rf"step-([0-9]{{12}})/{re.escape(MANIFEST)}"
    rf"|{re.escape(MERGED_ROOT)}/({MERGED_NAME_PATTERN})/{re.escape(MANIFEST)}"
    rf"|{re.escape(QUARANTINE_ROOT)}/[^/]+\.json"
)
_CATALOG_NAME = re.compile(r"([0-9]{20})\.json\.z")
_SEGMENT_NAME = re.compile(r"([0-9a-f]{16})\.json\.z")
# The largest sequence number: names above it are not deck's (and are ignored).
MAX_SEQ = 10**18
# A catalog holds every record (a few hundred bytes to a few KiB each): 64 MiB compressed and
# 1 GiB inflated are millions of records; a larger one is damaged or planted.
MAX_CATALOG_BYTES = 64 * 2**20
MAX_CATALOG_INFLATED = 2**30
# Tries at a taken sequence number before listing the log again.
_CONFLICTS_BEFORE_LISTING = 8
_APPEND_TRIES = 16


def record_key_kind(key: str) -> tuple[int | None, str | None] | None:
    """What the record at ``key`` is: ``(step, None)`` for a trainer step's commit record,
    ``(None, folder name)`` for a merger checkpoint's, ``(None, None)`` for a quarantine record,
    None for a key that is no record."""
    # One match per key (every reader of the whole history asks this of each record, often):
    # the forms of step_dir, merged_dir and a quarantine record's name, whole keys only.
    m = _RECORD_KEY.fullmatch(key)
    if m is None:
        return None
    if m.group(1) is not None:
        return int(m.group(1)), None
    return None, m.group(2)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Hint(_Strict):
    """One record a writer is about to change: ``commit`` (write record ``key`` of checkpoint
    ``id``), ``delete`` (remove the record of ``id`` there), ``abandon`` (the commit of ``id``
    there will never come: its files are gone); or one whose change GC found behind the log's
    back: ``reread`` (read ``key`` again; ``id``, the record's as the catalog held it, says
    nothing more)."""

    key: str
    op: Literal["commit", "delete", "abandon", "reread"]
    id: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]

    @field_validator("key")
    @classmethod
    def _record_key(cls, v: str) -> str:
        if record_key_kind(v) is None:
            raise ValueError(f"{v!r} is not the key of a commit or quarantine record")
        return v


class LogEntry(_Strict):
    """``_log/<seq>.json``."""

    format_version: int
    seq: Annotated[int, Field(ge=1, le=MAX_SEQ)]
    hints: Annotated[tuple[Hint, ...], Field(min_length=1, max_length=100_000)]

    @field_validator("format_version")
    @classmethod
    def _version(cls, v: int) -> int:
        return _check_version(v)


class SegmentRef(_Strict):
    """One segment of a catalog, as the catalog describes it: ``name``, the checksum of the
    segment's inflated bytes (its file is ``_catalog/segments/<name>.json.z``); ``first`` /
    ``last``, the lowest and highest step its record keys name; ``count``, its records;
    ``newest``, ``(epoch, step)`` of its newest trainer record (None: it holds none). A reader
    checks a segment against this when it reads it."""

    name: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
    first: Annotated[int, Field(ge=0)]
    last: Annotated[int, Field(ge=0)]
    count: Annotated[int, Field(ge=1)]
    newest: tuple[int, int] | None

    @model_validator(mode="after")
    def _steps(self) -> SegmentRef:
        if self.first > self.last or (
            self.newest is not None and not self.first <= self.newest[1] <= self.last
        ):
            raise ValueError("a segment's steps are out of order")
        return self


class _Records(_Strict):
    """A versioned list of record keys with their text (what catalogs and segments hold)."""

    format_version: int
    records: tuple[tuple[str, str], ...]

    @field_validator("format_version")
    @classmethod
    def _version(cls, v: int) -> int:
        return _check_version(v)

    @field_validator("records")
    @classmethod
    def _keys(cls, v: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
        _check_keys(k for k, _ in v)
        return v


class Segment(_Records):
    """``_catalog/segments/<name>.json.z`` (zlib of the JSON): record keys with their text,
    sorted by the step the key names, then the key."""

    records: Annotated[tuple[tuple[str, str], ...], Field(min_length=1)]


class Catalog(_Records):
    """``_catalog/<seq>.json.z`` (zlib of the JSON): ``records``, each record key with its
    record's text, as read after every log entry up to ``seq`` existed; ``recheck``, the hints
    of those entries whose change had not shown when the record was read; ``unreadable``, keys
    whose record could not be held as text (too large, a link, not UTF-8): read each time;
    ``log_from``: the log holds every entry from this number to ``seq`` while this catalog is
    the newest (a log emptied or cut by hand is told from one with nothing new);
    ``segments``: where the records of checkpoints are, in step order (``records`` holds the
    others: quarantine records)."""

    seq: Annotated[int, Field(ge=0, le=MAX_SEQ)]
    recheck: tuple[Hint, ...]
    unreadable: tuple[str, ...] = ()
    log_from: Annotated[int, Field(ge=1, le=MAX_SEQ + 1)] = 1
    segments: tuple[SegmentRef, ...] = ()

    @field_validator("segments")
    @classmethod
    def _in_order(cls, v: tuple[SegmentRef, ...]) -> tuple[SegmentRef, ...]:
        if any(a.last >= b.first for a, b in itertools.pairwise(v)):
            raise ValueError("segments overlap or are out of step order")
        return v

    @field_validator("unreadable")
    @classmethod
    def _unreadable(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        _check_keys(v)
        return v


def _check_keys(keys: Iterable[str]) -> None:
    bad = next((k for k in keys if record_key_kind(k) is None), None)
    if bad is not None:
        raise ValueError(f"{bad!r} is not the key of a commit or quarantine record")


def _check_version(v: int) -> int:
    if v != FORMAT_VERSION:
        raise ValueError(f"format_version {v} is not supported by this deck")
    return v


def log_key(seq: int) -> str:
    return f"{LOG_ROOT}/{seq:020d}.json"


def catalog_key(seq: int) -> str:
    return f"{CATALOG_ROOT}/{seq:020d}.json.z"


def segment_key(name: str) -> str:
    return f"{SEGMENT_ROOT}/{name}.json.z"


def listed_segments(storage: Storage) -> set[str]:
    """Names of the segments the store lists; other names there are ignored."""
    out = set()
    for key in storage.list(f"{SEGMENT_ROOT}/"):
        m = _SEGMENT_NAME.fullmatch(key[len(SEGMENT_ROOT) + 1 :])
        if m:
            out.add(m.group(1))
    return out


def key_step(key: str) -> int | None:
    """The step the record key ``key`` names (a trainer step's folder, a merger folder's step);
    None for a quarantine record (or a key that is no record)."""
    kind = record_key_kind(key)
    if kind is None:
        return None
    step, merged = kind
    if merged is not None:
        parsed = parse_merged_dir(merged)
        return None if parsed is None else parsed[1]
    return step


def listed_seqs(storage: Storage, root: str) -> list[int]:
    """Sequence numbers of the log entries (``root`` = :data:`LOG_ROOT`) or catalogs
    (:data:`CATALOG_ROOT`) the store lists, ascending; other names there are ignored."""
    return seqs_in(storage.list(f"{root}/"), root)


def seqs_in(keys: Iterable[str], root: str) -> list[int]:
    """:func:`listed_seqs` of a listing the caller has (keys of the whole store, say)."""
    pattern = _LOG_NAME if root == LOG_ROOT else _CATALOG_NAME
    out = []
    for key in keys:
        if key.startswith(f"{root}/"):
            m = pattern.fullmatch(key[len(root) + 1 :])
            if m and int(m.group(1)) <= MAX_SEQ:
                out.append(int(m.group(1)))
    return sorted(out)


def keeps_log(storage: Storage) -> bool:
    """Whether writers to ``storage`` keep the commit log (and readers may use catalogs)."""
    return storage.atomic_create


def append_hints(storage: Storage, hints: list[Hint]) -> int | None:
    """Write one log entry holding ``hints``, before the changes they announce; its sequence
    number (None where the store keeps no log).

    The entry is created under the next free number (atomic create-if-absent, after listing
    the log). If a catalog at or after that number exists once it is written, the catalog may
    have been made without it (a writer slow enough for the log to be pruned past its number):
    it is written again under a later number. Errors: :class:`StorageError` naming the log."""
    if not keeps_log(storage) or not hints:
        return None
    with _lock:
        guess = _last_seq.get(storage.uri)
    for _ in range(_APPEND_TRIES):
        if guess is None:  # the first append here, or the guesses were taken: list the log
            logged = listed_seqs(storage, LOG_ROOT)
            guess = max(logged[-1] if logged else 0, newest_catalog_seq(storage))
        seq = guess + 1
        guess = None
        for _ in range(_CONFLICTS_BEFORE_LISTING):
            if seq > MAX_SEQ:
                raise _no_number_left(storage)
            entry = LogEntry(format_version=FORMAT_VERSION, seq=seq, hints=tuple(hints))
            if storage.put_if_absent(log_key(seq), dump_model(entry)):
                if newest_catalog_seq(storage) < seq:
                    with _lock:
                        _last_seq[storage.uri] = seq
                    return seq
                break  # a catalog covers this number: take a later one
            seq += 1
    raise StorageError(
        f"could not append to the commit log at {storage.describe(LOG_ROOT + '/')}: every "
        f"sequence number tried was taken ({_APPEND_TRIES} listings); other writers are "
        "appending faster than this one can: try again"
    )


def _no_number_left(storage: Storage) -> CorruptCheckpointError:
    """The error of a log whose numbers are used up: by a name that is not deck's (a break-it
    finding: one forged ``_log/`` entry numbered MAX_SEQ made every later commit fail with a
    validation error that named no file, and stopped `deck merge` and `deck gc` with a
    traceback)."""
    logged, catalogs = listed_seqs(storage, LOG_ROOT), listed_seqs(storage, CATALOG_ROOT)
    top = [log_key(logged[-1])] if logged else []
    top += [catalog_key(catalogs[-1])] if catalogs else []
    return CorruptCheckpointError(
        f"the commit log at {storage.describe(LOG_ROOT + '/')} has no number left after "
        f"{' and '.join(top) or 'its newest entry'}: deck numbers its entries one after "
        f"another from 1 (at most {MAX_SEQ}), so a name that high is not deck's (written by "
        "someone else, or damaged). Delete the log entries and catalogs numbered far above "
        "the others; until then nothing can be committed to this URI"
    )


# The last number this process appended under each URI: the next append tries the one after
# it without listing the log (a job without catalog writers would list a log as long as its
# history at every commit). A number taken meanwhile fails its create; one a catalog passed
# meanwhile is caught by the check after the create.
_last_seq: dict[str, int] = {}
_lock = threading.Lock()


def newest_catalog_seq(storage: Storage) -> int:
    """The sequence number of the newest catalog listed (0 when there is none)."""
    seqs = listed_seqs(storage, CATALOG_ROOT)
    return seqs[-1] if seqs else 0


def read_log_entry(storage: Storage, seq: int) -> tuple[LogEntry, bytes]:
    """Log entry ``seq`` and its bytes; :class:`CorruptCheckpointError` naming it when it is
    unreadable as one (never "absent": a reader that cannot read a hint cannot trust a
    catalog); :class:`NotFoundError` when it is gone (pruned since it was listed)."""
    key = log_key(seq)
    where = storage.describe(key)
    data = get_bounded(storage, key, MAX_RECORD_BYTES)
    entry = load_model(LogEntry, data, where)
    if entry.seq != seq:
        raise CorruptCheckpointError(f"{where}: entry says seq {entry.seq}")
    return entry, data


def encode_catalog(catalog: Catalog) -> bytes:
    return zlib.compress(dump_model(catalog), 1)


def encode_segment(segment: Segment) -> tuple[str, bytes]:
    """A segment's name (the checksum of its inflated bytes) and its file's bytes."""
    data = dump_model(segment)
    return checksum(data), zlib.compress(data, 1)


def _inflated(packed: bytes, where: str) -> bytes:
    inflater = zlib.decompressobj()
    try:
        data = inflater.decompress(packed, MAX_CATALOG_INFLATED + 1)
    except zlib.error as e:
        raise CorruptCheckpointError(
            f"{where}: not a zlib stream ({e}); the file is damaged"
        ) from None
    if len(data) > MAX_CATALOG_INFLATED or not inflater.eof or inflater.unused_data:
        raise CorruptCheckpointError(f"{where}: not one zlib stream within its size bound")
    return data


def check_segment(packed: bytes, ref: SegmentRef, where: str) -> Segment:
    """The segment ``ref`` describes, from its file's bytes ``packed``: refused with
    :class:`CorruptCheckpointError` naming ``where`` unless its content is the one named
    (checksum) and holds what ``ref`` says (count, steps)."""
    data = _inflated(packed, where)
    if checksum(data) != ref.name:
        raise CorruptCheckpointError(f"{where}: content does not match its name; damaged")
    segment = load_model(Segment, data, where)
    steps = [key_step(k) for k, _ in segment.records]
    if (
        len(steps) != ref.count
        or any(s is None or not ref.first <= s <= ref.last for s in steps)
        or steps[0] != ref.first
        or steps[-1] != ref.last
    ):
        raise CorruptCheckpointError(f"{where}: not the segment its catalog describes")
    return segment


def read_catalog(storage: Storage, seq: int) -> Catalog:
    """Catalog ``seq``, checked (size bounds, its own checksum, schema, its number):
    :class:`CorruptCheckpointError` naming the file otherwise."""
    key = catalog_key(seq)
    where = storage.describe(key)
    data = _inflated(get_bounded(storage, key, MAX_CATALOG_BYTES), where)
    catalog = load_model(Catalog, data, where)
    if catalog.seq != seq:
        raise CorruptCheckpointError(f"{where}: catalog says seq {catalog.seq}")
    return catalog


def put_record(
    storage: Storage, key: str, ckpt_id: str, data: bytes, *, exclusive: bool = False
) -> bool:
    """Write the commit or quarantine record ``data`` of checkpoint ``ckpt_id`` at ``key``,
    announced in the commit log first (where the store keeps one), so that readers through a
    catalog look at ``key`` again. Every writer of a record writes it through here.

    With ``exclusive`` an existing record stays (:meth:`Storage.put_if_absent`; of writers
    racing on a store without atomic creates, the last still wins): returns whether this call
    wrote it."""
    append_hints(storage, [Hint(key=key, op="commit", id=ckpt_id)])
    failpoint("commit.after_hint")  # (announced, not written: a restart's recovery commits it)
    if exclusive:
        return storage.put_if_absent(key, data)
    storage.put(key, data)
    return True
