"""row_wise and table_row_wise tables with explicit plans (TorchRec's
``construct_module_sharding_plan``), on real 2-rank gloo DMP models on CPU.

Tables have 1001 rows, so the two row shards are uneven (501 + 500). In the row-wise layout t0 is
row_wise, t1 table_row_wise (host 0, both ranks) and t2 table_wise; all train with fused
EXACT_ROWWISE_ADAGRAD. Checked: a full + deltas restore bitwise into a fresh model (weights,
momentum1, dense parameters and optimizer) and training on gives identical losses, for an
EmbeddingBagCollection and an EmbeddingCollection (row_wise; TorchRec's EC has no
table_row_wise); a row-wise checkpoint restores into an all-table-wise plan, and a table-wise one
into the row-wise plan, bitwise equal to the saving model's tables (gathered by global row, so
layouts do not matter).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import deck
from deck.demo import ModelSpec, SequenceModel, capture_state, diff_states, train_step
from deck.testing.dist_harness import run_ranks

SPEC = ModelSpec(num_tables=3, rows=1001, dim=16, batch=32, pooling=2)
STEPS, EVERY, MORE = 9, 3, 3
LAYOUTS = {
    "rw": {"t0": "row_wise", "t1": "table_row_wise", "t2": "table_wise"},
    "tw": {"t0": "table_wise", "t1": "table_wise", "t2": "table_wise"},
    # TorchRec's EmbeddingCollection has no table_row_wise sharding.
    "rw_ec": {"t0": "row_wise", "t1": "row_wise", "t2": "table_wise"},
}


def _build(layout: str, seed: int, collection: str = "ebc") -> tuple[Any, Any]:
    """DLRM over an EmbeddingBagCollection of 3 tables (``collection="ec"``: the demo's sequence
    model over an EmbeddingCollection) with an explicit plan (``LAYOUTS[layout]``); TorchRec's CPU
    planner never proposes row-wise, so the plan is built by hand as a user would."""
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingCollection,
        EmbeddingConfig,
    )
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan,
        row_wise,
        table_row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan
    from torchrec.models.dlrm import DLRM
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    torch.manual_seed(seed)
    shape = dict(embedding_dim=SPEC.dim, num_embeddings=SPEC.rows)
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-8}
    names = [f"t{i}" for i in range(SPEC.num_tables)]
    sharder: Any
    if collection == "ebc":
        ebc: Any = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=n, feature_names=[f"f{i}"], **shape)
                for i, n in enumerate(names)
            ],
            device=torch.device("meta"),
        )
        module: torch.nn.Module = DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=13,
            dense_arch_layer_sizes=[32, SPEC.dim],
            over_arch_layer_sizes=[32, 1],
            dense_device=torch.device("cpu"),
        )
        sharder = EmbeddingBagCollectionSharder(fused_params=fused)
        path = "sparse_arch.embedding_bag_collection"
    else:
        ebc = EmbeddingCollection(
            tables=[
                EmbeddingConfig(name=n, feature_names=[f"f{i}"], **shape)
                for i, n in enumerate(names)
            ],
            device=torch.device("meta"),
        )
        module = SequenceModel(ebc, SPEC.dim)
        sharder = EmbeddingCollectionSharder(fused_params=fused)
        path = "ec"
    make = {
        "row_wise": lambda i: row_wise(compute_kernel="fused"),
        "table_row_wise": lambda i: table_row_wise(host_index=0),
        "table_wise": lambda i: table_wise(rank=i % 2, compute_kernel="fused"),
    }
    ws = dist.get_world_size()
    per_table = {t: make[kind](i) for i, (t, kind) in enumerate(LAYOUTS[layout].items())}
    module_plan = construct_module_sharding_plan(
        ebc, per_table, local_size=ws, world_size=ws, device_type="cpu", sharder=sharder
    )
    # table_row_wise() takes no compute kernel and picks "dense" unless the parameter carries an
    # in-backward optimizer; fused is what a user sets to get the TBE kernel.
    for ps in module_plan.values():  # type: ignore[attr-defined]
        ps.compute_kernel = "fused"
    plan = ShardingPlan({path: module_plan})
    model = DistributedModelParallel(
        module, device=torch.device("cpu"), sharders=[sharder], plan=plan
    )
    got = {n: ps.sharding_type for p in model.plan.plan.values() for n, ps in p.items()}
    assert got == LAYOUTS[layout], got
    if layout.startswith("rw"):  # uneven row shards
        assert [s.shard_sizes[0] for s in module_plan["t0"].sharding_spec.shards] == [501, 500]  # type: ignore[index, union-attr]
    params = dict(in_backward_optimizer_filter(model.named_parameters()))
    dense = KeyedOptimizerWrapper(params, lambda p: torch.optim.Adagrad(p, lr=0.02))
    return model, dense


def _dump(model: Any, dense: Any, path: str) -> None:
    """This rank's pieces, read with TorchRec's APIs: ``<table>|<state>|<row offset>`` for every
    local shard of a table's weight and fused states, ``dense|<key>`` for the rest."""
    out: dict[str, torch.Tensor] = {}
    for key, w in model.state_dict().items():
        for s in getattr(w, "local_shards", list)():
            out[f"{key}|weight|{int(s.metadata.shard_offsets[0])}"] = s.tensor.clone()
    for key, states in model.fused_optimizer.state_dict()["state"].items():
        for name, st in states.items():
            for s in st.local_shards():
                offs = int(s.metadata.shard_offsets[0])
                out[f"{key}|{name.split('.', 1)[1]}|{offs}"] = s.tensor.clone()
    for k, v in capture_state(model, dense).items():
        if "@" not in k and not k.startswith("fused."):
            out[f"dense|{k}"] = v.contiguous()
    save_file(out, path)


def _gather(paths: list[Path]) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Unsharded ``<table>|<state>`` tensors from every rank's dump, and each rank's dense state;
    every row of every table must come from some rank."""
    tables: dict[str, torch.Tensor] = {}
    dense = []
    for p in paths:
        d = load_file(str(p))
        dense.append({k.split("|", 1)[1]: v for k, v in d.items() if k.startswith("dense|")})
        for k, v in d.items():
            if k.startswith("dense|"):
                continue
            table, state, r0 = k.rsplit("|", 2)
            shape = (SPEC.rows, *v.shape[1:])
            full = tables.setdefault(f"{table}|{state}", torch.full(shape, float("nan")))
            full[int(r0) : int(r0) + v.shape[0]] = v
    for k, t in tables.items():
        assert not t.isnan().any(), f"{k}: some rows were in no rank's dump"
    return tables, dense


def _train_chain(
    layout: str, uri: str, live: str, rank: int, collection: str = "ebc"
) -> tuple[Any, Any]:
    """Train ``layout`` with a full at 0 and deltas every EVERY steps to STEPS; dump the state."""
    model, dense = _build(layout, seed=0, collection=collection)
    with deck.enable(model, [dense], deck.DeckConfig(uri=uri, delta_every_steps=EVERY)) as ck:
        for step in range(STEPS + 1):
            if step:
                train_step(model, dense, SPEC, step)
            ck.step(step)
        assert [h.kind for h in ck.history] == ["full"] + ["delta"] * (STEPS // EVERY)
        assert all(h.rows < ck.history[0].rows for h in ck.history[1:])  # real deltas
    _dump(model, dense, f"{live}/r{rank}.safetensors")
    return model, dense


def _restore_into(layout: str, uri: str, out: str, rank: int, seed: int) -> None:
    model, dense = _build(layout, seed=seed)
    with deck.enable(model, [dense], deck.DeckConfig(uri=uri)) as ck:
        assert ck.restore(STEPS) == STEPS
    _dump(model, dense, f"{out}/r{rank}.safetensors")


def _restores_and_trains_on(root: str, rank: int, collection: str) -> None:
    """Row-wise: full + deltas, then a fresh row-wise model restores bitwise and trains on alike."""
    uri = f"{root}/rw" if collection == "ebc" else f"{root}/rw_{collection}"
    live_dir = f"{root}/rw_live" if collection == "ebc" else f"{root}/rw_{collection}_live"
    layout = "rw" if collection == "ebc" else "rw_ec"
    model, dense = _train_chain(layout, uri, live_dir, rank, collection)
    live = capture_state(model, dense)
    losses = [train_step(model, dense, SPEC, s) for s in range(STEPS + 1, STEPS + 1 + MORE)]
    fresh, fresh_dense = _build(layout, seed=1, collection=collection)
    assert diff_states(live, capture_state(fresh, fresh_dense))  # it starts elsewhere
    with deck.enable(fresh, [fresh_dense], deck.DeckConfig(uri=uri)) as ck:
        assert ck.restore(STEPS) == STEPS
    bad = diff_states(live, capture_state(fresh, fresh_dense))
    assert not bad, f"{collection}, rank {rank}: restored state differs: {bad[:8]}"
    again = [train_step(fresh, fresh_dense, SPEC, s) for s in range(STEPS + 1, STEPS + 1 + MORE)]
    assert again == losses, (collection, again, losses)


def _job(rank: int, world_size: int, root: str) -> None:
    _restores_and_trains_on(root, rank, "ebc")
    _restores_and_trains_on(root, rank, "ec")
    # Resharding both ways.
    _restore_into("tw", f"{root}/rw", f"{root}/rw_into_tw", rank, seed=2)
    _train_chain("tw", f"{root}/tw", f"{root}/tw_live", rank)
    _restore_into("rw", f"{root}/tw", f"{root}/tw_into_rw", rank, seed=3)


@pytest.mark.slow
def test_row_wise_restores_bitwise_and_reshards(tmp_path: Path) -> None:
    """row_wise + table_row_wise + table_wise (uneven 1001-row shards): a full and three deltas
    restore into a fresh model bitwise and training on gives identical losses (asserted on each
    rank; an EmbeddingCollection with row_wise tables too); a row-wise checkpoint restored into an all-table-wise plan, and a table-wise one into
    the row-wise plan, hold the saving model's tables, states and dense state bitwise."""
    for d in ("rw_live", "rw_ec_live", "rw_into_tw", "tw_live", "tw_into_rw"):
        (tmp_path / d).mkdir()
    run_ranks(_job, str(tmp_path))
    for live, restored in (("rw_live", "rw_into_tw"), ("tw_live", "tw_into_rw")):
        want, want_dense = _gather([tmp_path / live / f"r{r}.safetensors" for r in range(2)])
        got, got_dense = _gather([tmp_path / restored / f"r{r}.safetensors" for r in range(2)])
        assert sorted(want) == sorted(got)
        assert len(want) == 6  # weight and momentum1 of three tables
        bad = diff_states(want, got)
        assert not bad, f"{live} -> {restored}: tables differ: {bad}"
        for r in range(2):
            bad = diff_states(want_dense[r], got_dense[r])
            assert not bad, f"{live} -> {restored}, rank {r}: dense state differs: {bad[:5]}"
