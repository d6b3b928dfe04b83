"""The active window of a retention plan: the trainer steps from the latest one back along its
timeline to the newest state with a usable full. A plan keeps them all (restores of any of them
are what a job restarting or rolling back a little asks for), and so does every moment of GC's
grace period, replayed from the records committed now.

Shared by the plan (:mod:`deck.ops.retention.plan`) and its incremental replay over the grace
period (:mod:`deck.ops.retention.grace`), which index the lineage alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from deck.format.manifest import Kind
from deck.read.lineage import LineageNode, StateKey

__all__ = ["Lineage", "active_window"]


class Lineage(Protocol):
    """What the walk reads of a lineage (a :class:`deck.read.lineage.LineageGraph`, or the
    grace period's replay of one as it was at a moment)."""

    @property
    def nodes(self) -> Mapping[str, LineageNode]: ...
    @property
    def fulls_at(self) -> Mapping[StateKey, Sequence[LineageNode]]: ...
    @property
    def ending_at(self) -> Mapping[StateKey, Sequence[LineageNode]]: ...

    def trainer_at(self, state: StateKey) -> LineageNode | None: ...
    def merged_from(self, cid: str) -> Sequence[LineageNode]: ...


def active_window(
    lineage: Lineage, latest: LineageNode
) -> tuple[list[LineageNode], StateKey | None]:
    """The trainer checkpoints of the active window, newest first, and the state with a usable
    full it ends at (None when the walk found none).

    Each step goes back along parent links. Where the trainer record of the state before is
    gone -- a newer timeline saved that step again (a rollback), or GC deleted it for a merged
    delta -- the walk goes on through a usable merged delta that merged it, and the steps of the
    trainer checkpoints that delta merged that are still committed are in the window: GC's
    replay of a moment before a rollback sees the older timeline without the records the
    rollback replaced, and must still keep what the plan of that moment kept (a restore started
    then may be reading it)."""
    window: list[LineageNode] = []
    node: LineageNode | None = latest
    while node is not None:
        window.append(node)
        if node.kind is Kind.FULL or any(f.usable for f in lineage.fulls_at.get(node.state, ())):
            break
        if node.start is None:
            node = None
            break
        prev = lineage.trainer_at(node.start)
        if prev is None and (merged := _merged_over(lineage, node.start[1])) is not None:
            assert merged.start is not None
            seen = {n.id for n in window}
            window += [n for n in _merged_trainer(lineage, merged) if n.id not in seen]
            prev = lineage.trainer_at(merged.start)
        node = prev
    return window, node.state if node is not None else None


def _merged_over(lineage: Lineage, cid: str) -> LineageNode | None:
    """Of the usable merged deltas that merged ``cid`` (through merged deltas they merged) and
    start at a state with a trainer record, the one starting last (ties: by id); None if none."""
    found: dict[str, LineageNode] = {}
    todo = [cid]
    while todo:
        for m in lineage.merged_from(todo.pop()):
            if m.id not in found:
                found[m.id] = m
                todo.append(m.id)
    usable = [
        m
        for m in found.values()
        if m.usable and m.start is not None and lineage.trainer_at(m.start) is not None
    ]
    return max(usable, key=lambda m: (m.start, m.id), default=None)


def _merged_trainer(lineage: Lineage, merged: LineageNode) -> list[LineageNode]:
    """The trainer checkpoints ``merged`` merged (through the merged deltas it merged) whose
    records are committed, newest first."""
    out: dict[str, LineageNode] = {}
    todo = list(merged.inputs)
    seen: set[str] = set()  # (records naming each other as inputs, forged or damaged: it ends)
    while todo:
        cid = todo.pop()
        n = lineage.nodes.get(cid)
        if n is None or cid in seen:
            continue
        seen.add(cid)
        if n.merged:
            todo += n.inputs
        elif lineage.trainer_at(n.state) is not None:
            out[n.id] = n
    return sorted(out.values(), key=lambda n: n.step, reverse=True)
