"""What the merger should build next: a pure function of the committed lineage.

:func:`plan` walks the usable trainer checkpoints in step order. Counting the deltas of a
timeline from their full (positions 1, 2, ...), every aligned block of ``s**L`` positions gets a
merged delta of layer ``L`` (:class:`PlannedItem`, id: :func:`item_id`, a hash of its inputs),
and each state is asked whether it gets a new full (:class:`deck.merge.policy.FullPolicy`). Of
that, only the ancestry of the newest trainer checkpoint after its newest committed full is
wanted, and of several fulls planned in a row only the newest (:func:`_across_skipped`).

Every worker derives the same plan from the same store, so workers agree without talking, and a
rerun after a crash finds the same work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from deck.format.manifest import Kind, merged_dir
from deck.merge.policy import MergeConfig
from deck.read.lineage import LineageGraph, LineageNode, StateKey


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


def _full_item(inputs: tuple[str, ...], step: int, state: StateKey, base: int) -> PlannedItem:
    """A planned merger full of ``state`` made from ``inputs`` (a full, then a chain)."""
    return PlannedItem(
        id=item_id(Kind.FULL, 0, inputs),
        kind=Kind.FULL,
        layer=0,
        inputs=inputs,
        first_step=None,
        step=step,
        start=None,
        state=state,
        base=base,
    )


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
    planner = _Planner(graph, config)
    planner.walk()
    return planner.select()


def _committed_fulls(graph: LineageGraph) -> dict[StateKey, LineageNode]:
    """The full each state is restored from: the smallest usable one (ties: lowest id)."""
    out: dict[StateKey, LineageNode] = {}
    for st, fulls in graph.fulls_at.items():
        good = [f for f in fulls if f.usable]
        if good:
            out[st] = min(good, key=lambda f: (f.bytes, f.id))
    return out


class _Planner:
    """The state of one :func:`plan`: :meth:`walk` places every usable trainer checkpoint in its
    segment and plans the merged deltas and fulls ending at it (step order); :meth:`select` keeps
    what is wanted and orders what is ready."""

    def __init__(self, graph: LineageGraph, config: MergeConfig):
        self.graph = graph
        self.s = config.stride
        self.policy = config.full
        self.trainer = sorted((n for n in graph.trainer.values() if n.usable), key=lambda n: n.step)
        self.nodes_at: dict[str, LineageNode] = {n.id: n for n in self.trainer}
        self.committed_full = _committed_fulls(graph)
        self.full_bytes_at: dict[StateKey, int] = {
            st: f.bytes for st, f in self.committed_full.items()
        }
        self.seg: dict[str, _Seg] = {}
        self.planned_full: dict[StateKey, PlannedItem] = {}
        self.by_layer_end: dict[tuple[int, str], str] = {}  # (layer, end trainer id) -> item id
        self.wanted_merged: dict[str, PlannedItem] = {}
        self.undecided: set[str] = set()

    # ---- the walk over the trainer's checkpoints ----

    def walk(self) -> None:
        for t in self.trainer:
            if self._place(t):
                self._plan_merges(t)
                self._decide_full(t)

    def _place(self, t: LineageNode) -> bool:
        """Give ``t`` its segment (anchor, position); whether merges and a full are planned at
        it (not for a trainer full, nor a delta whose predecessor is missing or undecided)."""
        if t.kind is Kind.FULL:
            self.seg[t.id] = _Seg(t.state, 0, None, t.step)
            return False
        if t.start is None:
            return False
        if t.start in self.committed_full or t.start in self.planned_full:
            self.seg[t.id] = _Seg(t.start, 1, None, t.start[0])
            return True
        p = self.graph.trainer_at(t.start)
        if p is None or p.id not in self.seg or p.id in self.undecided:
            if p is not None and p.id in self.undecided:
                self.undecided.add(t.id)
            return False
        ps = self.seg[p.id]
        self.seg[t.id] = _Seg(ps.anchor, ps.pos + 1, p.id, ps.base)
        return True

    def _before(self, tid: str, layer: int) -> str:
        """The trainer id ``s**layer`` positions before ``tid``, whose block of that layer is
        planned: one jump (the state the block starts from), not one hop per delta, which made
        every chain cost its position and a long stretch quadratic."""
        if layer == 0:
            p = self.seg[tid].prev
        else:
            start = self.wanted_merged[self.by_layer_end[(layer, tid)]].start
            p = start[1] if start is not None else None
        assert p is not None
        return p

    def _plan_merges(self, t: LineageNode) -> None:
        """Merged deltas ending at ``t``: one per layer whose block size divides the position."""
        s = self.s
        cur = self.seg[t.id]
        layer = 1
        while cur.pos % s**layer == 0:
            ends = [t.id]
            for _ in range(s - 1):
                ends.append(self._before(ends[-1], layer - 1))
            ends.reverse()
            inputs = tuple(e if layer == 1 else self.by_layer_end[(layer - 1, e)] for e in ends)
            iid = item_id(Kind.MERGED, layer, inputs)
            if layer == 1:
                first_step, start = self.nodes_at[ends[0]].step, self.nodes_at[ends[0]].start
            else:
                below = self.wanted_merged[inputs[0]]
                first_step, start = below.first_step or 0, below.start
            self.wanted_merged[iid] = PlannedItem(
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
            self.by_layer_end[(layer, t.id)] = iid
            layer += 1

    def _chain(self, tid: str) -> list[str]:
        """Planned chain (ids, oldest first) from the anchor to trainer node ``tid``: aligned
        blocks read from the end (the base-s digits of the position)."""
        s = self.s
        out: list[str] = []
        pos = self.seg[tid].pos
        while pos > 0:
            layer = 0
            while pos % s ** (layer + 1) == 0 and (layer + 1, tid) in self.by_layer_end:
                layer += 1
            out.append(tid if layer == 0 else self.by_layer_end[(layer, tid)])
            pos -= s**layer
            if pos > 0:
                tid = self._before(tid, layer)
        return out[::-1]

    def _live_bytes(self, chain: list[str]) -> int | None:
        """Bytes of ``chain``, or None while a merged delta in it is not committed."""
        sizes = []
        for iid in chain:
            n = self.graph.nodes.get(iid)
            if n is None or not n.usable:
                return None
            sizes.append(n.bytes)
        return sum(sizes)

    def _decide_full(self, t: LineageNode) -> None:
        """Plan a new full at ``t`` if the policy wants one (or mark ``t`` undecided while the
        sizes a size rule needs are not committed yet)."""
        if t.state in self.committed_full:
            return
        cur = self.seg[t.id]
        anchor_bytes = self.full_bytes_at.get(cur.anchor)
        if anchor_bytes is None:
            return  # the anchor's own full is still planned: decide once it exists
        chain = self._chain(t.id)
        live = self._live_bytes(chain) if self.policy.needs_sizes else None
        every = self.policy.every
        if self.policy.needs_sizes and live is None and (every is None or cur.pos < every):
            self.undecided.add(t.id)
            return
        if not self.policy.want_full(cur.pos, live, anchor_bytes):
            return
        anchor_full = self.committed_full.get(cur.anchor)
        base_id = anchor_full.id if anchor_full is not None else self.planned_full[cur.anchor].id
        self.planned_full[t.state] = _full_item((base_id, *chain), t.step, t.state, t.step)
        self.full_bytes_at[t.state] = anchor_bytes

    # ---- what of it is wanted ----

    def _open_stretch(self) -> tuple[set[str], set[str]]:
        """(ancestry, closed): the trainer ids on the newest trainer checkpoint's ancestry, and
        those of them at or before its newest committed full (no merging needed any more).

        The walk goes on through the checkpoints left unplaced behind an undecided one: the
        merged deltas that decision waits for lie before them. Stopping there wanted nothing
        once the trainer was a block past the merger, and a size rule then waited forever."""
        latest = max(self.trainer, key=lambda n: (n.epoch, n.step), default=None)
        ancestry: set[str] = set()
        closed: set[str] = set()
        node = latest
        seen_full = False
        while node is not None and (node.id in self.seg or node.id in self.undecided):
            ancestry.add(node.id)
            seen_full = seen_full or node.state in self.committed_full
            if seen_full:
                closed.add(node.id)
            node = self.graph.trainer_at(node.start) if node.start is not None else None
        return ancestry, closed

    def _consumers(self) -> dict[str, list[str]]:
        """The planned merged deltas made from each id."""
        consumers: dict[str, list[str]] = {}
        for it in self.wanted_merged.values():
            for i in it.inputs:
                consumers.setdefault(i, []).append(it.id)
        return consumers

    def _consumed(self, iid: str, consumers: dict[str, list[str]]) -> bool:
        """Whether a consumer of ``iid`` (the next layer's block containing it, or one above) is
        committed: then ``iid`` is not needed any more, even if retention deleted it. After a
        rollback an item can have a consumer on each timeline (retained old timelines keep
        theirs): any committed one counts."""
        # A walk up the layers with a stack, not recursion: the number of layers above ``iid``
        # grows with history.
        todo = list(consumers.get(iid, ()))
        seen = set(todo)
        while todo:
            c = todo.pop()
            if c in self.graph.nodes:
                return True
            for above in consumers.get(c, ()):
                if above not in seen:
                    seen.add(above)
                    todo.append(above)
        return False

    def select(self) -> Plan:
        ancestry, closed = self._open_stretch()
        consumers = self._consumers()
        open_fulls = sorted(
            (
                it
                for it in self.planned_full.values()
                if it.state[1] in ancestry and it.state[1] not in closed
            ),
            key=lambda it: it.step,
        )
        # A merger that fell behind has several fulls planned in a row, each made from the one
        # before. Building them in order reads and writes a full per planned full; only the
        # newest is worth building: it is made straight from the newest committed full and the
        # chain across the skipped anchors, and the older ones (and the merged deltas of their
        # stretches) are superseded. Every step in between stays restorable from the trainer's
        # own deltas.
        newest_full: PlannedItem | None = None
        if len(open_fulls) >= 2:
            newest_full = _across_skipped(
                open_fulls[-1], self.planned_full, self.wanted_merged, self.graph
            )
            open_fulls = [newest_full]

        wanted: list[PlannedItem] = []
        for it in self.wanted_merged.values():
            end_tid = it.state[1]
            superseded = newest_full is not None and it.step <= newest_full.step
            live = end_tid in ancestry and end_tid not in closed and not superseded
            if live and not self._consumed(it.id, consumers):
                wanted.append(it)
        wanted.extend(open_fulls)
        return self._plan_of(wanted)

    def _plan_of(self, wanted: list[PlannedItem]) -> Plan:
        todo = [it for it in wanted if it.id not in self.graph.nodes]
        ready = [it for it in todo if all(_committed(self.graph, i) for i in it.inputs)]
        ready.sort(key=lambda it: (it.kind is Kind.FULL, it.layer, it.step, it.id))
        return Plan(
            wanted=wanted,
            ready=ready,
            undecided=sorted(self.nodes_at[i].step for i in self.undecided if i in self.nodes_at),
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
        # Depth-first, oldest input first, with a stack: the same order as expanding each input
        # in turn, without a Python frame per layer.
        out: list[str] = []
        todo = [iid]
        while todo:
            x = todo.pop()
            below = wanted_merged.get(x)
            if below is None or _committed(graph, x):
                out.append(x)
            else:
                todo.extend(reversed(below.inputs))
        return out

    # The planned fulls ``newest`` stands on, newest first, down to the one whose base is
    # committed. A loop, not recursion: a merger far behind (or a small full that every delta
    # outgrows) has one planned full per delta, thousands in a row.
    fulls = [newest]
    while fulls[-1].inputs[0] in planned_by_id:
        fulls.append(planned_by_id[fulls[-1].inputs[0]])
    inputs = [fulls[-1].inputs[0]]
    for f in reversed(fulls):
        for c in f.inputs[1:]:
            inputs.extend(expand(c))
    return _full_item(tuple(inputs), newest.step, newest.state, newest.base)


def _committed(graph: LineageGraph, iid: str) -> bool:
    n = graph.nodes.get(iid)
    return n is not None and n.usable
