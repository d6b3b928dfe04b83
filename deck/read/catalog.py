"""Reading what a URI holds: committed checkpoints, their manifests, and restore chains.

:func:`read_manifests` returns a :class:`ManifestSet`: the trainer's checkpoints by step (a
plain ``dict``, as before) that also carries the merger's checkpoints and the quarantine list.
:func:`chain_for` and :func:`latest_restorable` given a ``ManifestSet`` resolve chains through
the lineage graph (:mod:`deck.read.lineage`: the cheapest chain, merged checkpoints included); given a
plain dict they follow trainer parent links only.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from deck.errors import CorruptCheckpointError, DeckError, NotFoundError
from deck.format.checksum import checksum
from deck.format.commit_log import (
    LOG_ROOT,
    Hint,
    keeps_log,
    listed_seqs,
    put_record,
    record_key_kind,
    seqs_in,
)
from deck.format.jsonio import paused_gc
from deck.format.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    MERGED_ROOT,
    QUARANTINE_ROOT,
    CheckpointManifest,
    QuarantineRecord,
    RankManifest,
    RankRef,
    dump_model,
    load_model,
    parse_merged_dir,
    parse_step_dir,
)
from deck.read.indexed import IndexedRead, compact, read_indexed, repair, whole_read
from deck.storage import Storage
from deck.storage.base import MAX_RECORD_BYTES

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

# Reads in flight at once on a remote store (requests the client overlaps: each pays the store's
# round trip, not its bandwidth), and the bytes those in flight and waiting to be used may hold.
READ_WORKERS = 8
READ_AHEAD_BYTES = 64 * 2**20


def overlapped(
    storage: Storage,
    read: Callable[[T], R],
    items: Sequence[T],
    *,
    nbytes: Callable[[T], int] | None = None,
) -> Iterator[tuple[T, R | Exception]]:
    """``(item, read(item))`` for each of ``items``, in order; the exception ``read`` raised in
    place of its result, so that the caller meets each one where a loop of its own would.

    Where the store says reads are worth overlapping (:attr:`~deck.storage.Storage.overlap_reads`:
    a remote store) up to
    :data:`READ_WORKERS` reads run at once ahead of the caller, while the bytes they return
    (``nbytes(item)`` each, when given) stay within :data:`READ_AHEAD_BYTES` (one read is
    always let through); a caller that stops early leaves the rest unread. On a local store
    each read runs when the caller asks for it: overlapping them gains nothing there."""
    if not storage.overlap_reads or len(items) < 2:
        for item in items:
            try:
                got: R | Exception = read(item)
            except Exception as e:
                got = e
            yield item, got
        return
    weight = nbytes or (lambda item: 0)
    workers = min(READ_WORKERS, len(items))
    with ThreadPoolExecutor(workers, thread_name_prefix="deck-read") as pool:
        pending: deque[tuple[T, int, Future[R]]] = deque()
        held = 0
        nxt = 0
        try:
            while nxt < len(items) or pending:
                while (
                    nxt < len(items)
                    and len(pending) < 2 * workers
                    and (not pending or held + weight(items[nxt]) <= READ_AHEAD_BYTES)
                ):
                    item = items[nxt]
                    held += weight(item)
                    pending.append((item, weight(item), pool.submit(read, item)))
                    nxt += 1
                item, size, fut = pending.popleft()
                try:
                    got = fut.result()
                except Exception as e:
                    got = e
                held -= size
                yield item, got
        finally:  # stopped early, or failed: what has not started never does
            for _, _, fut in pending:
                fut.cancel()


@dataclass(frozen=True)
class Window:
    """The part of a URI's records a windowed read holds (:mod:`deck.read.window`): every
    record of a step at or above ``floor``, those a later read named, and no trainer record
    newer (epoch, step) than ``horizon`` left out (None: none left out)."""

    floor: int
    horizon: tuple[int, int] | None


class OutsideWindow(Exception):
    """A question about a windowed :class:`ManifestSet` needs records of steps below its
    floor (``step``; -1: every record). Not a :class:`DeckError`: it never means damage or
    absence, and no caller may take it for either (the windowed reader reads more)."""

    def __init__(self, step: int) -> None:
        super().__init__(f"needs the records of step {step}" if step >= 0 else "needs every record")
        self.step = step


class ManifestSet(dict[int, CheckpointManifest]):
    """Committed trainer checkpoints by step (what :func:`read_manifests` always returned), plus
    ``merged``: the merger's committed checkpoints by id, and ``quarantined``: ids that failed
    verification, with the reason. Chains built from it never use a quarantined checkpoint."""

    def __init__(
        self,
        trainer: Mapping[int, CheckpointManifest] | None = None,
        merged: Mapping[str, CheckpointManifest] | None = None,
        quarantined: Mapping[str, str] | None = None,
        uri: str = "",
        damaged: Mapping[int, str] | None = None,
        damaged_merged: Mapping[str, str] | None = None,
        index: IndexedRead | None = None,
    ) -> None:
        super().__init__(trainer or {})
        self.merged: dict[str, CheckpointManifest] = dict(merged or {})
        self.quarantined: dict[str, str] = dict(quarantined or {})
        self.uri = uri
        # Trainer steps whose commit record is unreadable: not checkpoints, but not to be
        # forgotten either (a restore of the latest step must not silently pass them by).
        self.damaged: dict[int, str] = dict(damaged or {})
        # Merger checkpoints (by the id in their folder name) whose commit record is unreadable:
        # the merger must not take the folder for done work, nor GC for an orphan.
        self.damaged_merged: dict[str, str] = dict(damaged_merged or {})
        # How the records were read, when through the commit log (or as a first catalog could
        # be made of them): what a writer of catalogs compacts (deck.read.indexed.compact).
        self.index = index
        # Each commit record parsed, by key with its bytes: what a next read of the same store
        # need not parse again (read_manifests(previous=...)).
        self.parsed: dict[str, tuple[bytes, CheckpointManifest]] = {}
        # Each record's bytes as read, when every record was read from a listing (GC's): what
        # the catalog is checked against (repair_catalog).
        self.raw: dict[str, bytes | CorruptCheckpointError] = {}
        # Set when only part of the records were read (deck.read.window).
        self.window: Window | None = None
        # The newest epoch witness (deck.format.epochs) listed with this read, when listed
        # (``witness_listed``): what the checks of the latest step and the next epoch take.
        self.witness: int | None = None
        self.witness_listed = False
        # Trainer records a read through the catalog held that a read of every record then did
        # not find (deck.read.lineage.confirmed): lost since, or never there (a forged
        # catalog). What the check of the latest step takes as word of a commit
        # (deck.read.lineage.announced_unrecorded), never as a checkpoint.
        self.catalog_only: dict[int, CheckpointManifest] = {}

    def all(self) -> list[CheckpointManifest]:
        """Every committed checkpoint, trainer's and merger's."""
        return [*self.values(), *self.merged.values()]


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint as :func:`list_checkpoints` reports it."""

    step: int
    kind: str
    ranks: int
    bytes: int
    committed: bool
    parent: int | None
    base: int
    epoch: int
    id: str


def manifest_keys(storage: Storage) -> list[str]:
    """Where the commit records can be: ``manifest.json`` of every trainer step folder and every
    merger folder (committed or not: reading says), and every quarantine record.

    Lists folders one level at a time, so it costs a few LISTs however many chunk files the
    store holds (a listing of everything grows with every checkpoint kept)."""
    found: list[str | Callable[[], list[str]]] = []  # keys, and the listings that give more
    for entry in storage.list_dir(""):
        name = entry.rstrip("/")
        if not entry.endswith("/"):
            continue
        if parse_step_dir(name) is not None:
            found.append(f"{name}/{MANIFEST}")
        elif name == MERGED_ROOT:
            found.append(
                lambda: [
                    f"{MERGED_ROOT}/{sub}{MANIFEST}"
                    for sub in storage.list_dir(f"{MERGED_ROOT}/")
                    if sub.endswith("/")
                ]
            )
        elif name == QUARANTINE_ROOT:
            found.append(lambda: storage.list(f"{QUARANTINE_ROOT}/"))
    listings = [f for f in found if callable(f)]
    listed: dict[int, list[str]] = {}
    for listing, got in overlapped(storage, lambda f: f(), listings):
        if isinstance(got, Exception):
            raise got
        listed[id(listing)] = got
    keys: list[str] = []
    for f in found:
        if callable(f):
            keys += listed[id(f)]
        else:
            keys.append(f)
    return keys


def read_manifests(
    storage: Storage, keys: Iterable[str] | None = None, *, previous: ManifestSet | None = None
) -> ManifestSet:
    """Every committed checkpoint under ``storage``: trainer checkpoints by step, and (as
    attributes of the returned :class:`ManifestSet`) the merger's checkpoints and quarantined ids.

    Folders without ``manifest.json`` (in progress, failed, or crashed) are not checkpoints and
    are skipped. A damaged trainer record is left out with a warning and listed in ``damaged``
    (step -> problem, naming the file); a damaged merger record is left out with a warning
    (merged checkpoints only make restores faster) and listed in ``damaged_merged`` (id ->
    problem). ``keys``: keys to look at, a listing the caller already has (then each is read);
    by default the records are read through the catalog where the store keeps one
    (:mod:`deck.read.indexed`: the newest catalog, the log after it and the records it names),
    else each record the store lists (:func:`manifest_keys`): the same result either way.
    ``previous``: the caller's last read of this store (a merger or follower polling it; with
    ``keys``, only what it said is not said again): its read goes on from there, and records
    whose bytes did not change are not parsed again;
    when nothing was committed since, ``previous`` itself is returned (with this read's
    ``index``), so a poll that finds nothing new costs its few reads, not the history's length.
    """
    with paused_gc():  # (some ten objects per record, 100,000 records: see paused_gc)
        return _read_manifests(storage, keys, previous)


def read_every_record(storage: Storage) -> ManifestSet:
    """:func:`read_manifests` of every record read from its file, never a catalog's copy: what
    the readers that report on the whole history take (``deck lineage``, ``deck history``,
    :func:`deck.lineage_graph`), so that a record damaged or replaced behind the commit log's
    back is reported as it is (a catalog cannot tell without reading it)."""
    return read_manifests(storage, manifest_keys(storage))


def _read_manifests(
    storage: Storage, keys: Iterable[str] | None, previous: ManifestSet | None
) -> ManifestSet:
    if keys is not None:
        wanted = [k for k in keys if record_key_kind(k) is not None]
        read = dict(get_records(storage, wanted))
        out = manifest_set(storage, read.items(), None, said=previous)
        out.raw = {k: v for k, v in read.items() if v is not None}
        return out
    last = previous.index if previous is not None and previous.uri == storage.uri else None
    index = read_indexed(storage, lambda ks: get_records(storage, ks), last)
    if index is None:
        # The log is listed before the records, so a first catalog made from them knows every
        # hint whose change they may not show.
        logged = listed_seqs(storage, LOG_ROOT) if keeps_log(storage) else []
        wanted = [k for k in manifest_keys(storage) if record_key_kind(k) is not None]
        records = {k: d for k, d in get_records(storage, wanted) if d is not None}
        index = whole_read(storage, logged, records)
        return manifest_set(storage, records.items(), index, said=previous)
    if previous is not None and last is not None and index.records is last.records:
        previous.index = index  # (nothing new: the same records, so the same set)
        previous.witness_listed = False  # (this read listed no witness: the checks list again)
        return previous
    parsed = previous.parsed if last is not None and previous is not None else None
    return manifest_set(storage, sorted(index.records.items()), index, parsed, said=previous)


def refresh_catalog(storage: Storage, manifests: ManifestSet | None = None) -> int | None:
    """For writers of history (merger passes, GC): write a new catalog when enough log entries
    have piled up since the newest one (:func:`deck.read.indexed.compact`), from ``manifests``
    when they were just read (else read now). Its number, or None. A failure is logged, never
    raised: a missing catalog costs readers time, not correctness."""
    try:
        if manifests is None:
            manifests = read_manifests(storage)
        index = manifests.index
        return None if index is None else compact(storage, index, parsed=manifests.parsed)
    except (DeckError, OSError) as e:
        logger.warning("could not write a catalog at %s (readers read more): %s", storage.uri, e)
        return None


def repair_catalog(
    storage: Storage, manifests: ManifestSet, listing: list[str], pending: list[Hint]
) -> int | None:
    """For GC: check the catalog against ``manifests`` (every record read from ``listing``, a
    listing of the whole store) and write one from them where it disagrees
    (:func:`deck.read.indexed.repair`). Its number, or None. A failure is logged, never
    raised: the catalog only costs readers time while it waits for the next run."""
    try:
        return repair(
            storage,
            manifests.raw,
            seqs_in(listing, LOG_ROOT),
            pending,
            lambda ks: get_records(storage, ks),
            manifests.parsed,
        )
    except (DeckError, OSError) as e:
        logger.warning("could not check the catalog at %s: %s", storage.uri, e)
        return None


def manifest_set(
    storage: Storage,
    records: Iterable[tuple[str, bytes | CorruptCheckpointError | None]],
    index: IndexedRead | None,
    parsed: Mapping[str, tuple[bytes, CheckpointManifest]] | None = None,
    said: ManifestSet | None = None,
) -> ManifestSet:
    """The checkpoints of ``records`` (each record key with its bytes, None when it is gone:
    not committed, or replaced or deleted by GC since the listing). ``parsed``: commit records
    parsed before, by key with their bytes (the same bytes at the same key parse the same).
    ``said``: the caller's last read, whose damaged records were logged then: the same problem
    again is logged at DEBUG (a follower polling every second would otherwise say it forever),
    a new or changed one at WARNING."""
    trainer: dict[int, CheckpointManifest] = {}
    merged: dict[str, CheckpointManifest] = {}
    done: dict[str, tuple[bytes, CheckpointManifest]] = {}
    if parsed:
        todo = []
        for key, data in records:
            seen = parsed.get(key)
            if seen is None or seen[0] != data:
                todo.append((key, data))
                continue
            m = seen[1]
            done[key] = seen
            if m.is_merged:
                merged[m.id] = m
            else:
                trainer[m.step] = m
        records = todo
    damaged: dict[int, str] = {}
    damaged_merged: dict[str, str] = {}
    quarantined: dict[str, str] = {}

    def take(key: str, data: bytes | CorruptCheckpointError) -> CorruptCheckpointError | None:
        """Take the record at ``key``; the problem that refused it, if any."""
        step, folder = record_key_kind(key) or (None, None)
        where = storage.describe(key)
        try:
            if step is not None:
                m = load_model(CheckpointManifest, _record(data), where)
                if m.step != step or m.is_merged:
                    raise CorruptCheckpointError(
                        f"{where}: manifest says step {m.step}"
                        + (" and was written by the merger" if m.is_merged else "")
                        + f", folder says trainer step {step}"
                    )
                trainer[step] = m
            elif folder is not None:
                m = load_model(CheckpointManifest, _record(data), where)
                if f"{MERGED_ROOT}/{folder}" != m.folder or (m.id, m.step) != parse_merged_dir(
                    folder
                ):
                    raise CorruptCheckpointError(f"{where}: record does not match its folder name")
                merged[m.id] = m
            else:
                q = load_model(QuarantineRecord, _record(data), where)
                quarantined[q.id] = q.reason
                return None
        except CorruptCheckpointError as e:
            return e
        done[key] = (_record(data), m)
        return None

    def refuse(key: str, e: CorruptCheckpointError) -> None:
        step, folder = record_key_kind(key) or (None, None)
        if step is not None:
            known = said is not None and said.damaged.get(step) == str(e)
            logger.log(
                logging.DEBUG if known else logging.WARNING,
                "step %d is not restorable: %s",
                step,
                e,
            )
            damaged[step] = str(e)
        elif folder is not None:
            named = parse_merged_dir(folder)
            assert named is not None  # checked when the key was chosen
            known = said is not None and said.damaged_merged.get(named[0]) == str(e)
            logger.log(
                logging.DEBUG if known else logging.WARNING, "ignoring merged checkpoint: %s", e
            )
            damaged_merged[named[0]] = str(e)
        else:
            logger.warning("ignoring quarantine record: %s", e)

    # A record a catalog gave that fails its checks may be the catalog's fault (damaged in a
    # way its checksums cannot see, or forged): the record's own file decides.
    catalogued = index if index is not None and index.catalog is not None else None
    suspects: list[str] = []
    for key, data in records:
        if data is None or record_key_kind(key) is None:
            continue
        problem = take(key, data)
        if problem is None:
            continue
        if catalogued is not None and key not in catalogued.shadow:
            suspects.append(key)
        else:
            refuse(key, problem)
    if suspects and index is not None:
        for key, data in get_records(storage, suspects):
            if not _same_record(data, index.records.get(key)):
                _catalog_disagrees(storage, key)
                if data is None:
                    index.records.pop(key, None)
                else:
                    index.records[key] = data
            index.shadow.add(key)  # (read after the catalog: its copy is out of date)
            problem = None if data is None else take(key, data)
            if problem is not None:
                refuse(key, problem)
    out = ManifestSet(
        trainer,
        merged,
        quarantined,
        uri=storage.uri,
        damaged=damaged,
        damaged_merged=damaged_merged,
        index=index,
    )
    out.parsed = done
    return out


def get_records(
    storage: Storage, keys: list[str]
) -> Iterator[tuple[str, bytes | CorruptCheckpointError | None]]:
    """``(key, record)`` for each of ``keys`` in order: its bytes (read concurrently where the
    backend can, never more than :data:`MAX_RECORD_BYTES`), None when it is gone, or the
    :class:`CorruptCheckpointError` that refused it (too large; a link, FIFO or device in a
    local store), so that one bad record is reported as that record's damage, not the whole
    listing's failure."""
    i = 0
    while i < len(keys):
        try:
            for key, data in storage.get_many(keys[i:], limit=MAX_RECORD_BYTES):
                i += 1
                yield key, data
        except CorruptCheckpointError as e:  # the next key's: go on after it
            yield keys[i], e
            i += 1


def _same_record(a: bytes | CorruptCheckpointError | None, b: object) -> bool:
    if isinstance(a, CorruptCheckpointError) or isinstance(b, CorruptCheckpointError):
        return str(a) == str(b)
    return a == b


_disagreed: set[str] = set()


def _catalog_disagrees(storage: Storage, key: str) -> None:
    """Say once per URI that its catalog holds a record that is not its file's (the file is
    taken; GC writes the catalog again from every record)."""
    if storage.uri not in _disagreed:
        _disagreed.add(storage.uri)
        logger.warning(
            "the catalog at %s disagrees with %s (damaged or forged): the record's own file is "
            "read instead; the next `deck gc` writes the catalog again",
            storage.uri,
            storage.describe(key),
        )


def _record(data: bytes | CorruptCheckpointError) -> bytes:
    if isinstance(data, CorruptCheckpointError):
        raise data
    return data


def quarantine(storage: Storage, m: CheckpointManifest, reason: str) -> None:
    """Record that checkpoint ``m`` failed verification, so chains stop using it (idempotent).

    Only for damage (checksum mismatch, missing file of a committed checkpoint), never for a
    transient storage error. The checkpoint's files stay until GC removes them.
    """
    rec = QuarantineRecord(
        format_version=FORMAT_VERSION,
        id=m.id,
        folder=m.folder,
        reason=reason[:2000],
        created_unix=time.time(),
    )
    put_record(storage, f"{QUARANTINE_ROOT}/{m.id}.json", m.id, dump_model(rec))
    logger.warning("quarantined checkpoint %s (%s): %s", m.id, m.folder, reason)


def missing_uri(storage: Storage, uri: str, options: str = "storage_options") -> str | None:
    """Why ``uri`` (opened as ``storage``) is not there: a local path that is not a directory,
    or a remote prefix with no object under it; None when it exists (holding checkpoints or
    not). ``options``: how the caller's user passes storage options (named in the remote
    case). Lets a typo be told from an empty run ("no checkpoints")."""
    local = storage.local_path("")
    if local is not None:
        if os.path.isdir(local):
            return None
        what = "is not a directory" if os.path.exists(local) else "does not exist"
        return f"URI {uri} {what}: check the path (a checkpoint URI is a folder)"
    if storage.list_dir(""):
        return None
    return (
        f"URI {uri} does not exist (nothing under that prefix): check the bucket, prefix and "
        f"{options}"
    )


def list_checkpoints(storage: Storage) -> list[CheckpointInfo]:
    """Committed checkpoints at ``storage``, oldest step first (an empty list for an empty
    store). ``deck.list_checkpoints(uri)`` opens a URI for it."""
    return [
        CheckpointInfo(
            step=m.step,
            kind=m.kind.value,
            ranks=m.world_size,
            bytes=m.data_bytes,
            committed=True,
            parent=m.parent,
            base=m.base,
            epoch=m.epoch,
            id=m.id,
        )
        for m in sorted(read_manifests(storage).values(), key=lambda m: m.step)
    ]


def damaged_records(manifests: ManifestSet, target: int | None, *, latest: bool) -> str | None:
    """What a restore of ``target`` would pass by, naming the files: the unreadable commit
    records of ``target`` itself or, when ``target`` is the latest restorable step (or None),
    of newer steps. None when there are none."""
    damaged = manifests.damaged
    hit = sorted(s for s in damaged if s == target or (latest and (target is None or s > target)))
    if not hit:
        return None
    return f"the commit record of step(s) {hit} is damaged ({damaged[hit[-1]]})"


def checkpoint_label(m: CheckpointManifest) -> str:
    """How errors name a checkpoint: ``step 40`` for the trainer's, the folder for the merger's."""
    return f"step {m.step}" if not m.is_merged else f"{m.kind.value} {m.folder} (step {m.step})"


def part_where(storage: Storage, m: CheckpointManifest, rank: int) -> str:
    """How errors name the rank ``rank`` part manifest of checkpoint ``m``: its file's URI."""
    ref = next((r for r in m.ranks if r.rank == rank), None)
    if ref is None:
        return f"rank {rank} part of {checkpoint_label(m)} at {storage.uri}"
    return f"{storage.describe(f'{m.folder}/{ref.path}')} ({checkpoint_label(m)})"


def read_rank_manifests(storage: Storage, m: CheckpointManifest) -> list[RankManifest]:
    """The rank parts of a committed checkpoint, each verified against the commit record (read
    concurrently on a remote store; the first problem in rank order is raised)."""

    def read(ref: RankRef) -> RankManifest:
        key = f"{m.folder}/{ref.path}"
        where = storage.describe(key)
        try:
            # The record says its size: never read more than one byte past it.
            data = storage.get(key, 0, ref.nbytes + 1)
        except NotFoundError:
            raise CorruptCheckpointError(
                f"{where}: rank {ref.rank} part of {checkpoint_label(m)} is missing"
            ) from None
        if len(data) != ref.nbytes or checksum(data) != ref.checksum:
            raise CorruptCheckpointError(
                f"{where}: rank {ref.rank} part of {checkpoint_label(m)} fails its checksum"
            )
        return load_model(RankManifest, data, where)

    out = []
    for _, part in overlapped(storage, read, m.ranks, nbytes=lambda ref: ref.nbytes):
        if isinstance(part, Exception):
            raise part
        out.append(part)
    return out
