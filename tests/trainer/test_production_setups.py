"""deck on the setups production TorchRec jobs use, trained through ``TrainPipelineSparseDist``
on real gloo DMP ranks, each checked against the run that never stopped:

- TorchRec's DLRM example recipe: ``CombinedOptimizer([model.fused_optimizer,
  KeyedOptimizerWrapper(dense)])`` driven by an LR schedule (a warmup+decay ``LambdaLR`` like the
  example's ``LRPolicyScheduler``, and ``StepLR``), the scheduler saved as user state; and
  TorchRec's ``WarmupOptimizer`` around that CombinedOptimizer (its dense part in a
  ``GradientClippingOptimizer``). The fused tables' learning rate
  is not in TorchRec's state_dict: deck saves every param group's hyperparameters itself.
- A dense arch with ``BatchNorm1d`` (running statistics differ per rank: DMP does not broadcast
  buffers) and ``Dropout`` (torch RNG), with no RNG code of the user's: deck saves both per rank.
- 4 ranks over a mixed row_wise / column_wise / table_wise / data_parallel plan, where a float sum
  over ranks depends on its order (DDP's gradient buckets are pinned at ``enable``).

Each restore is compared bitwise (tables, fused and dense optimizer state, every param group's
hyperparameters, every buffer, RNG) with the live state, the continued losses must equal the
uninterrupted run's, and so must the whole state after the last continued step.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import deck
from deck.demo import ModelSpec, capture_state, diff_states, make_batch
from deck.errors import UnsupportedError
from deck.testing.dist_harness import run_ranks

pytestmark = pytest.mark.slow

SPEC = ModelSpec(num_tables=4, rows=301, dim=8, batch=16, pooling=2)
STEPS, EVERY, MORE = 8, 4, 6  # full at 0, deltas at 4 and 8; then 6 more steps


def _module(seed: int, norm_and_dropout: bool) -> Any:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM, DLRMTrain

    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=SPEC.dim, num_embeddings=SPEC.rows, feature_names=[f"f{i}"]
        )
        for i in range(SPEC.num_tables)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    dlrm = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=13,
        dense_arch_layer_sizes=[16, SPEC.dim],
        over_arch_layer_sizes=[16, 1],
        dense_device=torch.device("cpu"),
    )
    if norm_and_dropout:
        dlrm.dense_arch = torch.nn.Sequential(  # type: ignore[assignment]
            torch.nn.BatchNorm1d(13), torch.nn.Dropout(0.2), dlrm.dense_arch
        )
    return DLRMTrain(dlrm)


def _build(
    seed: int,
    recipe: str,
    norm_and_dropout: bool,
    grid: bool = False,
    dense_in_backward: bool = False,
) -> tuple[Any, Any, Any]:
    """(model, the optimizer the pipeline steps and deck saves, the LR scheduler or None): t0
    table_wise (``grid``: grid_shard), t1 row_wise, t2 column_wise over two ranks, t3
    data_parallel; fused rowwise Adagrad; dense Adam in a KeyedOptimizerWrapper, combined with
    the fused one."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        grid_shard,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.clipping import GradientClipping, GradientClippingOptimizer
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage

    module = _module(seed, norm_and_dropout)
    ebc = module.model.sparse_arch.embedding_bag_collection
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-8}
    sharder = EmbeddingBagCollectionSharder(fused_params=fused)
    ws = dist.get_world_size()
    per_table = {
        "t0": table_wise(rank=ws - 1, compute_kernel="fused"),
        "t1": row_wise(compute_kernel="fused"),
        "t2": column_wise(ranks=[max(ws - 2, 0), ws - 1], compute_kernel="fused"),
        "t3": data_parallel(),
    }
    if grid:
        per_table["t0"] = grid_shard(host_indexes=[0])
    plan = ShardingPlan(
        {
            "model.sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
                ebc, per_table, local_size=ws, world_size=ws, device_type="cpu", sharder=sharder
            )
        }
    )
    wrapper = None
    if dense_in_backward:  # (kept out of DDP: its optimizer-in-backward needs an accelerator)
        from torchrec.distributed.model_parallel import DefaultDataParallelWrapper
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

        arch = list(module.model.dense_arch.named_parameters(prefix="model.dense_arch"))
        apply_optimizer_in_backward(torch.optim.Adam, [p for _, p in arch], {"lr": 0.01})
        wrapper = DefaultDataParallelWrapper(params_to_ignore=[n for n, _ in arch])
    model = DistributedModelParallel(
        module,
        device=torch.device("cpu"),
        sharders=[sharder],
        plan=plan,
        **({"data_parallel_wrapper": wrapper} if wrapper else {}),
    )
    params = dict(in_backward_optimizer_filter(model.named_parameters()))
    dense = KeyedOptimizerWrapper(params, lambda p: torch.optim.Adam(p, lr=0.01))
    combined = CombinedOptimizer([model.fused_optimizer, dense])
    if recipe == "warmup":  # nested: a warmup over fused + gradient-clipped dense
        clipped = GradientClippingOptimizer(
            dense, max_gradient=0.05, clipping=GradientClipping.NORM
        )
        combined = CombinedOptimizer([model.fused_optimizer, clipped])
        stages = [
            WarmupStage(policy=WarmupPolicy.LINEAR, max_iters=5, value=0.1),
            WarmupStage(policy=WarmupPolicy.STEP, max_iters=40, value=0.5, decay_iters=3),
        ]
        return model, WarmupOptimizer(combined, stages=stages, lr=0.05), None
    if recipe == "steplr":
        return model, combined, torch.optim.lr_scheduler.StepLR(combined, step_size=3, gamma=0.5)
    assert recipe == "warmup_decay"  # as TorchRec's DLRM example's LRPolicyScheduler shapes it
    warm, decay_start, decay_steps = 3, 6, 6

    def factor(i: int) -> float:
        if i < warm:
            return 0.1 + 0.9 * i / warm
        if i < decay_start:
            return 1.0
        return max(0.0, 1.0 - (i - decay_start) / decay_steps) ** 2

    return model, combined, torch.optim.lr_scheduler.LambdaLR(combined, factor)


def _batches(rank: int, first: int, last: int) -> Iterator[Any]:
    from torchrec.datasets.utils import Batch

    for step in range(first, last + 1):
        dense, kjt, labels = make_batch(SPEC, step, rank)
        yield Batch(dense_features=dense, sparse_features=kjt, labels=labels)


def _train(pipeline: Any, it: Iterator[Any], sched: Any) -> float:
    loss = float(pipeline.progress(it)[0])
    if sched is not None:
        sched.step()
    return loss


def _run(rank: int, root: str, recipe: str, norm_and_dropout: bool) -> None:
    """Train with checkpoints, restore into a fresh build, compare, train both on, compare."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    uri = f"{root}/{recipe}-{norm_and_dropout}"
    cpu = torch.device("cpu")
    model, opt, sched = _build(0, recipe, norm_and_dropout)
    pipeline = TrainPipelineSparseDist(model, opt, cpu)
    it = _batches(rank, 1, STEPS + MORE)
    config = deck.DeckConfig(uri=uri, delta_every_steps=EVERY)
    # Passed twice (a user's slip): saved once, so a restore given it once matches.
    given = [opt, opt] if recipe == "steplr" else [opt]
    with deck.enable(model, given, config, state=sched) as ck:
        assert len(ck._optimizers.dense) == 1, sorted(ck._optimizers.dense)
        for step in range(STEPS + 1):
            if step:
                _train(pipeline, it, sched)
            ck.step(step)
        assert ck.flush()
    live = capture_state(model, opt, full=True)
    losses = [_train(pipeline, it, sched) for _ in range(MORE)]
    end = capture_state(model, opt, full=True)
    if norm_and_dropout:
        _assert_rank_local(model)

    model2, opt2, sched2 = _build(1, recipe, norm_and_dropout)
    torch.manual_seed(1000 + rank)  # the fresh process's RNG is elsewhere
    assert diff_states(live, capture_state(model2, opt2, full=True))
    with deck.enable(model2, [opt2], config, state=sched2) as ck2:
        assert ck2.restore() == STEPS
        bad = diff_states(live, capture_state(model2, opt2, full=True))
        assert not bad, f"{recipe}, rank {rank}: {len(bad)} differ after restore: {bad[:6]}"
        pipeline2 = TrainPipelineSparseDist(model2, opt2, cpu)
        it2 = _batches(rank, STEPS + 1, STEPS + MORE)
        again = [_train(pipeline2, it2, sched2) for _ in range(MORE)]
    assert again == losses, (recipe, rank, again, losses)
    bad = diff_states(end, capture_state(model2, opt2, full=True))
    assert not bad, f"{recipe}, rank {rank}: {len(bad)} differ after training on: {bad[:6]}"


def _assert_rank_local(model: Any) -> None:
    """The case under test: BatchNorm statistics really differ across ranks."""
    mean = next(b for n, b in model.named_buffers() if n.endswith("running_mean"))
    gathered = [torch.empty_like(mean) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mean)
    assert not torch.equal(gathered[0], gathered[1])


def _recipes(rank: int, world_size: int, root: str) -> None:
    for recipe in ("warmup_decay", "steplr", "warmup"):
        _run(rank, root, recipe, norm_and_dropout=False)
    _refusals(f"{root}/refused")
    dist.barrier()


def _refusals(uri: str) -> None:
    """What deck cannot save is refused at enable, naming the optimizer and why."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper, OptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    class Stateful(OptimizerWrapper):  # keeps state deck does not know about
        pass

    model, opt, _ = _build(2, "steplr", False)
    config = deck.DeckConfig(uri=uri, delta_every_steps=1)
    with pytest.raises(UnsupportedError, match=r"Stateful.*OptimizerWrapper deck does not know"):
        deck.enable(model, [Stateful(CombinedOptimizer([opt]))], config)
    over_tables = KeyedOptimizerWrapper(
        dict(model.named_parameters()), lambda p: torch.optim.SGD(p, lr=0.1)
    )
    with pytest.raises(UnsupportedError, match="parameter of a sharded table"):
        deck.enable(model, [over_tables], config)
    # (a break-it finding: accepted, then every checkpoint failed blaming a gradient no step had
    # applied)
    zero = torch.distributed.optim.ZeroRedundancyOptimizer(
        [p for _, p in in_backward_optimizer_filter(model.named_parameters())],
        optimizer_class=torch.optim.Adam,
    )
    with pytest.raises(UnsupportedError, match="ZeroRedundancyOptimizer keeps each rank's share"):
        deck.enable(model, [zero], config)
    # Nothing was left installed: a later enable on the same model works.
    deck.enable(model, [opt], config).close()
    grid, grid_opt, _ = _build(3, "steplr", False, grid=True)
    with pytest.raises(UnsupportedError, match=r"grid_shard is not supported \(deck checkpoints"):
        deck.enable(grid, [grid_opt], config)
    # Training state out of every optimizer's reach (break-it findings: both restored without
    # a word, then trained apart): a DDP comm hook that keeps state (PowerSGD's error feedback)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    hooked, hooked_opt, _ = _build(4, "steplr", False)
    state = powerSGD_hook.PowerSGDState(process_group=None, start_powerSGD_iter=2)
    hooked._dmp_wrapped_module.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    with pytest.raises(UnsupportedError, match="DDP comm hook 'powerSGD_hook' keeps state"):
        deck.enable(hooked, [hooked_opt], config)
    stateless, stateless_opt, _ = _build(5, "steplr", False)  # (a stateless hook is fine)
    stateless._dmp_wrapped_module.register_comm_hook(None, default_hooks.fp16_compress_hook)
    deck.enable(stateless, [stateless_opt], config).close()
    # ... and dense parameters updated by an optimizer applied in backward
    inside, inside_opt, _ = _build(6, "steplr", False, dense_in_backward=True)
    with pytest.raises(UnsupportedError, match=r"dense parameters \['model.dense_arch"):
        deck.enable(inside, [inside_opt], config)


def _rank_local(rank: int, world_size: int, root: str, recipes: tuple[str, ...]) -> None:
    for recipe in recipes:
        _run(rank, root, recipe, norm_and_dropout=True)
    dist.barrier()


def _into_one_rank(rank: int, world_size: int, root: str) -> None:
    """The documented rule into another world size: rank 0's buffers, the process's own RNG."""
    import logging

    from deck.read.catalog import read_manifests, read_rank_manifests
    from deck.read.restore import read_state_file
    from deck.storage import open_storage

    uri = f"{root}/steplr-True"
    storage = open_storage(uri)
    saved = read_rank_manifests(storage, read_manifests(storage)[STEPS])[0].dense
    rank0 = read_state_file(storage, read_manifests(storage)[STEPS], saved)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("deck.trainer.loader").addHandler(handler)
    model, opt, sched = _build(1, "steplr", True)
    rng = torch.get_rng_state()
    with deck.enable(model, [opt], deck.DeckConfig(uri=uri), state=sched) as ck:
        assert ck.restore() == STEPS
    live = model.state_dict()
    means = [k for k in rank0 if k.endswith("running_mean")]
    assert means and all(torch.equal(live[k], rank0[k]) for k in means)
    assert torch.equal(torch.get_rng_state(), rng)
    assert any("every rank starts from rank 0's values" in m for m in seen), seen
    assert any("RNG states are not restored" in m for m in seen), seen
    # (its user state, the scheduler, is rank 0's: said, since a per-rank one would be wrong)
    assert any("user state is the saved rank's of its number" in m for m in seen), seen


def test_lr_schedules_and_warmup_restore_exactly(tmp_path: Path) -> None:
    """DLRM example recipe with a warmup+decay LambdaLR and StepLR, and WarmupOptimizer; plus
    refusals at enable (an unknown stateful wrapper, a dense optimizer over sharded tables)."""
    run_ranks(_recipes, str(tmp_path))


def test_batchnorm_statistics_and_dropout_rng_per_rank(tmp_path: Path) -> None:
    """BatchNorm running statistics (different on each rank) and the dropout RNG come back per
    rank without any user code; losses and the state after training on stay equal. Into one
    rank: rank 0's statistics and the process's own RNG, both logged."""
    run_ranks(_rank_local, str(tmp_path), ("steplr",))
    run_ranks(_into_one_rank, str(tmp_path), world_size=1)


def test_four_ranks_mixed_plan_trains_on_identically(tmp_path: Path) -> None:
    """4 ranks, row_wise / column_wise / table_wise / data_parallel, BatchNorm + dropout, under
    StepLR and under WarmupOptimizer(CombinedOptimizer([fused, GradientClippingOptimizer(dense)])):
    with 3+ ranks a gradient sum depends on its order, which deck pins at enable."""
    run_ranks(_rank_local, str(tmp_path), ("steplr", "warmup"), world_size=4)
