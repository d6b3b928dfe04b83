"""Every fused optimizer / weight-decay setting fbgemm's CPU TBE runs (fbgemm-gpu-cpu 1.8), on a
real 2-rank gloo DMP, table_wise and column_wise: full + deltas restore bitwise (weights, every
optimizer state and TBE buffer, dense params) and training on gives the never-stopped losses.

fbgemm refuses the other EmbOptimTypes on CPU at construction (ADAM, LAMB, PARTIAL_ROWWISE_*,
LARS_SGD, MADGRAD, ENSEMBLE_ROWWISE_ADAGRAD: "not supported in CPU mode"; SGD, ROWWISE_ADAGRAD:
deprecated; NONE: device only), so they cannot reach deck here.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import deck
from deck.demo import ModelSpec, TrainState, build_model, capture_state, diff_states, train_step
from deck.read.catalog import read_manifests, read_rank_manifests
from deck.storage import open_storage
from deck.testing.dist_harness import run_ranks

pytestmark = pytest.mark.slow

SMALL = dict(num_tables=3, rows=400, dim=8, batch=32, pooling=2)
STEPS, EVERY, RESUME = 12, 3, 6


def _counter() -> dict[str, Any]:
    from fbgemm_gpu.tbe.config.optimizer_config import (
        CounterBasedRegularizationDefinition,
        CounterWeightDecayMode,
        WeightDecayMode,
    )

    return {
        "weight_decay_mode": WeightDecayMode.COUNTER,
        "weight_decay": 0.01,
        "counter_based_regularization": CounterBasedRegularizationDefinition(
            counter_weight_decay_mode=CounterWeightDecayMode.DECOUPLE, counter_halflife=4
        ),
    }


def _wd(mode: str) -> dict[str, Any]:
    from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode

    return {"weight_decay_mode": getattr(WeightDecayMode, mode), "weight_decay": 0.01}


def _ema() -> dict[str, Any]:
    from fbgemm_gpu.tbe.config.optimizer_config import EmainplaceModeDefinition

    return {
        "emainplace_mode": EmainplaceModeDefinition(step_ema=2, step_start=1, step_ema_coef=0.5)
    }


CASES: dict[str, tuple[str, Any]] = {
    "sgd": ("EXACT_SGD", dict),
    "adagrad": ("EXACT_ADAGRAD", dict),
    "rowwise-none": ("EXACT_ROWWISE_ADAGRAD", dict),
    "rowwise-l2": ("EXACT_ROWWISE_ADAGRAD", lambda: _wd("L2")),
    "rowwise-decouple": ("EXACT_ROWWISE_ADAGRAD", lambda: _wd("DECOUPLE")),
    "rowwise-counter": ("EXACT_ROWWISE_ADAGRAD", _counter),
    "emainplace": ("EMAINPLACE_ROWWISE_ADAGRAD", _ema),
}


def _tbe_buffers(model: Any) -> dict[str, torch.Tensor]:
    """Every persistent buffer of every fbgemm TBE in the model (momentum, prev_iter,
    row_counter, iter, ...), read from fbgemm's own state_dict, independent of deck."""
    out: dict[str, torch.Tensor] = {}
    ebc = model.module.sparse_arch.embedding_bag_collection  # DLRM's sharded EBC
    for i, lookup in enumerate(ebc._lookups):
        while not hasattr(lookup, "_emb_modules") and hasattr(lookup, "module"):
            lookup = lookup.module
        for j, emb in enumerate(lookup._emb_modules):
            tbe = emb._emb_module
            for k, v in tbe.state_dict().items():
                out[f"tbe:{i}.{j}.{k}"] = v.detach().clone()
            if tbe._used_rowwise_adagrad_with_counter:
                # Read by the COUNTER kernel, yet not in fbgemm 1.8's state_dict in that mode.
                out[f"tbe:{i}.{j}.iter"] = tbe.iter.detach().clone()
    assert out
    return out


def _state(model: Any, opt: Any, user: TrainState) -> dict[str, torch.Tensor]:
    return {**capture_state(model, opt, user), **_tbe_buffers(model)}


def _worker(rank: int, world_size: int, case: str, sharding: str, root: str) -> None:
    optimizer, extra = CASES[case]
    spec = ModelSpec(**SMALL, sharding=sharding, fused_optimizer=optimizer, fused_params=extra())
    uri = f"{root}/ckpt"
    config = deck.DeckConfig(uri=uri, delta_every_steps=EVERY)
    model, opt = build_model(spec)
    user = TrainState()
    captured: dict[int, dict[str, torch.Tensor]] = {}
    losses: dict[int, float] = {}
    with deck.enable(model, [opt], config, state=user) as ck:
        for step in range(STEPS + 1):
            if step:
                losses[step] = train_step(model, opt, spec, step)
                user.step = step
            if ck.step(step) is not None:
                captured[step] = _state(model, opt, user)
        kinds = [h.kind for h in ck.history]
    assert kinds == ["full"] + ["delta"] * (STEPS // EVERY), kinds
    dist.barrier()
    if rank == 0:
        # Tables whose optimizer rewrites unlooked rows go whole into every delta; others
        # hold only the (Zipf, few) looked-up rows.
        storage = open_storage(uri)
        for step, m in read_manifests(storage).items():
            rows: dict[tuple[str, int], int] = defaultdict(int)
            for part in read_rank_manifests(storage, m):
                for rec in part.shards:
                    rows[(rec.table, rec.col_offset)] += sum(c.rows for c in rec.chunks)
            full = m.kind.value == "full" or optimizer == "EMAINPLACE_ROWWISE_ADAGRAD"
            assert all((n == SMALL["rows"]) == full for n in rows.values()), (step, rows)
    for step in (RESUME, STEPS):
        model2, opt2 = build_model(spec, seed=99 + step)
        user2 = TrainState()
        with deck.DeltaCheckpointer(model2, [opt2], config, state=user2) as ck2:
            assert ck2.restore(step) == step
        bad = diff_states(captured[step], _state(model2, opt2, user2))
        assert not bad, f"{case}/{sharding} rank {rank} step {step}: {bad[:6]}"
    # Train on from the restore: the never-stopped losses, bitwise.
    model3, opt3 = build_model(spec, seed=7)
    with deck.enable(model3, [opt3], config) as ck3:
        assert ck3.restore(RESUME) == RESUME
        again = {s: train_step(model3, opt3, spec, s) for s in range(RESUME + 1, STEPS + 1)}
    assert again == {s: losses[s] for s in range(RESUME + 1, STEPS + 1)}, (case, again, losses)
    # A model that trained on restores in place too (fbgemm's cached step counter follows).
    with deck.enable(model3, [opt3], config) as ck3:
        assert ck3.restore(RESUME) == RESUME
        again2 = {s: train_step(model3, opt3, spec, s) for s in range(RESUME + 1, STEPS + 1)}
    assert again2 == again, (case, again2, again)


@pytest.mark.parametrize("sharding", ["table_wise", "column_wise"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_optimizer_restores_bitwise(tmp_path: Path, case: str, sharding: str) -> None:
    run_ranks(_worker, case, sharding, str(tmp_path))


def _another_update_rule(rank: int, world_size: int, root: str) -> None:
    from deck.errors import IncompatibleModelError

    def spec(optimizer: str, extra: dict[str, Any]) -> ModelSpec:
        return ModelSpec(
            **SMALL, sharding="table_wise", fused_optimizer=optimizer, fused_params=extra
        )

    def tbes(model: Any) -> list[Any]:
        ebc = model.module.sparse_arch.embedding_bag_collection
        return [e._emb_module for lookup in ebc._lookups for e in lookup._emb_modules]

    saved = spec("EMAINPLACE_ROWWISE_ADAGRAD", _ema())
    config = deck.DeckConfig(uri=f"{root}/ckpt", delta_every_steps=2)
    model, opt = build_model(saved)
    with deck.enable(model, [opt], config) as ck:
        for step in range(4):
            if step:
                train_step(model, opt, saved, step)
            ck.step(step)
    # The same state names and shapes ({weight, momentum1}), another rule: refused, named
    other, other_opt = build_model(spec("EXACT_ROWWISE_ADAGRAD", {}), seed=3)
    with (
        deck.enable(other, [other_opt], config) as ck2,
        pytest.raises(
            IncompatibleModelError,
            match=r"saved with another fused optimizer than this model's kernels run "
            r"\(EMAINPLACE_ROWWISE_ADAGRAD saved, EXACT_ROWWISE_ADAGRAD now\)",
        ),
    ):
        ck2.restore()
    # The same rule with another EMA schedule: the saved schedule is the kernel's again
    from fbgemm_gpu.tbe.config.optimizer_config import EmainplaceModeDefinition

    mode = EmainplaceModeDefinition(step_ema=3, step_start=2, step_ema_coef=0.25)
    again, again_opt = build_model(
        spec("EMAINPLACE_ROWWISE_ADAGRAD", {"emainplace_mode": mode}), seed=3
    )
    with deck.enable(again, [again_opt], config) as ck3:
        assert ck3.restore() == 2
    assert {tuple(sorted(t._emainplace_mode.items())) for t in tbes(again)} == {
        tuple(sorted(t._emainplace_mode.items())) for t in tbes(model)
    }


def test_a_checkpoint_of_another_fused_optimizer_is_refused(tmp_path: Path) -> None:
    """A break-it finding: a checkpoint of EMAINPLACE_ROWWISE_ADAGRAD tables restored into
    EXACT_ROWWISE_ADAGRAD ones without a word (the same states, another update rule) and an
    EMA schedule was dropped. The rule is saved and checked before anything is written; the
    EMA schedule is put back like the kernel's other arguments."""
    run_ranks(_another_update_rule, str(tmp_path), world_size=1)
