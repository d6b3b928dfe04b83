"""Resharding restore: a checkpoint restores into another world size and sharding plan.

The first tests write real checkpoints with the real writer (no TorchRec) and apply them into
other column / row layouts; the slow ones train real 2-rank TorchRec DMP models and restore into
1 rank, 3 ranks, column-wise and table-column-wise plans, and back. Tables are compared unsharded
(every table's weight and states gathered by global row and column), so layouts do not matter.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
import torch
from deck.adapters.base import TableShard

from deck.catalog import chain_for, read_manifests
from deck.errors import IncompatibleModelError
from deck.format import Kind
from deck.restore import apply_chain
from deck.storage import Storage, open_storage
from deck.writer import RankPartWriter, commit

# ---- the rules, on synthetic shards ----------------------------------------------------------

ROWS, COLS = 40, 24
TABLE = "emb.t.weight"


def _shards(
    layout: list[tuple[int, int, int, int]], full: dict[str, torch.Tensor]
) -> list[TableShard]:
    """Shards ``(row_offset, rows, col_offset, cols)`` of the unsharded ``full`` state: weight and
    ``exp_avg`` are per element, ``momentum1`` (rows x column shards, stored per shard as
    ``full["momentum1"][:, k]`` for the k-th shard) per row of a column shard."""
    out = []
    for k, (r0, rows, c0, cols) in enumerate(layout):
        out.append(
            TableShard(
                table=TABLE,
                num_rows=ROWS,
                num_cols=COLS,
                row_offset=r0,
                rows=rows,
                col_offset=c0,
                cols=cols,
                states={
                    "weight": full["weight"][r0 : r0 + rows, c0 : c0 + cols].clone(),
                    "exp_avg": full["exp_avg"][r0 : r0 + rows, c0 : c0 + cols].clone(),
                    "momentum1": full["momentum1"][r0 : r0 + rows, k].clone(),
                },
            )
        )
    return out


def _empty(layout: list[tuple[int, int, int, int]]) -> list[TableShard]:
    nan = {
        "weight": torch.full((ROWS, COLS), float("nan")),
        "exp_avg": torch.full((ROWS, COLS), float("nan")),
        "momentum1": torch.full((ROWS, len(layout)), float("nan")),
    }
    return _shards(layout, nan)


def _write(
    storage: Storage,
    step: int,
    ranks: list[list[TableShard]],
    rows: torch.Tensor | None,
    parent: tuple[int, str] | None,
) -> tuple[int, str]:
    """One checkpoint of ``ranks`` (a list of shards per rank): ``rows`` (global ids) or all."""
    ckpt_id = secrets.token_hex(8)
    for rank, shards in enumerate(ranks):
        w = RankPartWriter(storage, step, ckpt_id, rank, len(ranks), 4096)

        def rows_for(s: TableShard) -> torch.Tensor | None:
            if rows is None:
                return None
            local = rows - s.row_offset
            return local[(local >= 0) & (local < s.rows)]

        w.write_part(shards, rows_for, {"d": torch.zeros(1)} if rank == 0 else None, {})
    commit(
        storage,
        step=step,
        ckpt_id=ckpt_id,
        kind=Kind.FULL if parent is None else Kind.DELTA,
        parent=parent,
        base=0,
        epoch=0,
        world_size=len(ranks),
        deck_version="test",
    )
    return step, ckpt_id


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _check(
    shards: list[TableShard],
    weight: torch.Tensor,
    exp_avg: torch.Tensor,
    momentum: dict[tuple[int, int], torch.Tensor],
) -> None:
    for s in shards:
        rs, cs = (
            slice(s.row_offset, s.row_offset + s.rows),
            slice(s.col_offset, s.col_offset + s.cols),
        )
        assert torch.equal(_bits(s.states["weight"]), _bits(weight[rs, cs])), (
            s.row_offset,
            s.col_offset,
        )
        assert torch.equal(_bits(s.states["exp_avg"]), _bits(exp_avg[rs, cs]))
        want = momentum[(s.col_offset, s.cols)][rs]
        assert torch.equal(_bits(s.states["momentum1"]), _bits(want)), (s.col_offset, s.cols)


def _col_mean(m: torch.Tensor, saved: list[tuple[int, int]], c0: int, cols: int) -> torch.Tensor:
    """The documented join: saved per-row values weighted by the columns each saved shard
    shares with ``[c0, c0 + cols)``, averaged in float64."""
    total = torch.zeros(m.shape[0], dtype=torch.float64)
    weight = 0
    for k, (s0, sn) in enumerate(saved):
        n = min(s0 + sn, c0 + cols) - max(s0, c0)
        if n > 0:
            total += m[:, k].double() * n
            weight += n
    return (total / weight).float()


SAVED_COLS = [(0, 12), (12, 12)]  # column-wise over 2 ranks
TARGETS = {
    # 3 column shards of 8: [8, 16) spans both saved shards; rows split as well
    "cw3-rows": [(0, 25, 0, 8), (25, 15, 0, 8), (0, 40, 8, 8), (0, 40, 16, 8)],
    "table_wise": [(0, 40, 0, 24)],
    "same": [(0, 40, 0, 12), (0, 40, 12, 12)],
}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_columns_move_between_layouts(tmp_path: Path, target: str) -> None:
    """A column-wise full + delta applies into other column / row splits: weights and
    per-element states bitwise, per-row states by the split / join rule."""
    g = torch.Generator().manual_seed(1)
    full = {
        "weight": torch.randn(ROWS, COLS, generator=g),
        "exp_avg": torch.randn(ROWS, COLS, generator=g),
        "momentum1": torch.rand(ROWS, 2, generator=g),
    }
    storage = open_storage(str(tmp_path / "ckpt"))
    layout = [(0, ROWS, c0, n) for c0, n in SAVED_COLS]
    saved = _shards(layout, full)
    parent = _write(storage, 0, [[saved[0]], [saved[1]]], None, None)
    # A delta changes some rows in every column shard (a lookup touches all of a row's shards).
    touched = torch.tensor([1, 7, 24, 25, 39])
    for k, s in enumerate(saved):
        for name, v in s.states.items():
            new = torch.randn(v[touched].shape, generator=g).abs()
            v[touched] = new
            if name == "momentum1":
                full[name][touched, k] = new
            else:
                full[name][touched, s.col_offset : s.col_offset + s.cols] = new
    _write(storage, 1, [[saved[0]], [saved[1]]], touched, parent)

    shards = _empty(TARGETS[target])
    chain = chain_for(read_manifests(storage), 1)
    stats, _ = apply_chain(storage, chain, shards, {TABLE: (ROWS, COLS)})
    assert stats.resharded == (target != "same")
    momentum = {
        (c0, n): _col_mean(full["momentum1"], SAVED_COLS, c0, n)
        for (_, _, c0, n) in TARGETS[target]
    }
    _check(shards, full["weight"], full["exp_avg"], momentum)


def test_split_then_join_is_exact(tmp_path: Path) -> None:
    """Per-row states split into column shards and joined back are bitwise the original: a
    table-wise checkpoint -> 3 column shards -> a checkpoint of those -> table-wise again."""
    g = torch.Generator().manual_seed(2)
    full = {
        "weight": torch.randn(ROWS, COLS, generator=g),
        "exp_avg": torch.randn(ROWS, COLS, generator=g),
        "momentum1": torch.rand(ROWS, 1, generator=g) * 1e-3 + 1e-7,  # awkward mantissas
    }
    tw = open_storage(str(tmp_path / "tw"))
    _write(tw, 0, [_shards([(0, ROWS, 0, COLS)], full)], None, None)
    cw = _empty([(0, ROWS, 0, 8), (0, ROWS, 8, 8), (0, ROWS, 16, 8)])
    apply_chain(tw, chain_for(read_manifests(tw), 0), cw, {TABLE: (ROWS, COLS)})
    for s in cw:
        assert torch.equal(_bits(s.states["momentum1"]), _bits(full["momentum1"][:, 0]))
    again = open_storage(str(tmp_path / "cw"))
    _write(again, 0, [cw[:2], cw[2:]], None, None)
    back = _empty([(0, ROWS, 0, COLS)])
    apply_chain(again, chain_for(read_manifests(again), 0), back, {TABLE: (ROWS, COLS)})
    _check(back, full["weight"], full["exp_avg"], {(0, COLS): full["momentum1"][:, 0]})


def test_states_that_cannot_move_are_refused(tmp_path: Path) -> None:
    """A state that is neither per element nor per row cannot change columns; other optimizer
    states or dtypes do not fit at all: typed errors naming the table / state."""
    g = torch.Generator().manual_seed(3)
    storage = open_storage(str(tmp_path / "odd"))
    shards = [
        TableShard(
            TABLE,
            ROWS,
            COLS,
            0,
            ROWS,
            c0,
            12,
            states={
                "weight": torch.randn(ROWS, 12, generator=g),
                "odd": torch.randn(ROWS, 3, generator=g),
            },
        )
        for c0 in (0, 12)
    ]
    _write(storage, 0, [[shards[0]], [shards[1]]], None, None)
    chain = chain_for(read_manifests(storage), 0)

    def target(c0: int, cols: int, **states: torch.Tensor) -> list[TableShard]:
        return [TableShard(TABLE, ROWS, COLS, 0, ROWS, c0, cols, states=states)]

    # Same columns: the odd state is copied as it is.
    same = target(0, 12, weight=torch.zeros(ROWS, 12), odd=torch.zeros(ROWS, 3))
    apply_chain(storage, chain, same, {TABLE: (ROWS, COLS)})
    assert torch.equal(same[0].states["odd"], shards[0].states["odd"])
    with pytest.raises(IncompatibleModelError, match=r"state odd .*columns \[0, 12\).*\[0, 24\)"):
        apply_chain(
            storage,
            chain,
            target(0, 24, weight=torch.zeros(ROWS, 24), odd=torch.zeros(ROWS, 3)),
            {TABLE: (ROWS, COLS)},
        )
    with pytest.raises(IncompatibleModelError, match=r"emb\.t\.weight.*states"):
        apply_chain(
            storage, chain, target(0, 24, weight=torch.zeros(ROWS, 24)), {TABLE: (ROWS, COLS)}
        )
    with pytest.raises(IncompatibleModelError, match=r"state weight is torch.float32.*float16"):
        apply_chain(
            storage,
            chain,
            target(
                0, 24, weight=torch.zeros(ROWS, 24, dtype=torch.float16), odd=torch.zeros(ROWS, 3)
            ),
            {TABLE: (ROWS, COLS)},
        )
    with pytest.raises(IncompatibleModelError, match=r"table shapes differ.*emb\.t\.weight"):
        apply_chain(
            storage,
            chain,
            target(0, 25, weight=torch.zeros(ROWS, 25), odd=torch.zeros(ROWS, 3)),
            {TABLE: (ROWS, 25)},
        )
