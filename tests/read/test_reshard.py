"""Resharding restore: a checkpoint restores into another world size and sharding plan.

The first tests write real checkpoints with the real writer (no TorchRec) and apply them into
other column / row layouts; the slow ones train real 2-rank TorchRec DMP models and restore into
1 rank, 3 ranks, column-wise and table-column-wise plans, and back. Tables are compared unsharded
(every table's weight and states gathered by global row and column), so layouts do not matter.
"""

from __future__ import annotations

import logging
import secrets
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from deck.adapters.torchrec_optim import algorithm_class
from safetensors.torch import load_file, save_file

import deck
from deck.demo import ModelSpec, TrainState, build_model, capture_state, diff_states, train_step
from deck.errors import IncompatibleModelError
from deck.format.manifest import Kind
from deck.format.statefile import scalar_key
from deck.model import TableShard, optimizer_record
from deck.read.catalog import read_manifests
from deck.read.lineage import chain_for
from deck.read.restore import apply_chain, read_state_file
from deck.storage import Storage, open_storage
from deck.testing.dist_harness import run_ranks
from deck.trainer.fitting import put_scalars, rank_part, shard_scalars
from deck.trainer.writer import RankPartWriter, commit

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

        # Per-shard scalars as the checkpointer saves them (deck.format.statefile.scalar_key).
        scalars = {
            scalar_key(s.table, s.row_offset, s.col_offset): dict(s.scalars)
            for s in shards
            if s.scalars
        }
        w.write_part(
            shards, rows_for, {"d": torch.zeros(1)} if rank == 0 else None, {"scalars": scalars}
        )
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
def test_columns_move_between_layouts(
    tmp_path: Path, target: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A column-wise full + delta applies into other column / row splits: weights and
    per-element states bitwise, per-row states by the split / join rule. A join of differing
    values (an approximation) is logged, naming the state (a break-it finding: it was not)."""
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
    with caplog.at_level(logging.WARNING, logger="deck.read.restore"):
        stats, _ = apply_chain(storage, chain, shards, {TABLE: (ROWS, COLS)})
    assert stats.resharded == (target != "same")
    joined = [r.getMessage() for r in caplog.records if "joined per-row" in r.getMessage()]
    if target == "same":
        assert not joined
    else:  # every row's two saved values differ (random): one line for the chain
        assert len(joined) == 1 and f"{TABLE} momentum1 (40 rows)" in joined[0], joined
    momentum = {
        (c0, n): _col_mean(full["momentum1"], SAVED_COLS, c0, n)
        for (_, _, c0, n) in TARGETS[target]
    }
    _check(shards, full["weight"], full["exp_avg"], momentum)


def test_the_rows_said_approximated_are_those_of_the_state_restored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A break-it finding: the warning counted the rows of the one checkpoint with the most,
    not of the state restored (half of them after a full and two deltas). A row stays
    approximated until a later checkpoint writes it whole; rows whose saved values agree never
    are."""
    g = torch.Generator().manual_seed(4)
    full = {
        "weight": torch.randn(ROWS, COLS, generator=g),
        "exp_avg": torch.randn(ROWS, COLS, generator=g),
        # both column shards hold the same value per row (as after a split): exact to join
        "momentum1": torch.rand(ROWS, 1, generator=g).expand(ROWS, 2).clone(),
    }
    storage = open_storage(str(tmp_path / "ckpt"))
    saved = _shards([(0, ROWS, c0, n) for c0, n in SAVED_COLS], full)
    parent = _write(storage, 0, [[saved[0]], [saved[1]]], None, None)
    for step, rows in ((1, [1, 7, 24]), (2, [7, 25, 39])):
        touched = torch.tensor(rows)
        for s in saved:  # each column shard's own value: they differ
            s.states["momentum1"][touched] = torch.rand(len(rows), generator=g)
        parent = _write(storage, step, [[saved[0]], [saved[1]]], touched, parent)
    # a delta written table-wise (one shard of every column) holds rows 1 and 25 whole
    whole = _shards([(0, ROWS, 0, COLS)], full)
    _write(storage, 3, [whole], torch.tensor([1, 25]), parent)

    for step, want in ((0, None), (2, 5), (3, 3)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="deck.read.restore"):
            stats, _ = apply_chain(
                storage,
                chain_for(read_manifests(storage), step),
                _empty(TARGETS["table_wise"]),
                {TABLE: (ROWS, COLS)},
            )
        joined = [r.getMessage() for r in caplog.records if "joined per-row" in r.getMessage()]
        if want is None:
            assert not joined and not stats.approximated, joined
        else:
            assert stats.approximated == {f"{TABLE} momentum1": want}, (step, stats.approximated)
            assert len(joined) == 1 and f"{TABLE} momentum1 ({want} rows)" in joined[0], joined


def test_split_then_join_is_exact(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
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
    with caplog.at_level(logging.WARNING, logger="deck.read.restore"):
        apply_chain(again, chain_for(read_manifests(again), 0), back, {TABLE: (ROWS, COLS)})
    assert not [r for r in caplog.records if "joined per-row" in r.getMessage()]  # (exact)
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
    # A later step's refusal names the store and the step asked for, not only its full's
    # (a break-it finding: "checkpoint step 0 has states ..." for a restore of step 1)
    _write(storage, 1, [[shards[0]], [shards[1]]], torch.tensor([3]), (0, chain[0].id))
    with pytest.raises(
        IncompatibleModelError,
        match=rf"step 0 at {storage.uri} \(the full step 1 is restored from\) has states",
    ):
        apply_chain(
            storage,
            chain_for(read_manifests(storage), 1),
            target(0, 24, weight=torch.zeros(ROWS, 24)),
            {TABLE: (ROWS, COLS)},
        )
    # (found before anything is written: the saved records say each state's dtype)
    with pytest.raises(IncompatibleModelError, match=r"state weight as float32 .*float16"):
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


def test_scalars_and_extra_state_of_other_layouts(tmp_path: Path) -> None:
    """Per-shard scalars come from the saved shard of the table that overlaps the live one; a
    rank the writer did not have reads rank 0's extra state."""
    storage = open_storage(str(tmp_path / "ckpt"))
    saved = [
        TableShard(
            TABLE,
            ROWS,
            COLS,
            0,
            ROWS,
            c0,
            12,
            states={"weight": torch.zeros(ROWS, 12)},
            scalars={"iter": torch.tensor([7.0 + c0])},
        )
        for c0 in (0, 12)
    ]
    _write(storage, 0, [[saved[0]], [saved[1]]], None, None)
    m = read_manifests(storage)[0]
    _, parts = apply_chain(
        storage, [m], _empty_weights([(0, ROWS, 0, 8), (0, ROWS, 16, 8)]), {TABLE: (ROWS, COLS)}
    )
    assert rank_part(parts, 1) is parts[1] and rank_part(parts, 2) is parts[0]
    live = [
        TableShard(TABLE, ROWS, COLS, 0, ROWS, c0, 8, states={}, scalars={"iter": torch.zeros(1)})
        for c0 in (0, 16)
    ]
    own = read_state_file(storage, 0, rank_part(parts, 2).extra)
    got = shard_scalars(storage, 0, parts, own, live)
    assert [float(got[id(s)]["iter"]) for s in live] == [7.0, 19.0]
    other = TableShard(
        "emb.other.weight", ROWS, COLS, 0, ROWS, 0, 8, states={}, scalars={"iter": torch.zeros(1)}
    )
    with pytest.raises(IncompatibleModelError, match=r"emb\.other\.weight.*\['iter'\]"):
        shard_scalars(storage, 0, parts, own, [other])


def test_scalars_of_two_saved_kernels_into_one(caplog: pytest.LogCaptureFixture) -> None:
    """A break-it reading: tables saved in two fbgemm TBEs restored into one (another plan)
    bring two saved values of its one scalar (COUNTER's ``max_counter``); the last one written
    won, whichever it was. The largest is kept (a counter's bound over both tables' rows) and
    said; equal values are put back without a word."""
    one = torch.zeros(1)  # the kernel's scalar, shared by its tables' shards
    a, b = (
        TableShard(t, ROWS, COLS, 0, ROWS, 0, COLS, states={}, scalars={"max_counter": one})
        for t in ("t.a", "t.b")
    )
    with caplog.at_level(logging.WARNING, logger="deck.trainer.fitting"):
        put_scalars(
            [a, b],
            {
                id(a): {"max_counter": torch.tensor([9.0])},
                id(b): {"max_counter": torch.tensor([4.0])},
            },
            "step 3",
        )
        assert float(one) == 9.0
        put_scalars(
            [b, a],
            {
                id(a): {"max_counter": torch.tensor([2.0])},
                id(b): {"max_counter": torch.tensor([2.0])},
            },
            "step 4",
        )
    assert float(one) == 2.0
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "['t.a', 't.b']" in said[0] and "[4.0, 9.0]" in said[0], said


def _empty_weights(layout: list[tuple[int, int, int, int]]) -> list[TableShard]:
    return [
        TableShard(
            TABLE, ROWS, COLS, r0, rows, c0, cols, states={"weight": torch.zeros(rows, cols)}
        )
        for r0, rows, c0, cols in layout
    ]


# ---- real TorchRec DMP models over gloo ranks ------------------------------------------------
# Each rank dumps what it holds, read with TorchRec's own APIs (not deck's adapter): every local
# piece of every table's weight and fused optimizer states with its global offsets, and its dense
# / optimizer / user state. The test process assembles the pieces into unsharded tables.

# Table t1 is data_parallel: replicated dense state, which every rank must find in any world size.
SMALL = dict(num_tables=3, rows=300, dim=16, batch=32, pooling=2, data_parallel_tables=(1,))
TW = ModelSpec(**SMALL, sharding="table_wise")
STEP = 20


def _dump(model: Any, dense_opt: Any, user: TrainState | None, path: str) -> None:
    """Write this rank's pieces to ``path``: ``<table>|<state>|<row>|<col>|<cols>`` for tables
    (per-row states of a column shard carry its column range), ``dense|<key>`` for the rest."""
    out: dict[str, torch.Tensor] = {}
    sd = model.state_dict()
    fused = model.fused_optimizer.state_dict()["state"]
    for key, w in sd.items():
        if not hasattr(w, "local_shards"):
            continue
        num_rows = int(w.size(0))
        # Column shards in column order: the k-th holds the k-th block of a per-row state.
        cols = sorted(
            {(int(m.shard_offsets[1]), int(m.shard_sizes[1])) for m in w.metadata().shards_metadata}
        )
        for s in w.local_shards():
            r0, c0 = (int(x) for x in s.metadata.shard_offsets)
            out[f"{key}|weight|{r0}|{c0}|{s.tensor.shape[1]}"] = s.tensor.detach().clone()
        for name, st in fused.get(key, {}).items():
            state = name.split(".", 1)[1]
            for s in st.local_shards():
                offs = [int(x) for x in s.metadata.shard_offsets]
                if s.tensor.dim() == 2:
                    out[f"{key}|{state}|{offs[0]}|{offs[1]}|{s.tensor.shape[1]}"] = s.tensor.clone()
                else:
                    c0, n = cols[offs[0] // num_rows]
                    out[f"{key}|{state}|{offs[0] % num_rows}|{c0}|{n}"] = s.tensor.clone()
    for k, v in capture_state(model, dense_opt, user).items():
        if "@" not in k and not k.startswith("fused."):  # sharded pieces are above
            out[f"dense|{k}"] = v.contiguous()
    save_file(out, path)


def _pieces(paths: list[Path]) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Unsharded ``<table>|<state>`` tensors (per-row states widened to one value per column)
    from every rank's dump, and each rank's dense state."""
    tables: dict[str, torch.Tensor] = {}
    dense = []
    for p in paths:
        d = load_file(str(p))
        dense.append({k.split("|", 1)[1]: v for k, v in d.items() if k.startswith("dense|")})
        for k, v in d.items():
            if k.startswith("dense|"):
                continue
            table, state, r0, c0, n = k.split("|")
            r, c, cols = int(r0), int(c0), int(n)
            full = tables.setdefault(
                f"{table}|{state}", torch.full((TW.rows, TW.dim), float("nan"))
            )
            full[r : r + v.shape[0], c : c + cols] = (
                v if v.dim() == 2 else v[:, None].expand(-1, cols)
            )
    for k, t in tables.items():
        assert not t.isnan().any(), f"{k}: some rows / columns were in no rank's dump"
    return tables, dense


def _write_chain(rank: int, world_size: int, spec: ModelSpec, uri: str, out: str) -> None:
    """Train 2 ranks with a full at 0 and deltas every 5 steps to STEP; dump the state at STEP."""
    model, dense_opt = build_model(spec)
    user = TrainState()
    config = deck.DeckConfig(
        uri=uri, delta_every_steps=5, staging=deck.StagingConfig(chunk_bytes=16384)
    )
    with deck.enable(model, [dense_opt], config, state=user) as ck:
        for step in range(STEP + 1):
            if step:
                user.step, user.losses = (
                    step,
                    [*user.losses, train_step(model, dense_opt, spec, step)],
                )
            ck.step(step)
        assert [h.kind for h in ck.history] == ["full"] + ["delta"] * (STEP // 5)
    _dump(model, dense_opt, user, f"{out}/r{rank}.safetensors")


def _restore_dump(rank: int, spec: ModelSpec, uri: str, step: int, out: str, seed: int) -> None:
    model, dense_opt = build_model(spec, seed=seed)
    user = TrainState()
    with deck.enable(model, [dense_opt], deck.DeckConfig(uri=uri), state=user) as ck:
        assert ck.restore(step) == step
    _dump(model, dense_opt, user, f"{out}/r{rank}.safetensors")


@pytest.fixture(scope="module")
def tw_chain(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A table-wise checkpoint chain written by 2 ranks, and the live state dumped at STEP."""
    root = tmp_path_factory.mktemp("tw")
    (root / "live").mkdir()
    run_ranks(_write_chain, TW, str(root / "ckpt"), str(root / "live"))
    return str(root / "ckpt"), root / "live"


def _expect_same(live: Path, restored: Path, world_size: int, written_by: int = 2) -> None:
    want, want_dense = _pieces(sorted(live.glob("r*.safetensors")))
    got, got_dense = _pieces([restored / f"r{r}.safetensors" for r in range(world_size)])
    assert sorted(got) == sorted(want)
    bad = diff_states(want, got)
    assert not bad, f"tables differ: {bad}"
    assert any(k.endswith("embedding_bags.t1.weight") for k in want_dense[0])  # the DP table
    for r in range(world_size):
        # Dense params and optimizer are replicated; user state is the rank's own, or rank 0's
        # for a rank the writer did not have.
        bad = diff_states(want_dense[r if r < written_by else 0], got_dense[r])
        assert not bad, f"rank {r}: dense state differs: {bad[:5]}"


def _one_rank(rank: int, world_size: int, uri: str, out: str) -> None:
    _restore_dump(rank, TW, uri, STEP, out, seed=11)
    # Models that cannot hold the checkpoint: typed errors naming the tables.
    cases = {
        r"t\d\.weight: \(300, 16\) saved, \(300, 8\) in model": dict(SMALL, dim=8),
        r"checkpoint tables not in the model: .*t2\.weight": dict(SMALL, num_tables=2),
        r"model tables missing from the checkpoint: .*t3\.weight": dict(SMALL, num_tables=4),
    }
    for match, kw in cases.items():
        model, opt = build_model(ModelSpec(**kw, sharding="table_wise"))
        with (
            deck.enable(model, [opt], deck.DeckConfig(uri=uri)) as ck,
            pytest.raises(deck.errors.IncompatibleModelError, match=match),
        ):
            ck.restore(STEP)


@pytest.mark.slow
def test_table_wise_into_one_rank(tw_chain: tuple[str, Path], tmp_path: Path) -> None:
    """2 ranks table-wise -> 1 rank: every table, state and the dense state bitwise; models with
    another dim or other tables are refused with IncompatibleModelError naming them."""
    uri, live = tw_chain
    run_ranks(_one_rank, uri, str(tmp_path), world_size=1)
    _expect_same(live, tmp_path, 1)


def _three_ranks(rank: int, world_size: int, uri: str, out: str) -> None:
    _restore_dump(rank, TW, uri, STEP, out, seed=12)


@pytest.mark.slow
def test_table_wise_into_three_ranks(tw_chain: tuple[str, Path], tmp_path: Path) -> None:
    """2 ranks -> 3 ranks: rank 2 (no part of its own) finds the dense and user state."""
    uri, live = tw_chain
    run_ranks(_three_ranks, uri, str(tmp_path), world_size=3)
    _expect_same(live, tmp_path, 3)


CW = ModelSpec(**SMALL, sharding="column_wise")
TCW = ModelSpec(**SMALL, sharding="table_column_wise")


def _column_wise_and_back(rank: int, world_size: int, uri: str, out: str) -> None:
    model, dense_opt = build_model(CW, seed=21)
    types = {ps.sharding_type for plan in model.plan.plan.values() for ps in plan.values()}
    assert types == {"column_wise", "data_parallel"}, types
    user = TrainState()
    config = deck.DeckConfig(
        uri=uri, delta_every_steps=5, staging=deck.StagingConfig(chunk_bytes=16384)
    )
    with deck.enable(model, [dense_opt], config, state=user) as ck:
        assert ck.restore(STEP) == STEP
        _dump(model, dense_opt, user, f"{out}/cw{STEP}/r{rank}.safetensors")
        # Written right after the restore with no training in between; a full, since deltas
        # never build on a checkpoint of another layout.
        ck.save(step=STEP + 1)
        for step in range(STEP + 2, STEP + 11):
            user.step, user.losses = step, [*user.losses, train_step(model, dense_opt, CW, step)]
            ck.step(step)
        assert [h.kind for h in ck.history] == ["full", "delta", "delta"], ck.history
    _dump(model, dense_opt, user, f"{out}/cw{STEP + 10}/r{rank}.safetensors")
    _restore_dump(rank, TCW, uri, STEP, f"{out}/tcw{STEP}", seed=22)
    _restore_dump(rank, TW, uri, STEP + 1, f"{out}/tw{STEP + 1}", seed=23)
    _restore_dump(rank, TW, uri, STEP + 10, f"{out}/tw{STEP + 10}", seed=24)


def _joined(cw: Path) -> dict[str, torch.Tensor]:
    """What a table-wise restore of the column-wise dump ``cw`` must hold: the same weights and
    dense state; per-row states the column-weighted mean of the column shards' values (float64,
    shards in column order, as deck.read.restore documents)."""
    tables, _ = _pieces(sorted(cw.glob("r*.safetensors")))
    per_row: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
    for p in sorted(cw.glob("r*.safetensors")):
        for k, v in load_file(str(p)).items():
            if not k.startswith("dense|") and v.dim() == 1:
                table, state, _r, c0, n = k.split("|")
                per_row.setdefault(f"{table}|{state}", []).append((int(c0), int(n), v))
    for key, blocks in per_row.items():
        total = torch.zeros(TW.rows, dtype=torch.float64)
        for _c0, n, v in sorted(blocks, key=lambda b: b[0]):
            total += v.double() * n
        mean = (total / sum(n for _, n, _ in blocks)).float()
        tables[key] = mean[:, None].expand(-1, TW.dim).clone()
    return tables


@pytest.mark.slow
def test_table_wise_into_column_wise_and_back(tw_chain: tuple[str, Path], tmp_path: Path) -> None:
    """2 ranks table-wise -> column-wise and table-column-wise: weights bitwise and each column
    shard's rowwise momentum bitwise the saved row value. A column-wise checkpoint taken right
    after (a full) restores into table-wise bitwise equal to the original state; after training
    on column-wise, table-wise gets the weights bitwise and the column-weighted mean momentum."""
    uri, live = tw_chain
    copy = tmp_path / "ckpt"
    shutil.copytree(uri, copy)  # this test writes to it; the fixture's chain stays as it was
    for d in (f"cw{STEP}", f"cw{STEP + 10}", f"tcw{STEP}", f"tw{STEP + 1}", f"tw{STEP + 10}"):
        (tmp_path / d).mkdir()
    run_ranks(_column_wise_and_back, str(copy), str(tmp_path))
    for d in (f"cw{STEP}", f"tcw{STEP}", f"tw{STEP + 1}"):
        _expect_same(live, tmp_path / d, 2)
    got, got_dense = _pieces([tmp_path / f"tw{STEP + 10}" / f"r{r}.safetensors" for r in range(2)])
    bad = diff_states(_joined(tmp_path / f"cw{STEP + 10}"), got)
    assert not bad, f"tables differ: {bad}"
    _, want_dense = _pieces(sorted((tmp_path / f"cw{STEP + 10}").glob("r*.safetensors")))
    assert not any(diff_states(w, g) for w, g in zip(want_dense, got_dense, strict=True))
    # The join is not the identity here: training made the column shards' momenta differ.
    cw_tables, _ = _pieces(sorted((tmp_path / f"cw{STEP + 10}").glob("r*.safetensors")))
    momenta = [t for k, t in cw_tables.items() if k.endswith("|momentum1")]
    assert momenta and all((m[:, 0] != m[:, -1]).any() for m in momenta)


EXACT_CW = ModelSpec(**SMALL, sharding="column_wise", fused_optimizer="EXACT_ADAGRAD")


def _exact_adagrad(rank: int, world_size: int, uri: str, out: str) -> None:
    _write_chain(rank, world_size, EXACT_CW, uri, f"{out}/live")
    _restore_dump(
        rank,
        ModelSpec(**SMALL, sharding="table_wise", fused_optimizer="EXACT_ADAGRAD"),
        uri,
        STEP,
        f"{out}/tw",
        seed=31,
    )


@pytest.mark.slow
def test_per_element_states_column_wise_into_table_wise(tmp_path: Path) -> None:
    """Exact Adagrad (momentum per element): a column-wise chain (full + deltas) restores
    into table-wise with weights and momentum bitwise."""
    for d in ("live", "tw"):
        (tmp_path / d).mkdir()
    run_ranks(_exact_adagrad, str(tmp_path / "ckpt"), str(tmp_path))
    live, _ = _pieces(sorted((tmp_path / "live").glob("r*.safetensors")))
    assert any(t.dim() == 2 and k.endswith("|momentum1") for k, t in live.items())
    _expect_same(tmp_path / "live", tmp_path / "tw", 2)


# ---- a table that is data_parallel on one side of the restore and sharded on the other -------

DP12 = ModelSpec(**{**SMALL, "data_parallel_tables": (1, 2)}, sharding="table_wise")
DP_NONE = ModelSpec(**{**SMALL, "data_parallel_tables": ()}, sharding="table_wise")


def _swap_data_parallel(rank: int, world_size: int, uri: str, copy: str, out: str) -> None:
    _restore_dump(rank, DP12, uri, STEP, f"{out}/dp12", seed=41)
    _restore_dump(rank, DP_NONE, uri, STEP, f"{out}/sharded", seed=42)
    # Training goes on in the new plan: a full first (the layout changed), then deltas, which
    # restore bitwise into another model of that plan.
    model, dense_opt = build_model(DP12, seed=43)
    user = TrainState()
    config = deck.DeckConfig(uri=copy, delta_every_steps=2)
    with deck.enable(model, [dense_opt], config, state=user) as ck:
        assert ck.restore(STEP) == STEP
        for step in range(STEP + 1, STEP + 5):
            user.step, user.losses = step, [*user.losses, train_step(model, dense_opt, DP12, step)]
            ck.step(step)
        assert [h.kind for h in ck.history] == ["full", "delta"], ck.history
    _dump(model, dense_opt, user, f"{out}/dp12-live/r{rank}.safetensors")
    _restore_dump(rank, DP12, copy, STEP + 4, f"{out}/dp12-again", seed=44)


def _only(keys: Any, table: str) -> str:
    found = [k for k in keys if f"embedding_bags.{table}.weight" in k]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.slow
def test_table_between_sharded_and_data_parallel(
    tw_chain: tuple[str, Path], tmp_path: Path
) -> None:
    """The table-wise chain (t0, t2 sharded with fused rowwise Adagrad; t1 data_parallel)
    restores into a plan where t2 is data_parallel (its weight, from the saved rows, bitwise; its
    fused momentum is dropped) and into one where t1 is sharded (its weight, from the saved dense
    state, bitwise; its fused momentum starts at zero). Everything else stays bitwise. Training
    on in the new plan checkpoints a full, then deltas, which restore bitwise."""
    uri, live = tw_chain
    copy = tmp_path / "ckpt"
    shutil.copytree(uri, copy)  # written to below; the fixture's chain stays as it was
    for d in ("dp12", "sharded", "dp12-live", "dp12-again"):
        (tmp_path / d).mkdir()
    run_ranks(_swap_data_parallel, uri, str(copy), str(tmp_path))
    want, want_dense = _pieces(sorted(live.glob("r*.safetensors")))

    def same_dense_except(got_dense: list[dict[str, torch.Tensor]], table: str) -> None:
        for r in range(2):
            w = {k: v for k, v in want_dense[r].items() if f".{table}." not in k}
            g = {k: v for k, v in got_dense[r].items() if f".{table}." not in k}
            assert not diff_states(w, g), f"rank {r}: {diff_states(w, g)[:5]}"

    # t2: sharded -> data_parallel.
    got, got_dense = _pieces([tmp_path / "dp12" / f"r{r}.safetensors" for r in range(2)])
    t2 = _only([k for k in want if k.endswith("|weight")], "t2")
    assert sorted(got) == sorted(k for k in want if not k.startswith(t2.split("|")[0]))
    assert not diff_states({k: want[k] for k in got}, got)
    for r in range(2):
        restored = got_dense[r][_only([k for k in got_dense[r] if k.startswith("model.")], "t2")]
        assert torch.equal(_bits(restored), _bits(want[t2]))
    same_dense_except(got_dense, "t2")

    # t1: data_parallel -> sharded.
    got, got_dense = _pieces([tmp_path / "sharded" / f"r{r}.safetensors" for r in range(2)])
    t1_saved = want_dense[0][_only([k for k in want_dense[0] if k.startswith("model.")], "t1")]
    t1 = _only([k for k in got if k.endswith("|weight")], "t1").split("|")[0]
    assert torch.equal(_bits(got[f"{t1}|weight"]), _bits(t1_saved))
    assert torch.equal(got[f"{t1}|momentum1"], torch.zeros_like(got[f"{t1}|momentum1"]))
    assert not diff_states(want, {k: v for k, v in got.items() if not k.startswith(t1)})
    same_dense_except(got_dense, "t1")

    # After the restore into the new plan: a full, a delta, and a bitwise restore of the delta.
    t_live, d_live = _pieces(sorted((tmp_path / "dp12-live").glob("r*.safetensors")))
    t_again, d_again = _pieces(sorted((tmp_path / "dp12-again").glob("r*.safetensors")))
    assert not diff_states(t_live, t_again)
    assert all(not diff_states(a, b) for a, b in zip(d_live, d_again, strict=True))


def test_keyed_optimizer_state_fits_a_moved_table() -> None:
    """A KeyedOptimizer's saved state fitted to a model where a table moved: a state the live
    optimizer no longer has is dropped, a moved table it has now keeps its live state, every other
    state loads exactly; nothing moved (or a plain torch optimizer) leaves the saved state alone."""
    from torchrec.optim.keyed import KeyedOptimizerWrapper

    from deck.trainer.fitting import load_optimizer, reconcile_optimizer

    def make(names: list[str], seed: int) -> KeyedOptimizerWrapper:
        g = torch.Generator().manual_seed(seed)
        params = {n: torch.nn.Parameter(torch.randn(3, 2, generator=g)) for n in names}
        opt = KeyedOptimizerWrapper(params, lambda p: torch.optim.Adagrad(p, lr=0.1))
        for p in params.values():
            p.grad = torch.randn(3, 2, generator=g)
        opt.step()
        return opt

    def saved(opt: KeyedOptimizerWrapper) -> dict[str, Any]:
        return optimizer_record(opt, algorithm_class(opt))

    old = make(["mlp.w", "sparse.embedding_bags.t2.weight"], 1)  # t2 was data_parallel
    new = make(["mlp.w", "sparse.embedding_bags.t1.weight"], 2)  # t1 is data_parallel now
    t1_live = new.state_dict()["state"]["sparse.embedding_bags.t1.weight"]["sum"].clone()
    src = saved(old)
    assert reconcile_optimizer(new, src, set()) is src
    plain = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert reconcile_optimizer(plain, src, {"embedding_bags.t1.weight"}) is src
    with pytest.raises(
        IncompatibleModelError, match=r"Different parameter count|not found|does not have"
    ):
        load_optimizer(new, src, "0.0", algorithm_class(new))
    moved = {"sparse.embedding_bags.t1.weight", "sparse.embedding_bags.t2.weight"}
    load_optimizer(new, reconcile_optimizer(new, src, moved), "0.0", algorithm_class(new))
    state = new.state_dict()["state"]
    assert torch.equal(state["mlp.w"]["sum"], old.state_dict()["state"]["mlp.w"]["sum"])
    assert torch.equal(state["sparse.embedding_bags.t1.weight"]["sum"], t1_live)
    assert "sparse.embedding_bags.t2.weight" not in state


def test_a_table_moved_to_data_parallel_starts_a_new_adams_state_fresh() -> None:
    """A break-it finding: restoring into a new Adam (no state before its first step) with
    weight decay, the table now data_parallel got the state of a zero-gradient step (step 1, a
    momentum of (1 - beta1) * wd * w) where the docs promise a fresh one. It has none now, and
    its first step is a fresh Adam's, bitwise; the other parameters' state is the saved one."""
    from torchrec.optim.keyed import KeyedOptimizerWrapper

    from deck.trainer.fitting import load_optimizer, reconcile_optimizer

    def adam(params: dict[str, torch.nn.Parameter]) -> KeyedOptimizerWrapper:
        return KeyedOptimizerWrapper(
            params, lambda p: torch.optim.Adam(p, lr=0.1, weight_decay=0.01)
        )

    g = torch.Generator().manual_seed(5)
    w, t1 = torch.randn(3, 2, generator=g), torch.randn(4, 2, generator=g)
    old_params = {"mlp.w": torch.nn.Parameter(w.clone())}  # t1 was sharded
    old = adam(old_params)
    old_params["mlp.w"].grad = torch.randn(3, 2, generator=g)
    old.step()
    src = optimizer_record(old, algorithm_class(old))

    params = {
        "mlp.w": torch.nn.Parameter(w.clone()),
        "sparse.embedding_bags.t1.weight": torch.nn.Parameter(t1.clone()),
    }
    new = adam(params)
    moved = {"sparse.embedding_bags.t1.weight"}
    load_optimizer(new, reconcile_optimizer(new, src, moved), "0.0", algorithm_class(new))
    state = new.state_dict()["state"]
    assert "sparse.embedding_bags.t1.weight" not in state, state.keys()
    assert torch.equal(state["mlp.w"]["exp_avg"], old.state_dict()["state"]["mlp.w"]["exp_avg"])
    # its next step is the first step of a fresh Adam on that parameter (the load's
    # init_state() stepped the parameters: a restore writes the dense state after it)
    with torch.no_grad():
        params["sparse.embedding_bags.t1.weight"].copy_(t1)
    fresh_p = torch.nn.Parameter(t1.clone())
    fresh = torch.optim.Adam([fresh_p], lr=0.1, weight_decay=0.01)
    grad = torch.randn(4, 2, generator=g)
    for p, gr in ((params["sparse.embedding_bags.t1.weight"], grad), (fresh_p, grad)):
        p.grad = gr.clone()
    params["mlp.w"].grad = torch.zeros(3, 2)
    new.step()
    fresh.step()
    assert torch.equal(params["sparse.embedding_bags.t1.weight"], fresh_p)


class _Tower(torch.nn.Module):
    def __init__(self, ebc: torch.nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        self.out = torch.nn.Linear(24, 1)

    def forward(self, kjt: Any) -> torch.Tensor:
        return self.out(self.ebc(kjt).values())


def _per_table_optimizer_model(data_parallel: bool) -> tuple[Any, Any]:
    """An EBC of three tables under a linear layer: t0 with its own fused rowwise Adagrad
    (``apply_optimizer_in_backward``), t1 (mean pooling) data_parallel (trained by the dense
    Adagrad) or table-wise under the sharder's fused EXACT_ADAGRAD, t2 under the sharder's."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )
    from torchrec.modules.embedding_configs import PoolingType
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    torch.manual_seed(3)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=f"t{i}",
                embedding_dim=8,
                num_embeddings=32,
                feature_names=[f"f{i}"],
                # (a kernel of its own when sharded: with t2's it would take t2's state)
                pooling=PoolingType.MEAN if i == 1 else PoolingType.SUM,
            )
            for i in range(3)
        ],
        device=torch.device("meta"),
    )
    apply_optimizer_in_backward(RowWiseAdagrad, [ebc.embedding_bags["t0"].weight], {"lr": 0.1})
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.03}
    )
    kinds = {"t0": "table_wise", "t1": "data_parallel" if data_parallel else "table_wise"}
    constraints = {
        n: ParameterConstraints(
            sharding_types=[kinds.get(n, "table_wise")],
            compute_kernels=["dense" if kinds.get(n) == "data_parallel" else "fused"],
        )
        for n in ("t0", "t1", "t2")
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu"), constraints=constraints
    )
    tower = _Tower(ebc)
    plan = planner.collective_plan(tower, [sharder], torch.distributed.GroupMember.WORLD)
    model = DistributedModelParallel(
        tower, device=torch.device("cpu"), sharders=[sharder], plan=plan
    )
    params = dict(in_backward_optimizer_filter(model.named_parameters()))
    return model, KeyedOptimizerWrapper(params, lambda p: torch.optim.Adagrad(p, lr=0.02))


def _train_per_table(model: Any, opt: Any, step: int) -> None:
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(step)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2"],
        values=torch.randint(0, 32, (24,), generator=g),
        lengths=torch.full((12,), 2, dtype=torch.int32),
    )
    opt.zero_grad()
    model(kjt).pow(2).sum().backward()
    opt.step()


def _local(t: Any) -> torch.Tensor:
    return t.local_shards()[0].tensor if hasattr(t, "local_shards") else t


def _data_parallel_into_per_table_optimizers(rank: int, world_size: int, uri: str) -> None:
    model, opt = _per_table_optimizer_model(data_parallel=True)
    with deck.enable(model, [opt], deck.DeckConfig(uri=uri, delta_every_steps=1)) as ck:
        for step in range(1, 4):
            _train_per_table(model, opt, step)
            ck.step(step)
        live = {k: _local(v).detach().clone() for k, v in model.state_dict().items()}
        fused = model.fused_optimizer.state_dict()["state"]
        saved = {
            t: {k: _local(v).clone() for k, v in fused[f"ebc.embedding_bags.{t}.weight"].items()}
            for t in ("t0", "t2")
        }
    assert set(saved["t0"]) and set(saved["t2"])
    model, opt = _per_table_optimizer_model(data_parallel=False)
    with deck.enable(model, [opt], deck.DeckConfig(uri=uri, delta_every_steps=1)) as ck:
        assert ck.restore() == 3
        got = model.state_dict()
        for key, want in live.items():
            assert torch.equal(_bits(_local(got[key])), _bits(want)), key
        state = model.fused_optimizer.state_dict()["state"]
        for t, states in saved.items():
            for k, v in states.items():
                assert torch.equal(_local(state[f"ebc.embedding_bags.{t}.weight"][k]), v), (t, k)
        t1 = state["ebc.embedding_bags.t1.weight"]
        assert t1 and not any(_local(v).any() for v in t1.values()), "t1 starts fresh"
        _train_per_table(model, opt, 4)
        ck.step(4)


@pytest.mark.slow
def test_a_data_parallel_table_restores_into_a_kernel_beside_other_update_rules(
    tmp_path: Path,
) -> None:
    """A break-it finding: a table data_parallel in the checkpoint and sharded in the model took
    the saved fused optimizers of every other table as its own, so where those differed (t0 its
    own rowwise Adagrad, t2 the sharder's Adagrad) the restore was refused as "saved with another fused
    optimizer". Its kernel now starts fresh, as documented: its weight bitwise, its state zero,
    the other tables' weights and states bitwise, and training goes on."""
    run_ranks(_data_parallel_into_per_table_optimizers, str(tmp_path / "ckpt"), world_size=1)
