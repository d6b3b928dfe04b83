"""Merger workers: hierarchical merging of deltas and new fulls, off the training path.

A merger worker is a plain CPU process pointed at the checkpoint URI (``deck merge URI``). It
reads committed checkpoints only and writes only under ``merged/``; the trainer never waits for
it and never reads anything it is writing.

What it builds (DECK sec. 3.3; docs/operations.md, "Merger workers"):

- **Merged deltas, stride s.** Counting the deltas of a timeline from their full (positions
  1, 2, ...), every aligned block of ``s**L`` positions becomes one merged delta of layer ``L``,
  made from the ``s`` items of layer ``L - 1`` in it (layer 0: the trainer's deltas). Rows are
  merged newest-wins, as sorted streams (one chunk per input in memory), and written sorted by
  global row id in chunks like the trainer's.
- **New fulls** (:class:`FullPolicy`): after ``every`` deltas, or when the bytes a restore reads on
  top of the full (the "live" chain) pass ``max_live_fraction`` of a full (DECK eq. 2, dynamic
  form), or by an IncrCP-style cost rule, a merger full of that state is built from the full plus
  its chain. The next deltas count their positions from it; the trainer never takes another full.
  When several fulls are planned in a row (a merger that fell behind), only the newest is built,
  from the newest committed full and the chain across the skipped ones.

What gets built is a pure function of the committed trainer checkpoints (and, for the dynamic
rule, of the sizes of committed merged deltas), and every merged checkpoint's id is a hash of
its inputs. So workers agree without talking, and a rerun after a crash finds the same work.

**Partitions and commit.** A merged checkpoint is built per partition = (rank, table shard);
partition ``p`` belongs to worker ``xxh3(p) % num_workers``. A worker writes a partition's chunks
under a fresh attempt folder, then its partition record ``merged/<name>/parts/<p>.json`` (atomic).
Whichever worker finds every partition record present writes the rank manifests (under a fresh
folder) and then ``merged/<name>/manifest.json``: the commit, last, exactly as the trainer's.
Two workers doing the same partition or the same commit each write complete, self-consistent
files, and the last record written wins; kill -9 at any point leaves either no manifest (the
item does not exist yet; its files are orphans that GC removes) or a complete one.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import xxhash

from deck.errors import (
    ConfigError,
    CorruptCheckpointError,
    DeckError,
    MergeError,
    NotFoundError,
    StorageError,
)
from deck.failpoints import failpoint
from deck.format.chunks import (
    ChunkLayout,
    aligned_buffer,
    checksum,
    chunk_where,
    decode_chunk,
    encode_chunk,
    read_chunks,
)
from deck.format.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    CheckpointManifest,
    ChunkRecord,
    FileRecord,
    Kind,
    MergePartRecord,
    RankManifest,
    RankRef,
    ShardRecord,
    dump_model,
    load_model,
    merged_dir,
    rank_dir,
    rank_manifest_name,
    table_dir,
)
from deck.format.rowindex import build_index
from deck.read.catalog import (
    ManifestSet,
    quarantine,
    read_manifests,
    read_rank_manifests,
)
from deck.read.lineage import LineageGraph, LineageNode, StateKey, build_graph
from deck.storage import Storage
from deck.version import __version__

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
PARTS_DIR = "parts"
DENSE_FILE = "dense.safetensors"
EXTRA_FILE = "extra.safetensors"


# ---- policy ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FullPolicy:
    """When the merger builds a new full (any rule that is set triggers it).

    - ``every``: after this many deltas since the last full (DECK's fixed N; see
      :func:`full_every_for_bound` for N from eq. 2).
    - ``max_live_fraction``: when the chain a restore reads on top of the full (merged deltas and
      deltas) is larger than this fraction of the full (DECK's dynamic rule: bounds recovery at
      about ``1 + fraction`` full loads).
    - ``cost_ratio`` (IncrCP-style alternative): when ``live * cost_ratio >= 2 * full + live``,
      i.e. when the bytes every recovery must read on top of the full, weighted by how much more a
      recovery byte costs than a background byte, outweigh building a full (read full + live,
      write full).

    Decisions are evaluated once the planned chain to a step is committed, in step order, so
    every worker takes the same decision.
    """

    every: int | None = field(
        default=None,
        metadata={
            "description": "New full after this many deltas since the last full (DECK's fixed "
            "N; `full_every_for_bound` solves eq. 2 for it). None: no fixed interval.",
            "constraints": ">= 1 or None",
            "cli": "deck merge --full-every N",
        },
    )
    max_live_fraction: float | None = field(
        default=0.1,
        metadata={
            "description": "New full when the chain a restore reads on top of the full is "
            "larger than this fraction of the full (recovery reads about 1 + F fulls). "
            "None: off.",
            "constraints": "> 0 or None",
            "cli": "deck merge --full-live-fraction F (0: off)",
        },
    )
    cost_ratio: float | None = field(
        default=None,
        metadata={
            "description": "IncrCP-style rule: new full when live x R >= 2 x full + live (R: how "
            "much more a byte read at recovery costs than a byte of background merging). "
            "None: off.",
            "constraints": "> 1 or None",
            "cli": "deck merge --full-cost-ratio R",
        },
    )

    def __post_init__(self) -> None:
        if self.every is not None and self.every < 1:
            raise ConfigError(f"full policy: every must be >= 1 or None, got {self.every}")
        if self.max_live_fraction is not None and not self.max_live_fraction > 0:
            raise ConfigError(
                f"full policy: max_live_fraction must be > 0 or None, got {self.max_live_fraction}"
            )
        if self.cost_ratio is not None and not self.cost_ratio > 1:
            raise ConfigError(f"full policy: cost_ratio must be > 1 or None, got {self.cost_ratio}")

    @property
    def needs_sizes(self) -> bool:
        return self.max_live_fraction is not None or self.cost_ratio is not None

    def want_full(self, position: int, live_bytes: int | None, full_bytes: int) -> bool:
        """Whether the state ``position`` deltas after a full gets a new full; ``live_bytes``
        is None when the sizes are not known yet (only asked then if no size rule is set)."""
        if self.every is not None and position >= self.every:
            return True
        if live_bytes is None:
            return False
        if self.max_live_fraction is not None and live_bytes > self.max_live_fraction * full_bytes:
            return True
        return self.cost_ratio is not None and live_bytes * self.cost_ratio >= (
            2 * full_bytes + live_bytes
        )


@dataclass(frozen=True)
class MergeConfig:
    """What a merger worker builds and which share of the work is its own."""

    stride: int = field(
        default=4,
        metadata={
            "description": "Items per merge, s: every s items of layer L become one merged "
            "delta of layer L + 1 (DECK eq. 1, `stride_for_velocity`, picks s).",
            "constraints": ">= 2",
            "cli": "deck merge --stride S",
        },
    )
    full: FullPolicy = field(
        default_factory=FullPolicy,
        metadata={"description": "When the merger builds a new full (any rule that is set)."},
    )
    chunk_bytes: int = field(
        default=DEFAULT_CHUNK_BYTES,
        metadata={
            "description": "Chunk file size of merged checkpoints.",
            "constraints": "a positive multiple of 4096",
            "cli": "deck merge --chunk-bytes B",
        },
    )
    worker_index: int = field(
        default=0,
        metadata={
            "description": "This worker's share of the partitions: those with "
            "xxh3(partition) % num_workers == worker_index.",
            "constraints": "0 <= worker_index < num_workers",
            "cli": "deck merge --worker-index i",
        },
    )
    num_workers: int = field(
        default=1,
        metadata={
            "description": "How many workers split the work (give every worker the same value).",
            "constraints": ">= 1",
            "cli": "deck merge --num-workers n (or --workers K on one host)",
        },
    )

    def __post_init__(self) -> None:
        if self.stride < 2:
            raise ConfigError(f"merge stride must be >= 2, got {self.stride}")
        if self.chunk_bytes < 4096 or self.chunk_bytes % 4096:
            raise ConfigError(
                f"merge chunk_bytes must be a positive multiple of 4096, got {self.chunk_bytes}"
            )
        if self.num_workers < 1 or not 0 <= self.worker_index < self.num_workers:
            raise ConfigError(
                f"worker index {self.worker_index} of {self.num_workers} workers: need "
                "0 <= worker_index < num_workers"
            )


def merged_size(dup_ratio: float, stride: int, layer: int) -> float:
    """DECK's model of a layer-``layer`` merged delta's size relative to one delta:
    ``(2 - d) ** (layer * log2 s)`` for duplication ratio ``d`` of two consecutive deltas."""
    return (2 - dup_ratio) ** (layer * math.log2(stride))


def full_every_for_bound(stride: int, dup_ratio: float, bound: float, limit: int = 10_000) -> int:
    """DECK eq. 2: the largest N such that the live merged volume after N deltas,
    ``sum_i (floor(N / s^i) - floor(N / s^(i+1)) * s) * (2 - d)^(i log s)``, stays below
    ``bound`` (in units of one delta). At least 1."""
    best = 1
    for n in range(1, limit + 1):
        vol, i = 0.0, 1
        while stride**i <= n:
            vol += (n // stride**i - (n // stride ** (i + 1)) * stride) * merged_size(
                dup_ratio, stride, i
            )
            i += 1
        vol += n % stride  # the unmerged deltas of layer 0
        if vol >= bound:
            break
        best = n
    return best


def stride_for_velocity(dup_ratio: float, velocity: float, max_stride: int = 64) -> int | None:
    """DECK eq. 1: the smallest stride ``s`` with ``sum_i (2 - d)^(i log s) / s^i < v`` (the
    merger keeps up with the trainer at relative merge velocity ``v``), or None if none does."""
    for s in range(2, max_stride + 1):
        r = (2 - dup_ratio) ** math.log2(s) / s
        if r < 1 and r / (1 - r) < velocity:
            return s
    return None


# ---- the plan ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedItem:
    """A checkpoint the merger should build (not committed yet)."""

    id: str
    kind: Kind  # MERGED or FULL
    layer: int  # merged: >= 1; full: 0
    inputs: tuple[str, ...]  # oldest first; for a full: the full, then the chain
    first_step: int | None
    step: int
    start: StateKey | None
    state: StateKey
    base: int  # step of the full of its segment (informational, like a delta's ``base``)

    @property
    def folder(self) -> str:
        if self.kind is Kind.FULL:
            return merged_dir(self.id, self.step)
        return merged_dir(self.id, self.step, layer=self.layer, first_step=self.first_step)

    def describe(self) -> str:
        if self.kind is Kind.FULL:
            return f"full of step {self.step}"
        return f"L{self.layer} merge of steps {self.first_step}..{self.step}"


def item_id(kind: Kind, layer: int, inputs: Sequence[str]) -> str:
    """Deterministic id of a merger checkpoint: a hash of what it is made from."""
    return xxhash.xxh3_64_hexdigest(f"deck-merge|{kind.value}|{layer}|{','.join(inputs)}".encode())


@dataclass
class _Seg:
    anchor: StateKey  # the state of the full this delta's positions count from
    pos: int  # deltas since the anchor (0: the anchor itself)
    prev: str | None  # trainer id of the delta at pos - 1 (None when pos <= 1)
    base: int  # step of the anchor


@dataclass
class Plan:
    """Everything the policy wants built (``wanted``) and the subset whose inputs are all
    committed (``ready``, in build order: lower layers first, fulls last)."""

    wanted: list[PlannedItem]
    ready: list[PlannedItem]
    undecided: list[int]  # steps whose full decision waits for merged deltas


def plan(graph: LineageGraph, config: MergeConfig) -> Plan:
    """What the merger should build next, from the committed lineage alone (deterministic).

    Only the ancestry of the newest trainer checkpoint is merged (abandoned timelines are left
    to retention), and nothing is built in a stretch of deltas that already has a newer full.
    """
    s = config.stride
    policy = config.full
    trainer = sorted((n for n in graph.trainer.values() if n.usable), key=lambda n: n.step)
    committed_full: dict[StateKey, LineageNode] = {}
    for st, fulls in graph.fulls_at.items():
        good = [f for f in fulls if f.usable]
        if good:
            committed_full[st] = min(good, key=lambda f: (f.bytes, f.id))

    seg: dict[str, _Seg] = {}
    planned_full: dict[StateKey, PlannedItem] = {}
    full_bytes_at: dict[StateKey, int] = {st: f.bytes for st, f in committed_full.items()}
    by_layer_end: dict[tuple[int, str], str] = {}  # (layer, end trainer id) -> item id
    wanted_merged: dict[str, PlannedItem] = {}
    undecided: set[str] = set()
    nodes_at: dict[str, LineageNode] = {n.id: n for n in trainer}

    def anchor_state(st: StateKey) -> bool:
        return st in committed_full or st in planned_full

    def back(tid: str, hops: int) -> str:
        for _ in range(hops):
            p = seg[tid].prev
            assert p is not None
            tid = p
        return tid

    def item_bytes(iid: str) -> int | None:
        n = graph.nodes.get(iid)
        return n.bytes if n is not None and n.usable else None

    def chain_items(tid: str) -> list[str]:
        """Planned chain (ids, oldest first) from the anchor to trainer node ``tid``: aligned
        blocks read from the end (the base-s digits of the position)."""
        out: list[str] = []
        pos = seg[tid].pos
        while pos > 0:
            layer = 0
            while pos % s ** (layer + 1) == 0 and (layer + 1, tid) in by_layer_end:
                layer += 1
            out.append(tid if layer == 0 else by_layer_end[(layer, tid)])
            step_back = s**layer
            pos -= step_back
            if pos > 0:
                tid = back(tid, step_back)
        return out[::-1]

    for t in trainer:
        if t.kind is Kind.FULL:
            seg[t.id] = _Seg(t.state, 0, None, t.step)
            continue
        if t.start is None:
            continue
        if anchor_state(t.start):
            seg[t.id] = _Seg(t.start, 1, None, t.start[0])
        else:
            p = graph.trainer_at(t.start)
            if p is None or p.id not in seg or p.id in undecided:
                if p is not None and p.id in undecided:
                    undecided.add(t.id)
                continue
            ps = seg[p.id]
            seg[t.id] = _Seg(ps.anchor, ps.pos + 1, p.id, ps.base)
        cur = seg[t.id]
        # Merged deltas ending at t: one per layer whose block size divides the position.
        layer = 1
        while cur.pos % s**layer == 0:
            size = s ** (layer - 1)
            ends = [back(t.id, k * size) for k in range(s)][::-1]
            inputs = tuple(e if layer == 1 else by_layer_end[(layer - 1, e)] for e in ends)
            iid = item_id(Kind.MERGED, layer, inputs)
            if layer == 1:
                first_step, start = nodes_at[ends[0]].step, nodes_at[ends[0]].start
            else:
                below = wanted_merged[inputs[0]]
                first_step, start = below.first_step or 0, below.start
            wanted_merged[iid] = PlannedItem(
                id=iid,
                kind=Kind.MERGED,
                layer=layer,
                inputs=inputs,
                first_step=first_step,
                step=t.step,
                start=start,  # the state the block applies on
                state=t.state,
                base=cur.base,
            )
            by_layer_end[(layer, t.id)] = iid
            layer += 1
        # A new full at t?
        if t.state in committed_full:
            continue
        anchor_bytes = full_bytes_at.get(cur.anchor)
        if anchor_bytes is None:
            continue  # the anchor's own full is still planned: decide once it exists
        chain = chain_items(t.id)
        live: int | None = None
        if policy.needs_sizes:
            sizes = [item_bytes(i) for i in chain]
            if any(b is None for b in sizes):
                if policy.every is None or cur.pos < policy.every:
                    undecided.add(t.id)
                    continue
            else:
                live = sum(b for b in sizes if b is not None)
        if not policy.want_full(cur.pos, live, anchor_bytes):
            continue
        anchor_full = committed_full.get(cur.anchor)
        base_id = anchor_full.id if anchor_full is not None else planned_full[cur.anchor].id
        inputs = (base_id, *chain)
        fid = item_id(Kind.FULL, 0, inputs)
        planned_full[t.state] = PlannedItem(
            id=fid,
            kind=Kind.FULL,
            layer=0,
            inputs=inputs,
            first_step=None,
            step=t.step,
            start=None,
            state=t.state,
            base=t.step,
        )
        full_bytes_at[t.state] = anchor_bytes

    # Only merge along the ancestry of the newest trainer checkpoint, and only the part of it
    # after its newest committed full ("closed": an older stretch needs no merging any more).
    latest = max(trainer, key=lambda n: (n.epoch, n.step), default=None)
    ancestry: set[str] = set()
    closed: set[str] = set()
    node = latest
    seen_full = False
    while node is not None and node.id in seg:
        ancestry.add(node.id)
        seen_full = seen_full or node.state in committed_full
        if seen_full:
            closed.add(node.id)
        node = graph.trainer_at(node.start) if node.start is not None else None

    # An item whose consumer (the next layer's block containing it, or one above) is committed
    # is not needed any more, even if retention deleted it. After a rollback an item can have
    # a consumer on each timeline (retained old timelines keep theirs): any committed one counts.
    consumers: dict[str, list[str]] = {}
    for it in wanted_merged.values():
        for i in it.inputs:
            consumers.setdefault(i, []).append(it.id)

    def consumed(iid: str) -> bool:
        return any(c in graph.nodes or consumed(c) for c in consumers.get(iid, ()))

    open_fulls = sorted(
        (
            it
            for it in planned_full.values()
            if it.state[1] in ancestry and it.state[1] not in closed
        ),
        key=lambda it: it.step,
    )
    # A merger that fell behind has several fulls planned in a row, each made from the one
    # before. Building them in order reads and writes a full per planned full; only the newest
    # is worth building: it is made straight from the newest committed full and the chain across
    # the skipped anchors, and the older ones (and the merged deltas of their stretches) are
    # superseded. Every step in between stays restorable from the trainer's own deltas.
    newest_full: PlannedItem | None = None
    if len(open_fulls) >= 2:
        newest_full = _across_skipped(open_fulls[-1], planned_full, wanted_merged, graph)
        open_fulls = [newest_full]

    wanted: list[PlannedItem] = []
    for it in wanted_merged.values():
        end_tid = it.state[1]
        superseded = newest_full is not None and it.step <= newest_full.step
        live = end_tid in ancestry and end_tid not in closed and not superseded
        if live and not consumed(it.id):
            wanted.append(it)
    wanted.extend(open_fulls)
    todo = [it for it in wanted if it.id not in graph.nodes]
    ready = [it for it in todo if all(_committed(graph, i) for i in it.inputs)]
    ready.sort(key=lambda it: (it.kind is Kind.FULL, it.layer, it.step, it.id))
    return Plan(
        wanted=wanted,
        ready=ready,
        undecided=sorted(nodes_at[i].step for i in undecided if i in nodes_at),
    )


def _across_skipped(
    newest: PlannedItem,
    planned_full: dict[StateKey, PlannedItem],
    wanted_merged: dict[str, PlannedItem],
    graph: LineageGraph,
) -> PlannedItem:
    """``newest`` (a planned full) re-planned on the newest committed full: its planned base
    fulls are replaced by their own inputs, and every merged delta in the chain that is not
    committed by the items it would be made from (down to the trainer's deltas, which are).

    Depends only on the committed lineage (which merged deltas exist), so every worker derives
    the same inputs, and the id is the hash of them like any other item's.
    """
    planned_by_id = {it.id: it for it in planned_full.values()}

    def expand(iid: str) -> list[str]:
        below = wanted_merged.get(iid)
        if below is None or _committed(graph, iid):
            return [iid]
        return [x for i in below.inputs for x in expand(i)]

    def full_inputs(f: PlannedItem) -> list[str]:
        base, *chain = f.inputs
        head = full_inputs(planned_by_id[base]) if base in planned_by_id else [base]
        return head + [x for c in chain for x in expand(c)]

    inputs = tuple(full_inputs(newest))
    return PlannedItem(
        id=item_id(Kind.FULL, 0, inputs),
        kind=Kind.FULL,
        layer=0,
        inputs=inputs,
        first_step=None,
        step=newest.step,
        start=None,
        state=newest.state,
        base=newest.base,
    )


def _committed(graph: LineageGraph, iid: str) -> bool:
    n = graph.nodes.get(iid)
    return n is not None and n.usable


# ---- building one item -------------------------------------------------------------------------


@dataclass(frozen=True)
class Partition:
    """One rank's table shard of a merged checkpoint: the unit of work of a worker."""

    rank: int
    index: int  # position of the shard in the rank's part manifest
    key: str  # stable name: rank, table, row and column offset

    def owner(self, num_workers: int) -> int:
        """The worker index that builds this partition (stable hash, no coordinator)."""
        return xxhash.xxh3_64_intdigest(self.key.encode()) % num_workers


def _layout(rec: ShardRecord) -> tuple[object, ...]:
    return (
        rec.table,
        rec.num_rows,
        rec.num_cols,
        rec.row_offset,
        rec.rows,
        rec.col_offset,
        rec.cols,
        rec.states,
    )


class _InputDamaged(Exception):
    """An input checkpoint's file failed verification (the input may need quarantine)."""

    def __init__(self, m: CheckpointManifest, error: DeckError):
        super().__init__(str(error))
        self.manifest = m
        self.error = error


class _ShardStream:
    """The rows of one shard of one input, in ascending global id, one chunk in memory."""

    def __init__(self, storage: Storage, m: CheckpointManifest, rec: ShardRecord, order: int):
        self.storage = storage
        self.m = m
        self.rec = rec
        self.order = order
        self.i = 0
        self.pos = 0
        self.last = -1
        self.ids = torch.empty(0, dtype=torch.int64)
        self.arrays: dict[str, torch.Tensor] = {}
        self.bytes_read = 0
        self.done = False
        self._load()

    def _load(self) -> None:
        while self.i < len(self.rec.chunks):
            c = self.rec.chunks[self.i]
            self.i += 1
            where = f"{chunk_where(self.storage, self.m.folder, c)} (table {self.rec.table})"
            try:
                # One chunk at a time (a ranged read of a bundled one): every input stream holds
                # a single chunk in memory, whatever the bundle size.
                _c, _at, data = next(read_chunks(self.storage, self.m.folder, [c]))
                arrays = decode_chunk(data, c, where)
            except NotFoundError as e:
                raise _InputDamaged(self.m, CorruptCheckpointError(f"{where}: missing")) from e
            except CorruptCheckpointError as e:
                raise _InputDamaged(self.m, e) from e
            self.bytes_read += len(data)
            ids = arrays["ids"]
            if ids.numel() == 0:
                continue
            if (
                int(ids[0]) <= self.last
                or (ids.numel() > 1 and not bool(torch.all(ids[1:] > ids[:-1])))
                or int(ids[0]) < self.rec.row_offset
                or int(ids[-1]) >= self.rec.row_offset + self.rec.rows
            ):
                raise _InputDamaged(
                    self.m,
                    CorruptCheckpointError(
                        f"{where}: row ids are not ascending within the shard's range"
                    ),
                )
            missing = [n for n in self.rec.states if n not in arrays]
            if missing:
                raise _InputDamaged(
                    self.m, CorruptCheckpointError(f"{where}: no segment(s) {missing}")
                )
            self.ids, self.arrays, self.pos = ids, arrays, 0
            self.last = int(ids[-1])
            return
        self.done = True
        self.ids, self.arrays = torch.empty(0, dtype=torch.int64), {}

    @property
    def chunk_last(self) -> int:
        return int(self.ids[-1])

    def take_upto(self, cutoff: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Rows with id <= ``cutoff`` from the current chunk (moving on when it is used up)."""
        rest = self.ids[self.pos :]
        n = int(torch.searchsorted(rest, torch.tensor([cutoff]), right=True)[0])
        lo, hi = self.pos, self.pos + n
        out = (self.ids[lo:hi], {k: self.arrays[k][lo:hi] for k in self.rec.states})
        self.pos = hi
        if self.pos >= self.ids.numel():
            self._load()
        return out


_thread_buffers = threading.local()


def _chunk_buffer(size: int) -> memoryview:
    """This thread's page-aligned chunk buffer of at least ``size`` bytes, reused by every output
    shard: fresh pages cost a fault each (as much as the write itself on the project's VMs), and
    aligned chunks are written with O_DIRECT to local storage."""
    buf: memoryview | None = getattr(_thread_buffers, "buf", None)
    if buf is None or len(buf) < size:
        buf = _thread_buffers.buf = aligned_buffer(size)
    return buf


class _ChunkOut:
    """Cuts merged rows into chunks like the trainer's writer and writes them."""

    def __init__(
        self,
        storage: Storage,
        folder: str,
        rel_dir: str,
        rec: ShardRecord,
        row_bytes: int,
        chunk_bytes: int,
    ):
        self.storage = storage
        self.folder = folder
        self.rel_dir = rel_dir
        self.rec = rec
        overhead = ChunkLayout.overhead(1 + len(rec.states))
        self.per_chunk = max(1, (chunk_bytes - overhead) // max(1, row_bytes))
        self.pending: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
        self.pending_rows = 0
        self.chunks: list[ChunkRecord] = []
        self.rows = 0
        self.bytes_written = 0
        self._buf = _chunk_buffer(chunk_bytes)

    def add(self, ids: torch.Tensor, states: dict[str, torch.Tensor]) -> None:
        if ids.numel() == 0:
            return
        self.pending.append((ids, states))
        self.pending_rows += int(ids.numel())
        while self.pending_rows >= self.per_chunk:
            self._flush(self.per_chunk)

    def close(self) -> None:
        if self.pending_rows:
            self._flush(self.pending_rows)

    def _flush(self, n: int) -> None:
        if len(self.pending) == 1:  # the common case: no copy before encoding
            ids, states = self.pending[0]
        else:
            ids = torch.cat([p[0] for p in self.pending])
            states = {k: torch.cat([p[1][k] for p in self.pending]) for k in self.rec.states}
        rel = (
            f"{self.rel_dir}/c{self.rec.col_offset}-r{self.rec.row_offset}-{len(self.chunks):06d}"
            ".chunk"
        )
        arrays = [("ids", ids[:n]), *((k, states[k][:n]) for k in self.rec.states)]
        buf, chunk = encode_chunk(rel, arrays, out=self._buf)
        chunk = chunk.model_copy(update={"index": build_index(ids[:n])})
        self.storage.put(f"{self.folder}/{rel}", buf)
        failpoint("merger.chunk.after_put")
        self.chunks.append(chunk)
        self.rows += n
        self.bytes_written += len(buf)
        rest = self.pending_rows - n
        self.pending = [(ids[n:], {k: v[n:] for k, v in states.items()})] if rest else []
        self.pending_rows = rest


def merge_rows(
    streams: Sequence[_ShardStream], out: Callable[[torch.Tensor, dict[str, torch.Tensor]], None]
) -> None:
    """Merge ascending row streams (oldest first) newest-wins, emitting ascending rows.

    Each round takes, from every stream, the rows up to the smallest "last id of the current
    chunk" among them, so at least one chunk is used up per round and memory stays at one chunk
    per stream plus one round's output. When the oldest stream holds every row of the shard (the
    full of a new full), newer rows are scattered over a copy of its rows instead of sorted.
    """
    active = [st for st in streams if not st.done]
    dense_first = bool(streams) and streams[0].rec.full
    while active:
        cutoff = min(st.chunk_last for st in active)
        pieces = [(st, *st.take_upto(cutoff)) for st in active]
        pieces = [p for p in pieces if p[1].numel()]
        if len(pieces) == 1:
            _, ids, states = pieces[0]
            out(ids, states)
        elif pieces and dense_first and pieces[0][0] is streams[0]:
            _, ids, states = pieces[0]
            merged = {k: v.clone() for k, v in states.items()}
            for _, newer_ids, newer in pieces[1:]:
                # Every id in (previous cutoff, cutoff] is in the full's piece: find its slot.
                pos = torch.searchsorted(ids, newer_ids)
                if pos.numel() and (
                    int(pos[-1]) >= ids.numel() or not bool(torch.equal(ids[pos], newer_ids))
                ):
                    raise CorruptCheckpointError(
                        f"{streams[0].storage.describe(streams[0].m.folder)}: table "
                        f"{streams[0].rec.table} is marked full but misses rows of a newer input"
                    )
                for k, v in merged.items():
                    v.index_copy_(0, pos, newer[k])
            out(ids, merged)
        elif pieces:
            ids = torch.cat([p[1] for p in pieces])
            # Stable sort keeps equal ids in stream order (oldest first): the last of each run
            # of equal ids is the newest version of that row.
            sorted_ids, order = torch.sort(ids, stable=True)
            keep = torch.ones_like(sorted_ids, dtype=torch.bool)
            keep[:-1] = sorted_ids[1:] != sorted_ids[:-1]
            idx = order[keep]
            names = list(pieces[0][2])
            out(
                ids.index_select(0, idx),
                {k: torch.cat([p[2][k] for p in pieces]).index_select(0, idx) for k in names},
            )
        active = [st for st in active if not st.done]


def _row_bytes(rec: ShardRecord) -> int:
    """Bytes one row of this shard takes on disk (id + every state), from its chunk layout."""
    for c in rec.chunks:
        if c.rows:
            return 8 + sum(seg.nbytes // c.rows for seg in c.segments if seg.name != "ids")
    return 0


@dataclass
class WorkStats:
    """What a worker did (summed over a run)."""

    items_committed: int = 0
    partitions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    committed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)

    def add(self, other: WorkStats) -> None:
        self.items_committed += other.items_committed
        self.partitions += other.partitions
        self.bytes_read += other.bytes_read
        self.bytes_written += other.bytes_written
        self.seconds += other.seconds
        self.committed += other.committed
        self.failed.update(other.failed)


class ItemBuilder:
    """Builds one planned item: this worker's partitions, then the commit if all are done."""

    def __init__(
        self,
        storage: Storage,
        item: PlannedItem,
        inputs: list[CheckpointManifest],
        config: MergeConfig,
    ):
        self.storage = storage
        self.item = item
        self.inputs = inputs
        self.config = config
        self.folder = item.folder
        self.parts: list[list[RankManifest]] = []
        for m in inputs:
            try:
                self.parts.append(read_rank_manifests(storage, m))
            except CorruptCheckpointError as e:
                raise _InputDamaged(m, e) from e
        ws = {m.world_size for m in inputs}
        if len(ws) != 1:
            raise MergeError(f"{item.describe()}: inputs have world sizes {sorted(ws)}")
        self.world_size = ws.pop()
        self.partitions: list[Partition] = []
        for r in range(self.world_size):
            layouts = [[_layout(rec) for rec in p[r].shards] for p in self.parts]
            if any(lay != layouts[-1] for lay in layouts):
                raise MergeError(
                    f"{item.describe()}: rank {r}'s table shards differ between the inputs "
                    "(resharded); this stretch is not merged"
                )
            for i, rec in enumerate(self.parts[-1][r].shards):
                key = f"{r:05d}-{table_dir(rec.table)}-c{rec.col_offset}-r{rec.row_offset}"
                self.partitions.append(Partition(r, i, key))

    def part_path(self, p: Partition) -> str:
        return f"{self.folder}/{PARTS_DIR}/{p.key}.json"

    def mine(self) -> list[Partition]:
        return [
            p
            for p in self.partitions
            if p.owner(self.config.num_workers) == self.config.worker_index
        ]

    def committed(self) -> bool:
        return self.storage.exists(f"{self.folder}/{MANIFEST}")

    def build_partition(self, p: Partition, stats: WorkStats) -> None:
        """Merge one partition and write its partition record (skipped if already there)."""
        if self.storage.exists(self.part_path(p)):
            return
        recs = [parts[p.rank].shards[p.index] for parts in self.parts]
        # Rows of an input that saved the whole shard (a full, or a shard saved in full every
        # time) replace everything older: start from the newest such input.
        first = max((i for i, r in enumerate(recs) if r.full), default=0)
        if self.item.kind is Kind.FULL and not recs[first].full:
            raise MergeError(
                f"{self.item.describe()}: the first input does not hold every row of "
                f"{recs[0].table} (rank {p.rank})"
            )
        attempt = secrets.token_hex(8)
        rec = recs[-1]
        row_bytes = max((_row_bytes(r) for r in recs), default=0)
        out = _ChunkOut(
            self.storage,
            self.folder,
            f"{attempt}/{rank_dir(p.rank)}/{table_dir(rec.table)}",
            rec,
            row_bytes,
            self.config.chunk_bytes,
        )
        streams = [
            _ShardStream(self.storage, self.inputs[i], recs[i], i) for i in range(first, len(recs))
        ]
        failpoint("merger.partition.before_read")
        merge_rows(streams, out.add)
        failpoint("merger.partition.after_read")
        out.close()
        failpoint("merger.partition.after_chunks")
        full = any(r.full for r in recs[first:])
        if full and out.rows != rec.rows:
            raise _InputDamaged(
                self.inputs[first],
                CorruptCheckpointError(
                    f"{self.storage.describe(self.inputs[first].folder)}: table {rec.table} "
                    f"(rank {p.rank}) should hold all {rec.rows} rows, has {out.rows}"
                ),
            )
        shard = rec.model_copy(update={"full": full, "chunks": tuple(out.chunks)})
        record = MergePartRecord(
            format_version=FORMAT_VERSION, item_id=self.item.id, rank=p.rank, shard=shard
        )
        self.storage.put(self.part_path(p), dump_model(record))
        failpoint("merger.partition.after_record")
        stats.partitions += 1
        stats.bytes_read += sum(st.bytes_read for st in streams)
        stats.bytes_written += out.bytes_written

    def missing_parts(self) -> list[Partition]:
        have = set(self.storage.list(f"{self.folder}/{PARTS_DIR}/"))
        return [p for p in self.partitions if self.part_path(p) not in have]

    def try_commit(self, stats: WorkStats) -> bool:
        """Write the rank manifests and the commit record if every partition is done.

        Returns whether the item is committed (by this call or earlier)."""
        if self.committed():
            return True
        if self.missing_parts():
            return False
        records: dict[tuple[int, int], ShardRecord] = {}
        for p in self.partitions:
            path = self.part_path(p)
            try:
                rec = load_model(
                    MergePartRecord, self.storage.get(path), self.storage.describe(path)
                )
            except NotFoundError:
                return False
            except CorruptCheckpointError as e:
                logger.warning("%s; deleting it so the partition is merged again", e)
                self.storage.delete(path)
                return False
            expected = self.parts[-1][p.rank].shards[p.index]
            if (
                rec.item_id != self.item.id
                or rec.rank != p.rank
                or _layout(rec.shard) != _layout(expected)
            ):
                logger.warning("%s does not match its item; merging it again", path)
                self.storage.delete(path)
                return False
            # A record may outlive its chunks (GC of an earlier build of this id): check they
            # are all there before committing a record that names them.
            for c in rec.shard.chunks:
                try:
                    ok = self.storage.size(f"{self.folder}/{c.path}") == c.nbytes
                except NotFoundError:
                    ok = False
                if not ok:
                    logger.warning("%s names a missing chunk %s; merging it again", path, c.path)
                    self.storage.delete(path)
                    return False
            records[(p.rank, p.index)] = rec.shard
        failpoint("merger.commit.before_rank_manifests")
        asm = secrets.token_hex(8)
        refs = []
        for r in range(self.world_size):
            last = self.parts[-1][r]
            src = self.inputs[-1]
            dense = self._copy(src, last.dense, f"{asm}/{rank_dir(r)}/{DENSE_FILE}", stats)
            extra = self._copy(src, last.extra, f"{asm}/{rank_dir(r)}/{EXTRA_FILE}", stats)
            assert extra is not None
            shards = tuple(records[(r, i)] for i in range(len(last.shards)))
            part = RankManifest(
                format_version=FORMAT_VERSION,
                step=self.item.step,
                ckpt_id=self.item.id,
                rank=r,
                world_size=self.world_size,
                shards=shards,
                dense=dense,
                extra=extra,
            )
            data = dump_model(part)
            rel = f"{asm}/{rank_manifest_name(r)}"
            self.storage.put(f"{self.folder}/{rel}", data)
            files = [c.nbytes for s in shards for c in s.chunks] + [extra.nbytes]
            if dense is not None:
                files.append(dense.nbytes)
            refs.append(
                RankRef(
                    rank=r,
                    path=rel,
                    nbytes=len(data),
                    checksum=checksum(data),
                    data_bytes=sum(files),
                )
            )
        it = self.item
        manifest = CheckpointManifest(
            format_version=FORMAT_VERSION,
            id=it.id,
            step=it.step,
            kind=it.kind,
            parent=it.start[0] if it.start else None,
            parent_id=it.start[1] if it.start else None,
            base=it.base,
            epoch=self.inputs[-1].epoch,
            world_size=self.world_size,
            ranks=tuple(refs),
            created_unix=time.time(),
            deck_version=__version__,
            first_step=it.first_step if it.kind is Kind.MERGED else None,
            layer=it.layer,
            inputs=it.inputs,
            state_id=it.state[1],
        )
        if self.committed():  # another worker was faster: its record stands
            return True
        failpoint("merger.commit.before_manifest")
        self.storage.put(f"{self.folder}/{MANIFEST}", dump_model(manifest))
        failpoint("merger.commit.after_manifest")
        stats.items_committed += 1
        stats.committed.append(it.id)
        logger.info(
            "deck merge: committed %s (%s, %.1f MiB)",
            it.describe(),
            self.folder,
            manifest.data_bytes / 2**20,
        )
        return True

    def _copy(
        self, src: CheckpointManifest, rec: FileRecord | None, rel: str, stats: WorkStats
    ) -> FileRecord | None:
        """Copy a dense / extra file of the newest input (verified) into this item's folder."""
        if rec is None:
            return None
        key = f"{src.folder}/{rec.path}"
        try:
            data = self.storage.get(key)
        except NotFoundError as e:
            raise _InputDamaged(
                src, CorruptCheckpointError(f"{self.storage.describe(key)}: missing")
            ) from e
        if len(data) != rec.nbytes or checksum(data) != rec.checksum:
            raise _InputDamaged(
                src,
                CorruptCheckpointError(f"{self.storage.describe(key)}: size or checksum mismatch"),
            )
        self.storage.put(f"{self.folder}/{rel}", data)
        stats.bytes_read += len(data)
        stats.bytes_written += len(data)
        return FileRecord(path=rel, nbytes=rec.nbytes, checksum=rec.checksum)


def _still_committed(storage: Storage, m: CheckpointManifest) -> bool:
    """Whether ``m`` is still the committed record of its folder (GC deletes the record first,
    so a missing file of a still-committed checkpoint is damage, not a deletion in progress)."""
    try:
        data = storage.get(f"{m.folder}/{MANIFEST}")
    except NotFoundError:
        return False
    try:
        return load_model(CheckpointManifest, data, storage.describe(m.folder)).id == m.id
    except CorruptCheckpointError:
        return False


# ---- the worker --------------------------------------------------------------------------------


@dataclass
class PassResult:
    """One pass of a worker over the plan."""

    stats: WorkStats
    ready: int  # items whose inputs were committed
    waiting: int  # of those, items whose missing partitions belong to other workers
    wanted: int  # items the policy wants that are not committed
    progressed: bool  # this worker wrote something, or the lineage changed during the pass
    fingerprint: str  # changes whenever any worker commits or finishes a partition


ProgressFn = Callable[[str, WorkStats], None]


class MergeWorker:
    """One merger worker (one process) on one URI.

    ``run_pass`` does everything currently possible for this worker; ``run_once`` repeats
    passes until nothing is left (waiting for other workers' partitions up to ``wait_s``);
    ``follow`` keeps doing passes until ``stop`` is set. Every operation is idempotent; a
    worker killed at any moment is restarted by running it again.
    """

    def __init__(
        self,
        storage: Storage,
        config: MergeConfig | None = None,
        *,
        after_pass: Callable[[ManifestSet], None] | None = None,
        progress: ProgressFn | None = None,
    ):
        self.storage = storage
        self.config = config or MergeConfig()
        self.after_pass = after_pass
        self.progress = progress
        self.failures: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}
        self.max_failures = 3

    def run_pass(self) -> PassResult:
        t0 = time.perf_counter()
        manifests = read_manifests(self.storage)
        graph = build_graph(manifests)
        p = plan(graph, self.config)
        # What every worker can see of everyone's progress: committed checkpoints and the
        # finished partitions of the items that can be built now. A worker waiting for others
        # watches it change.
        parts = [k for it in p.ready for k in self.storage.list(f"{it.folder}/{PARTS_DIR}/")]
        fingerprint = xxhash.xxh3_64_hexdigest("|".join([*sorted(graph.nodes), *parts]).encode())
        stats = WorkStats()
        waiting = 0
        progressed = False
        for item in p.ready:
            if time.monotonic() < self._retry_at.get(item.id, 0.0):
                continue  # failed repeatedly: back off (it may be a lasting storage problem)
            try:
                inputs = [graph.nodes[i].manifest for i in item.inputs]
                b = ItemBuilder(self.storage, item, inputs, self.config)
                if b.committed():
                    # Committed by another worker since this pass listed the store: the plan is
                    # stale (items built on it may be ready now), so this pass counts as progress.
                    progressed = progressed or item.id not in graph.nodes
                    continue
                for part in b.mine():
                    before = stats.partitions
                    b.build_partition(part, stats)
                    if stats.partitions != before:
                        progressed = True
                        if self.progress:
                            self.progress("partition", stats)
                if b.try_commit(stats):
                    progressed = progressed or item.id in stats.committed
                    if item.id in stats.committed and self.progress:
                        self.progress("commit", stats)
                else:
                    waiting += 1
            except _InputDamaged as e:
                self._fail(item, str(e), stats)
                if _still_committed(self.storage, e.manifest):
                    quarantine(self.storage, e.manifest, f"found by the merger: {e.error}")
                    progressed = True
            except (MergeError, CorruptCheckpointError) as e:
                self._fail(item, str(e), stats)
            except StorageError as e:
                # Transient or not, nothing was committed: try again next pass.
                self._fail(item, f"storage error: {e}", stats)
        if self.after_pass is not None:
            self.after_pass(read_manifests(self.storage) if progressed else manifests)
        stats.seconds = time.perf_counter() - t0
        return PassResult(
            stats=stats,
            ready=len(p.ready),
            waiting=waiting,
            wanted=sum(1 for it in p.wanted if it.id not in graph.nodes),
            progressed=progressed,
            fingerprint=fingerprint,
        )

    def _fail(self, item: PlannedItem, why: str, stats: WorkStats) -> None:
        n = self.failures[item.id] = self.failures.get(item.id, 0) + 1
        stats.failed[item.id] = why
        if n >= self.max_failures:
            # Retried at once a few times (a transient error), then with a growing pause.
            self._retry_at[item.id] = time.monotonic() + min(3600.0, 60.0 * 2 ** (n - 3))
        logger.warning("deck merge: %s failed (attempt %d): %s", item.describe(), n, why)

    def run_once(self, wait_s: float = 60.0, poll_s: float = 0.2) -> tuple[WorkStats, int]:
        """Catch up: passes until every checkpoint the policy wants is committed, or nothing
        changes (no commit, no finished partition, by any worker) for ``wait_s`` seconds --
        other workers may still be building what the next items need. A single worker
        (``num_workers == 1``) stops as soon as a pass does nothing. Returns the summed stats
        and the number of wanted items left uncommitted."""
        total = WorkStats()
        last_change = time.monotonic()
        seen = ""
        while True:
            r = self.run_pass()
            total.add(r.stats)
            if r.progressed:
                last_change, seen = time.monotonic(), r.fingerprint
                continue
            if r.wanted == 0:
                return total, 0
            if r.fingerprint != seen:
                last_change, seen = time.monotonic(), r.fingerprint
            if self.config.num_workers == 1 or time.monotonic() - last_change >= wait_s:
                if self.config.num_workers > 1:
                    logger.warning(
                        "deck merge: %d checkpoint(s) still wait for inputs or partitions of "
                        "other workers after %.0f s without progress; run the other workers "
                        "(--worker-index 0..%d)",
                        r.wanted,
                        wait_s,
                        self.config.num_workers - 1,
                    )
                elif r.wanted and (r.waiting or self.failures):
                    logger.warning(
                        "deck merge: %d checkpoint(s) could not be built (see the errors above)",
                        r.wanted,
                    )
                return total, r.wanted
            time.sleep(poll_s)

    def follow(self, stop: threading.Event, poll_s: float = 5.0) -> WorkStats:
        """Keep merging as the trainer commits, until ``stop`` is set."""
        total = WorkStats()
        while not stop.is_set():
            r = self.run_pass()
            total.add(r.stats)
            if not r.progressed:
                stop.wait(poll_s)
        return total
