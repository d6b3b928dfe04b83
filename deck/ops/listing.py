"""What a URI holds, for people and scripts: the rows of ``deck ls`` (committed checkpoints of
the lineage plus pending trainer steps), its tree view, and the details ``deck show`` prints.

A *pending* checkpoint is a trainer step folder with rank part manifests but no
``manifest.json``: ranks are still uploading, rank 0 has not committed yet, or the job died
before committing (GC removes those once they are older than its grace period). A *damaged* one
is a folder whose commit record (``manifest.json``) is there but cannot be read (truncated,
garbage, another step's): not a checkpoint, not to be forgotten either (``deck ls`` exits 1).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, fields, replace
from typing import Any

from deck.errors import CheckpointNotFoundError, CorruptCheckpointError, DeckError, NotFoundError
from deck.format.commit_log import record_key_kind
from deck.format.jsonio import paused_gc
from deck.format.manifest import (
    MANIFEST,
    MERGED_ROOT,
    QUARANTINE_ROOT,
    CheckpointManifest,
    Kind,
    RankManifest,
    RankRef,
    ShardRecord,
    load_model,
    parse_merged_dir,
    parse_step_dir,
    step_dir,
    step_dirs_from,
    steps_text,
)
from deck.format.pending import PENDING_SUFFIX, PendingPart
from deck.read.catalog import (
    ManifestSet,
    get_records,
    manifest_keys,
    manifest_set,
    read_every_record,
    read_manifests,
    read_rank_manifests,
)
from deck.read.lineage import (
    LineageGraph,
    LineageNode,
    PathLink,
    StateKey,
    announced_unrecorded,
    build_graph,
    keep_chain,
)
from deck.storage import Storage
from deck.storage.base import MAX_RECORD_BYTES, get_bounded

_PART = re.compile(r"^(step-\d{12})/([0-9a-f]{16})/rank-(\d{5})\.json$")
_PENDING_RECORD = re.compile(r"^(step-\d{12})/([0-9a-f]{16})/rank-(\d{5})\.pending\.json$")
# A merged delta's folder: its layer and first step.
_MERGED_NAME = re.compile(rf"^{MERGED_ROOT}/L(\d+)-(\d{{12}})-")


@dataclass(frozen=True)
class Row:
    """One checkpoint as ``deck ls`` shows it."""

    kind: str  # full | delta | merged
    step: int
    layer: int  # 0: trainer checkpoints and merger fulls; L >= 1: merged deltas of layer L
    first_step: int  # first trainer step whose rows it holds (covers first_step..step)
    bytes: int  # all its files, all ranks
    created_unix: float | None  # commit time (pending: newest rank part's file time, if known)
    # committed | pending | quarantined | damaged, or for a committed trainer checkpoint with
    # no complete chain: abandoned (a timeline a rollback left) | broken (damage);
    # a merger checkpoint no step's chain can use any more: abandoned
    state: str
    ranks: int  # rank parts present
    world_size: int  # 0: unknown (a pending checkpoint none of whose rank parts could be read)
    merged: bool  # written by the merger
    parent: int | None
    base: int | None
    epoch: int | None
    id: str
    folder: str
    # damaged: what is wrong with its commit record, naming the file; pending: its rank parts
    # that could not be read
    problem: str | None = None

    @property
    def ranks_text(self) -> str:
        """``ranks/world_size`` as shown (``?`` for a world size not known)."""
        return f"{self.ranks}/{self.world_size or '?'}"

    def to_dict(self, now: float) -> dict[str, Any]:
        """JSON-ready, with ``age_s`` and ``covers``."""
        # Every field holds a number, a string, a bool or None: a shallow copy is what
        # dataclasses.asdict's deep one gives, at a tenth of its cost (a row per checkpoint
        # for `deck ls --all --json`).
        d = {name: getattr(self, name) for name in _ROW_FIELDS}
        d["covers"] = [self.first_step, self.step]
        d["age_s"] = None if self.created_unix is None else round(now - self.created_unix, 3)
        return d


_ROW_FIELDS = tuple(f.name for f in fields(Row))


def _row(n: LineageNode) -> Row:
    m = n.manifest
    return Row(
        kind=n.kind.value,
        step=n.step,
        layer=n.layer,
        first_step=n.first_step,
        bytes=n.bytes,
        created_unix=m.created_unix,
        state="quarantined" if n.quarantined else "committed",
        ranks=len(m.ranks),
        world_size=m.world_size,
        merged=n.merged,
        parent=m.parent,
        base=m.base,
        epoch=m.epoch,
        id=n.id,
        folder=n.folder,
    )


def list_rows(storage: Storage) -> tuple[LineageGraph, list[Row]]:
    """The lineage graph of ``storage`` and one :class:`Row` per committed checkpoint (trainer's
    and merger's), per pending trainer checkpoint and per folder whose commit record is
    damaged (state ``damaged``, ``problem`` naming the file), ordered by step, then layer. A
    committed trainer checkpoint without a complete chain is ``abandoned`` (an older timeline
    a rollback left: :meth:`LineageGraph.abandoned`) or ``broken`` (damage, ``deck verify``
    says what)."""
    with paused_gc():  # (100,000 records make millions of objects: see paused_gc)
        keys, records = _listed_records(storage)
        manifests = manifest_set(storage, records, None)
        graph = build_graph(manifests, storage.uri)
        rows = [_row(n) for n in graph.nodes.values()]
        restorable, left = set(graph.restorable_steps()), graph.abandoned()
        rows = [
            replace(r, state="abandoned" if r.step in left else "broken")
            if not r.merged and r.state == "committed" and r.step not in restorable
            else r
            for r in _left_merged_abandoned(graph, rows)
        ]
        rows.extend(_unreadable_rows(manifests, keys))
        rows.extend(_built_on(storage, manifests, graph, _pending_rows(storage, keys)))
        rows.sort(key=_row_order)
    return graph, rows


def _built_on(
    storage: Storage, manifests: ManifestSet, graph: LineageGraph, pending: list[Row]
) -> list[Row]:
    """``pending`` rows, those whose commit record is lost saying so (:data:`LOST_RECORD`):
    a committed checkpoint applies on it, or the commit log announced its record after the
    latest step's (:func:`announced_unrecorded`). Not a save in progress (break-it findings:
    listed as pending, nothing said which record to put back)."""
    users: dict[str, list[int]] = {}
    for n in graph.nodes.values():
        if n.start is not None:
            users.setdefault(n.start[1], []).append(n.step)
    newest = (
        announced_unrecorded(storage, manifests, graph.latest(log=False))
        if any(r.id not in users for r in pending)
        else None
    )
    out = []
    for r in pending:
        record = f"{r.folder.split('/')[0]}/{MANIFEST}"
        if r.id in users:
            why = f"committed step(s) {steps_text(users[r.id])} build on it; put it back from a backup"
        elif newest is not None and newest.id == r.id:
            why = f"{newest.vouched}; put it back"
        else:
            out.append(r)
            continue
        out.append(replace(r, problem=f"{LOST_RECORD} {record} is lost: {why}"))
    return out


# How a pending row whose commit record is lost begins its problem
LOST_RECORD = "its commit record"


def _left_merged_abandoned(graph: LineageGraph, rows: list[Row]) -> list[Row]:
    """``rows`` with the committed merger checkpoints that no step's chain can use any more
    marked ``abandoned``: each reproduces a state that no trainer checkpoint holds or builds on,
    nor a merger checkpoint those can use (a rollback re-saved its step and the steps after
    it). A merger full of a step the new timeline has not saved again still restores that
    step's old state, and stays ``committed``. What it takes of the graph are the records of
    its own step and later ones, all of which a windowed read holds when it holds it."""

    def held(state: StateKey) -> bool:  # by the step's trainer checkpoint
        t = graph.trainer.get(state[0])
        return t is not None and t.state == state

    # States something builds on that no trainer checkpoint holds (few: a rollback's)
    wanted = {t.start for t in graph.trainer.values() if t.start is not None and not held(t.start)}
    left: set[str] = set()
    # Newest first: what a merged delta builds on is older than what it reproduces, so one
    # pass sees every use of a state before the checkpoints that reproduce it
    for n in sorted((n for n in graph.nodes.values() if n.merged), key=lambda n: -n.step):
        if not (held(n.state) or n.state in wanted):
            left.add(n.id)
        elif n.start is not None and not held(n.start):
            wanted.add(n.start)
    return [
        replace(r, state="abandoned") if r.id in left and r.state == "committed" else r
        for r in rows
    ]


def _listed_records(
    storage: Storage,
) -> tuple[list[str], list[tuple[str, bytes | CorruptCheckpointError]]]:
    """What a listing of every file of ``storage`` says for :func:`list_rows`, and the records
    it names, read: the keys of the regular files among the records and in the folders that
    hold no readable record (their rank parts: pending checkpoints), and each record key (of
    a folder holding any file, and every quarantine record) with its bytes, sorted by key.

    A listing of every file walks every chunk folder of every checkpoint (500,000 files at
    100,000 checkpoints: seconds, most of ``deck ls --all``). So the folders are listed (the
    root, ``merged/``, ``quarantine/``), each folder's record read, and only the folders whose
    record is not a file that was read are listed whole: there the listing decides, as it
    did, whether the record is a regular file (a link, a FIFO is not: damaged, and its rank
    parts pending) and whether the folder holds anything at all (else it was never looked
    at)."""
    wanted = sorted(k for k in manifest_keys(storage) if record_key_kind(k) is not None)
    # Each from its file, not a catalog's copy: a record damaged or replaced behind the log's
    # back is what ls reports (a break-it finding: taken from the catalog it showed as committed)
    read = list(get_records(storage, wanted))
    keys = [k for k, data in read if isinstance(data, bytes)]
    odd = [k for k, data in read if not isinstance(data, bytes) and not _quarantine_key(k)]
    listed = {k: storage.list(k[: -len(MANIFEST)]) for k in odd}
    keys += [f for found in listed.values() for f in found]
    keys.sort()
    records = [
        (k, data)
        for k, data in read
        # (an empty folder: nothing; but a record refused as it is, a link, is damage whatever
        # the listing, which shows regular files only: a break-it finding left it out)
        if data is not None
        and (k not in listed or listed[k] or isinstance(data, CorruptCheckpointError))
    ]
    return keys, records


def _quarantine_key(key: str) -> bool:
    return key.startswith(f"{QUARANTINE_ROOT}/")


@dataclass(frozen=True)
class RecentRows:
    """What :func:`list_recent_rows` found: the graph of the records it read (every one of
    steps ``floor`` and later), the rows of the newest steps and of the fulls among them, and
    how many other checkpoints there are (``older``: the catalog's count of those not read,
    and those read but not in ``rows``)."""

    graph: LineageGraph
    rows: list[Row]
    floor: int
    older: int


def list_recent_rows(storage: Storage, steps: int) -> RecentRows | None:
    """The rows of :func:`list_rows` for the newest ``steps`` steps (every checkpoint of them,
    and the pending ones), for the fulls of the newest part of the history, and for the damaged
    records among those read, read
    from the newest segments of the catalog (:func:`deck.read.window.read_window`): what a
    long history costs to list does not grow with its length. The same rows as
    :func:`list_rows` gives for those checkpoints, or None where a windowed read cannot say
    (no catalog with segments, a history of one segment, or a shown trainer checkpoint with
    no chain among the records read: whether it is broken or abandoned takes every record):
    the caller lists every record then."""
    from deck.read.window import read_window

    got = read_window(storage)
    if got is None or got.window is None or got.index is None:
        return None
    floor = got.window.floor
    unread = [r for r in got.index.segments if r.name not in got.index.loaded]
    # A chain among the records read is a chain (an answer without the window's limits)
    got.window = None
    graph = build_graph(got, storage.uri)
    every = sorted({n.step for n in graph.nodes.values()})
    first = every[-min(len(every), steps)] if every else floor
    nodes = [n for n in graph.nodes.values() if n.step >= first or n.kind is Kind.FULL]
    restorable = set(graph.restorable_steps())
    if any(not n.merged and not n.quarantined and n.step not in restorable for n in nodes):
        return None
    if not _as_stored(storage, got, graph, nodes):
        return None
    rows = _left_merged_abandoned(graph, [_row(n) for n in nodes])
    rows.extend(_unreadable_rows(got, list(got.index.records)))
    # Pending checkpoints: the step folders of the shown steps and after, listed one by one
    names = [n.rstrip("/") for n in storage.list_dir_after("", step_dirs_from(first))]
    recent = [n for n in names if (s := parse_step_dir(n)) is not None and s >= first]
    listed = [k for n in recent for k in storage.list(f"{n}/")]
    committed = {parse_step_dir(k.partition("/")[0]) for k in listed if k.endswith(MANIFEST)}
    if committed - set(got) - set(got.damaged):
        return None  # a record the catalog does not hold (written without the log)
    rows.extend(_built_on(storage, got, graph, _pending_rows(storage, listed)))
    rows.sort(key=_row_order)
    older = sum(r.count for r in unread) + len(graph.nodes) - len(nodes)
    return RecentRows(graph, rows, floor, older)


def _as_stored(
    storage: Storage, got: ManifestSet, graph: LineageGraph, nodes: list[LineageNode]
) -> bool:
    """Whether what the rows of ``nodes`` say, read through the catalog, is what the store
    holds now: the commit records of those checkpoints and of the chains of the trainer steps
    among them (a damaged full there makes the steps after it broken), and their quarantine
    records. A catalog is an index, never the truth: any difference and the caller lists every
    record."""
    assert got.index is not None
    ways = graph.chain_ways(sorted({n.step for n in nodes if not n.merged}), frozenset())
    ids = {n.id for n in nodes}
    walked: set[PathLink] = set()
    for way in ways.values():
        keep_chain(way, ids, walked)
    records = {i: f"{graph.nodes[i].folder}/{MANIFEST}" for i in ids}
    marks = {i: f"{QUARANTINE_ROOT}/{i}.json" for i in ids}
    try:
        now = dict(storage.get_many([*records.values(), *marks.values()], limit=MAX_RECORD_BYTES))
    except DeckError:  # (a record too large now, a link: every record's read says what)
        return False
    return all(
        now.get(records[i]) == got.index.records.get(records[i])
        and (now.get(marks[i]) is not None) == (i in got.quarantined)
        for i in ids
    )


def _row_order(r: Row) -> tuple[int, int, int, bool, str]:
    return (r.step, r.layer, r.first_step, r.state != "committed", r.id)


def _unreadable_rows(manifests: ManifestSet, keys: list[str]) -> list[Row]:
    """A ``damaged`` row per trainer record of ``manifests`` that cannot be read, and per
    merger record among ``keys`` that cannot be (its folder's name says its layer and steps)."""
    rows = []
    for step, why in manifests.damaged.items():
        rows.append(_damaged(step, 0, step_dir(step), "", why))
    for k in keys:
        head, _, tail = k.partition("/")
        name, _, rest = tail.partition("/")
        named = parse_merged_dir(name) if head == MERGED_ROOT and rest == MANIFEST else None
        if named is not None and named[0] in manifests.damaged_merged:
            folder = f"{MERGED_ROOT}/{name}"
            hit = _MERGED_NAME.match(folder)
            layer, first = (int(hit.group(1)), int(hit.group(2))) if hit else (0, named[1])
            row = _damaged(named[1], layer, folder, named[0], manifests.damaged_merged[named[0]])
            rows.append(replace(row, first_step=first))
    return rows


def _pending_rows(storage: Storage, keys: list[str]) -> list[Row]:
    """A ``pending`` row per attempt of a step folder among ``keys`` with rank parts, or
    pending records (a local destination's first tier: files being written, no rank part up
    yet), and no ``manifest.json``."""
    have = set(keys)
    parts: dict[tuple[str, str], list[str]] = {}
    records: dict[tuple[str, str], list[str]] = {}
    for k in keys:
        hit = _PART.match(k) or _PENDING_RECORD.match(k)
        if hit and f"{hit.group(1)}/{MANIFEST}" not in have:
            parts.setdefault((hit.group(1), hit.group(2)), [])
            if k.endswith(PENDING_SUFFIX):
                records.setdefault((hit.group(1), hit.group(2)), []).append(k)
            else:
                parts[(hit.group(1), hit.group(2))].append(k)
    return [
        _pending(storage, folder, ckpt_id, found, records.get((folder, ckpt_id), []))
        for (folder, ckpt_id), found in parts.items()
    ]


def _damaged(step: int, layer: int, folder: str, ckpt_id: str, why: str) -> Row:
    """The row of a folder whose commit record cannot be read: only what its name says."""
    return Row(
        kind="?",
        step=step,
        layer=layer,
        first_step=step,
        bytes=0,
        created_unix=None,
        state="damaged",
        ranks=0,
        world_size=0,
        merged=folder.startswith(f"{MERGED_ROOT}/"),
        parent=None,
        base=None,
        epoch=None,
        id=ckpt_id,
        folder=folder,
        problem=why,
    )


def _pending(
    storage: Storage, folder: str, ckpt_id: str, keys: list[str], records: list[str]
) -> Row:
    from deck.ops.retention import file_age_s

    parsed: list[RankManifest] = []
    unreadable: list[str] = []
    for k in keys:
        try:
            parsed.append(load_model(RankManifest, get_bounded(storage, k), storage.describe(k)))
        except (CorruptCheckpointError, NotFoundError):
            # being written, replaced or deleted right now; still pending
            unreadable.append(k.rsplit("/", 1)[-1])
    # No part up yet: what its pending record says (kind, world size), if one reads
    record = next(filter(None, (_pending_record(storage, k) for k in records[:1])), None)
    now = time.time()
    ages = [a for a in (file_age_s(storage, k, now) for k in keys + records) if a is not None]
    nbytes = sum(
        sum(c.nbytes for rec in p.shards for c in rec.chunks)
        + sum(f.nbytes for f in (p.dense, p.extra) if f is not None)
        for p in parsed
    )
    shards = [rec for p in parsed for rec in p.shards]
    step = int(folder.split("-")[1])
    if not parsed and record is not None:
        kind = record.kind.value
    else:
        kind = "full" if shards and all(r.full for r in shards) else "delta"
    return Row(
        kind=kind,
        step=step,
        layer=0,
        first_step=step,
        bytes=nbytes,
        created_unix=now - min(ages) if ages else None,
        state="pending",
        ranks=len(keys),
        # 0: unknown (no part could be read: its job's size is written in the parts)
        world_size=(
            parsed[0].world_size if parsed else record.world_size if record is not None else 0
        ),
        merged=False,
        parent=None,
        base=None,
        epoch=None,
        id=ckpt_id,
        folder=f"{folder}/{ckpt_id}",
        problem=(
            f"rank part(s) {', '.join(sorted(unreadable))} not readable (being written?)"
            if unreadable
            else None
        ),
    )


def _pending_record(storage: Storage, key: str) -> PendingPart | None:
    """The pending record at ``key`` (None: unreadable now, being written or gone)."""
    try:
        return load_model(PendingPart, get_bounded(storage, key), storage.describe(key))
    except (CorruptCheckpointError, NotFoundError):
        return None


def tree_lines(graph: LineageGraph, rows: list[Row], fmt: Any) -> list[str]:
    """The lineage as an ASCII tree: each trainer full with the trainer deltas built on it
    (and on them), and under each state the merger checkpoints that apply on it or reproduce
    it. ``fmt(row)`` renders one line. Pending checkpoints come last, then damaged ones.
    ``rows`` may be a narrowed view: a checkpoint not among them is left out, and what hangs
    under it hangs under the nearest one shown (or is a root)."""
    by_id = {r.id: r for r in rows}
    children: dict[str, list[LineageNode]] = {}
    roots: list[LineageNode] = []

    def parent(n: LineageNode) -> LineageNode | None:
        if n.merged:
            # A merged delta hangs under the state it applies on, a merger full under the
            # trainer checkpoint whose state it reproduces.
            return graph.trainer_at(n.start if n.start is not None else n.state)
        return graph.trainer_at(n.start) if n.start is not None else None

    for n in sorted(graph.nodes.values(), key=lambda n: (n.step, n.layer, n.first_step, n.id)):
        if n.id not in by_id:
            continue  # not shown (a narrowed view): its children hang under what is
        anchor = parent(n)
        seen = set()
        while anchor is not None and anchor.id not in by_id and anchor.id not in seen:
            seen.add(anchor.id)
            anchor = parent(anchor)
        if anchor is None or anchor.id not in by_id:
            roots.append(n)
        else:
            children.setdefault(anchor.id, []).append(n)
    out: list[str] = []
    # Depth first with an explicit stack (a chain of thousands of deltas is that deep): each
    # entry is (node, prefix of its line, last of its siblings, a root).
    stack: list[tuple[LineageNode, str, bool, bool]] = [
        (r, "", True, True) for r in reversed(roots)
    ]
    while stack:
        n, prefix, last, top = stack.pop()
        head = "" if top else prefix + ("`- " if last else "|- ")
        out.append(head + fmt(by_id[n.id]))
        # Merger checkpoints first, then the trainer chain goes on: it reads top to bottom.
        kids = sorted(children.get(n.id, []), key=lambda k: (not k.merged, k.step, k.layer, k.id))
        inner = prefix if top else prefix + ("   " if last else "|  ")
        stack.extend(
            (k, inner, i == len(kids) - 1, False) for i, k in reversed(list(enumerate(kids)))
        )
    pending = [r for r in rows if r.state == "pending"]
    if pending:
        out.append("pending (rank parts without manifest.json):")
        out.extend("  " + fmt(r) for r in pending)
    damaged = [r for r in rows if r.state == "damaged"]
    if damaged:
        out.append("damaged (manifest.json there but unreadable):")
        out.extend("  " + fmt(r) for r in damaged)
    return out


def find_checkpoint(storage: Storage, which: str) -> CheckpointManifest:
    """The committed checkpoint named by ``which``: a trainer step number, a checkpoint id, or
    a merger folder (``merged/L01-...`` or its last part), as its record's file says (read
    through the catalog, the record found is read again from its file, and any difference, or
    nothing found, reads every record: a break-it finding showed a record damaged behind the
    log's back as the catalog held it). Raises :class:`CheckpointNotFoundError` listing what
    there is, :class:`CorruptCheckpointError` naming the file for a step whose commit record
    is damaged."""
    manifests = read_manifests(storage)
    if manifests.index is None:
        return _find(manifests, which, storage.uri)
    try:
        m = _find(manifests, which, storage.uri)
    except (CheckpointNotFoundError, CorruptCheckpointError):
        m = None
    if m is not None and _as_stored_record(storage, m):
        return m
    return _find(read_every_record(storage), which, storage.uri)


def _as_stored_record(storage: Storage, m: CheckpointManifest) -> bool:
    """Whether ``m``'s commit record reads back from its file as ``m``."""
    key = f"{m.folder}/{MANIFEST}"
    data = dict(get_records(storage, [key])).get(key)
    if not isinstance(data, bytes):
        return False
    try:
        return load_model(CheckpointManifest, data, storage.describe(key)) == m
    except DeckError:
        return False


def _find(manifests: ManifestSet, which: str, uri: str) -> CheckpointManifest:
    if which.isdigit():
        m = manifests.get(int(which))
        if m is not None:
            return m
        if int(which) in manifests.damaged:  # damage, not absence
            raise CorruptCheckpointError(
                f"step {which}: {manifests.damaged[int(which)]}; repair it, or delete it to give "
                "the step up"
            )
    for cand in manifests.all():
        if which in (cand.id, cand.folder) or cand.folder.endswith(f"/{which}"):
            return cand
    raise CheckpointNotFoundError(
        f"no committed checkpoint {which!r} at {uri}; trainer steps: "
        f"{steps_text(manifests)}"
        + (
            f", merger checkpoints: {len(manifests.merged)} (see `deck ls`)"
            if manifests.merged
            else ""
        )
    )


def describe_checkpoint(storage: Storage, m: CheckpointManifest) -> dict[str, Any]:
    """Everything about one committed checkpoint, JSON-ready: its record, and per rank the
    part manifest, dense / extra files and every shard (offsets, saved rows, bytes, chunk files
    with their checksums); ``tables`` sums the shards per table. Reads the rank manifests
    (checked against the record), not the data."""
    parts = read_rank_manifests(storage, m)
    refs = {r.rank: r for r in m.ranks}
    tables: dict[str, dict[str, Any]] = {}
    ranks = []
    for p in parts:
        shards = [_describe_shard(rec) for rec in p.shards]
        for shard in shards:
            _add_to_table(tables, shard)
        ranks.append(_describe_rank(p, refs[p.rank], shards))
    return {**_describe_record(m), "tables": tables, "ranks": ranks}


def _describe_shard(rec: ShardRecord) -> dict[str, Any]:
    return {
        "table": rec.table,
        "shape": [rec.num_rows, rec.num_cols],
        "row_offset": rec.row_offset,
        "rows": rec.rows,
        "col_offset": rec.col_offset,
        "cols": rec.cols,
        "full": rec.full,
        "states": list(rec.states),
        "saved_rows": sum(c.rows for c in rec.chunks),
        "bytes": sum(c.nbytes for c in rec.chunks),
        "num_chunks": len(rec.chunks),
        "chunks": [
            {"path": c.path, "rows": c.rows, "bytes": c.nbytes, "checksum": c.checksum}
            for c in rec.chunks
        ],
    }


def _add_to_table(tables: dict[str, dict[str, Any]], shard: dict[str, Any]) -> None:
    """Count ``shard`` (a :func:`_describe_shard`) in its table's sums."""
    t = tables.setdefault(
        shard["table"], {"shape": list(shard["shape"]), "shards": 0, "saved_rows": 0, "bytes": 0}
    )
    t["shards"] += 1
    t["saved_rows"] += shard["saved_rows"]
    t["bytes"] += shard["bytes"]


def _describe_rank(p: RankManifest, ref: RankRef, shards: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "rank": p.rank,
        "manifest": {"path": ref.path, "bytes": ref.nbytes, "checksum": ref.checksum},
        "data_bytes": ref.data_bytes,
        "dense": p.dense.model_dump() if p.dense else None,
        "extra": p.extra.model_dump(),
        "shards": shards,
    }


def _describe_record(m: CheckpointManifest) -> dict[str, Any]:
    return {
        "id": m.id,
        "kind": m.kind.value,
        "step": m.step,
        "folder": m.folder,
        "merged": m.is_merged,
        "layer": m.layer,
        "covers": list(m.covers),
        "parent": m.parent,
        "parent_id": m.parent_id,
        "base": m.base,
        "epoch": m.epoch,
        "inputs": list(m.inputs),
        "state_id": m.state_id,
        "world_size": m.world_size,
        "created_unix": m.created_unix,
        "deck_version": m.deck_version,
        "bytes": m.data_bytes,
    }
