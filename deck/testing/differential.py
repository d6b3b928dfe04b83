"""Differential runs of a drawn TorchRec setup: train with deck, restore into a fresh build in
another process, and compare with the run that never stopped.

A :class:`Setup` is plain data (its ``repr`` is a ready-to-paste test case). :func:`train_phase`
runs on every rank of one process group: it builds the setup, trains ``steps`` steps with
checkpoints and then ``more`` steps, and returns the live state at the restore point, the
losses after it and the final state. :func:`restore_phase` runs on the ranks of another process
group (processes that never trained this setup): it builds the setup with other initial
weights, restores, and trains on. :func:`compare` says what differs. A refusal at ``enable``
comes back as ``("refused", error class, message)`` from every rank.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import deck
from deck.config import StagingConfig
from deck.demo import capture_state, diff_states, state_leaves
from deck.errors import DeckError
from deck.testing.fbgemm_cpu import enable_cpu_eviction
from deck.testing.managed_collision import remapper_state

# Loop orders of one plain training step: F forward + loss, Z zero_grad, B backward, S
# optimizer step, L scheduler step. Every placement of zero_grad (before the forward, between
# forward and backward, after the step) and of the scheduler step (after the step, or first).
LOOP_ORDERS = ("ZFBSL", "FZBSL", "FBSZL", "LZFBS", "LFZBS", "LFBSZ")
PIPELINE = "pipeline"  # TorchRec's TrainPipelineSparseDist (zero_grad, forward, backward, step)

SHARDINGS_EBC = (
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "table_column_wise",
    "data_parallel",
)
# Variable batch per feature (VBE): EBC tables only (TorchRec's EC and MC collections take one
# batch size), under the sharding types whose output dist expands it back.
# (row_wise fails in gloo's allgather of uneven sizes in the backward, TorchRec alone.)
SHARDINGS_VBE = ("table_wise", "column_wise", "table_column_wise")
# Quantised comms (TorchRec's qcomm codecs): the precision of the forward and backward
# AllToAlls of every sharded collection.
QCOMMS = ("none", "fp16", "bf16")
# TorchRec 1.8's sharded EmbeddingCollection fails on CPU without deck with a data_parallel
# table ("split_with_sizes expects split_sizes to sum exactly to ..." in its output dist).
SHARDINGS_EC = ("table_wise", "row_wise", "column_wise")
SHARDINGS_FP = ("table_wise", "row_wise", "column_wise")
# Managed-collision collections ("mc_ec", "mc_ebc"): row_wise only (TorchRec's MC sharder), with
# MCH remappers over raw ids in [0, MC_ID_SPACE); evictions through deck.testing.fbgemm_cpu.
MC_COLLECTIONS = ("mc_ec", "mc_ebc")
MC_POLICIES = ("lfu", "lru", "distance_lfu")
MC_ID_SPACE = 1000
FUSED = (
    "EXACT_SGD",
    "EXACT_ADAGRAD",
    "EXACT_ROWWISE_ADAGRAD",
    "ROWWISE_L2",
    "ROWWISE_DECOUPLE",
    "ROWWISE_COUNTER",
    "EMAINPLACE_ROWWISE_ADAGRAD",
)
IN_BACKWARD = ("SGD", "Adagrad", "RowWiseAdagrad")  # torch / TorchRec optimizers per table
DENSE_IN = 4


@dataclass(frozen=True)
class Table:
    """One embedding table: its collection ("ebc", "ec", "fp": a position-weighted EBC, "mc_ec" /
    "mc_ebc": a managed-collision EC / EBC), rows, dim, the feature it reads, its sharding type
    and (with in-backward optimizers) its own optimizer; a managed-collision table's remapper
    evicts every ``eviction`` training forwards (0: never) with eviction policy ``policy``."""

    collection: str = "ebc"
    rows: int = 16
    dim: int = 8
    feature: str = "f0"
    sharding: str = "table_wise"
    fp16: bool = False
    mean_pooling: bool = False
    in_backward: str = "RowWiseAdagrad"
    eviction: int = 0
    policy: str = "lfu"


@dataclass(frozen=True)
class Setup:
    """A TorchRec training job and the checkpoint/restore done to it."""

    tables: tuple[Table, ...] = (Table(),)
    world_size: int = 2
    fused: str = "EXACT_ROWWISE_ADAGRAD"  # sharder-wide fused optimizer, or "in_backward"
    weighted: bool = False  # EBC tables read per-id weights
    dense_optimizer: str = "adam"  # "sgd" | "adam" | "adagrad"
    wrapper: str = "combined"  # "dense" | "combined" | "clipping" | "warmup" | "warmup_clipping"
    # "none" | "steplr" | "lambdalr" | "plateau": ReduceLROnPlateau stepped with each rank's own
    # loss, so the ranks' rates, and then their dense parameters, drift apart
    scheduler: str = "none"
    loop: str = "ZFBSL"  # one of LOOP_ORDERS, or PIPELINE
    steps: int = 6
    every: int = 2
    full_every: int | None = None
    restore_at: int | None = None  # a checkpoint step; None: the latest
    more: int = 3
    eval_every: int = 0
    dropout: bool = False
    batchnorm: bool = False
    batch: int = 4
    copy_on_write: str = "deltas"  # staging.copy_on_write
    # staging.mode ("threads" | "process"); None: StagingConfig's default (DECK_STAGING_MODE)
    staging_mode: str | None = None
    # Chunks of 16 KiB bundled into 64 KiB files (staging.chunk_bytes / bundle_bytes): the
    # shards of these small tables share bundles, at offsets other than 0
    bundled: bool = False
    vbe: bool = False  # each feature its own batch size, expanded by inverse indices
    qcomms: str = "none"  # one of QCOMMS
    # Restore into this many ranks (another plan): compared is the global state right after the
    # restore (tables and fused optimizer states assembled from every rank's shards, dense
    # state, user state); what training does next is another computation. None: the same.
    restore_world_size: int | None = None
    # After this step's checkpoint call, model.load_state_dict of a model built with other
    # weights (a warm start mid-run: rows no lookup touched change). None: none.
    warm_start_at: int | None = None

    def checkpoint_steps(self) -> list[int]:
        return [s for s in range(self.steps + 1) if s % self.every == 0]

    def target(self) -> int:
        return self.checkpoint_steps()[-1] if self.restore_at is None else self.restore_at


# ---- the model -------------------------------------------------------------------------------
class FuzzModel(torch.nn.Module):
    """Dense MLP (optional BatchNorm / Dropout) + pooled embedding collections -> one logit;
    ``forward(batch)`` returns ``(loss, logits)`` as TorchRec's train pipelines expect."""

    def __init__(self, sparse: dict[str, torch.nn.Module], out_dim: int, setup: Setup):
        super().__init__()
        self.sparse = torch.nn.ModuleDict(sparse)
        self.ec_features = {
            c: [t.feature for t in setup.tables if t.collection == c] for c in ("ec", "mc_ec")
        }
        dense: list[torch.nn.Module] = []
        if setup.batchnorm:
            dense.append(torch.nn.BatchNorm1d(DENSE_IN))
        dense += [torch.nn.Linear(DENSE_IN, 8), torch.nn.ReLU()]
        if setup.dropout:
            dense.append(torch.nn.Dropout(0.3))
        self.dense = torch.nn.Sequential(*dense)
        self.over = torch.nn.Linear(8 + out_dim, 1)

    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [self.dense(batch.dense_features)]
        for name, module in self.sparse.items():
            out = module(batch.sparse_features)
            if name in MC_COLLECTIONS:
                out = out[0]  # (embeddings, remapped ids or None)
            if name in self.ec_features:
                for f in self.ec_features[name]:  # by name: the pipeline traces this forward
                    jt = out[f]
                    parts.append(torch.segment_reduce(jt.values(), "sum", lengths=jt.lengths()))
            else:
                parts.append(out.values())
        logits = self.over(torch.cat(parts, dim=1)).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, logits


def _features(setup: Setup) -> list[str]:
    return sorted({t.feature for t in setup.tables})


def make_batch(setup: Setup, step: int, rank: int, seed: int = 7) -> Any:
    """The batch of ``rank`` at ``step``: a pure function of its arguments."""
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    rng = np.random.default_rng([seed, step, rank])
    keys = _features(setup)
    # An id of a managed-collision table is raw: drawn from its id space, remapped by TorchRec.
    smallest = {
        f: min(
            MC_ID_SPACE if t.collection in MC_COLLECTIONS else t.rows
            for t in setup.tables
            if t.feature == f
        )
        for f in keys
    }
    # VBE: feature k has its own batch size; inverse indices map the batch's samples onto them.
    sizes = rng.integers(1, setup.batch + 1, size=len(keys)) if setup.vbe else None
    lengths: list[np.ndarray] = (
        list(rng.integers(0, 4, size=(len(keys), setup.batch)))  # the draws before VBE came
        if sizes is None
        else [rng.integers(0, 4, size=int(b)) for b in sizes]
    )
    per_key = [int(x.sum()) for x in lengths]
    mc = {t.feature for t in setup.tables if t.collection in MC_COLLECTIONS}
    # Hot raw ids spread over the id space (they land on every rank's remapper).
    ids = [
        ((rng.zipf(1.3, size=int(n)) - 1) * (0x9E3779B1 if f in mc else 1)) % smallest[f]
        for f, n in zip(keys, per_key, strict=True)
    ]
    values = torch.from_numpy(np.concatenate(ids).astype(np.int64))
    weights = torch.from_numpy(rng.random(values.numel(), dtype=np.float32)) + 0.5
    weighted = setup.weighted or any(t.collection == "fp" for t in setup.tables)
    if sizes is None:
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=keys,
            values=values,
            lengths=torch.from_numpy(np.concatenate(lengths).astype(np.int32)),
            weights=weights if weighted else None,
        )
    else:
        inverse = np.stack([rng.integers(0, int(b), size=setup.batch) for b in sizes])
        kjt = KeyedJaggedTensor(
            keys=keys,
            values=values,
            weights=weights if weighted else None,
            lengths=torch.from_numpy(np.concatenate(lengths).astype(np.int32)),
            stride_per_key_per_rank=[[int(b)] for b in sizes],
            inverse_indices=(keys, torch.from_numpy(inverse.astype(np.int64))),
        )
    dense = torch.from_numpy(rng.standard_normal((setup.batch, DENSE_IN), dtype=np.float32))
    labels = torch.from_numpy((rng.random(setup.batch) < 0.4).astype(np.float32))
    return Batch(dense_features=dense, sparse_features=kjt, labels=labels)


def _fused_params(setup: Setup) -> dict[str, Any]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.tbe.config.optimizer_config import (
        CounterBasedRegularizationDefinition,
        CounterWeightDecayMode,
        EmainplaceModeDefinition,
        WeightDecayMode,
    )

    if setup.fused == "in_backward":
        return {}
    params: dict[str, Any] = {"learning_rate": 0.05, "eps": 1e-3}
    kind = setup.fused
    if kind.startswith("ROWWISE_"):
        mode = kind.removeprefix("ROWWISE_")
        params["optimizer"] = EmbOptimType.EXACT_ROWWISE_ADAGRAD
        params["weight_decay_mode"] = getattr(WeightDecayMode, mode)
        params["weight_decay"] = 0.01
        if mode == "COUNTER":
            params["counter_based_regularization"] = CounterBasedRegularizationDefinition(
                counter_weight_decay_mode=CounterWeightDecayMode.DECOUPLE, counter_halflife=3
            )
    else:
        params["optimizer"] = getattr(EmbOptimType, kind)
        if kind == "EMAINPLACE_ROWWISE_ADAGRAD":
            params["emainplace_mode"] = EmainplaceModeDefinition(
                step_ema=2, step_start=1, step_ema_coef=0.5
            )
    return params


def _qcomms(setup: Setup) -> dict[str, Any]:
    """The sharders' keyword for the setup's quantised comms (none: no keyword)."""
    if setup.qcomms == "none":
        return {}
    from torchrec.distributed.fbgemm_qcomm_codec import (
        CommType,
        QCommsConfig,
        get_qcomm_codecs_registry,
    )

    kind = {"fp16": CommType.FP16, "bf16": CommType.BF16}[setup.qcomms]
    config = QCommsConfig(forward_precision=kind, backward_precision=kind)
    return {"qcomm_codecs_registry": get_qcomm_codecs_registry(config)}


def _table_column_wise(ranks: list[int]) -> Any:
    """TorchRec's column_wise generator with the table_column_wise sharding type (the plan
    helpers have none for it): ``len(ranks)`` column shards, one per listed rank."""
    from torchrec.distributed.sharding_plan import (
        _get_parameter_sharding,
        _get_parameter_size_offsets,
    )
    from torchrec.distributed.types import ShardingType

    def generate(
        param: torch.nn.Parameter, local_size: int, world_size: int, device_type: str, sharder: Any
    ) -> Any:
        sizes = _get_parameter_size_offsets(
            param,
            ShardingType.COLUMN_WISE,
            local_size,
            world_size,
            col_wise_shard_dim=param.shape[1] // len(ranks),
        )
        return _get_parameter_sharding(
            param,
            ShardingType.TABLE_COLUMN_WISE.value,
            [(size, offset, rank) for (size, offset), rank in zip(sizes, ranks, strict=True)],
            local_size,
            device_type,
            sharder,
            compute_kernel="fused",
        )

    return generate


def _per_table(t: Table, ws: int, index: int) -> Any:
    from torchrec.distributed.sharding_plan import (
        column_wise,
        data_parallel,
        row_wise,
        table_row_wise,
        table_wise,
    )

    two = [index % ws, (index + 1) % ws]  # two column shards (on one rank when ws is 1)
    return {
        "table_wise": lambda: table_wise(rank=index % ws, compute_kernel="fused"),
        "row_wise": lambda: row_wise(compute_kernel="fused"),
        "column_wise": lambda: column_wise(ranks=two, compute_kernel="fused"),
        "table_column_wise": lambda: _table_column_wise(two),
        "table_row_wise": lambda: table_row_wise(host_index=0),
        "data_parallel": data_parallel,
    }[t.sharding]()


def build(setup: Setup, seed: int) -> tuple[Any, Any, Any]:
    """(DMP model, the optimizer the loop steps, the LR scheduler or None). Needs the process
    group of ``setup.world_size`` ranks."""
    from torchrec import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingCollection,
        EmbeddingConfig,
    )
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fp_embeddingbag import (
        FeatureProcessedEmbeddingBagCollectionSharder,
    )
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.embedding_configs import DataType, PoolingType
    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.clipping import GradientClipping, GradientClippingOptimizer
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage

    torch.manual_seed(seed)
    ws = setup.world_size
    meta = torch.device("meta")
    by_coll: dict[str, list[tuple[int, Table]]] = {}
    for i, t in enumerate(setup.tables):
        by_coll.setdefault(t.collection, []).append((i, t))

    def common(i: int, t: Table) -> dict[str, Any]:
        return {
            "name": f"t{i}",
            "embedding_dim": t.dim,
            "num_embeddings": t.rows,
            "feature_names": [t.feature],
            "data_type": DataType.FP16 if t.fp16 else DataType.FP32,
        }

    fused = _fused_params(setup)
    qcomms = _qcomms(setup)
    sparse: dict[str, torch.nn.Module] = {}
    sharders: list[Any] = []
    out_dim = 0
    weights_of: dict[str, list[tuple[int, Table, torch.nn.Parameter]]] = {}
    for coll, items in by_coll.items():
        if coll in MC_COLLECTIONS:
            sparse[coll], sharder_mc, weights_of[coll] = _managed_collision(
                coll, items, common, fused, qcomms
            )
            sharders.append(sharder_mc)
            out_dim += sum(t.dim for _, t in items)
            continue
        if coll == "ec":
            ec = EmbeddingCollection(
                tables=[EmbeddingConfig(**common(i, t)) for i, t in items], device=meta
            )
            sparse["ec"] = ec
            sharders.append(EmbeddingCollectionSharder(fused_params=fused, **qcomms))
            weights_of["ec"] = [(i, t, ec.embeddings[f"t{i}"].weight) for i, t in items]
            out_dim += sum(t.dim for _, t in items)
            continue
        configs = [
            EmbeddingBagConfig(
                **common(i, t), pooling=PoolingType.MEAN if t.mean_pooling else PoolingType.SUM
            )
            for i, t in items
        ]
        ebc = EmbeddingBagCollection(
            tables=configs, is_weighted=setup.weighted or coll == "fp", device=meta
        )
        weights_of[coll] = [(i, t, ebc.embedding_bags[f"t{i}"].weight) for i, t in items]
        out_dim += sum(t.dim for _, t in items)
        if coll == "fp":
            feats = sorted({t.feature for _, t in items})
            fp = FeatureProcessedEmbeddingBagCollection(
                ebc, PositionWeightedModuleCollection(dict.fromkeys(feats, 4))
            )
            with torch.no_grad():
                for name, p in fp.named_parameters():
                    if "position_weight" in name:
                        p.uniform_(0.5, 1.5)
            sparse["fp"] = fp
            sharders.append(
                FeatureProcessedEmbeddingBagCollectionSharder(
                    EmbeddingBagCollectionSharder(fused_params=fused, **qcomms)
                )
            )
        else:
            sparse["ebc"] = ebc
            sharders.append(EmbeddingBagCollectionSharder(fused_params=fused, **qcomms))
    if setup.fused == "in_backward":
        classes: dict[str, Any] = {"SGD": torch.optim.SGD, "Adagrad": torch.optim.Adagrad}
        for items3 in weights_of.values():
            for _, t, w in items3:
                if t.sharding == "data_parallel":
                    continue
                cls: Any = classes.get(t.in_backward, RowWiseAdagrad)
                apply_optimizer_in_backward(cls, [w], {"lr": 0.05})
    module = FuzzModel(sparse, out_dim, setup)
    plans = {}
    for name, coll_module in sparse.items():
        sharder = sharders[list(sparse).index(name)]
        per_table = {f"t{i}": _per_table(t, ws, i) for i, t in by_coll[name]}
        mp = construct_module_sharding_plan(
            coll_module,
            per_table,
            local_size=ws,
            world_size=ws,
            device_type="cpu",
            sharder=sharder,
        )
        for ps in mp.values():  # type: ignore[attr-defined]
            if ps.sharding_type == "table_row_wise":  # table_row_wise() picks "dense" otherwise
                ps.compute_kernel = "fused"
        plans[f"sparse.{name}"] = mp
    model = DistributedModelParallel(
        module, device=torch.device("cpu"), sharders=sharders, plan=ShardingPlan(plans)
    )
    if any(t.eviction for t in setup.tables if t.collection in MC_COLLECTIONS):
        enable_cpu_eviction(model)  # TorchRec's eviction on CPU (tests only)
    params = dict(in_backward_optimizer_filter(model.named_parameters()))
    make_dense: Callable[[Any], torch.optim.Optimizer] = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        "adam": lambda p: torch.optim.Adam(p, lr=0.01),
        "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05),
    }[setup.dense_optimizer]
    dense: Any = KeyedOptimizerWrapper(params, make_dense)
    if setup.wrapper in ("clipping", "warmup_clipping"):
        dense = GradientClippingOptimizer(dense, max_gradient=0.5, clipping=GradientClipping.NORM)
    opt: Any = dense
    if setup.wrapper != "dense":
        opt = CombinedOptimizer([model.fused_optimizer, dense])
    if setup.wrapper.startswith("warmup"):
        stages = [
            WarmupStage(policy=WarmupPolicy.LINEAR, max_iters=3, value=0.2),
            WarmupStage(policy=WarmupPolicy.STEP, max_iters=50, value=0.5, decay_iters=2),
        ]
        opt = WarmupOptimizer(opt, stages=stages, lr=0.05)
    sched: Any = None
    if setup.scheduler == "steplr":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    elif setup.scheduler == "lambdalr":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / math.sqrt(i + 1))
    elif setup.scheduler == "plateau":
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    return model, opt, sched


def _managed_collision(
    coll: str,
    items: list[tuple[int, Table]],
    common: Callable[[int, Table], dict[str, Any]],
    fused: dict[str, Any],
    qcomms: dict[str, Any],
) -> tuple[torch.nn.Module, Any, list[tuple[int, Table, torch.nn.Parameter]]]:
    """A managed-collision EC ("mc_ec") or EBC ("mc_ebc") of ``items`` with an MCH remapper
    per table, its sharder, and its tables' weights (for in-backward optimizers)."""
    from torchrec import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingCollection,
        EmbeddingConfig,
    )
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
    from torchrec.distributed.mc_embeddingbag import (
        ManagedCollisionEmbeddingBagCollectionSharder,
    )
    from torchrec.distributed.mc_modules import ManagedCollisionCollectionSharder
    from torchrec.modules.mc_embedding_modules import (
        ManagedCollisionEmbeddingBagCollection,
        ManagedCollisionEmbeddingCollection,
    )
    from torchrec.modules.mc_modules import (
        DistanceLFU_EvictionPolicy,
        LFU_EvictionPolicy,
        LRU_EvictionPolicy,
        ManagedCollisionCollection,
        MCHManagedCollisionModule,
    )

    meta = torch.device("meta")
    policies = {
        "lfu": LFU_EvictionPolicy,
        "lru": LRU_EvictionPolicy,
        "distance_lfu": DistanceLFU_EvictionPolicy,
    }
    configs: list[Any]
    inner: Any
    if coll == "mc_ebc":
        configs = [EmbeddingBagConfig(**common(i, t)) for i, t in items]
        inner = EmbeddingBagCollection(tables=configs, device=meta)
        weights = [(i, t, inner.embedding_bags[f"t{i}"].weight) for i, t in items]
    else:
        configs = [EmbeddingConfig(**common(i, t)) for i, t in items]
        inner = EmbeddingCollection(tables=configs, device=meta)
        weights = [(i, t, inner.embeddings[f"t{i}"].weight) for i, t in items]
    remappers = {
        f"t{i}": MCHManagedCollisionModule(
            zch_size=t.rows,
            device=torch.device("cpu"),
            # No eviction within a run: its history is sized by it (batch ids x interval).
            eviction_interval=t.eviction or 1000,
            input_hash_size=MC_ID_SPACE,
            eviction_policy=policies[t.policy](),
        )
        for i, t in items
    }
    mcc = ManagedCollisionCollection(remappers, configs)
    if coll == "mc_ebc":
        return (
            ManagedCollisionEmbeddingBagCollection(inner, mcc),
            ManagedCollisionEmbeddingBagCollectionSharder(
                EmbeddingBagCollectionSharder(fused_params=fused, **qcomms),
                ManagedCollisionCollectionSharder(),
            ),
            weights,
        )
    return (
        ManagedCollisionEmbeddingCollection(inner, mcc),
        ManagedCollisionEmbeddingCollectionSharder(
            EmbeddingCollectionSharder(fused_params=fused, **qcomms),
            ManagedCollisionCollectionSharder(),
        ),
        weights,
    )


class UserState:
    """The user's own state: the scheduler (if any) and the step."""

    def __init__(self, sched: Any) -> None:
        self.sched = sched
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.step}
        if self.sched is not None:
            out["sched"] = self.sched.state_dict()
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        if self.sched is not None:
            self.sched.load_state_dict(sd["sched"])


# ---- the loop --------------------------------------------------------------------------------
class Loop:
    """Trains one step at a time in the setup's loop order (or through the pipeline)."""

    def __init__(self, setup: Setup, model: Any, opt: Any, sched: Any, first: int) -> None:
        self.setup, self.model, self.opt, self.sched = setup, model, opt, sched
        self.rank = dist.get_rank()
        self.pipeline: Any = None
        self.warm: dict[str, Any] | None = None
        if setup.warm_start_at is not None and setup.warm_start_at + 1 >= first:
            # (built in every phase that trains past it, alike: the same weights; collective;
            # the RNG it seeds is put back, so that dropout draws as if it had not been built)
            with torch.random.fork_rng():
                self.warm = build(setup, seed=3)[0].state_dict()
        if setup.loop == PIPELINE:
            from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

            last = setup.steps + setup.more
            self.it: Iterator[Any] = (
                make_batch(setup, s, self.rank) for s in range(first, last + 1)
            )
            self.pipeline = TrainPipelineSparseDist(model, opt, torch.device("cpu"))

    def step(self, step: int) -> float:
        if self.warm is not None and step == self.setup.warm_start_at + 1:  # type: ignore[operator]
            self.model.load_state_dict(self.warm)
        if self.pipeline is not None:
            loss = float(self.pipeline.progress(self.it)[0])
            self._schedule(loss)
        else:
            loss = self._plain(step)
        if self.setup.eval_every and step % self.setup.eval_every == 0:
            self.model.eval()
            with torch.no_grad():
                self.model(make_batch(self.setup, 10_000 + step, self.rank))
            self.model.train()
        return loss

    def _schedule(self, loss: float | None) -> None:
        if self.sched is None:
            return
        if self.setup.scheduler != "plateau":
            self.sched.step()
        elif loss is not None:  # before this step's forward: nothing measured yet
            self.sched.step(loss)

    def _plain(self, step: int) -> float:
        batch = make_batch(self.setup, step, self.rank)
        loss: Any = None
        for op in self.setup.loop:
            if op == "F":
                loss = self.model(batch)[0]
            elif op == "Z":
                self.opt.zero_grad()
            elif op == "B":
                loss.backward()
            elif op == "S":
                self.opt.step()
            elif op == "L":
                self._schedule(float(loss.detach()) if loss is not None else None)
        return float(loss.detach())


def _capture(model: Any, opt: Any, user: UserState) -> dict[str, torch.Tensor]:
    state = capture_state(model, opt, full=True)
    # Managed-collision remappers: what TorchRec keeps outside its state_dict too.
    state.update({f"mch.{k}": v for k, v in remapper_state(model).items()})
    state.update({f"user.{k}": torch.tensor(float(v)) for k, v in _flat(user.state_dict())})
    return state


def _flat(x: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _flat(v, f"{prefix}{k}.")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _flat(v, f"{prefix}{i}.")
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield prefix, float(x)


def _config(setup: Setup, uri: str) -> deck.DeckConfig:
    return deck.DeckConfig(
        uri=uri,
        delta_every_steps=setup.every,
        full_every_steps=setup.full_every,
        lease_ttl_s=None,
        staging=StagingConfig.model_validate(
            {"copy_on_write": setup.copy_on_write}
            | ({} if setup.staging_mode is None else {"mode": setup.staging_mode})
            | ({"chunk_bytes": 16 * 1024, "bundle_bytes": 64 * 1024} if setup.bundled else {})
        ),
    )


def _global(model: Any, opt: Any, user: UserState) -> dict[str, torch.Tensor]:
    """Collective: the state as one process would hold it, independent of the plan: on rank 0,
    every sharded tensor of the model's and the fused optimizer's state dicts assembled from
    all ranks' shards, and the dense and user state (rank 0's); on other ranks, empty. RNG and
    the TBE kernels' own arguments are per rank, so not here."""
    shards: dict[str, tuple[list[int], list[tuple[list[int], torch.Tensor]]]] = {}
    plain: dict[str, torch.Tensor] = {}

    def put(prefix: str, state: Any) -> None:
        for name, v in state_leaves(prefix, state):
            if not hasattr(v, "local_shards"):  # (a ShardedTensor is a Tensor too)
                plain[name] = v
            else:
                shards[name] = (
                    list(v.size()),
                    [
                        (list(sh.metadata.shard_offsets), sh.tensor.detach())
                        for sh in v.local_shards()
                    ],
                )

    put("model", model.state_dict())
    put("fused", model.fused_optimizer.state_dict())
    put("dense_opt", opt.state_dict())
    _place_row_states_by_their_weights(shards)
    # Hyperparameters by parameter name: how params fall into groups depends on the plan (the
    # fused optimizer's groups are per kernel of each rank)
    names = {id(p): n for n, p in getattr(opt, "params", {}).items()}
    hyper = {
        names[id(p)]: {k: v for k, v in g.items() if k != "params"}
        for g in opt.param_groups
        for p in g["params"]
        if id(p) in names
    }
    if not hyper:  # (a wrapper's own state, TorchRec's warmup's, is a param of no group)
        raise AssertionError("no parameter of the optimizer is in a param group")
    plain.update({f"user.{k}": torch.tensor(float(v)) for k, v in _flat(user.state_dict())})
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (shards, hyper))
    if dist.get_rank() != 0:
        return {}
    for _, ranks_hyper in reversed(every):  # rank 0's last: it wins where ranks agree anyway
        for name, hp in ranks_hyper.items():
            put(f"hyper.{name}", hp)
    every = [ranks_shards for ranks_shards, _ in every]
    # A table's fused optimizer state is only on the ranks holding a shard of it
    sizes = {name: size for ranks in every for name, (size, _) in ranks.items()}
    for name, size in sizes.items():
        parts = [piece for ranks in every for piece in ranks.get(name, (size, []))[1]]
        whole = torch.zeros(size, dtype=parts[0][1].dtype)
        for offsets, t in parts:
            whole[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape, strict=True))] = t
        plain[name] = whole
    return plain


# Where a table's fused optimizer state sits in the global state: the fused optimizer's own, and
# a CombinedOptimizer's (the loop's optimizer, which holds the fused one).
ROW_STATE_PREFIXES = ("fused.state.", "dense_opt.state.")


def _place_row_states_by_their_weights(
    shards: dict[str, tuple[list[int], list[tuple[list[int], torch.Tensor]]]],
) -> None:
    """Give each one-value-per-row fused state of this rank its weight's row offset and row count.

    TorchRec 1.8 builds the ShardedTensors of the counter-based optimizers' states
    (``prev_iter``, ``row_counter``) with wrong metadata on the last rank of an uneven row-wise
    split (3 rows on 2 ranks: rank 1 says offset 1 of 2 rows, not offset 2 of 3), so a global
    state assembled from their own metadata drops or overwrites rows. The weight's shard of the
    same table on this rank has the layout every state of that table shares."""
    for name, (size, parts) in shards.items():
        prefix = next((p for p in ROW_STATE_PREFIXES if name.startswith(p)), None)
        if prefix is None or ".weight." not in name or len(size) != 1:
            continue
        weight = "model." + name.removeprefix(prefix).split(".weight.")[0] + ".weight"
        if weight not in shards or len(parts) != 1 or len(shards[weight][1]) != 1:
            continue
        weight_size, [(weight_offsets, weight_shard)] = shards[weight]
        (_, tensor) = parts[0]
        whole_rows = weight_shard.dim() == 2 and weight_shard.shape[1] == weight_size[1]
        if whole_rows and tensor.shape[0] == weight_shard.shape[0]:  # a block of rows
            shards[name] = ([weight_size[0]], [([weight_offsets[0]], tensor)])


def train_phase(rank: int, world_size: int, setup: Setup, uri: str) -> Any:
    """The uninterrupted run with checkpoints: ``(live state at the restore point, losses of the
    steps after it, state at the end)``, or ``("refused", class, message)``."""
    model, opt, sched = build(setup, seed=1)
    user = UserState(sched)
    try:
        ck = deck.enable(model, [opt], _config(setup, uri), state=user)
    except DeckError as e:
        return ("refused", type(e).__name__, str(e))
    loop = Loop(setup, model, opt, sched, first=1)
    target = setup.target()
    live: dict[str, torch.Tensor] = {}
    losses: list[float] = []
    with ck:
        for step in range(setup.steps + setup.more + 1):
            if step:
                loss = loop.step(step)
                user.step = step
                if step > target:
                    losses.append(loss)
            if step <= setup.steps:
                ck.step(step)
            if step == target:
                live = (_capture if setup.restore_world_size is None else _global)(model, opt, user)
        if not ck.flush():
            failed = [(e.step, e.error) for e in ck.history if e.state == "failed"]
            raise AssertionError(f"checkpoints did not commit: {failed}")
    if setup.restore_world_size is not None:
        return live, [], {}
    return live, losses, _capture(model, opt, user)


def restore_phase(rank: int, world_size: int, setup: Setup, uri: str) -> Any:
    """A process that never trained this setup: build with other weights (into
    ``restore_world_size`` ranks when set), restore the target step, train on. ``(state right
    after the restore, losses, state at the end)``; into another world size only the first,
    global (:func:`_global`)."""
    if setup.restore_world_size is not None:
        setup = dataclasses.replace(setup, world_size=world_size)
    model, opt, sched = build(setup, seed=2)
    user = UserState(sched)
    torch.manual_seed(1000 + rank)
    try:
        ck = deck.enable(model, [opt], _config(setup, uri), state=user)
    except DeckError as e:
        return ("refused", type(e).__name__, str(e))
    target = setup.target()
    with ck:
        got = ck.restore(target)
        if got != target:
            raise AssertionError(f"restore({target}) returned {got}")
        if setup.restore_world_size is not None:
            return _global(model, opt, user), [], {}
        restored = _capture(model, opt, user)
        loop = Loop(setup, model, opt, sched, first=target + 1)
        losses = []
        for step in range(target + 1, setup.steps + setup.more + 1):
            losses.append(loop.step(step))
            user.step = step
    return restored, losses, _capture(model, opt, user)


def compare(trained: list[Any], restored: list[Any]) -> list[str]:
    """What differs between the ranks' results of the two phases (empty: exact)."""
    problems: list[str] = []
    refused_a = [r for r in trained if isinstance(r, tuple) and r and r[0] == "refused"]
    if refused_a:
        if len(refused_a) != len(trained) or len({r[1] for r in refused_a}) != 1:
            problems.append(f"refused on some ranks only: {trained!r:.600}")
        return problems
    if len(trained) != len(restored):  # into another world size: rank 0's global states
        trained, restored = trained[:1], restored[:1]
    for rank, (a, b) in enumerate(zip(trained, restored, strict=True)):
        if isinstance(b, tuple) and b and b[0] == "refused":
            problems.append(f"rank {rank}: the restore's enable refused: {b}")
            continue
        bad = diff_states(a[0], b[0])
        if bad:
            problems.append(f"rank {rank}: {len(bad)} differ after the restore: {bad[:6]}")
        if [x.hex() for x in a[1]] != [x.hex() for x in b[1]]:  # bitwise; nan equals nan
            problems.append(f"rank {rank}: losses differ: {a[1]} vs {b[1]}")
        bad = diff_states(a[2], b[2])
        if bad:
            problems.append(f"rank {rank}: {len(bad)} differ after training on: {bad[:6]}")
    return problems


def pasteable(setup: Setup) -> str:
    """``setup`` as a pinned example to paste into tests/trainer/test_differential.py."""
    fields = {f.name: getattr(setup, f.name) for f in dataclasses.fields(setup)}
    return f"PINNED.append({Setup(**fields)!r})"


def bare_phase(rank: int, world_size: int, setup: Setup) -> list[float]:
    """The setup trained by TorchRec alone (no deck): its losses. A setup that fails here is
    one TorchRec cannot train, not one deck got wrong."""
    model, opt, sched = build(setup, seed=1)
    loop = Loop(setup, model, opt, sched, first=1)
    return [loop.step(step) for step in range(1, setup.steps + setup.more + 1)]
