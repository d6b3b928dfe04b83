"""Parquet output (pyarrow): `deck export --format parquet` of a real 2-rank checkpoint reads back
with pyarrow bitwise equal to what `restore(step)` loads, for a full and for a chain of full +
merged delta + delta; `deck follow --format parquet` writes a full, then per applied step a delta
holding exactly the rows that step changed, with the values `restore(step)` loads."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

# The export test's checkpoint (column-wise tables: row-wise momentum kept per column shard,
# a fixed_size_list[2] column) and its console-script runner.
from test_export import SPEC, STEP, _deck, _write

import deck
from deck.demo import ModelSpec, build_model, train_step
from deck.storage import open_storage
from deck.testing.dist_harness import run_ranks

pytestmark = pytest.mark.slow

# ---- reading the files back --------------------------------------------------------------------

# (state_dict key, state) -> (global tensor in TorchRec's layout, which of its entries a file set)
Held = dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]]


def _read(folder: str, key: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    from deck.format.parquet import read_table

    return read_table(os.path.join(folder, f"{key}.parquet"))


def _local(model: Any) -> dict[tuple[str, str], list[tuple[tuple[int, ...], torch.Tensor, int]]]:
    """This rank's shards of every table and fused optimizer state: (offsets, copy, num_rows)
    by (table key, state)."""
    out: dict[tuple[str, str], list[tuple[tuple[int, ...], torch.Tensor, int]]] = {}
    rows: dict[str, int] = {}
    for key, v in model.state_dict().items():
        if hasattr(v, "local_shards"):
            rows[key] = v.size()[0]
            out[(key, "weight")] = [
                (tuple(s.metadata.shard_offsets), s.tensor.clone(), rows[key])
                for s in v.local_shards()
            ]
    for key, states in model.fused_optimizer.state_dict()["state"].items():
        for name, st in states.items():
            out[(key, name.rsplit(".", 1)[-1])] = [
                (tuple(s.metadata.shard_offsets), s.tensor.clone(), rows[key])
                for s in st.local_shards()
            ]
    return out


def _from_files(folder: str, local: dict[Any, Any], sizes: dict[Any, torch.Size]) -> Held:
    """Each table's files put back into TorchRec's global layout (a row-wise state: one block
    of num_rows per column shard), with the entries the file's rows cover."""
    held: Held = {}
    for (key, state), size in sizes.items():
        _, cols = _read(folder, key)
        rows, col = cols["row"], cols[state]
        full = torch.zeros(size, dtype=col.dtype)
        cov = torch.zeros(size, dtype=torch.bool)
        if len(size) == 2:
            full[rows], cov[rows] = col, True
        else:  # num_rows x k in the file, k blocks of num_rows in TorchRec
            n = sizes[(key, "weight")][0]
            k = size[0] // n
            col = col.reshape(-1, k)
            full.view(k, n)[:, rows], cov.view(k, n)[:, rows] = col.t(), True
        held[(key, state)] = (full, cov)
    return held


def _assert_holds(held: Held, local: dict[Any, Any], tag: tuple[object, ...]) -> None:
    """Every local shard equals, bitwise, the file's values wherever the file has its rows."""
    for ks, shards in local.items():
        full, cov = held[ks]
        for offsets, t, _ in shards:
            sl = tuple(slice(o, o + n) for o, n in zip(offsets, t.shape, strict=True))
            c = cov[sl]
            assert torch.equal(full[sl][c].view(torch.uint8), t[c].view(torch.uint8)), (*tag, ks)


def _sizes(model: Any) -> dict[tuple[str, str], torch.Size]:
    sizes = {
        (k, "weight"): v.size() for k, v in model.state_dict().items() if hasattr(v, "local_shards")
    }
    for key, states in model.fused_optimizer.state_dict()["state"].items():
        for name, st in states.items():
            sizes[(key, name.rsplit(".", 1)[-1])] = st.size()
    return sizes


# ---- deck export --format parquet --------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Full 0, deltas 5, 10, 15 and a merged delta of 5..10: step 15's chain is full + merged +
    delta (test_export's checkpoint)."""
    uri = str(tmp_path_factory.mktemp("parquet") / "ck")
    run_ranks(_write, uri)
    r = _deck("merge", uri, "--once", "--stride", "2", "--full-live-fraction", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    return uri


def _compare_export(rank: int, world_size: int, uri: str, folders: dict[int, str]) -> None:
    model, opt = build_model(SPEC, seed=101)
    with deck.DeltaCheckpointer(model, [opt], deck.DeckConfig(uri=uri, lease_ttl_s=None)) as ck:
        for step, folder in sorted(folders.items()):
            assert ck.restore(step) == step
            local, sizes = _local(model), _sizes(model)
            held = _from_files(folder, local, sizes)
            assert all(bool(cov.all()) for _, cov in held.values()), (rank, step)  # every row
            _assert_holds(held, local, (rank, step))
    dist.barrier()


def test_export_parquet_matches_restore(ckpt: str, tmp_path: Path) -> None:
    folders = {}
    for step in (0, STEP):  # a full alone; full + merged delta + delta
        out = tmp_path / f"pq{step}"
        r = _deck("export", ckpt, "--step", str(step), "--out", str(out), "--format", "parquet")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "not exported: dense state" in r.stdout
        folders[step] = str(out)
    run_ranks(_compare_export, ckpt, folders)

    import pyarrow.parquet as pq

    (f, *_) = sorted(Path(folders[STEP]).glob("*.parquet"))
    sch = pq.read_schema(f)
    meta = {k.decode(): v.decode() for k, v in (sch.metadata or {}).items()}
    assert meta["deck.step"] == str(STEP) and meta["deck.kind"] == "full"
    assert json.loads(meta["deck.column_offsets"]) == [0, SPEC.dim // 2]
    weight, momentum = sch.field("weight").type, sch.field("momentum1").type
    assert (weight.list_size, str(weight.value_type)) == (SPEC.dim, "float")
    assert (momentum.list_size, str(momentum.value_type)) == (2, "float")  # two column shards
    assert str(sch.field("row").type) == "int64"


def test_export_parquet_streams_row_blocks(ckpt: str, tmp_path: Path) -> None:
    """One file per table, rows ascending and complete; at most one table's row block (here,
    column-wise: the table's column shards) held at once; an existing folder is refused."""
    from deck.errors import ConfigError
    from deck.format.parquet import read_table
    from deck.ops.export import StepState
    from deck.ops.export.parquet import export_parquet

    state = StepState(open_storage(ckpt), STEP)
    rep = export_parquet(state, str(tmp_path / "pq"))
    tables: dict[str, int] = {}
    for s in state.shards:
        tables[s.table] = tables.get(s.table, 0) + s.nbytes
    assert rep.max_held_bytes == max(tables.values()) < sum(tables.values())
    assert sorted(p.name for p in (tmp_path / "pq").iterdir()) == sorted(
        f"{t}.parquet" for t in tables
    )
    for t in tables:
        meta, cols = read_table(str(tmp_path / "pq" / f"{t}.parquet"))
        assert meta["table"] == t and meta["checkpoint"] == state.last.state[1]
        assert torch.equal(cols["row"], torch.arange(SPEC.rows))
    with pytest.raises(ConfigError, match="empty directory"):
        export_parquet(state, str(tmp_path / "pq"))


# ---- deck follow --format parquet --------------------------------------------------------------

# Table-wise tables: one shard each, the row-wise momentum a scalar column.
FOLLOW_SPEC = ModelSpec(num_tables=2, rows=300, dim=8, batch=16, sharding="table_wise")
LAST = 12
FOLLOW_AT = (4, 6, LAST)  # a full of 0, 2, 4; one delta; three deltas in one catch-up


def _publish(rank: int, world_size: int, ckpt: str, pub: str, out: str) -> None:
    model, opt = build_model(FOLLOW_SPEC)
    config = deck.DeckConfig(
        uri=ckpt,
        delta_every_steps=6,
        staging=deck.StagingConfig(chunk_bytes=4 * 1024),
        publish=deck.PublishConfig(uri=pub, every_steps=2),
    )
    with deck.enable(model, [opt], config) as ck:
        for step in range(0, LAST + 1):
            if step:
                train_step(model, opt, FOLLOW_SPEC, step)
            ck.step(step)
            if step in FOLLOW_AT:
                assert ck.flush()
                if rank == 0:
                    r = _deck("follow", pub, "--out", out, "--once", "--format", "parquet")
                    assert r.returncode == 0, r.stdout + r.stderr
                dist.barrier()


def _changed(
    before: dict[Any, Any], after: dict[Any, Any], num_rows: dict[str, int]
) -> dict[str, torch.Tensor]:
    """Global rows where any state of any rank's shard differs bitwise (all ranks agree)."""
    out = {}
    for key, n in sorted(num_rows.items()):
        mask = torch.zeros(n, dtype=torch.int32)
        for ks, shards in after.items():
            if ks[0] != key:
                continue
            for (offsets, b, _), (_, a, _) in zip(shards, before[ks], strict=True):
                diff = a.view(torch.int32) != b.view(torch.int32)
                diff = diff.reshape(diff.shape[0], -1).any(dim=1)
                pos = torch.nonzero(diff).view(-1) + offsets[0]
                mask[pos % n] = 1  # a row-wise state's position -> its row
        dist.all_reduce(mask)
        out[key] = torch.nonzero(mask).view(-1)
    return out


def _check_follow(rank: int, world_size: int, pub: str, root: str) -> None:
    model, opt = build_model(FOLLOW_SPEC, seed=7)
    folders = sorted(os.listdir(root))
    sizes = _sizes(model)
    num_rows = {k: s[0] for (k, st), s in sizes.items() if st == "weight"}
    prev: tuple[int, dict[Any, Any]] | None = None
    for name in folders:
        folder = os.path.join(root, name)
        metas = {k: _read(folder, k)[0] for k in num_rows}
        step = int(metas[next(iter(num_rows))]["step"])
        assert deck.load(model, [opt], pub, step=step) == step
        local = _local(model)
        held = _from_files(folder, local, sizes)
        _assert_holds(held, local, (rank, name))
        if prev is None:
            assert name.endswith("-full") and all(bool(c.all()) for _, c in held.values())
        else:
            assert name.endswith("-delta")
            changed = _changed(prev[1], local, num_rows)
            for key, meta in metas.items():
                assert int(meta["parent_step"]) == prev[0], (name, meta)
                rows = _read(folder, key)[1]["row"]
                assert torch.equal(rows, changed[key]), (rank, name, key)
                assert 0 < rows.numel() < num_rows[key]  # a real delta, not a full
        prev = (step, local)
    dist.barrier()


def test_follow_parquet_deltas_hold_exactly_the_changed_rows(tmp_path: Path) -> None:
    ckpt, pub, out = str(tmp_path / "ckpt"), str(tmp_path / "pub"), str(tmp_path / "serving")
    run_ranks(_publish, ckpt, pub, out)
    root = os.path.join(out, "parquet")
    assert sorted(os.listdir(root)) == ["000000000004-full"] + [
        f"{s:012d}-delta" for s in range(6, LAST + 1, 2)
    ]
    assert os.path.exists(os.path.join(out, "state.safetensors"))  # kept beside
    run_ranks(_check_follow, pub, root)
    # Nothing new: no folder appears, none is rewritten.
    before = {p: os.stat(os.path.join(root, p)).st_mtime_ns for p in os.listdir(root)}
    r = _deck("follow", pub, "--out", out, "--once", "--format", "parquet")
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr
    assert {p: os.stat(os.path.join(root, p)).st_mtime_ns for p in os.listdir(root)} == before


def test_follow_parquet_on_an_out_an_earlier_run_wrote_starts_with_a_base(
    ckpt: str, tmp_path: Path
) -> None:
    """An --out an earlier `deck follow` without --format parquet brought to step 10: a run
    with it first writes step 10 in full (it held nothing of it), then the delta of 15 on it,
    so the newest -full plus the -deltas after it are the state the follower serves."""
    import shutil

    from safetensors.torch import load_file

    from deck.format.parquet import read_table

    src = Path(ckpt)
    uri, out = tmp_path / "ck", tmp_path / "serving"
    shutil.copytree(src, uri, ignore=shutil.ignore_patterns("step-000000000015"))
    first = _deck("follow", str(uri), "--out", str(out), "--once")
    assert first.returncode == 0 and "step 10 " in first.stdout, first.stdout + first.stderr
    # Up to date, nothing new: the base is still written (and said), once.
    again = _deck("follow", str(uri), "--out", str(out), "--once", "--format", "parquet")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "held nothing of step 10" in again.stderr, again.stderr
    root = out / "parquet"
    assert sorted(p.name for p in root.iterdir()) == ["000000000010-full"]
    shutil.copytree(src / "step-000000000015", uri / "step-000000000015")
    r = _deck("follow", str(uri), "--out", str(out), "--once", "--format", "parquet")
    assert r.returncode == 0 and "held nothing" not in r.stderr, r.stdout + r.stderr
    assert sorted(p.name for p in root.iterdir()) == ["000000000010-full", "000000000015-delta"]
    state = load_file(str(out / "state.safetensors"))
    for f in sorted((root / "000000000010-full").iterdir()):
        meta, full = read_table(str(f))
        dmeta, delta = read_table(str(root / "000000000015-delta" / f.name))
        assert meta["step"] == "10" and dmeta["parent_step"] == "10"
        assert dmeta["parent_checkpoint"] == meta["checkpoint"]
        weight = full["weight"].clone()
        weight[delta["row"]] = delta["weight"]
        assert torch.equal(weight, state["model." + meta["table"]]), f.name
