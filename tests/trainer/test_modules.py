"""TorchRec modules beyond plain EmbeddingBagCollection / EmbeddingCollection, on real 2-rank
gloo DMP models built with TorchRec's public APIs (as torchrec.distributed.test_utils does):

- FeatureProcessedEmbeddingBagCollection (position-weighted EBC): tables live in its inner
  sharded EBC, position weights are dense parameters; full + deltas restore bitwise into a fresh
  model and training on gives the same losses.
- Managed-collision collections: tests/trainer/test_managed_collision.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import deck
from deck.demo import capture_state, diff_states
from deck.testing.dist_harness import run_ranks

ROWS, DIM, BATCH, MAX_LEN = 400, 8, 16, 4
STEPS, EVERY, MORE = 9, 3, 3


def _fused() -> dict[str, Any]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return {
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "learning_rate": 0.05,
        "eps": 1e-8,
    }


class _FPModel(torch.nn.Module):
    def __init__(self, fp: torch.nn.Module):
        super().__init__()
        self.fp = fp
        self.over = torch.nn.Linear(2 * DIM, 1)

    def forward(self, kjt: Any) -> torch.Tensor:
        return self.over(self.fp(kjt).values()).squeeze(-1)


def _build_fp(seed: int, t1: str = "column_wise") -> tuple[Any, Any]:
    """A DMP over a position-weighted EBC: t0 table_wise on rank 0, t1 column_wise or row_wise
    (TorchRec then computes positions before the input dist) on both ranks."""
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fp_embeddingbag import (
        FeatureProcessedEmbeddingBagCollectionSharder,
    )
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"]
        )
        for i in range(2)
    ]
    fp = FeatureProcessedEmbeddingBagCollection(
        EmbeddingBagCollection(tables=tables, is_weighted=True, device=torch.device("meta")),
        PositionWeightedModuleCollection({"f0": MAX_LEN, "f1": MAX_LEN}),
    )
    module = _FPModel(fp)
    with torch.no_grad():  # position weights start at 1.0; make them differ between seeds
        for p in fp._feature_processors.parameters():
            p.uniform_(0.5, 1.5)
    sharder = FeatureProcessedEmbeddingBagCollectionSharder(
        EmbeddingBagCollectionSharder(fused_params=_fused())
    )
    ws = dist.get_world_size()
    plan = ShardingPlan(
        {
            "fp": construct_module_sharding_plan(
                fp,
                {
                    "t0": table_wise(rank=0, compute_kernel="fused"),
                    "t1": column_wise(ranks=[0, 1], compute_kernel="fused")
                    if t1 == "column_wise"
                    else row_wise(compute_kernel="fused"),
                },
                world_size=ws,
                device_type="cpu",
                sharder=sharder,
            )
        }
    )
    model = DistributedModelParallel(
        module, device=torch.device("cpu"), sharders=[sharder], plan=plan
    )
    params = dict(in_backward_optimizer_filter(model.named_parameters()))
    dense = KeyedOptimizerWrapper(params, lambda p: torch.optim.Adagrad(p, lr=0.05))
    return model, dense


def _fp_step(model: Any, dense: Any, step: int, rank: int) -> float:
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(0, MAX_LEN + 1, (2 * BATCH,), generator=g, dtype=torch.int32)
    ids = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=ids, lengths=lengths)
    labels = (torch.rand(BATCH, generator=g) < 0.3).float()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(kjt), labels)
    dense.zero_grad()
    loss.backward()
    dense.step()
    return float(loss.detach())


def _fp_job(rank: int, world_size: int, uri: str, out: str, t1: str) -> None:
    model, dense = _build_fp(seed=0, t1=t1)
    pw0 = {k: v.clone() for k, v in model.state_dict().items() if "position_weights" in k}
    assert len(pw0) == 2
    config = deck.DeckConfig(uri=uri, delta_every_steps=EVERY)
    with deck.enable(model, [dense], config) as ck:
        for step in range(STEPS + 1):
            if step:
                _fp_step(model, dense, step, rank)
            ck.step(step)
        assert [h.kind for h in ck.history] == ["full"] + ["delta"] * (STEPS // EVERY)
        assert all(h.rows < ck.history[0].rows for h in ck.history[1:])  # real deltas
    live = capture_state(model, dense)
    # The position weights trained (they are dense state, saved with the dense parameters).
    sd = model.state_dict()
    assert all(not torch.equal(sd[k], v) for k, v in pw0.items())
    losses = [_fp_step(model, dense, s, rank) for s in range(STEPS + 1, STEPS + 1 + MORE)]

    fresh, fresh_dense = _build_fp(seed=1, t1=t1)
    assert diff_states(live, capture_state(fresh, fresh_dense))  # it starts elsewhere
    with deck.enable(fresh, [fresh_dense], deck.DeckConfig(uri=uri)) as ck2:
        assert ck2.restore(STEPS) == STEPS
    bad = diff_states(live, capture_state(fresh, fresh_dense))
    again = [_fp_step(fresh, fresh_dense, s, rank) for s in range(STEPS + 1, STEPS + 1 + MORE)]
    save_file(
        {
            "bad": torch.tensor([len(bad)]),
            "losses": torch.tensor(losses, dtype=torch.float64),
            "again": torch.tensor(again, dtype=torch.float64),
        },
        f"{out}/r{rank}.safetensors",
    )
    assert not bad, f"rank {rank}: restored state differs: {bad[:8]}"


@pytest.mark.slow
@pytest.mark.parametrize("t1", ["column_wise", "row_wise"])
def test_feature_processed_ebc_restores_bitwise(tmp_path: Path, t1: str) -> None:
    """Position-weighted EBC (t0 table_wise, t1 column_wise or row_wise): a full and three deltas
    restore into a freshly built model bitwise (tables, rowwise momentum, position weights, dense
    parameters and optimizer), and training on gives the same losses as the model that never
    stopped."""
    run_ranks(_fp_job, str(tmp_path / "ckpt"), str(tmp_path), t1)
    for r in range(2):
        d = load_file(str(tmp_path / f"r{r}.safetensors"))
        assert int(d["bad"]) == 0
        assert torch.equal(d["losses"], d["again"]), (d["losses"], d["again"])
