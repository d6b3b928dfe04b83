"""Long lineages of commit records in seconds: a trainer's and merger workers' records without
the data they describe.

What lineage code (the graph, cheapest chains, retention plans, GC) reads of a checkpoint is
its commit record (``manifest.json``); the chunks are only read by restores and verification.
:class:`LineageSim` makes the records the writers make, field for field: a trainer's through
:func:`deck.format.commit.commit_record` with the arguments :func:`deck.trainer.writer.commit`
passes, a merger's with those of :meth:`deck.merge.build.ItemBuilder._manifest` for an item of
the real planner (:func:`deck.merge.plan.plan`, :meth:`LineageSim.merge`) or of its block
layout (:meth:`LineageSim.merge_blocks`: the same aligned blocks and ids without re-planning the
whole lineage at every step, for histories of 100,000 checkpoints). Each rank reference names a
rank manifest by the writer's path, its ``data_bytes`` following a size model (a full's bytes,
deltas a few percent of it, merged deltas less than the sum of their inputs). With ``files``
(:func:`writer_checkpoint`: a delta and a full the real trainer writer wrote) the rank manifests
are those of the checkpoint of the same kind (a full's cover its tables), renamed into each
checkpoint's folder, and :meth:`LineageSim.write` stores
them with the data files they name (hard links of one copy): GC's checks of what it keeps find
them intact. Without, a rank reference names a placeholder (commit records only). The store
also gets the epoch witnesses the trainer leaves (:mod:`deck.format.epochs`: the newest few).

Commit times are the simulator's clock (one tick per commit unless told otherwise), kept per id
in :attr:`LineageSim.committed_at`; :meth:`LineageSim.write` gives each record that file time.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from deck.format.checksum import checksum
from deck.format.commit import commit_record
from deck.format.commit_log import Hint, LogEntry, log_key
from deck.format.epochs import KEEP_WITNESSES, witness_body, witness_key
from deck.format.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    QUARANTINE_ROOT,
    SELF_CHECKSUM,
    CheckpointManifest,
    Kind,
    QuarantineRecord,
    RankRef,
    dump_model,
    rank_manifest_name,
    with_checksum,
)
from deck.merge.plan import PlannedItem, item_id, plan
from deck.merge.policy import MergeConfig
from deck.read.catalog import ManifestSet, read_manifests
from deck.read.indexed import compact
from deck.read.lineage import LineageGraph, build_graph
from deck.storage import Storage

__all__ = ["CheckpointFiles", "LineageSim", "writer_checkpoint"]


@dataclass(frozen=True)
class CheckpointFiles:
    """The files of one checkpoint a real writer wrote, to stand in for a generated one's."""

    attempt: str  # its folder in the step folder (its id): every path its files name starts so
    parts: tuple[bytes, ...]  # its rank manifests, by rank
    data: dict[str, bytes]  # its data files by path (relative to the checkpoint's folder)
    # The files of a full the same writer wrote, for generated fulls: a full's records must
    # cover its tables (verify's table checks, which GC runs on what would replace a
    # checkpoint), which a delta's do not. None: fulls get these files too.
    full: CheckpointFiles | None = None

    def parts_in(self, attempt: str) -> list[bytes]:
        """The rank manifests naming the same files under ``attempt``: what the writer would
        have written there (its id names the folder and the checkpoint), each with its own
        checksum again (:func:`deck.format.manifest.with_checksum` of the canonical body)."""
        out = []
        for p in self.parts:
            cut = p.rfind(b',"' + SELF_CHECKSUM.encode() + b'":"')
            if cut < 0:  # (the placeholder)
                out.append(p)
                continue
            body = p[:cut] + b"}"
            out.append(with_checksum(body.replace(self.attempt.encode(), attempt.encode())))
        return out


# Without files: what a rank reference names (no rank manifest: GC's orphan pass reads it and
# finds it unreadable, which it tolerates; lineage code never reads it).
_NO_FILES = CheckpointFiles("0" * 16, (b'{"placeholder": "rank manifest"}',), {})


def writer_checkpoint(world_size: int = 1, bundle_bytes: int = 1 << 20) -> CheckpointFiles:
    """A delta the real trainer writer wrote (deck.testing.synth's SynthTrainer), with the full
    it was saved after (:attr:`CheckpointFiles.full`), bundled into one data file per rank by
    default (fewer files per generated checkpoint)."""
    from deck.storage import FsspecStorage
    from deck.testing.synth import SynthTrainer

    store = FsspecStorage(f"memory://deck-writer-checkpoint-{os.getpid()}-{id(object())}")
    tr = SynthTrainer(store, world_size=world_size, id_seed=0, bundle_bytes=bundle_bytes)
    full = tr.save("full")
    tr.train()
    delta = tr.save()

    def files_of(m: CheckpointManifest, full: CheckpointFiles | None) -> CheckpointFiles:
        parts = tuple(store.get(f"{m.folder}/{r.path}") for r in m.ranks)
        refs = {f"{m.folder}/{r.path}" for r in m.ranks} | {f"{m.folder}/{MANIFEST}"}
        data = {
            k[len(m.folder) + 1 :]: store.get(k)
            for k in store.list(f"{m.folder}/")
            if k not in refs
        }
        return CheckpointFiles(m.id, parts, data, full)

    return files_of(delta, files_of(full, None))


@dataclass
class _Block:
    """The merger's bookkeeping for one trainer checkpoint (like the planner's ``_Seg``)."""

    anchor: tuple[int, str]
    pos: int
    prev: str | None
    base: int
    items: dict[int, str] = field(default_factory=dict)  # layer -> merged item ending here


class LineageSim:
    """A trainer (saves, rollbacks) and merger workers committing records; see the module
    docstring. Everything is in memory until :meth:`write`."""

    def __init__(
        self,
        *,
        world_size: int = 2,
        seed: int = 0,
        full_bytes: int = 4_000_000,
        delta_fraction: tuple[float, float] = (0.01, 0.04),
        merged_fraction: tuple[float, float] = (0.55, 0.95),
        files: CheckpointFiles | None = None,
        deck_version: str = "test",
        tick: float = 1.0,
    ) -> None:
        self.rng = random.Random(seed)
        self.world_size = world_size
        self.full_bytes = full_bytes
        self.delta_fraction = delta_fraction
        self.merged_fraction = merged_fraction  # of the inputs' bytes (rows overlap)
        self.files = files or _NO_FILES
        if files is not None:
            self.world_size = len(files.parts)
        self.deck_version = deck_version
        self.tick = tick
        self.clock = 0.0
        self.trainer: dict[int, CheckpointManifest] = {}
        self.merged: dict[str, CheckpointManifest] = {}
        self.quarantined: dict[str, str] = {}
        self.committed_at: dict[str, float] = {}
        self.parent: tuple[int, str] | None = None
        self.base: int | None = None
        self.epoch = 0
        self.step = 0
        # merge_blocks' state: per trainer id its block position, and merger commits not due yet
        self._blocks: dict[str, _Block] = {}
        self._items: dict[str, PlannedItem] = {}
        self._full_ids: dict[tuple[int, str], str] = {}  # state -> a full of it (or planned)
        self._due: list[tuple[int, PlannedItem]] = []
        self._by_id: dict[str, CheckpointManifest] = {}
        self._bytes: dict[str, int] = {}
        self._epochs: dict[str, int] = {}
        # Each epoch's first saved step: its witness, as the trainer's committer puts it
        self.first_steps: dict[int, int] = {}
        self._saves = 0
        # write() and write_log(): what went to the store so far, so that a history can go on
        self._written: set[str] = set()
        self._linked = 0  # data files linked (a copy of them every 50,000 links)
        self._copies = ""
        self._logged_ids: set[str] = set()
        self._logged = 0

    # ---- records -------------------------------------------------------------------------
    def _files(self, kind: Kind) -> CheckpointFiles:
        """The files a checkpoint of ``kind`` stands on."""
        return self.files.full if kind is Kind.FULL and self.files.full else self.files

    def _refs(self, attempt: str, nbytes: int, kind: Kind) -> tuple[RankRef, ...]:
        """The rank references of a checkpoint of ``kind`` whose files are under ``attempt``."""
        per_rank = max(1, nbytes // self.world_size)
        parts = self._files(kind).parts_in(attempt)
        return tuple(
            RankRef(
                rank=r,
                path=f"{attempt}/{rank_manifest_name(r)}",
                nbytes=len(parts[r % len(parts)]),
                checksum=checksum(parts[r % len(parts)]),
                data_bytes=per_rank,
            )
            for r in range(self.world_size)
        )

    def _commit(self, m: CheckpointManifest, at: float | None) -> CheckpointManifest:
        if at is None:
            self.clock += self.tick
            at = self.clock
        else:
            self.clock = max(self.clock, at)
        if m.is_merged:
            self.merged[m.id] = m
        else:
            old = self.trainer.get(m.step)
            if old is not None:  # its record is replaced: the old checkpoint is gone
                self.committed_at.pop(old.id, None)
            self.trainer[m.step] = m
        self.committed_at[m.id] = at
        self._by_id[m.id] = m
        self._bytes[m.id] = m.data_bytes
        self._epochs[m.id] = m.epoch
        return m

    # ---- the trainer ---------------------------------------------------------------------
    def train(self, steps: int = 1) -> None:
        self.step += steps

    def save(
        self, kind: str = "delta", *, nbytes: int | None = None, at: float | None = None
    ) -> CheckpointManifest:
        """Commit the trainer checkpoint of the current step (a full when there is no parent);
        ``at``: its commit time (default: the next tick)."""
        full = kind == "full" or self.parent is None
        if nbytes is None:
            lo, hi = self.delta_fraction
            nbytes = self.full_bytes if full else int(self.full_bytes * self.rng.uniform(lo, hi))
        cid = f"{self.rng.getrandbits(64):016x}"
        parent = None if full else self.parent
        m = commit_record(
            list(self._refs(cid, nbytes, Kind.FULL if full else Kind.DELTA)),
            deck_version=self.deck_version,
            id=cid,
            step=self.step,
            kind=Kind.FULL if full else Kind.DELTA,
            parent=parent[0] if parent else None,
            parent_id=parent[1] if parent else None,
            base=self.step if full or self.base is None else self.base,
            epoch=self.epoch,
            world_size=self.world_size,
            encoding=None,
        )
        self._commit(m, at)
        self.first_steps.setdefault(self.epoch, self.step)
        self.parent = (self.step, cid)
        if full:
            self.base = self.step
        self._saves += 1
        return m

    @property
    def saves(self) -> int:
        """The trainer's saves so far."""
        return self._saves

    def rollback(self, step: int) -> None:
        """Continue from saved ``step`` (a restore): a new epoch; re-saving a later step
        replaces that step's record."""
        m = self.trainer[step]
        self.parent = (step, m.id)
        self.base = m.base
        self.epoch += 1
        self.step = step

    def quarantine(self, cid: str, why: str = "damaged (test)") -> None:
        self.quarantined[cid] = why

    # ---- the merger ----------------------------------------------------------------------
    def _merger_record(
        self, it: PlannedItem, nbytes: int, epoch: int, at: float | None
    ) -> CheckpointManifest:
        asm = f"{self.rng.getrandbits(64):016x}"  # the builder's assembly folder
        m = commit_record(  # the merger stamps its own deck version, like build.py
            list(self._refs(asm, nbytes, it.kind)),
            id=it.id,
            step=it.step,
            kind=it.kind,
            parent=it.start[0] if it.start else None,
            parent_id=it.start[1] if it.start else None,
            base=it.base,
            epoch=epoch,
            world_size=self.world_size,
            first_step=it.first_step if it.kind is Kind.MERGED else None,
            layer=it.layer,
            inputs=it.inputs,
            state_id=it.state[1],
        )
        return self._commit(m, at)

    def commit_merger(
        self,
        kind: Kind,
        *,
        start: tuple[int, str] | None,
        state: tuple[int, str],
        nbytes: int,
        first_step: int | None = None,
        layer: int = 0,
        at: float | None = None,
    ) -> CheckpointManifest:
        """Commit a merger record the planner would not plan (tests of the lineage code on any
        shape): a merged delta from ``start`` to ``state``, or a merger full of ``state``."""
        inputs = tuple(f"{self.rng.getrandbits(64):016x}" for _ in range(2))
        it = PlannedItem(
            id=item_id(kind, layer, inputs),
            kind=kind,
            layer=layer if kind is Kind.MERGED else 0,
            inputs=inputs,
            first_step=first_step,
            step=state[0],
            start=start,
            state=state,
            base=start[0] if start is not None else state[0],
        )
        return self._merger_record(it, nbytes, self.epoch, at)

    def _item_bytes(self, it: PlannedItem, sizes: dict[str, int]) -> int:
        if it.kind is Kind.FULL:
            return int(self.full_bytes * self.rng.uniform(0.98, 1.02))
        total = sum(sizes.get(i, self.full_bytes // 50) for i in it.inputs)
        return max(1, int(total * self.rng.uniform(*self.merged_fraction)))

    def merge(
        self, config: MergeConfig, *, max_items: int | None = None, at: float | None = None
    ) -> int:
        """One merger pass over the whole lineage: commit the real planner's ready items (in
        its order), at most ``max_items``; returns how many."""
        graph = self.graph()
        ready = plan(graph, config).ready
        sizes = {n.id: n.bytes for n in graph.nodes.values()}
        done = 0
        for it in ready[:max_items]:
            epoch = max((graph.nodes[i].epoch for i in it.inputs if i in graph.nodes), default=0)
            m = self._merger_record(it, self._item_bytes(it, sizes), epoch, at)
            sizes[m.id] = m.data_bytes
            done += 1
        return done

    def merge_blocks(
        self, last: CheckpointManifest, *, stride: int, full_every: int | None, lag: int = 0
    ) -> None:
        """The merger's block layout at trainer checkpoint ``last`` (call after each save):
        counting the deltas of a timeline from their full (positions 1, 2, ...), every aligned
        block of ``stride**L`` positions gets a merged delta of layer L, and with ``full_every``
        the state at that position a merger full (of the full and the chain of blocks), which
        later deltas count from -- :func:`deck.merge.plan.plan`'s layout for a merger that keeps
        up, without re-planning the whole lineage at every step. Each item is committed
        ``lag`` saves later (merger commits interleave with the trainer's)."""
        self._commit_due()
        b = self._place(last)
        if b is None:
            return
        layer = 1
        while b.pos > 0 and b.pos % stride**layer == 0:
            ends = [last.id]
            for _ in range(stride - 1):
                ends.append(self._before(ends[-1], layer - 1))
            ends.reverse()
            inputs = tuple(e if layer == 1 else self._blocks[e].items[layer - 1] for e in ends)
            if layer == 1:
                first = self._by_id[ends[0]]
                first_step, start = first.step, first.start
            else:
                below = self._items[inputs[0]]
                first_step, start = below.first_step or 0, below.start
            it = PlannedItem(
                id=item_id(Kind.MERGED, layer, inputs),
                kind=Kind.MERGED,
                layer=layer,
                inputs=inputs,
                first_step=first_step,
                step=last.step,
                start=start,
                state=last.state,
                base=b.base,
            )
            b.items[layer] = it.id
            total = sum(self._bytes[i] for i in inputs)
            self._plan_item(it, max(1, int(total * self.rng.uniform(*self.merged_fraction))), lag)
            layer += 1
        if full_every is not None and b.pos >= full_every and b.anchor in self._full_ids:
            inputs = (self._full_ids[b.anchor], *self._chain(last.id, stride))
            it = PlannedItem(
                id=item_id(Kind.FULL, 0, inputs),
                kind=Kind.FULL,
                layer=0,
                inputs=inputs,
                first_step=None,
                step=last.step,
                start=None,
                state=last.state,
                base=last.step,
            )
            self._full_ids[last.state] = it.id
            self._plan_item(it, int(self.full_bytes * self.rng.uniform(0.98, 1.02)), lag)

    def _place(self, t: CheckpointManifest) -> _Block | None:
        """``t``'s block position (like the planner's ``_place``); None: not placed."""
        if t.kind is Kind.FULL:
            self._full_ids[t.state] = t.id
            b = _Block(t.state, 0, None, t.step)
        elif t.start in self._full_ids:
            b = _Block(t.start, 1, None, t.start[0])
        else:
            assert t.start is not None
            p = self._blocks.get(t.start[1])
            if p is None:
                return None
            b = _Block(p.anchor, p.pos + 1, t.start[1], p.base)
        self._blocks[t.id] = b
        return b

    def _before(self, tid: str, layer: int) -> str:
        """The trainer id ``stride**layer`` positions before ``tid``."""
        b = self._blocks[tid]
        if layer == 0:
            assert b.prev is not None
            return b.prev
        start = self._items[b.items[layer]].start
        assert start is not None
        return start[1]

    def _chain(self, tid: str, s: int) -> list[str]:
        """The chain of blocks from the anchor to ``tid`` (the planner's ``_chain``)."""
        out: list[str] = []
        pos = self._blocks[tid].pos
        while pos > 0:
            layer = 0
            while pos % s ** (layer + 1) == 0 and (layer + 1) in self._blocks[tid].items:
                layer += 1
            out.append(tid if layer == 0 else self._blocks[tid].items[layer])
            pos -= s**layer
            if pos > 0:
                tid = self._before(tid, layer)
        return out[::-1]

    def _plan_item(self, it: PlannedItem, nbytes: int, lag: int) -> None:
        self._items[it.id] = it
        self._bytes[it.id] = nbytes
        self._epochs[it.id] = self._epochs[it.inputs[-1]]
        self._due.append((self._saves + lag, it))
        self._commit_due()

    def _commit_due(self) -> None:
        due = [it for when, it in self._due if when <= self._saves]
        self._due = [(when, it) for when, it in self._due if when > self._saves]
        for it in due:
            self._merger_record(it, self._bytes[it.id], self._epochs[it.id], None)

    # ---- views ---------------------------------------------------------------------------
    def manifests(self) -> ManifestSet:
        """The committed records as :func:`deck.read.catalog.read_manifests` returns them."""
        return ManifestSet(dict(self.trainer), dict(self.merged), dict(self.quarantined))

    def graph(self) -> LineageGraph:
        return build_graph(self.manifests())

    def write(
        self,
        storage: Storage,
        *,
        files: bool = True,
        durable: bool = True,
        log_behind: int | None = None,
        only_new: bool = False,
    ) -> None:
        """Store every record (with ``files``: and the rank manifests and data files it names),
        each commit record with its commit time as its file time (a local store). With
        ``log_behind``, also the commit log the writers keep (an entry per commit record, in
        commit order, as :func:`deck.format.commit_log.put_record` writes it) and a catalog
        as a merger pass writes it, ``log_behind`` entries before the end.
        ``durable=False`` writes the same files straight to the folder, without the store's
        fsyncs and renames, the data files as hard links of one copy (beside the store's
        folder): 100,000 checkpoints in a minute. ``only_new``: only the records this simulator
        has not written yet (to the store it wrote before: a history going on)."""
        root = storage.local_path("")
        assert root is not None, "write() sets file times on a local store"
        beside = os.path.join(os.path.dirname(os.path.abspath(root)), ".deck-synth-files")

        def put(key: str, data: bytes, link: str | None = None) -> None:
            if durable:
                storage.put(key, data)
                return
            path = storage.local_path(key)
            assert path is not None
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if link is not None:
                os.link(link, path)
            else:
                with open(path, "wb") as f:
                    f.write(data)

        def copy(n: int) -> str:
            """The n-th copy of the data files (a file system allows some 65,000 links), this
            simulator's own (others writing beside the same folder link theirs)."""
            where = os.path.join(beside, f"{id(self):x}-{n}")
            kinds = (self.files, self.files.full) if self.files.full else (self.files,)
            # (each kind's paths start with its own attempt: one folder holds both)
            for rel, data in ((r, d) for f in kinds for r, d in f.data.items()):
                os.makedirs(os.path.dirname(os.path.join(where, rel)), exist_ok=True)
                with open(os.path.join(where, rel), "wb") as f:
                    f.write(data)
                # (linked into every attempt: as old as the oldest commit, the clock's start)
                os.utime(os.path.join(where, rel), (0.0, 0.0))
            return where

        todo = [*self.trainer.values(), *self.merged.values()]
        if only_new:
            todo = [m for m in todo if m.id not in self._written]
        for m in todo:
            t = self.committed_at[m.id]
            if files:
                attempt = m.ranks[0].path.partition("/")[0]
                own = self._files(m.kind)
                for r, part in zip(m.ranks, own.parts_in(attempt), strict=False):
                    put(f"{m.folder}/{r.path}", part)
                    _set_time(storage, f"{m.folder}/{r.path}", t)
                if not durable and self._linked % 50_000 == 0:
                    self._copies = copy(self._linked // 50_000)
                self._linked += 1
                for rel, data in own.data.items():
                    where = rel.replace(own.attempt, attempt, 1)
                    link = None if durable else os.path.join(self._copies, rel)
                    put(f"{m.folder}/{where}", data, link)
                    if link is None:
                        _set_time(storage, f"{m.folder}/{where}", t)
            # (each file of an attempt is written before its record: no newer than it)
            key = f"{m.folder}/{MANIFEST}"
            put(key, dump_model(m))
            _set_time(storage, key, t)
            self._written.add(m.id)
        by_id = {m.id: m for m in [*self.trainer.values(), *self.merged.values()]}
        for cid, why in self.quarantined.items():
            if cid in by_id:  # (a record replaced since names nothing any more)
                rec = QuarantineRecord(
                    format_version=FORMAT_VERSION,
                    id=cid,
                    folder=by_id[cid].folder,
                    reason=why,
                    created_unix=self.clock,
                )
                storage.put(f"{QUARANTINE_ROOT}/{cid}.json", dump_model(rec))
        # The epoch witnesses the trainer's committer leaves (the newest few)
        epochs = sorted(self.first_steps)
        for epoch in epochs[-KEEP_WITNESSES:]:
            put(witness_key(epoch), witness_body(epoch, self.first_steps[epoch]))
        for epoch in epochs[:-KEEP_WITNESSES]:  # (written by an earlier call: pruned since)
            storage.delete(witness_key(epoch))
        if log_behind is not None:
            self.write_log(storage, log_behind, put)

    def write_log(
        self,
        storage: Storage,
        behind: int,
        put: Callable[[str, bytes], None] | None = None,
        *,
        only_new: bool = False,
    ) -> None:
        """Write the commit log and catalogs ``3 * behind``, ``2 * behind`` and ``behind``
        entries before its end: the last catalog prunes the first and the log up to the second,
        as a job's writers of catalogs leave it (see :meth:`write`); ``put``: how to write a
        file (default: the store's put). ``only_new``: the log goes on with the commits not
        logged yet (a catalog where ``behind`` entries before the end falls among them)."""
        put = put or storage.put
        order = sorted(
            [*self.trainer.values(), *self.merged.values()], key=lambda m: self.committed_at[m.id]
        )
        first = 0
        if only_new:
            first = self._logged
            order = [m for m in order if m.id not in self._logged_ids]
        cut = max(0, first + len(order) - behind)
        for seq, m in enumerate(order, first + 1):
            self._logged_ids.add(m.id)
            self._logged = seq
            hint = Hint(key=f"{m.folder}/{MANIFEST}", op="commit", id=m.id)
            put(
                log_key(seq),
                dump_model(LogEntry(format_version=FORMAT_VERSION, seq=seq, hints=(hint,))),
            )
            if seq in (cut - 2 * behind, cut - behind, cut) and seq > 0:
                index = read_manifests(storage).index
                assert index is not None and index.seq == seq
                compact(storage, index, force=True)


def _set_time(storage: Storage, key: str, t: float) -> None:
    path = storage.local_path(key)
    assert path is not None
    os.utime(path, (t, t))
