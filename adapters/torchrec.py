"""TorchRec adapter: DistributedModelParallel with sharded EmbeddingBagCollection /
EmbeddingCollection tables on the fused (TBE) kernel.

Modules: EmbeddingBagCollection, EmbeddingCollection, FeatureProcessedEmbeddingBagCollection (its
inner EBC); ManagedCollision collections are refused. Sharding types: table_wise, column_wise,
table_column_wise, row_wise and table_row_wise (ids arrive shard-local: each row shard has its own
tracker base); data_parallel tables are replicated dense state and are saved in full by every
checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from deck.adapters.base import (
    ModelAdapter,
    Optimizers,
    RemovableHandle,
    TableShard,
    WrapperState,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.fp_embeddingbag import ShardedFeatureProcessedEmbeddingBagCollection
from torchrec.distributed.mc_embedding_modules import (
    BaseShardedManagedCollisionEmbeddingCollection,
)
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.optim.clipping import GradientClippingOptimizer
from torchrec.optim.keyed import CombinedOptimizer, OptimizerWrapper
from torchrec.optim.warmup import WarmupOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from deck.errors import IncompatibleModelError, UnsupportedError
from deck.trainer.tracker import TrackerStore

logger = logging.getLogger(__name__)

_FUSED_KERNELS = {"fused", "fused_uvm", "fused_uvm_caching"}
_TRACKED_TYPES = {"table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise"}
_DMP_PREFIXES = ("_dmp_wrapped_module.module.", "_dmp_wrapped_module.")


def _sharded_tensor_shards(t: Any) -> list[Any]:
    return list(t.local_shards()) if hasattr(t, "local_shards") else []


@dataclass(frozen=True)
class _TableInfo:
    module_path: str  # path of the sharded module inside the DMP-wrapped model ("" for the root)
    table: str  # state_dict key of the weight: the table's identity on disk
    name: str  # table name inside its module
    sharding_type: str


class TorchRecAdapter(ModelAdapter):
    """Adapter for a TorchRec :class:`DistributedModelParallel` (fused embedding kernels)."""

    def __init__(self, model: DistributedModelParallel):
        if not isinstance(model, DistributedModelParallel):
            raise UnsupportedError(
                f"deck needs a torchrec DistributedModelParallel model, got {type(model).__name__}"
            )
        self.model = model
        self._replicated: set[str] = set()
        self._tables = self._discover_tables()
        self._warned_full: set[str] = set()
        self._tbes: list[Any] = []

    # ---- discovery -------------------------------------------------------------------------
    def _discover_tables(self) -> dict[str, _TableInfo]:
        sd_keys = set(self.model.state_dict().keys())
        tables: dict[str, _TableInfo] = {}
        for plan_path, module_plan in self.model.plan.plan.items():
            module_path = self._lookup_module_path(plan_path)
            for name, ps in module_plan.items():  # type: ignore[attr-defined]
                prefix = f"{module_path}." if module_path else ""
                candidates = [
                    f"{prefix}embedding_bags.{name}.weight",
                    f"{prefix}embeddings.{name}.weight",
                ]
                key = next((k for k in candidates if k in sd_keys), None)
                if key is None:
                    raise UnsupportedError(
                        f"table {name!r} of module {plan_path!r}: no weight in state_dict"
                    )
                if ps.sharding_type == "data_parallel":
                    logger.info(
                        "table %s is data_parallel: saved in full with the dense state", key
                    )
                    self._replicated.add(key)
                    continue
                if ps.sharding_type not in _TRACKED_TYPES:
                    raise UnsupportedError(
                        f"table {key}: sharding type {ps.sharding_type} is not supported"
                    )
                if ps.compute_kernel not in _FUSED_KERNELS:
                    raise UnsupportedError(
                        f"table {key} uses compute kernel {ps.compute_kernel!r}: deck checkpoints sharded "
                        "tables on TorchRec's fused kernels (their optimizer state is per row); use "
                        "compute_kernel='fused' or shard it data_parallel"
                    )
                tables[key] = _TableInfo(module_path, key, name, ps.sharding_type)
        return tables

    def _lookup_module_path(self, plan_path: str) -> str:
        """Path of the sharded module that owns the lookups of the tables ``plan_path`` shards.

        A FeatureProcessedEmbeddingBagCollection shards into a wrapper whose tables, fused
        optimizer states and tracker hooks belong to its inner ShardedEmbeddingBagCollection
        (``<path>._embedding_bag_collection``); its feature processors (position weights) are
        ordinary dense parameters. ManagedCollision collections are refused (see below).
        """
        root = self.model.module
        module = root.get_submodule(plan_path) if plan_path else root
        if isinstance(module, BaseShardedManagedCollisionEmbeddingCollection):
            raise UnsupportedError(
                f"module {plan_path!r} is a {type(module).__name__}: deck does not support "
                "managed-collision (ZCH) collections. Their evictions reset rows through "
                "fbgemm::reset_weight_momentum, which fbgemm-gpu-cpu has no CPU kernel for (so "
                "they cannot train, nor be tested, on CPU), and MCHManagedCollisionModule keeps "
                "remapping state outside its state_dict (the id history since the last eviction "
                "and the iteration of that eviction) that no restore could bring back exactly; "
                "use an EmbeddingCollection / EmbeddingBagCollection with hashed ids instead"
            )
        if isinstance(module, ShardedFeatureProcessedEmbeddingBagCollection):
            return (
                f"{plan_path}._embedding_bag_collection"
                if plan_path
                else "_embedding_bag_collection"
            )
        return plan_path

    def _sharded_modules(self) -> dict[str, Any]:
        root = self.model.module
        return {
            path: root.get_submodule(path) if path else root
            for path in {t.module_path for t in self._tables.values()}
        }

    # ---- state -----------------------------------------------------------------------------
    def table_shards(self) -> list[TableShard]:
        sd = self.model.state_dict()  # runs TorchRec's pre-state-dict hooks: caches are flushed
        opt_state = self.model.fused_optimizer.state_dict()["state"]
        shards: list[TableShard] = []
        for key in sorted(self._tables):
            info = self._tables[key]
            weight = sd[key]
            num_rows, num_cols = (int(s) for s in weight.size())
            wshards = sorted(
                _sharded_tensor_shards(weight), key=lambda s: tuple(s.metadata.shard_offsets)
            )
            # Optimizer states are ShardedTensors with one local shard per weight shard, in column
            # order (column-wise rowwise states are laid out shard after shard).
            per_state: dict[str, list[torch.Tensor]] = {}
            for sname, st in opt_state.get(key, {}).items():
                short = sname.split(".", 1)[1] if sname.startswith(info.name + ".") else sname
                local = sorted(
                    _sharded_tensor_shards(st), key=lambda s: tuple(s.metadata.shard_offsets)
                )
                if local:
                    per_state[short] = [s.tensor for s in local]
                elif isinstance(st, torch.Tensor):
                    per_state[short] = [st] * len(wshards)
            for i, ws in enumerate(wshards):
                row_off, col_off = (int(x) for x in ws.metadata.shard_offsets)
                rows, cols = (int(x) for x in ws.metadata.shard_sizes)
                states = {"weight": ws.tensor}
                scalars: dict[str, torch.Tensor] = {}
                for sname, tensors in per_state.items():
                    t = tensors[i] if i < len(tensors) else tensors[-1]
                    if t.dim() >= 1 and t.shape[0] == rows:
                        states[sname] = t
                    else:
                        scalars[sname] = t
                shards.append(
                    TableShard(
                        table=key,
                        num_rows=num_rows,
                        num_cols=num_cols,
                        row_offset=row_off,
                        rows=rows,
                        col_offset=col_off,
                        cols=cols,
                        states=states,
                        scalars=scalars,
                    )
                )
        self._add_tbe_state(shards)
        base = 0
        for s in shards:
            s.track_base = base
            base += s.rows
        return shards

    def _add_tbe_state(self, shards: list[TableShard]) -> None:
        """Add to ``shards`` what fbgemm's TBE keeps beyond TorchRec's fused optimizer state, and
        mark the shards whose rows the optimizer rewrites without a lookup as ``full_only``."""
        by_key = {(s.table, s.row_offset, s.col_offset): s for s in shards}
        by_name = {(t.module_path, t.name): t.table for t in self._tables.values()}
        self._tbes = []
        for path, module in self._sharded_modules().items():
            for tbe, tables in _tbes_of(module):
                self._tbes.append(tbe)
                full_reason = tbe_rewrites_unlooked_rows(tbe)
                per_table = tbe_table_states(tbe)
                scalars = tbe_scalars(tbe)
                for i, table in enumerate(tables):
                    tkey = by_name.get((path, table.name))
                    meta = table.local_metadata
                    if tkey is None or meta is None:  # data_parallel: saved with the dense state
                        continue
                    offs = meta.shard_offsets
                    shard = by_key.get((tkey, int(offs[0]), int(offs[1])))
                    if shard is None:
                        continue
                    for name, view in per_table[i].items():
                        shard.states.setdefault(name, view)
                    shard.scalars.update(scalars)
                    if full_reason is not None:
                        shard.full_only = True
                        if shard.table not in self._warned_full:
                            self._warned_full.add(shard.table)
                            logger.warning(
                                "table %s: %s; deck saves it in full on every checkpoint",
                                shard.table,
                                full_reason,
                            )

    def after_restore(self) -> None:
        # fbgemm counts steps in ``iter_cpu`` (not a buffer) and re-reads the restored ``iter``
        # buffer only while ``iter_cpu`` is 0.
        for tbe in self._tbes:
            if hasattr(tbe, "iter_cpu"):
                tbe.iter_cpu.zero_()

    def table_shapes(self) -> dict[str, tuple[int, int]]:
        sd = self.model.state_dict()
        return {k: (int(sd[k].size(0)), int(sd[k].size(1))) for k in sorted(self._tables)}

    def replicated_tables(self) -> dict[str, torch.Tensor]:
        sd = self.model.state_dict()
        return {k: sd[k] for k in sorted(self._replicated)}

    def dense_state(self) -> dict[str, torch.Tensor]:
        return {
            k: v
            for k, v in self.model.state_dict().items()
            if type(v) is torch.Tensor or isinstance(v, nn.Parameter)
        }

    def dense_buffers(self) -> set[str]:
        sd = self.model.state_dict(keep_vars=True)  # parameters stay nn.Parameter, buffers do not
        return {k for k, v in sd.items() if type(v) is torch.Tensor}

    def optimizers(self, optimizers: object) -> Optimizers:
        fused = {id(o) for o in _flatten(self.model.fused_optimizer)}
        fused.add(id(self.model.fused_optimizer))
        items: list[tuple[str, Any]]
        if optimizers is None:
            items = []
        elif isinstance(optimizers, dict):
            items = list(optimizers.items())
        elif isinstance(optimizers, (list, tuple)):
            items = [(str(i), o) for i, o in enumerate(optimizers)]
        else:
            items = [("0", optimizers)]
        out = Optimizers()
        for name, opt in items:
            for k, wrapper in enumerate(_wrappers(opt)):
                if id(wrapper) not in fused:
                    out.wrappers[f"{name}.w{k}"] = _wrapper_state(name, wrapper)
            # Leaves are named by their position among every leaf (fused ones included), as
            # checkpoints written before wrappers were unwrapped named them.
            for j, leaf in enumerate(_flatten(opt)):
                if id(leaf) in fused:
                    continue
                _check_dense_leaf(name, leaf)
                out.dense[f"{name}.{j}"] = leaf
        return out

    def fused_hyperparameters(self) -> dict[str, dict[str, Any]]:
        return {
            key: {"param_groups": _hyperparameters(leaf)}
            for leaf, keys in _fused_leaves(self.model.fused_optimizer, "")
            for key in keys
        }

    def load_fused_hyperparameters(self, saved: dict[str, dict[str, Any]], where: str) -> None:
        if not saved:  # written before deck saved them
            return
        distinct = {repr(v): v for v in saved.values()}
        for leaf, keys in _fused_leaves(self.model.fused_optimizer, ""):
            mine = {repr(saved[k]): saved[k] for k in keys if k in saved}
            # A table the saving rank did not hold (another plan or world size) takes the value
            # every saved table agrees on, if they do.
            choices = mine or distinct
            if len(choices) != 1:
                raise IncompatibleModelError(
                    f"{where}: the fused optimizer of tables {sorted(keys)[:4]} "
                    + (
                        "has no saved hyperparameters and the saved tables disagree"
                        if not mine
                        else f"has {len(mine)} different saved hyperparameter sets"
                    )
                    + "; restore with the plan the checkpoint was written with"
                )
            groups = next(iter(choices.values()))["param_groups"]
            if len(groups) != len(leaf.param_groups):
                raise IncompatibleModelError(
                    f"{where}: the fused optimizer of tables {sorted(keys)[:4]} has "
                    f"{len(leaf.param_groups)} param groups, the checkpoint {len(groups)}"
                )
            for live, hyper in zip(leaf.param_groups, groups, strict=True):
                live.update(hyper)
            # TorchRec hands param_groups[0]["lr"] to the TBE kernel in zero_grad()/step() only
            # (and the fused update runs in backward, before step()): push it now, so the first
            # step after a restore already uses the restored rate. zero_grad() of a fused
            # optimizer touches no gradient (it has none), it only sets the rate.
            leaf.zero_grad()

    def pin_reduction_order(self) -> None:
        for ddp in (m for m in self.model.modules() if isinstance(m, DistributedDataParallel)):
            _pin_buckets(ddp)

    # ---- tracking --------------------------------------------------------------------------
    def install_tracking(
        self, store: TrackerStore, shards: list[TableShard], is_active: Callable[[nn.Module], bool]
    ) -> RemovableHandle:
        bases = {(s.table, s.row_offset, s.col_offset): s.track_base for s in shards}
        by_name = {(t.module_path, t.name): t.table for t in self._tables.values()}
        undo: list[Callable[[], None]] = []
        for path, module in self._sharded_modules().items():
            key_plans = self._key_plans(path, module, by_name, bases)
            undo.append(_chain_hooks(module, key_plans, store, is_active))
        logger.info(
            "deck tracking installed on %d sharded module(s), %d rows", len(undo), store.num_rows
        )

        def remove() -> None:
            for u in undo:
                u()

        return RemovableHandle(remove)

    def _key_plans(
        self,
        path: str,
        module: Any,
        by_name: dict[tuple[str, str], str],
        bases: dict[tuple[str, int, int], int],
    ) -> dict[tuple[str, ...], torch.Tensor]:
        """For each lookup of ``module``: its KJT key order -> tracker base of each key's shard.

        A lookup splits its KJT by grouped config, and within a group by table, so key position
        j belongs to the j-th (table shard, feature) in that order; positions, not names, so
        duplicate feature names and several column shards on one rank stay distinct.
        """
        plans: dict[tuple[str, ...], torch.Tensor] = {}
        # EmbeddingBagCollection keeps a list of sharding types, EmbeddingCollection a dict; both
        # are in the order of ``_lookups``.
        types = getattr(module, "_sharding_types", None) or list(module._sharding_type_to_sharding)
        for sharding_type, lookup in zip(types, module._lookups, strict=True):  # type: ignore[arg-type]
            if sharding_type == "data_parallel":
                continue
            while not hasattr(lookup, "grouped_configs") and hasattr(lookup, "module"):
                lookup = lookup.module
            keys: list[str] = []
            key_bases: list[int] = []
            for config in lookup.grouped_configs:
                for table in config.embedding_tables:
                    offs = table.local_metadata.shard_offsets
                    tkey = by_name[(path, table.name)]
                    base = bases[(tkey, int(offs[0]), int(offs[1]))]
                    # Ids arrive shard-local; the tracker space is indexed by local row.
                    keys.extend(table.feature_names)
                    key_bases.extend([base] * len(table.feature_names))
            if not keys:  # no shard of this sharding type on this rank: nothing to track
                continue
            if tuple(keys) in plans:
                raise UnsupportedError(
                    f"module {path!r}: two lookups share the feature order {keys}"
                )
            plans[tuple(keys)] = torch.tensor(key_bases, dtype=torch.int64)
        return plans


_TBE_LAYOUT_BUFFERS = {
    "D_offsets",
    "feature_dims",
    "rows_per_table",
    "hash_size_cumsum",
    "bounds_check_warning",
    "table_wise_cache_miss",
    "placeholder_autograd_tensor",
    "lxu_cache_weights",
}

# fbgemm EmbeddingLocation values: where a split state's table lives (dev / uvm / host buffer).
_LOCATION_SUFFIX = {0: "_dev", 1: "_uvm", 2: "_uvm", 3: "_host", 4: "_host"}


def _tbes_of(module: Any) -> list[tuple[Any, list[Any]]]:
    """Every fbgemm TBE under a sharded module with its tables (ShardedEmbeddingTable, in the
    TBE's table order)."""
    out: list[tuple[Any, list[Any]]] = []
    for lookup in getattr(module, "_lookups", []):
        while not hasattr(lookup, "grouped_configs") and hasattr(lookup, "module"):
            lookup = lookup.module
        emb_modules = getattr(lookup, "_emb_modules", None)
        if emb_modules is None:
            continue
        for config, emb in zip(lookup.grouped_configs, emb_modules, strict=True):
            tbe = getattr(emb, "_emb_module", None)
            if tbe is not None and hasattr(tbe, "embedding_specs"):
                out.append((tbe, list(config.embedding_tables)))
    return out


def tbe_rewrites_unlooked_rows(tbe: Any) -> str | None:
    """Why fbgemm's TBE ``tbe`` changes rows that were not looked up in a step, or None.

    Read from the live module: EMAINPLACE_ROWWISE_ADAGRAD lerps the slow half of every row
    every ``step_ema`` steps (``ema_inplace``); ENSEMBLE_ROWWISE_ADAGRAD blends and swaps every
    row and its momentum2 (``ensemble_and_swap``). Weight decay modes (L2, DECOUPLE, COUNTER,
    DECOUPLE_GLOBAL, COWCLIP) run inside the backward kernel on looked-up rows only (COUNTER and
    the global mode catch up lazily from the per-row ``prev_iter``, which deck saves).
    """
    opt = getattr(getattr(tbe, "optimizer", None), "name", "")
    if opt == "EMAINPLACE_ROWWISE_ADAGRAD":
        mode = getattr(tbe, "_emainplace_mode", {})
        return (
            f"fbgemm optimizer {opt} rewrites every row every {int(mode.get('step_ema', 1))} "
            f"step(s) from step {int(mode.get('step_start', 0))} on (ema_inplace)"
        )
    if opt == "ENSEMBLE_ROWWISE_ADAGRAD":
        return f"fbgemm optimizer {opt} blends and swaps every row (ensemble_and_swap)"
    return None


def _split_prefixes(tbe: Any) -> list[str]:
    """The split (per-table, flat) states fbgemm persists: ``<p>_offsets`` buffers in its
    state_dict, with some storage behind them."""
    persistent = set(tbe.state_dict().keys())
    out = []
    for key in sorted(persistent):
        if not key.endswith("_offsets") or f"{key[:-8]}_placements" not in persistent:
            continue
        p = key[:-8]
        if sum(getattr(tbe, p + sfx).numel() for sfx in ("_dev", "_host", "_uvm")) > 0:
            out.append(p)
    return out


def tbe_table_states(tbe: Any) -> list[dict[str, torch.Tensor]]:
    """For each table of ``tbe``: every persistent per-row state fbgemm keeps for it (besides
    ``weights``), as a live view with the table's rows first: rowwise states (momentum1 of
    rowwise Adagrad, COUNTER's ``prev_iter`` / ``row_counter``) as 1-D, elementwise ones as
    (rows, dim)."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in tbe.embedding_specs]
    rows = [int(spec[0]) for spec in tbe.embedding_specs]
    dims = [int(spec[1]) for spec in tbe.embedding_specs]
    for p in _split_prefixes(tbe):
        if p == "weights":
            continue
        offsets = [int(x) for x in getattr(tbe, p + "_offsets").tolist()]
        placements = [int(x) for x in getattr(tbe, p + "_placements").tolist()]
        total = sum(getattr(tbe, p + sfx).numel() for sfx in ("_dev", "_host", "_uvm"))
        rowwise = total == sum(rows)
        for i in range(len(rows)):
            flat = getattr(tbe, p + _LOCATION_SUFFIX.get(placements[i], "_host"))
            n = rows[i] if rowwise else rows[i] * dims[i]
            view = flat[offsets[i] : offsets[i] + n]
            out[i][p] = view if rowwise else view.view(rows[i], dims[i])
    return out


def tbe_scalars(tbe: Any) -> dict[str, torch.Tensor]:
    """The TBE's persistent one-element buffers (e.g. the step counter ``iter`` that COUNTER
    weight decay and EMAINPLACE read, COUNTER's ``max_counter``): per-TBE optimizer scalars,
    saved whole with every checkpoint of each of its tables."""
    split: set[str] = set()
    for p in _split_prefixes(tbe):
        split.update(p + sfx for sfx in ("_dev", "_host", "_uvm", "_offsets", "_placements"))
    persistent = set(tbe.state_dict().keys())
    if getattr(tbe, "_used_rowwise_adagrad_with_counter", False):
        # COUNTER weight decay passes ``iter`` to its kernel, yet fbgemm 1.8 registers it
        # non-persistent in that mode (only Adam-family, EMA/ensemble and global decay persist it).
        persistent.add("iter")
    # Layout metadata (one entry per table or feature: one element for a one-table TBE) and
    # diagnostics (out-of-range id and cache-miss counts) are not optimizer state; saving them
    # would only tie a restore to the saved layout. Anything else one-element is kept, so a
    # buffer a newer fbgemm adds is saved rather than dropped.
    persistent -= _TBE_LAYOUT_BUFFERS
    out = {}
    for name, buf in tbe.named_buffers(recurse=False):
        if name in split or name not in persistent or buf.numel() != 1:
            continue
        out[f"tbe.{name}"] = buf
    return out


def _flatten(opt: Any) -> list[Any]:
    """The leaves of an optimizer tree: CombinedOptimizers and TorchRec's OptimizerWrappers
    (WarmupOptimizer, GradientClippingOptimizer, ...) opened, in order."""
    if isinstance(opt, CombinedOptimizer):
        return [leaf for _, sub in opt.optimizers for leaf in _flatten(sub)]
    if isinstance(opt, OptimizerWrapper):
        return _flatten(opt._optimizer)
    return [opt]


def _wrappers(opt: Any) -> list[Any]:
    """The OptimizerWrappers of an optimizer tree, outermost first."""
    if isinstance(opt, CombinedOptimizer):
        return [w for _, sub in opt.optimizers for w in _wrappers(sub)]
    if isinstance(opt, OptimizerWrapper):
        return [opt, *_wrappers(opt._optimizer)]
    return []


def _fused_leaves(opt: Any, prefix: str) -> list[tuple[Any, list[str]]]:
    """Every leaf of TorchRec's fused optimizer tree with the full keys of its parameters (the
    tables' state_dict keys), so hyperparameters are found by table whatever the grouping."""
    if isinstance(opt, CombinedOptimizer):
        return [
            leaf
            for key, sub in opt.optimizers
            for leaf in _fused_leaves(sub, CombinedOptimizer.prepend_opt_key(key, prefix))
        ]
    keys = [CombinedOptimizer.prepend_opt_key(k, prefix) for k in getattr(opt, "params", {})]
    return [(opt, keys)]


def _hyperparameters(opt: Any) -> list[dict[str, Any]]:
    """Every param group of ``opt`` without its parameters: lr, betas, weight decay, ... and
    whatever a scheduler added (``initial_lr``)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _wrapper_state(name: str, wrapper: Any) -> WrapperState:
    """How to save and restore what a TorchRec OptimizerWrapper keeps itself; refuses a wrapper
    deck does not know (it might keep state deck would silently drop)."""
    if isinstance(wrapper, WarmupOptimizer):

        def get_warmup() -> dict[str, Any]:
            iteration, stage = wrapper._get_warmup_state()
            return {"iter": int(iteration), "stage": int(stage)}

        def set_warmup(saved: dict[str, Any]) -> None:
            wrapper.state[wrapper._warmup_param] = {  # where WarmupOptimizer.step keeps it
                "warmup": torch.tensor([saved["iter"], saved["stage"]], dtype=torch.long)
            }
            wrapper.post_load_state_dict()  # sets the lr of the restored iteration

        return WrapperState(get_warmup, set_warmup)
    if isinstance(wrapper, GradientClippingOptimizer):

        def get_clip() -> dict[str, Any]:
            return {"step_num": int(wrapper._step_num)}

        def set_clip(saved: dict[str, Any]) -> None:
            wrapper._step_num = int(saved["step_num"])

        return WrapperState(get_clip, set_clip)
    if type(wrapper) is OptimizerWrapper:
        return WrapperState(dict, lambda saved: None)
    raise UnsupportedError(
        f"optimizer {name!r} contains a {type(wrapper).__name__}, a TorchRec OptimizerWrapper "
        "deck does not know: it may keep state outside the optimizers it wraps, which deck "
        "would not save. deck restores WarmupOptimizer, GradientClippingOptimizer and "
        "CombinedOptimizer exactly; pass the optimizers inside it instead and restore the "
        "wrapper's own state through enable(state=...)"
    )


def _check_dense_leaf(name: str, leaf: Any) -> None:
    """Refuse, at enable, a dense optimizer deck cannot save: one without a state_dict, or one
    over a sharded table's parameters (their state is the fused optimizer's, saved with the
    table's rows)."""
    if not hasattr(leaf, "state_dict") or not hasattr(leaf, "load_state_dict"):
        raise UnsupportedError(f"optimizer {name!r}: {type(leaf).__name__} has no state_dict()")
    params = getattr(leaf, "params", None)
    named = (
        list(params.items())
        if isinstance(params, dict)
        else [
            (f"param_groups[{i}][{j}]", p)
            for i, g in enumerate(leaf.param_groups)
            for j, p in enumerate(g["params"])
        ]
    )
    for key, p in named:
        if _sharded_tensor_shards(p) or hasattr(p, "_in_backward_optimizers"):
            raise UnsupportedError(
                f"optimizer {name!r} ({type(leaf).__name__}) holds {key}, a parameter of a "
                "sharded table: its optimizer state is TorchRec's fused optimizer's, saved with "
                "the table's rows. Build the dense optimizer over "
                "in_backward_optimizer_filter(model.named_parameters()) and pass "
                "model.fused_optimizer (or a CombinedOptimizer / wrapper holding it) for the tables"
            )


def _pin_buckets(ddp: DistributedDataParallel) -> None:
    """Collective. DDP sums gradients bucket by bucket, and gloo's ring allreduce sums each element
    in an order set by its position in its bucket; DDP rebuilds its buckets (in gradient-ready
    order) after the first iteration, so a process that starts from a restore would reduce its
    first step with another layout than the run that saved it, and with 3+ ranks its sums differ
    in the last bits. Rebuilding once now, in parameter order, fixes the layout for the whole run
    in both processes (TorchRec's DMP wraps its dense part with static_graph=True; tested
    there)."""
    if getattr(ddp, "_deck_pinned_buckets", False):  # a second enable on the same model
        return
    if getattr(ddp, "_has_rebuilt_buckets", False):
        logger.warning(
            "deck: DDP already rebuilt its gradient buckets (training ran before deck was "
            "enabled): with 3+ ranks the first step after a restore may sum gradients in another "
            "order; enable deck before the first training step"
        )
        return
    ddp.reducer._push_all_rebuilt_params()
    if ddp.reducer._rebuild_buckets():
        ddp._has_rebuilt_buckets = True
    ddp._deck_pinned_buckets = True  # type: ignore[assignment]


def _chain_hooks(
    module: Any,
    key_plans: dict[tuple[str, ...], torch.Tensor],
    store: TrackerStore,
    is_active: Callable[[nn.Module], bool],
) -> Callable[[], None]:
    """Install track/compact on ``module``, calling whatever callbacks were there before."""
    prev_lookup = module.post_lookup_tracker_fn
    prev_odist = module.post_odist_tracker_fn

    def on_lookup(features: KeyedJaggedTensor, embs: torch.Tensor, mod: Any, raw_ids: Any) -> None:
        if prev_lookup is not None:
            prev_lookup(features, embs, mod, raw_ids)
        if not is_active(module):
            return
        bases = key_plans.get(tuple(features.keys()))
        if bases is None or features.values().numel() == 0:
            return
        values = features.values()
        if features.variable_stride_per_key():
            per_key = torch.tensor(features.length_per_key(), device=values.device)
        else:
            per_key = features.lengths().view(len(bases), -1).sum(1)
        offsets = torch.repeat_interleave(
            bases.to(values.device), per_key, output_size=values.numel()
        )
        store.record(values.to(torch.int64) + offsets)

    def on_odist() -> None:
        if prev_odist is not None:
            prev_odist()
        store.compact()

    # The setters keep one callback each and warn when replacing one: clear, then register our
    # chained callback so a tracker installed before us (e.g. TorchRec's) keeps working.
    module.post_lookup_tracker_fn = None
    module.post_odist_tracker_fn = None
    module.register_post_lookup_tracker_fn(on_lookup)
    module.register_post_odist_tracker_fn(on_odist)

    def remove() -> None:
        if module.post_lookup_tracker_fn is on_lookup:
            module.post_lookup_tracker_fn = prev_lookup
        if module.post_odist_tracker_fn is on_odist:
            module.post_odist_tracker_fn = prev_odist

    return remove
