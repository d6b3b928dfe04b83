"""A long-running job: one full, then a trainer writing deltas forever, and ``deck merge --once``
with the default policy catching up on all of it.

The checkpoints are the real writer's (:class:`deck.trainer.writer.RankPartWriter` and
:func:`deck.trainer.writer.commit`) of one tiny table in an in-memory store, so ten thousand of
them take seconds and every record is what a trainer commits. With a table this small every
delta outgrows a tenth of the full, so the default live-fraction rule plans a merger full at
every delta: the merger's planning and merging walk ten thousand planned fulls in a row (which
recursed once per full and failed from about a thousand on).
"""

from __future__ import annotations

import inspect
import os
import random
import sys

import pytest
import torch

from deck import cli
from deck.format.manifest import Kind
from deck.merge.policy import MergeConfig
from deck.merge.stream import Rows, ShardStream, merge_rows
from deck.merge.worker import MergeWorker
from deck.model import TableShard
from deck.read.catalog import read_manifests, read_rank_manifests
from deck.read.lineage import build_graph, cheapest_chain
from deck.read.restore import apply_chain
from deck.storage import Storage
from deck.testing.lineage_checks import mem
from deck.trainer.writer import RankPartWriter, commit

TABLE = "t.weight"


def _shard(rows: int, fill: float | None = None) -> TableShard:
    weight = torch.full((rows, 2), fill) if fill is not None else torch.arange(rows * 2.0)
    return TableShard(
        table=TABLE,
        num_rows=rows,
        num_cols=2,
        row_offset=0,
        rows=rows,
        col_offset=0,
        cols=2,
        states={"weight": weight.reshape(rows, 2)},
    )


def _write(storage: Storage, rows: int, deltas: int) -> tuple[list[str], torch.Tensor]:
    """A full, then ``deltas`` deltas one step apart, each changing one row. Returns the ids in
    step order and the table as the last step saved it."""
    shard = _shard(rows)
    ids = random.Random(0)
    saved: list[str] = []
    parent: tuple[int, str] | None = None
    for step in range(deltas + 1):
        ckpt_id = f"{ids.getrandbits(64):016x}"
        writer = RankPartWriter(storage, step, ckpt_id, 0, 1, 4 * 1024 * 1024)
        changed = None if parent is None else torch.tensor([step * 7 % rows])
        if changed is not None:
            shard.states["weight"][changed] = float(step)

        def rows_of(_s: TableShard, changed: torch.Tensor | None = changed) -> torch.Tensor | None:
            return changed

        writer.write_part([shard], rows_of, None, {"step": step})
        commit(
            storage,
            step=step,
            ckpt_id=ckpt_id,
            kind=Kind.FULL if parent is None else Kind.DELTA,
            parent=parent,
            base=0,
            epoch=0,
            world_size=1,
            deck_version="test",
        )
        parent = (step, ckpt_id)
        saved.append(ckpt_id)
    return saved, shard.states["weight"].clone()


def _restored(storage: Storage, rows: int, step: int) -> tuple[list[str], torch.Tensor]:
    """The cheapest chain of ``step`` (folders) and the table it restores."""
    chain = cheapest_chain(build_graph(read_manifests(storage)), step)
    target = _shard(rows, fill=float("nan"))
    apply_chain(storage, chain, [target], {TABLE: (rows, 2)})
    return [m.folder for m in chain], target.states["weight"]


# 10,000 deltas is the size the merger must handle; that run takes ~10 minutes of CPU here
# (`make long` runs it: DECK_LONG_DELTAS=10000). CI runs 1,500 under a recursion limit a
# walk recursing once per planned full overruns (it failed from ~990 deltas at the default
# limit), so the same fault is found in a tenth of the time.
DELTAS = int(os.environ.get("DECK_LONG_DELTAS", "1500"))


@pytest.mark.timeout(3600)
def test_merge_once_catches_up_on_a_long_history() -> None:
    """`deck merge --once` (the default policy) over one full and N deltas (1,500 in CI, 10,000
    with `make long`): one pass plans N fulls in a row and builds only the newest, from the
    full and every delta in order; the latest step then restores from it, bitwise, and the next
    pass finds nothing to do."""
    storage = mem()
    deltas = DELTAS
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(min(limit, len(inspect.stack(0)) + deltas // 2))
    try:
        _merge_once_catches_up(storage, deltas)
    finally:
        sys.setrecursionlimit(limit)


def _merge_once_catches_up(storage: Storage, deltas: int) -> None:
    ids, last = _write(storage, 64, deltas)

    assert cli.main(["merge", storage.uri, "--once"]) == 0

    graph = build_graph(read_manifests(storage))
    merged = [n for n in graph.nodes.values() if n.merged]
    assert [(n.kind, n.step) for n in merged] == [(Kind.FULL, deltas)]
    # The inputs of the planned fulls it stands on, unrolled oldest first: what the recursive
    # walk gave (and so the same item id)
    assert merged[0].inputs == tuple(ids)
    chain = cheapest_chain(graph, deltas)
    assert [(m.is_merged, m.kind, m.step) for m in chain] == [
        (True, Kind.FULL, deltas),
        (False, Kind.DELTA, deltas),
    ]
    folders, table = _restored(storage, 64, deltas)
    assert folders == [m.folder for m in chain]
    assert torch.equal(table, last)

    again = MergeWorker(storage, MergeConfig()).run_pass()
    assert (again.wanted, again.progressed, again.stats.failed) == (0, False, {})


def test_a_size_rule_merges_a_backlog_more_than_a_block_long() -> None:
    """A full far larger than a delta: the default live-fraction rule decides a step only once
    the merged deltas of its chain are committed. A merger that starts when the trainer is more
    than a block (stride deltas) past it must still build them (it wanted nothing and waited
    forever), and the latest step then restores through them."""
    storage = mem()
    rows, deltas = 65_536, 40
    _, last = _write(storage, rows, deltas)
    assert build_graph(read_manifests(storage)).nodes  # the backlog is there before the merger

    assert cli.main(["merge", storage.uri, "--once"]) == 0

    graph = build_graph(read_manifests(storage))
    merged = sorted((n.layer, n.step) for n in graph.nodes.values() if n.merged)
    assert (1, 4) in merged and (2, 16) in merged and (2, 32) in merged  # merged deltas...
    assert all(n.kind is Kind.MERGED for n in graph.nodes.values() if n.merged)  # ...no full
    chain = cheapest_chain(graph, deltas)
    assert [(m.kind, m.layer, m.step) for m in chain] == [
        (Kind.FULL, 0, 0),
        (Kind.MERGED, 2, 16),
        (Kind.MERGED, 2, 32),
        (Kind.MERGED, 1, 36),
        (Kind.MERGED, 1, 40),
        (Kind.DELTA, 0, 40),
    ]
    _, table = _restored(storage, rows, deltas)
    assert torch.equal(table, last)


class _CountedStream(ShardStream):
    """A real input stream that counts how often the merge takes rows from it."""

    visits = 0

    def take_upto(self, cutoff: int) -> Rows:
        _CountedStream.visits += 1
        return super().take_upto(cutoff)


def test_merging_many_inputs_visits_each_only_for_its_rows() -> None:
    """A merger full across many skipped fulls has an input per delta. Each round of the merge
    takes the rows up to one chunk's last id; it visits only the inputs holding such rows (all
    of them every round was quadratic: 2,000 one-row deltas, 2 million visits)."""
    storage = mem()
    rows, deltas = 4096, 2000
    _write(storage, rows, deltas)
    manifests = sorted(read_manifests(storage).values(), key=lambda m: m.step)[1:]
    streams = [
        _CountedStream(storage, m, read_rank_manifests(storage, m)[0].shards[0], i)
        for i, m in enumerate(manifests)
    ]
    got: list[torch.Tensor] = []
    _CountedStream.visits = 0
    merge_rows(streams, lambda ids, states: got.append(ids))
    assert _CountedStream.visits == deltas  # one row each: one visit each
    assert torch.equal(
        torch.cat(got), torch.tensor(sorted(s * 7 % rows for s in range(1, deltas + 1)))
    )
