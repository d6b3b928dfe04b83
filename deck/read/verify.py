"""Re-reading a checkpoint and checking every checksum."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from deck.errors import CorruptCheckpointError, DeckError, NotFoundError, StorageError
from deck.format.checksum import checksum
from deck.format.chunk_io import check_chunk, read_chunks
from deck.format.manifest import (
    MANIFEST,
    CheckpointManifest,
    ChunkRecord,
    FileRecord,
    Kind,
    RankManifest,
    ShardRecord,
    load_model,
)
from deck.read.catalog import (
    checkpoint_label,
    get_records,
    overlapped,
    part_where,
    read_rank_manifests,
)
from deck.storage import Storage


@dataclass
class VerifyReport:
    """Result of verifying one checkpoint: files checked, the damage found (``problems``: file
    + cause) and what could not be read (``unreadable``: a read error is not damage; what it
    hides is unknown, so it is kept and never quarantined)."""

    step: int
    files: int = 0  # files read and checked: rank manifests and data files
    bytes: int = 0  # their bytes: CheckpointManifest.data_bytes when every file was read
    problems: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every file read and intact."""
        return not self.problems and not self.unreadable

    def note(self, error: DeckError) -> None:
        """File ``error`` as damage (a checksum, size or record that does not match, a file
        missing or of the wrong kind) or as a read error (permission, I/O, timeout)."""
        damage = isinstance(error, CorruptCheckpointError | NotFoundError) or not isinstance(
            error, StorageError
        )
        (self.problems if damage else self.unreadable).append(str(error))


def verify_checkpoint(
    storage: Storage,
    m: CheckpointManifest,
    progress: Callable[[int], None] | None = None,
    *,
    decode: bool = True,
    tables: Mapping[str, tuple[int, int]] | None = None,
) -> VerifyReport:
    """Read every file of checkpoint ``m`` and check sizes and checksums, and what a restore
    relies on besides (chunk layouts, row ids against their shard's record, state trees that
    decode, one shape per table, a full's records covering its tables, and with ``tables``,
    the tables of the full its chain starts from (:func:`full_tables`), that it names only
    those, with their shapes); never raises for corruption, it reports it (naming the file).
    On a remote store the files are read concurrently
    (:func:`~deck.read.catalog.overlapped`), and checked in order as they come.
    ``decode=False``: sizes, checksums and chunk layouts only (what storage can damage),
    without torch (``deck gc`` checks so)."""
    if decode:
        # Imported here: decoding needs torch, which the readers of records do not load
        from deck.format.chunks import decode_chunk
        from deck.read.restore import decode_state_file
    report = VerifyReport(step=m.step)
    try:
        parts = read_rank_manifests(storage, m)
    except DeckError as e:
        report.note(e)
        return report
    for problem in table_problems(storage, m, parts, tables):
        report.note(CorruptCheckpointError(problem))
    # The rank manifests were read and checked above: counted like the data files, so that
    # verify's bytes are those `deck ls` shows (CheckpointManifest.data_bytes).
    report.files += len(m.ranks)
    report.bytes += sum(r.nbytes for r in m.ranks)
    root = m.folder
    files: list[_ChunkFile | FileRecord] = []
    for part in parts:
        for rec in part.shards:
            index = {id(c): i for i, c in enumerate(rec.chunks)}
            # One read per file: a chunk file, or the run of chunks sharing a bundle.
            for _path, group in itertools.groupby(rec.chunks, key=lambda c: c.path):
                files.append(_ChunkFile(rec, index, list(group)))
        files += [f for f in (part.dense, part.extra) if f is not None]

    def read(f: _ChunkFile | FileRecord) -> _Read:
        if isinstance(f, FileRecord):
            # Never more than the record says (+1 to see a longer file): a file grown or
            # replaced by someone else is not read whole into memory.
            return _Read(data=storage.get(f"{root}/{f.path}", 0, f.nbytes + 1))
        got = _Read()
        try:
            got.chunks.extend(read_chunks(storage, root, f.chunks))
        except DeckError as e:  # the chunks read before it are checked all the same
            got.error = e
        return got

    def size(f: _ChunkFile | FileRecord) -> int:
        return f.nbytes if isinstance(f, FileRecord) else sum(c.nbytes for c in f.chunks)

    for f, done in overlapped(storage, read, files, nbytes=size):
        if isinstance(done, DeckError):
            done = _Read(error=done)
        elif isinstance(done, Exception):
            raise done
        if isinstance(f, FileRecord):
            key = f"{root}/{f.path}"
            try:
                if done.error is not None:
                    raise done.error
                assert done.data is not None
                report.bytes += len(done.data)
                # What a restore checks: size, checksum, and a state tree it can read.
                where = f"{storage.describe(key)} ({checkpoint_label(m)})"
                if decode:
                    decode_state_file(done.data, f, where)
                elif len(done.data) != f.nbytes or checksum(done.data) != f.checksum:
                    raise CorruptCheckpointError(
                        f"{where}: size or checksum mismatch (file is corrupt)"
                    )
            except DeckError as e:
                report.note(e)
            report.files += 1
            continue
        for c, at, data in done.chunks:
            where = f"{at} (table {f.rec.table}, chunk {f.index[id(c)]}, {checkpoint_label(m)})"
            try:
                if decode:
                    # Checks checksums, layout and the ids against the shard's record (what a
                    # restore relies on); quantised chunks are valid ones.
                    decode_chunk(data, c, where, allow_quantized=True, shard=f.rec)
                else:
                    check_chunk(data, c, where)
                report.bytes += len(data)
            except DeckError as e:
                report.note(e)
            if progress:
                progress(c.nbytes)
        if done.error is not None:
            report.note(done.error)
            if progress:
                progress(sum(c.nbytes for c in f.chunks[len(done.chunks) :]))
        report.files += 1
    return report


@dataclass
class _ChunkFile:
    """The chunks of one shard in one file (a chunk file, or the run sharing a bundle)."""

    rec: ShardRecord
    index: dict[int, int]  # id(chunk) -> its place in the shard's record, for messages
    chunks: list[ChunkRecord]


@dataclass
class _Read:
    """One file as read: a state file's bytes, or a chunk file's chunks read before the error
    that stopped it (if any)."""

    data: bytes | None = None
    chunks: list[tuple[ChunkRecord, str, bytes | memoryview]] = field(default_factory=list)
    error: DeckError | None = None


def table_problems(
    storage: Storage,
    m: CheckpointManifest,
    parts: list[RankManifest],
    tables: Mapping[str, tuple[int, int]] | None,
) -> list[str]:
    """What a restore would refuse in the shard records of ``m`` (its rank manifests
    ``parts``), each naming the file: a table of two shapes; a full whose records do not
    cover a table; with ``tables`` (those of the full its chain starts from), a table not
    among them or of another shape. A break-it finding: a rank manifest whose table shape was
    changed (and every checksum made to match) passed verify, while restore and export refused
    it as damaged, so neither a quarantine nor a fallback could go around it."""
    out: list[str] = []
    shapes: dict[str, tuple[int, int]] = {}
    area: dict[str, int] = {}
    for part in parts:
        where = part_where(storage, m, part.rank)
        for rec in part.shards:
            shape = (rec.num_rows, rec.num_cols)
            if shapes.setdefault(rec.table, shape) != shape:
                out.append(
                    f"{where}: table {rec.table!r} is {shape[0]} x {shape[1]} here and "
                    f"{shapes[rec.table][0]} x {shapes[rec.table][1]} in another record of "
                    "the checkpoint; the record is damaged or was not written by deck"
                )
            elif tables is not None and tables.get(rec.table) != shape:
                known = tables.get(rec.table)
                out.append(
                    f"{where}: table {rec.table!r} of shape {shape} is not one of the tables "
                    f"its chain restores ({known if known else 'no such table in its full'}); "
                    "the record is damaged or was not written by deck"
                )
            area[rec.table] = area.get(rec.table, 0) + rec.rows * rec.cols
    if m.kind is Kind.FULL:
        for table, (rows, cols) in sorted(shapes.items()):
            if area[table] < rows * cols:
                out.append(
                    f"full checkpoint {checkpoint_label(m)} at {storage.uri}: its records of "
                    f"table {table!r} hold {area[table]} of its {rows} x {cols} values; a "
                    "record is damaged or was not written by deck"
                )
    return out


def full_tables(storage: Storage, m: CheckpointManifest) -> dict[str, tuple[int, int]] | None:
    """The tables (name -> rows, cols) of full checkpoint ``m``, which every later checkpoint of
    its chains must name only of; None when its records cannot be read, contradict each other
    or its files their records (:func:`check_files`: a full whose records were all forged
    alike, whose deltas must not be blamed for it): its own verify reports that, and there is
    nothing to judge the others by."""
    try:
        parts = read_rank_manifests(storage, m)
    except DeckError:
        return None
    if table_problems(storage, m, parts, None) or check_files(storage, m, parts=parts):
        return None
    return {rec.table: (rec.num_rows, rec.num_cols) for part in parts for rec in part.shards}


def confirmed_damage(
    storage: Storage,
    m: CheckpointManifest,
    report: VerifyReport,
    tables: Mapping[str, tuple[int, int]] | None = None,
) -> VerifyReport:
    """Damage is proven only when it reads back: ``m`` (whose ``report`` found problems) is
    verified a second time (against the same ``tables``), and only what that finds counts.
    Quarantine on the returned report's ``problems``, never on ``unreadable``."""
    if not report.problems:
        return report
    return verify_checkpoint(storage, m, tables=tables)


def uncommitted_meanwhile(storage: Storage, m: CheckpointManifest) -> bool:
    """Whether checkpoint ``m``'s commit record is gone from its folder, or names another
    checkpoint now: GC deleted it (the record goes before the files), or a rollback's save
    replaced it, after the caller read it. What its files lack is then no damage. A record that
    cannot be read, or is damaged, counts as still there (an unreadable record is not absent)."""
    key = f"{m.folder}/{MANIFEST}"
    try:
        _, data = next(get_records(storage, [key]))
    except DeckError:
        return False
    if data is None:
        return True
    if isinstance(data, CorruptCheckpointError):
        return False
    try:
        return load_model(CheckpointManifest, data, storage.describe(key)).id != m.id
    except DeckError:
        return False


def check_files(
    storage: Storage,
    m: CheckpointManifest,
    listing: Collection[str] | None = None,
    parts: list[RankManifest] | None = None,
    unreadable: list[str] | None = None,
) -> list[str]:
    """The cheap check of checkpoint ``m`` (no chunk is read): its rank manifests verify, and
    every file they name exists with its recorded size (a bundle: at least up to its last
    chunk). Returns the problems, each naming the file; never raises for damage (a storage
    error is a problem too: what cannot be checked is not intact). ``listing``: keys the
    caller listed already; a file not in it is missing without a request. ``parts``: its rank
    manifests, read (and verified) by the caller already. ``unreadable``: where a file that
    could not be sized goes instead (a caller that must not call a read error damage).
    :func:`verify_checkpoint` is the full check (every checksum)."""
    if parts is None:
        try:
            parts = read_rank_manifests(storage, m)
        except DeckError as e:
            return [str(e)]
    sizes: dict[str, tuple[int, bool]] = {}  # key -> (bytes, exact)
    for part in parts:
        part.file_sizes(m.folder, sizes)

    def size(key: str) -> int:
        if listing is not None and key not in listing:
            raise NotFoundError(storage.describe(key))
        return storage.size(key)

    problems = []
    for key, have in overlapped(storage, size, list(sizes)):  # sized concurrently when remote
        want, exact = sizes[key]
        where = f"{storage.describe(key)} ({checkpoint_label(m)})"
        if isinstance(have, NotFoundError):
            problems.append(f"{where}: file is missing")
        elif isinstance(have, DeckError):
            (problems if unreadable is None else unreadable).append(
                f"{where}: cannot be checked ({have})"
            )
        elif isinstance(have, Exception):
            raise have
        elif have != want if exact else have < want:
            problems.append(f"{where}: {have} bytes, its record says {want}")
    return problems
