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
from dataclasses import dataclass, field, replace

from deck.errors import CorruptCheckpointError, DeckError, NotFoundError
from deck.format.checksum import checksum
from deck.format.commit_log import (
    CATALOG_ROOT,
    FORMAT_VERSION,
    LOG_ROOT,
    MAX_CATALOG_BYTES,
    Catalog,
    Hint,
    Segment,
    SegmentRef,
    append_hints,
    catalog_key,
    check_segment,
    encode_catalog,
    encode_segment,
    keeps_log,
    key_step,
    listed_segments,
    listed_seqs,
    log_key,
    read_catalog,
    read_log_entry,
    record_key_kind,
    segment_key,
)
from deck.format.manifest import CheckpointManifest, QuarantineRecord, load_model
from deck.storage import Storage
from deck.storage.base import MAX_RECORD_BYTES, get_bounded

logger = logging.getLogger(__name__)

# A catalog is written once this many log entries follow the newest one (or a thousandth of the
# records it holds, whichever is more: its size grows with the history, its readers' savings do
# not).
CATALOG_EVERY = 64
# A segment ends after a step whose hash is 0 modulo SEGMENT_STEPS (about this many steps per
# segment: what a reader planning one chain reads at least), after a step one below a multiple
# of SEGMENT_MAX_STEPS, or once it holds SEGMENT_MAX_RECORDS records. Where the hash cuts fall is
# random, so a window's size varies whatever the history's length; the newest segment, which
# every routine reader reads, is the one the end of the history falls in, so longer ones are
# likelier to be it (without the step bound, ~540 steps on average and up to ~1,600 in 100,000
# steps; with it ~300, at most 512). Small keeps a restore's read small, at the cost of a
# segment file per ~180 steps.
SEGMENT_STEPS = 256
SEGMENT_MAX_STEPS = 512
SEGMENT_MAX_RECORDS = 2048
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
    # The checksum of log entry `seq` as read: a later read goes on from here only while the
    # entry there is still this one.
    tail: str | None = None
    # The first log entry a catalog of this read may say is kept (see Catalog.log_from).
    log_from: int = 1
    # Log entries whose hints are still to be read into `recheck` (a whole read's: see
    # whole_read), before a catalog is made of it.
    unread_log: list[int] | None = None
    # The catalog's segments (Catalog.segments), and those whose records are in `records`
    # (a lazy read leaves the others to load_segments).
    segments: tuple[SegmentRef, ...] = ()
    loaded: set[str] = field(default_factory=set)
    # Keys read after the catalog: a segment's copy of one is out of date.
    shadow: set[str] = field(default_factory=set)
    # Newer catalogs this read passed by as unusable (damaged, a segment they name gone; a
    # lazy read does not read segments): GC writes one in their place
    passed: tuple[int, ...] = ()
    # The segment each record not in `shadow` was loaded from, by key: a new catalog names
    # that segment again without encoding it while it still holds exactly these records.
    origin: dict[str, str] = field(default_factory=dict)


_warned: set[tuple[str, str]] = set()


def _fall_back(storage: Storage, what: str, problem: object = None) -> None:
    """Say once per URI and kind of problem (``what``) that reads there go back to every
    record."""
    if (storage.uri, what) not in _warned:
        _warned.add((storage.uri, what))
        detail = f" ({problem})" if problem is not None else ""
        logger.warning("%s%s: reading every commit record at %s instead", what, detail, storage.uri)


def read_indexed(
    storage: Storage,
    read_keys: ReadKeys,
    previous: IndexedRead | None = None,
    *,
    lazy: bool = False,
) -> IndexedRead | None:
    """The records through the newest usable catalog (see the module doc); None when none can
    be used. ``read_keys(keys)``: the current bytes of each of ``keys`` (None: absent).
    ``previous``: this reader's last read of the same store, taken up from where it ended (only
    the log entries since, no catalog) while its last entry is still there, unchanged.
    ``lazy``: the catalog's segments are left unread (:func:`load_segments` reads those a
    caller needs): ``records`` then holds the records outside segments and those read after
    the catalog.

    A damaged newest catalog is passed by for the one before it (the log after that one is
    kept until a catalog after the damaged one is written), so one damaged file costs one
    catalog's worth of log entries, and the next catalog written replaces it. The log must
    still hold every entry the newest catalog's writer kept (after the catalog before it): a
    log emptied or cut by hand is not taken for one with nothing new."""
    if not keeps_log(storage):
        return None
    for _ in range(3):
        catalogs = listed_seqs(storage, CATALOG_ROOT)
        if not catalogs:
            return None
        try:
            got = _read_from(storage, read_keys, catalogs, previous, lazy)
        except NotFoundError:  # a catalog or entry pruned since it was listed
            continue
        if got is not None or listed_seqs(storage, CATALOG_ROOT)[-1:] == catalogs[-1:]:
            return got
    return None


def _read_from(
    storage: Storage,
    read_keys: ReadKeys,
    catalogs: list[int],
    previous: IndexedRead | None,
    lazy: bool,
) -> IndexedRead | None:
    # Entries after the older of the last two catalogs are never pruned before a newer
    # catalog is listed: a previous read from there on needs no catalog.
    floor = catalogs[-2] if len(catalogs) > 1 else 0
    start: IndexedRead | None = None
    passed: list[int] = []
    if previous is not None and previous.seq >= floor and _same_tail(storage, previous):
        start = previous
    else:
        found = _newest_readable(storage, catalogs, lazy)
        if found is None:
            _fall_back(storage, "no catalog is readable", catalog_key(catalogs[-1]))
            return None
        start, passed = found
    base = start.seq
    listed = listed_seqs(storage, LOG_ROOT)
    if listed_seqs(storage, CATALOG_ROOT)[-1:] != catalogs[-1:]:
        raise NotFoundError("a newer catalog")  # it may have pruned the log after ours: again
    logged = [s for s in listed if s > base]
    # The entries the newest catalog's writer kept are all there (counted, not enumerated: a
    # name can claim any number).
    low = base + 1 if start is previous or passed else start.log_from
    kept = sum(1 for n in listed if low <= n <= catalogs[-1]) == max(0, catalogs[-1] - low + 1)
    if (
        logged != list(range(base + 1, base + 1 + len(logged)))
        or (passed and (not logged or logged[-1] < passed[-1]))
        or not kept
    ):
        _fall_back(storage, "the commit log has a gap", catalog_key(catalogs[-1]))
        return None
    hints = list(start.recheck)
    tail = start.tail
    for s in logged:
        try:
            entry, data = read_log_entry(storage, s)
        except CorruptCheckpointError as e:
            _fall_back(storage, "commit log entry unusable", e)
            return None
        hints += entry.hints
        tail = checksum(data)
    if tail is None and base > 0:  # (a catalog's own entry: what the next read checks)
        tail = checksum(get_bounded(storage, log_key(base), MAX_RECORD_BYTES))
    again = sorted({h.key for h in hints} | start.unreadable)
    if start is previous and not logged and not again:
        # Nothing logged since the caller's last read: the same records (shared, not copied:
        # a reader polling a long history pays for what is new, not for its length)
        return replace(
            previous,
            passed=(),
            since=previous.seq - catalogs[-1],
            catalog=catalogs[-1],
            log_from=catalogs[-1] + 1,
        )
    records = dict(start.records)
    for key, value in read_keys(again):
        if value is None:
            records.pop(key, None)
        else:
            records[key] = value
    seq = logged[-1] if logged else base
    return IndexedRead(
        segments=start.segments,
        loaded=set(start.loaded),
        shadow=start.shadow | set(again),
        origin=dict(start.origin),
        seq=seq,
        records=records,
        recheck=unresolved(hints, records),
        since=seq - catalogs[-1],
        catalog=catalogs[-1],
        unreadable={k for k in again if k in records and _as_text(records[k]) is None},
        tail=tail,
        log_from=catalogs[-1] + 1,
        passed=tuple(passed),
    )


def _same_tail(storage: Storage, previous: IndexedRead) -> bool:
    """Whether the log entry ``previous`` ended at is still the one it read (a log deleted
    and started again by hand holds another entry there, or none)."""
    if previous.tail is None or previous.seq == 0:
        return False
    try:
        data = get_bounded(storage, log_key(previous.seq), MAX_RECORD_BYTES)
    except (NotFoundError, CorruptCheckpointError):
        return False
    return checksum(data) == previous.tail


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
        log_from=catalog.log_from,
        segments=catalog.segments,
    )


def load_segments(storage: Storage, read: IndexedRead, refs: Iterable[SegmentRef]) -> None:
    """Read the segments ``refs`` (of ``read.segments``) into ``read.records``, each record
    unless a later read of its key is there. :class:`CorruptCheckpointError` naming the file
    when one is not what its catalog describes or is gone (the catalog cannot be used)."""
    todo = [ref for ref in refs if ref.name not in read.loaded]
    keys = [segment_key(ref.name) for ref in todo]
    for (key, packed), ref in zip(
        storage.get_many(keys, limit=MAX_CATALOG_BYTES), todo, strict=True
    ):
        where = storage.describe(key)
        if packed is None:
            raise CorruptCheckpointError(f"{where}: a segment its catalog names is gone")
        for k, text in check_segment(packed, ref, where).records:
            if k not in read.shadow:
                read.records[k] = text.encode()
                read.origin[k] = ref.name
        read.loaded.add(ref.name)


def _newest_readable(
    storage: Storage, catalogs: list[int], lazy: bool
) -> tuple[IndexedRead, list[int]] | None:
    """The newest of ``catalogs`` that reads (with its segments, unless ``lazy``), and the newer
    ones passed by as damaged (each logged once per URI); None when none reads."""
    passed: list[int] = []
    for seq in reversed(catalogs):
        try:
            start = _from_catalog(read_catalog(storage, seq))
            if not lazy:
                load_segments(storage, start, start.segments)
            return start, passed
        except CorruptCheckpointError as e:
            if (storage.uri, str(seq)) not in _warned:
                _warned.add((storage.uri, str(seq)))
                older = "an older one is read instead" if seq != catalogs[0] else "no older one"
                logger.warning("catalog unusable (%s): %s", older, e)
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
    record is still there with its id, or whose id's commit has not shown yet (the slow commit
    may land before the delete does). An abandon drops the commit of its id and key."""
    hints = list(dict.fromkeys(hints))
    abandoned = {(h.key, h.id) for h in hints if h.op == "abandon"}
    out = set()
    for h in hints:
        if h.op in ("abandon", "reread") or (h.op == "commit" and (h.key, h.id) in abandoned):
            continue
        there = _record_id(h.key, records.get(h.key))
        if (h.op == "commit") == (there != h.id):
            out.add(h)
    # A delete seen done before its record's late commit landed is not done: the record comes,
    # then goes (a state-machine run: a reader kept a record the store no longer had).
    pending = {(h.key, h.id) for h in out if h.op == "commit"}
    return [h for h in hints if h in out or (h.op == "delete" and (h.key, h.id) in pending)]


def compact(
    storage: Storage,
    read: IndexedRead,
    *,
    force: bool = False,
    parsed: Mapping[str, tuple[bytes, CheckpointManifest]] | None = None,
) -> int | None:
    """Write catalog ``read.seq`` from ``read`` when enough log entries follow the newest
    catalog (or ``force``), then prune: catalogs before the last two, and log entries the
    older of those covers, and segments neither names. Its number, or None when none was
    written. ``read`` must come from :func:`read_indexed` or :func:`whole_read` of this store,
    just before. ``parsed``: commit records the caller parsed, by key with their bytes (a
    segment's description needs their epochs: those not given are parsed here)."""
    if not keeps_log(storage) or read.seq == read.catalog:
        return None
    due = max(CATALOG_EVERY, len(read.records) // 1000)
    if not force and read.since < due:
        return None
    ready = _with_log_read(storage, read)
    if ready is None:
        return None
    read = ready
    load_segments(storage, read, read.segments)
    texts: list[tuple[str, str]] = []
    unreadable: list[str] = []
    stepped: list[tuple[int, str, str]] = []
    for key in sorted(read.records):
        text = _as_text(read.records[key])
        step = key_step(key)
        if text is None:
            unreadable.append(key)
        elif step is None:
            texts.append((key, text))
        else:
            stepped.append((step, key, text))
    refs = _write_segments(storage, sorted(stepped), read, parsed or {})
    catalog = Catalog(
        format_version=FORMAT_VERSION,
        seq=read.seq,
        records=tuple(texts),
        recheck=tuple(read.recheck),
        unreadable=tuple(unreadable),
        # What the pruning below keeps: the entries after the catalog before this one.
        log_from=min(read.log_from, read.seq + 1),
        segments=refs,
    )
    storage.put(catalog_key(read.seq), encode_catalog(catalog))
    catalogs = listed_seqs(storage, CATALOG_ROOT)
    kept = {
        seq: catalog if seq == read.seq else _catalog_or_none(storage, seq)
        for seq in catalogs[-_KEEP_CATALOGS:]
    }
    # The segments the catalogs this writer drops name (read before they go): the only ones it
    # prunes, so a segment another writer just wrote for a catalog it has not listed yet is not
    # taken for garbage (a break-it run: two writers' catalogs 36 ms apart left the newest
    # naming a segment the other had deleted, and every read passed it by from then on)
    dropped = [_catalog_or_none(storage, seq) for seq in catalogs[:-_KEEP_CATALOGS]]
    if len(catalogs) > _KEEP_CATALOGS:
        # Never an entry the newest catalog says its log holds: another writer's catalog,
        # written beside this one from an older read, may need entries before the older kept
        # one (a break-it run: two mergers and GC left the newest catalog needing pruned
        # entries, and every reader read every record). (Readers passing a damaged newest one
        # by need the entries after the one before it: those are kept anyway.)
        newest = kept[catalogs[-1]]
        floor = min(catalogs[-_KEEP_CATALOGS], *([newest.log_from - 1] if newest else []))
        for seq in catalogs[:-_KEEP_CATALOGS]:
            storage.delete(catalog_key(seq))
        for seq in listed_seqs(storage, LOG_ROOT):
            if seq > floor:
                break
            storage.delete(log_key(seq))
    _prune_segments(storage, kept, dropped)
    logger.info(
        "catalog %d written at %s: %d record(s) in %d segment(s), %d to read again",
        read.seq,
        storage.uri,
        len(stepped) + len(texts),
        len(refs),
        len(catalog.recheck) + len(unreadable),
    )
    return read.seq


def _cut_after(step: int) -> bool:
    """Whether a segment ends after ``step``: decided by the step alone, so that the segments
    of a history cut the same way whatever was added or deleted elsewhere (a new catalog
    writes only the segments whose records changed)."""
    if step % SEGMENT_MAX_STEPS == SEGMENT_MAX_STEPS - 1:
        return True
    return int(checksum(step.to_bytes(8, "little")), 16) % SEGMENT_STEPS == 0


def _write_segments(
    storage: Storage,
    stepped: list[tuple[int, str, str]],
    read: IndexedRead,
    parsed: Mapping[str, tuple[bytes, CheckpointManifest]],
) -> tuple[SegmentRef, ...]:
    """The segments of ``stepped`` (step, key, text; sorted), each written unless the store
    holds it already (by its name: the checksum of its content) and ``read``'s segments (those
    this writer read and checked) name it: a file of that name it did not check may be damaged
    (flipped, cut short), and, its name being that of the right content, would never be
    written again, every catalog naming it passed by for good. One of ``read``'s segments that
    still holds exactly the same records is named again as it is (not encoded again: a long
    history's catalog costs what changed, not every record)."""
    known = {ref.name: ref for ref in read.segments}
    present = listed_segments(storage) if stepped else set()
    refs: list[SegmentRef] = []
    start = 0
    for i, (step, _, _) in enumerate(stepped):
        end = i + 1 == len(stepped)
        if not end and (
            stepped[i + 1][0] == step  # (a step's records stay together)
            or not (_cut_after(step) or i + 1 - start >= SEGMENT_MAX_RECORDS)
        ):
            continue
        part = stepped[start : i + 1]
        start = i + 1
        same = _unchanged(part, read, known)
        if same is not None and same.name in present:
            refs.append(same)
            continue
        segment = Segment(format_version=FORMAT_VERSION, records=tuple((k, t) for _, k, t in part))
        name, packed = encode_segment(segment)
        ref = known.get(name) or _describe(name, part, parsed, storage)
        if name not in present or name not in known:
            storage.put(segment_key(name), packed)
        refs.append(ref)
    return tuple(refs)


def _unchanged(
    part: list[tuple[int, str, str]], read: IndexedRead, known: Mapping[str, SegmentRef]
) -> SegmentRef | None:
    """The segment of ``known`` whose records ``part`` is (every one loaded from it, as many
    as it holds, none read again since), or None."""
    names = {read.origin.get(key) for _, key, _ in part}
    if len(names) != 1:
        return None
    ref = known.get(next(iter(names)) or "")
    if ref is None or ref.count != len(part) or any(key in read.shadow for _, key, _ in part):
        return None
    return ref


def _describe(
    name: str,
    part: list[tuple[int, str, str]],
    parsed: Mapping[str, tuple[bytes, CheckpointManifest]],
    storage: Storage,
) -> SegmentRef:
    """The description of the segment ``name`` of records ``part`` (a record that does not
    parse counts for nothing: it is no checkpoint)."""
    newest: tuple[int, int] | None = None
    for step, key, text in part:
        data = text.encode()
        seen = parsed.get(key)
        if seen is not None and seen[0] == data:
            m = seen[1]
        else:
            try:
                m = load_model(CheckpointManifest, data, storage.describe(key))
            except DeckError:
                continue
        if not m.is_merged and (newest is None or (m.epoch, step) > newest):
            newest = (m.epoch, step)
    return SegmentRef(
        name=name,
        first=part[0][0],
        last=part[-1][0],
        count=len(part),
        newest=newest,
    )


def _prune_segments(
    storage: Storage, kept: Mapping[int, Catalog | None], dropped: Iterable[Catalog | None]
) -> None:
    """Delete the segments the ``dropped`` catalogs name and none of the ``kept`` catalogs
    does. A catalog that cannot be read (None) names none: readers pass it by."""
    named = {ref.name for c in kept.values() if c is not None for ref in c.segments}
    old = {ref.name for c in dropped if c is not None for ref in c.segments}
    for name in sorted((old - named) & listed_segments(storage)):
        storage.delete(segment_key(name))


def _catalog_or_none(storage: Storage, seq: int) -> Catalog | None:
    try:
        return read_catalog(storage, seq)
    except (CorruptCheckpointError, NotFoundError):
        return None


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
    # The entries' hints are read only when a catalog is written (compact): a reader that
    # writes none (a restore, a job without merger or GC) pays no read per entry.
    return IndexedRead(
        seq=logged[-1] if logged else 0, records=records, since=len(logged), unread_log=logged
    )


def _with_log_read(storage: Storage, read: IndexedRead) -> IndexedRead | None:
    """``read`` with the hints of its not yet read log entries resolved into ``recheck``;
    None when one cannot be read (no catalog is made of it then)."""
    if not read.unread_log:
        return read
    hints = list(read.recheck)
    for s in read.unread_log:
        try:
            hints += read_log_entry(storage, s)[0].hints
        except (CorruptCheckpointError, NotFoundError):
            return None
    return replace(read, recheck=unresolved(hints, read.records), unread_log=None)


def repair(
    storage: Storage,
    truth: Mapping[str, RecordBytes],
    logged: list[int],
    pending: list[Hint],
    read_keys: ReadKeys,
    parsed: Mapping[str, tuple[bytes, CheckpointManifest]] | None = None,
) -> int | None:
    """For GC, which read every record (``truth``: each record key with its bytes, read after
    it listed the log as ``logged``): the read through the catalog is compared with ``truth``,
    and when they disagree on a key no later hint explains (a log cut or emptied by hand, a
    damaged or forged catalog, a record changed behind the log's back), or no catalog can be
    used while one exists, a catalog is written from ``truth`` in its place. ``pending``: the
    commits the listing shows begun but not committed (attempt folders without a record).
    Returns the new catalog's number, or None when none was needed (or the log moved past
    what ``truth`` can vouch for: the next run decides)."""
    if not keeps_log(storage):
        return None
    catalogs = listed_seqs(storage, CATALOG_ROOT)
    if not catalogs and logged == list(range(1, len(logged) + 1)):
        return None  # the first catalog is made from a whole read (whole_read), as ever
    # (No catalog and a log pruned behind catalogs that are gone: made from this read, its
    # hints those of the entries left and the commits begun, or no catalog ever again: a
    # break-it finding)
    seen = logged[-1] if logged else 0
    view = read_indexed(storage, read_keys)
    now = listed_seqs(storage, LOG_ROOT)
    # A catalog listed before the log and numbered past its every entry is no writer's (its
    # entry is written first and outlives it while it is the newest): garbage or forged, it
    # is replaced like a damaged one, not taken for a writer that pruned the log meanwhile
    # (which left such a store read whole by every reader, however often GC ran)
    forged = {seq for seq in catalogs if seq > max([seen, *now[-1:]])}
    again = [seq for seq in listed_seqs(storage, CATALOG_ROOT) if seq not in forged]
    high = max([seen, *now[-1:], *again[-1:]])
    if not set(range(seen + 1, high + 1)) <= set(now):
        # A writer of catalogs pruned entries written after ``truth`` was read: what they
        # announced is neither in ``truth`` nor in a hint left to read. The next run decides.
        return None
    later: list[Hint] = []  # hints of entries after the listing: what truth may not show
    for s in now:
        if s > seen:
            try:
                later += read_log_entry(storage, s)[0].hints
            except (CorruptCheckpointError, NotFoundError):
                return None
    changed: list[str] = []
    # A newest catalog readers pass by (damaged, a segment it names gone) stays the newest, and
    # is passed by (and said so) at every read, until one is written after it
    passed_by = view is not None and bool(view.passed)
    if view is not None:
        # What every reader reads again (``shadow``: the keys the catalog's recheck and the
        # hints after it name) is no disagreement: a record committed after ``truth`` was
        # read, announced before the log was listed (a break-it finding: a whole-store GC
        # beside a trainer took the newest step's commit for one, and replaced every catalog,
        # a third of its runs)
        explained = {h.key for h in later} | view.shadow
        keys = (set(view.records) | set(truth)) - explained
        changed = sorted(k for k in keys if not _same_bytes(view.records.get(k), truth.get(k)))
        if not changed and not passed_by:
            return None
    # A reader polling from its last read goes on from its log entry, not from a catalog: the
    # records changed behind the log's back are announced in it, so that it reads them again.
    if view is not None and changed:
        old = view.records
        announced = append_hints(
            storage,
            [
                Hint(
                    key=k,
                    op="reread",
                    id=_record_id(k, old.get(k)) or _record_id(k, truth.get(k)) or "0" * 16,
                )
                for k in changed
            ],
        )
        now += [] if announced is None else [announced]
    readable = [
        seq for seq in catalogs if seq not in forged and _catalog_or_none(storage, seq) is not None
    ]
    top = max([now[-1] if now else 0, *readable[-1:]])
    hints = [*pending, *later]
    for s in now:
        if s <= seen:
            try:
                hints += read_log_entry(storage, s)[0].hints
            except (CorruptCheckpointError, NotFoundError):
                continue  # (its commit, if it is one, is an attempt folder in `pending`)
    if readable:
        hints += read_catalog(storage, readable[-1]).recheck
    records = dict(truth)
    # The hints of entries after the listing stay to be read again, resolved or not: ``truth``
    # was read before them and cannot say which came last (a merger commit that landed before
    # GC's abandon hint of the same folder was taken for abandoned: a fuzz finding).
    recheck = unresolved(hints, records)
    recheck += [h for h in later if h not in recheck]
    fixed = IndexedRead(seq=top, records=records, recheck=recheck, log_from=top + 1)
    logger.warning(
        "%s: writing catalog %d from every record read",
        f"no catalog at {storage.uri} (its commit log was pruned behind catalogs that are gone)"
        if not catalogs
        else f"the catalog at {storage.uri} did not agree with the commit records"
        + (
            " (none could be used)"
            if view is None
            else " (the newest could not be used)"
            if passed_by and not changed
            else ""
        ),
        top,
    )
    written = compact(storage, fixed, force=True, parsed=parsed)
    for seq in catalogs:  # the ones it replaces, damaged or not
        if seq != top:
            storage.delete(catalog_key(seq))
    if written is not None:
        # And the segments no catalog left names (those of the ones it replaced, and any an
        # earlier repair left: a break-it finding, they piled up without end). A catalog
        # another writer is writing meanwhile may lose one: readers pass it by, and the next
        # catalog writes it again.
        named = {
            ref.name
            for seq in listed_seqs(storage, CATALOG_ROOT)
            if (c := _catalog_or_none(storage, seq)) is not None
            for ref in c.segments
        }
        for name in sorted(listed_segments(storage) - named):
            storage.delete(segment_key(name))
    return written


def _same_bytes(a: RecordBytes | None, b: RecordBytes | None) -> bool:
    if isinstance(a, CorruptCheckpointError) or isinstance(b, CorruptCheckpointError):
        return isinstance(a, CorruptCheckpointError) and isinstance(b, CorruptCheckpointError)
    return a == b
