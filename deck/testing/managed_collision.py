"""Managed-collision (ZCH) models for tests: a DMP over TorchRec's
``ManagedCollisionEmbeddingCollection`` or ``ManagedCollisionEmbeddingBagCollection`` with
``MCHManagedCollisionModule`` remappers, row_wise on the fused kernel, its batches, a training
step, and a bitwise capture of every remapper's state (what TorchRec's state_dict holds of it and
what it keeps outside: Python counters, the id history, non-persistent buffers).

Evictions need the CPU kernel of ``fbgemm::reset_weight_momentum``
(:func:`deck.testing.fbgemm_cpu.enable_cpu_eviction`): :func:`build_mc` registers it when the
spec evicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from deck.testing.fbgemm_cpu import enable_cpu_eviction

DENSE_IN = 4


@dataclass(frozen=True)
class MCSpec:
    """A managed-collision model: ``collection`` "ec" or "ebc", ``tables`` tables of ``rows``
    slots (rows) each, raw ids drawn (Zipf) from ``[0, id_space)``, an eviction every
    ``eviction_interval`` training forwards (``None``: never within a run), policy "lfu",
    "lru" or "distance_lfu". ``remapper="hash"`` builds TorchRec's
    HashZchManagedCollisionModule instead of MCH (which fbgemm cannot train on CPU: its
    ``zero_collision_hash`` CPU kernel only looks ids up, it never inserts them)."""

    collection: str = "ec"
    tables: int = 2
    rows: int = 24
    dim: int = 8
    batch: int = 8  # per rank
    id_space: int = 4000
    eviction_interval: int | None = 3
    policy: str = "distance_lfu"
    remapper: str = "mch"
    seed: int = 0


class MCModel(torch.nn.Module):
    """The MC collection, then a linear layer over the pooled embeddings and dense features."""

    def __init__(self, mc: torch.nn.Module, spec: MCSpec):
        super().__init__()
        self.mc = mc
        self.bagged = spec.collection == "ebc"
        self.top = torch.nn.Linear(DENSE_IN + spec.dim * (spec.tables if self.bagged else 1), 1)

    def forward(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        out, _ = self.mc(kjt)
        if self.bagged:
            pooled = out.values()
        else:
            pooled = torch.stack(
                [
                    torch.segment_reduce(jt.values(), "sum", lengths=jt.lengths())
                    for jt in out.values()
                ]
            ).sum(0)
        return self.top(torch.cat([dense, pooled], dim=1)).squeeze(-1)


def build_mc(spec: MCSpec, seed: int | None = None, cpu_eviction: bool = True) -> tuple[Any, Any]:
    """(DMP, dense optimizer) of ``spec`` on the current process group; ``seed`` sets the
    initial weights. Registers the CPU eviction kernel for it when the spec evicts (unless
    ``cpu_eviction`` is False: then its first eviction fails as on a plain CPU install)."""
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
    from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
    from torchrec.distributed.mc_embeddingbag import (
        ManagedCollisionEmbeddingBagCollectionSharder,
    )
    from torchrec.distributed.mc_modules import ManagedCollisionCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.hash_mc_modules import HashZchManagedCollisionModule
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
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    torch.manual_seed(spec.seed if seed is None else seed)
    shape = dict(embedding_dim=spec.dim, num_embeddings=spec.rows)
    names = [f"t{i}" for i in range(spec.tables)]
    configs: list[Any]
    if spec.collection == "ebc":
        configs = [
            EmbeddingBagConfig(name=n, feature_names=[f"f{i}"], **shape)
            for i, n in enumerate(names)
        ]
    else:
        configs = [
            EmbeddingConfig(name=n, feature_names=[f"f{i}"], **shape) for i, n in enumerate(names)
        ]
    policies = {
        "lfu": LFU_EvictionPolicy,
        "lru": LRU_EvictionPolicy,
        "distance_lfu": DistanceLFU_EvictionPolicy,
    }
    # "Never" within a test's few steps; its history buffer is sized by it (ids x interval).
    interval = spec.eviction_interval or 1000
    ws = dist.get_world_size()

    def remapper() -> Any:
        if spec.remapper == "hash":
            return HashZchManagedCollisionModule(
                zch_size=spec.rows,
                device=torch.device("cpu"),
                total_num_buckets=ws,
                input_hash_size=spec.id_space,
            )
        return MCHManagedCollisionModule(
            zch_size=spec.rows,
            device=torch.device("cpu"),
            eviction_interval=interval,
            input_hash_size=spec.id_space,
            eviction_policy=policies[spec.policy](),
        )

    mcc = ManagedCollisionCollection({n: remapper() for n in names}, configs)
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-8}
    sharder: Any
    if spec.collection == "ebc":
        mc: Any = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables=configs, device=torch.device("meta")), mcc
        )
        sharder = ManagedCollisionEmbeddingBagCollectionSharder(
            EmbeddingBagCollectionSharder(fused_params=fused), ManagedCollisionCollectionSharder()
        )
    else:
        mc = ManagedCollisionEmbeddingCollection(
            EmbeddingCollection(tables=configs, device=torch.device("meta")), mcc
        )
        sharder = ManagedCollisionEmbeddingCollectionSharder(
            EmbeddingCollectionSharder(fused_params=fused), ManagedCollisionCollectionSharder()
        )
    module = MCModel(mc, spec)
    plan = ShardingPlan(
        {
            "mc": construct_module_sharding_plan(
                mc,
                {n: row_wise(compute_kernel="fused") for n in names},
                world_size=ws,
                local_size=ws,
                device_type="cpu",
                sharder=sharder,
            )
        }
    )
    model = DistributedModelParallel(
        module, device=torch.device("cpu"), sharders=[sharder], plan=plan
    )
    if spec.eviction_interval is not None and cpu_eviction:
        enable_cpu_eviction(model)
    params = dict(in_backward_optimizer_filter(model.named_parameters()))
    dense = KeyedOptimizerWrapper(params, lambda p: torch.optim.Adagrad(p, lr=0.02))
    return model, dense


def mc_batch(spec: MCSpec, step: int, rank: int) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """The batch of ``rank`` at ``step``: a pure function of (seed, step, rank). Raw ids follow a
    Zipf law spread over the id space, so a few ids recur (and win slots) and many are new."""
    from torchrec import KeyedJaggedTensor

    rng = np.random.default_rng([spec.seed, step, rank, 7])
    lengths = rng.integers(1, 4, size=(spec.tables, spec.batch))
    ids = (rng.zipf(1.3, size=int(lengths.sum())) * 0x9E3779B1) % spec.id_space
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(spec.tables)],
        values=torch.from_numpy(ids.astype(np.int64)),
        lengths=torch.from_numpy(lengths.reshape(-1).astype(np.int32)),
    )
    dense = torch.from_numpy(rng.standard_normal((spec.batch, DENSE_IN), dtype=np.float32))
    labels = torch.from_numpy((rng.random(spec.batch) < 0.3).astype(np.float32))
    return dense, kjt, labels


def train_mc_step(model: Any, dense_opt: Any, spec: MCSpec, step: int) -> float:
    """One training step (the forward remaps, and evicts every ``eviction_interval``)."""
    dense, kjt, labels = mc_batch(spec, step, dist.get_rank())
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, kjt), labels)
    dense_opt.zero_grad()
    loss.backward()
    dense_opt.step()
    return float(loss.detach())


def remapper_state(model: Any) -> dict[str, torch.Tensor]:
    """Every MCH remapper's state on this rank, read without deck: each buffer (persistent or
    not) and each number or tensor attribute in its ``__dict__`` (the counters TorchRec keeps
    outside its state_dict, the id history, the pending evictions). The id history and its
    metadata only up to the filled part (past it, TorchRec's buffer holds leftovers of earlier
    intervals it never reads again)."""
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    out: dict[str, torch.Tensor] = {}
    for path, m in model.named_modules():
        if not isinstance(m, MCHManagedCollisionModule):
            continue
        attrs = vars(m)
        buffers = {name for name, _ in m.named_buffers(recurse=False)}
        filled = int(attrs["_current_history_buffer_offset"])
        for name, buf in m.named_buffers():
            keep = buf[:filled] if name.startswith("_history_") else buf
            out[f"{path}.{name}"] = keep.detach().clone()
        for name, v in sorted(attrs.items()):
            if isinstance(v, bool | int | float):
                out[f"{path}.{name}"] = torch.tensor(v, dtype=torch.float64)
            elif isinstance(v, torch.Tensor) and name not in buffers:
                keep = v[:filled] if name.startswith("_history_") else v
                if name == "_evicted_emb_indices" and not attrs["_evicted"]:
                    continue  # consumed: the next eviction replaces it before any read
                out[f"{path}.{name}"] = keep.detach().clone()
    return out
