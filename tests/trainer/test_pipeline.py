"""deck under TorchRec's training pipelines (``TrainPipelineSparseDist``, ``TrainPipelineBase``)
on real 2-rank gloo DMP models on CPU.

TrainPipelineSparseDist starts the NEXT batch's input dist (ids sent to the ranks that own the
rows) before the current step ends, but the lookups deck tracks run in the forward of the
current batch, so a checkpoint taken after ``pipeline.progress(it)`` holds exactly the rows the
trained batches touched. The pipeline has already pulled batches ahead from its iterator, so
the data position to resume from is the number of ``progress`` calls (the checkpoint's step),
not the loader's: the test resumes with a new pipeline over a new iterator starting at step + 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import deck
from deck.demo import ModelSpec, capture_state, diff_states, make_batch
from deck.testing.dist_harness import run_ranks

SPEC = ModelSpec(num_tables=2, rows=501, dim=8, batch=16, pooling=2)
STEPS, EVERY, MORE = 9, 3, 4
PIPELINES = ("TrainPipelineSparseDist", "TrainPipelineBase")


def _build(seed: int) -> tuple[Any, Any]:
    """DLRMTrain (forward(batch) -> (loss, output), as the pipelines expect) over t0 table_wise
    and t1 row_wise (uneven row shards), fused EXACT_ROWWISE_ADAGRAD."""
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=SPEC.dim, num_embeddings=SPEC.rows, feature_names=[f"f{i}"]
        )
        for i in range(SPEC.num_tables)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    module = DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=13,
            dense_arch_layer_sizes=[16, SPEC.dim],
            over_arch_layer_sizes=[16, 1],
            dense_device=torch.device("cpu"),
        )
    )
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-8}
    sharder = EmbeddingBagCollectionSharder(fused_params=fused)
    ws = dist.get_world_size()
    plan = ShardingPlan(
        {
            "model.sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
                ebc,
                {
                    "t0": table_wise(rank=0, compute_kernel="fused"),
                    "t1": row_wise(compute_kernel="fused"),
                },
                local_size=ws,
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
    dense = KeyedOptimizerWrapper(params, lambda p: torch.optim.Adagrad(p, lr=0.02))
    return model, dense


def _batches(rank: int, first: int, last: int) -> Iterator[Any]:
    """The data of steps ``first..last``: step s's batch is a pure function of (s, rank)."""
    from torchrec.datasets.utils import Batch

    for step in range(first, last + 1):
        dense, kjt, labels = make_batch(SPEC, step, rank)
        yield Batch(dense_features=dense, sparse_features=kjt, labels=labels)


def _pipeline(kind: str, model: Any, dense: Any) -> Any:
    from torchrec.distributed import train_pipeline

    return getattr(train_pipeline, kind)(model, dense, torch.device("cpu"))


def _loss(output: Any) -> float:
    return float(output[0])  # DLRMTrain's output: (loss, logits, labels), detached


def _job(rank: int, world_size: int, root: str) -> None:
    for kind in PIPELINES:
        uri = f"{root}/{kind}"
        model, dense = _build(seed=0)
        pipeline = _pipeline(kind, model, dense)
        it = _batches(rank, 1, STEPS + MORE)
        with deck.enable(model, [dense], deck.DeckConfig(uri=uri, delta_every_steps=EVERY)) as ck:
            for step in range(STEPS + 1):
                if step:
                    pipeline.progress(it)
                ck.step(step)
            assert [h.kind for h in ck.history] == ["full"] + ["delta"] * (STEPS // EVERY)
            assert all(h.rows < ck.history[0].rows for h in ck.history[1:])  # real deltas
            live = capture_state(model, dense)
            # The never-stopped run trains on through the same pipeline and iterator.
            losses = [_loss(pipeline.progress(it)) for _ in range(MORE)]

        fresh, fresh_dense = _build(seed=1)
        assert diff_states(live, capture_state(fresh, fresh_dense))  # it starts elsewhere
        with deck.enable(fresh, [fresh_dense], deck.DeckConfig(uri=uri)) as ck2:
            step = ck2.restore()
            assert step == STEPS
            bad = diff_states(live, capture_state(fresh, fresh_dense))
            assert not bad, f"{kind}, rank {rank}: restored state differs: {bad[:8]}"
            # Resume: a new pipeline over the data from the restored step on (the old pipeline's
            # loader had run ahead of its last trained batch).
            fresh_pipeline = _pipeline(kind, fresh, fresh_dense)
            fresh_it = _batches(rank, step + 1, STEPS + MORE)
            again = []
            for s in range(step + 1, step + 1 + MORE):
                again.append(_loss(fresh_pipeline.progress(fresh_it)))
                ck2.step(s)
        assert again == losses, (kind, rank, again, losses)


@pytest.mark.slow
def test_pipelines_restore_bitwise_and_train_on_alike(tmp_path: Path) -> None:
    """Through TrainPipelineSparseDist and TrainPipelineBase (t0 table_wise, t1 row_wise): a full
    and three deltas taken after ``progress`` restore into a fresh model bitwise (tables,
    momentum1, dense parameters and optimizer) and a new pipeline over the data from the restored
    step gives the same losses as the never-stopped pipeline (asserted on each rank)."""
    run_ranks(_job, str(tmp_path))
