"""TorchRec adapter: DistributedModelParallel with sharded EmbeddingBagCollection /
EmbeddingCollection tables on the fused (TBE) kernel.

Modules: EmbeddingBagCollection, EmbeddingCollection, FeatureProcessedEmbeddingBagCollection (its
inner EBC), ManagedCollisionEmbedding(Bag)Collection with MCH remappers (its inner collection;
the remappers' state: adapters/torchrec_mc.py). Sharding types: table_wise, column_wise,
table_column_wise, row_wise and table_row_wise (ids arrive shard-local: each row shard has its own
tracker base); data_parallel tables are replicated dense state and are saved in full by every
checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from deck.adapters.tensor_slots import TensorSlots
from deck.adapters.torchrec_compat import (
    called_lookups,
    ddp_buckets_pinned,
    ddp_comm_hooks,
    ddp_has_rebuilt_buckets,
    ddp_rebuild_buckets_now,
    fp_inner_collection_path,
    fused_optimizer_tbe,
    in_backward_optimized,
    lookup_callers,
    lookups,
    tbe_optimizer_name,
    tbe_reset_step_cache,
)
from deck.adapters.torchrec_grads import GradientWatch
from deck.adapters.torchrec_hooks import chain_hooks, load_hooks, lookup_forward_hooks
from deck.adapters.torchrec_mc import ManagedCollision, module_state, prepare_restore
from deck.adapters.torchrec_optim import (
    algorithm_class,
    check_dense_leaf,
    flatten,
    fused_leaves,
    global_shape,
    local_shards,
    wrapper_state,
    wrappers,
)
from deck.adapters.torchrec_tbe import (
    load_tbe_kernel_hyperparameters,
    tbe_caches_rows,
    tbe_kernel_hyperparameters,
    tbe_rewrites_unlooked_rows,
    tbe_scalars,
    tbe_table_states,
    tbes_of,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.fp_embeddingbag import ShardedFeatureProcessedEmbeddingBagCollection
from torchrec.distributed.mc_embedding_modules import (
    BaseShardedManagedCollisionEmbeddingCollection,
)
from torchrec.distributed.model_parallel import DistributedModelParallel

from deck.errors import IncompatibleModelError, UnsupportedError
from deck.model import (
    ModelAdapter,
    Optimizers,
    RemovableHandle,
    RowRecorder,
    TableShard,
    hyperparameters,
    load_hyperparameters,
)

logger = logging.getLogger(__name__)

_FUSED_KERNELS = {"fused", "fused_uvm", "fused_uvm_caching"}
_TRACKED_TYPES = {"table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise"}


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
        # Managed-collision collections by the path of their inner collection (the holder of
        # their tables and lookups)
        self._mc: dict[str, ManagedCollision] = {}
        self._tables = self._discover_tables()
        self._refuse_state_deck_cannot_see()
        self._warned_full: set[str] = set()
        self._tbes: list[Any] = []
        self._grads: GradientWatch | None = None
        # Trainable dense parameters in none of the dense optimizers given (see watch_gradients)
        self._unwatched: list[tuple[str, torch.nn.Parameter]] = []
        self._said_unoptimized = False
        # table_shards() and dense_state(), with the generation of the model's tensors they were
        # read in: reused while no tensor moved (a state_dict walk would sit in every stall)
        self._slots: TensorSlots | None = None
        self._generation = 0
        self._shards: tuple[int | None, list[TableShard]] | None = None
        self._dense: tuple[int, dict[str, torch.Tensor]] | None = None

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
                        f"table {key}: sharding type {ps.sharding_type} is not supported (deck "
                        f"checkpoints {', '.join(sorted(_TRACKED_TYPES))} and data_parallel "
                        "tables): shard this table with one of those"
                    )
                if ps.compute_kernel not in _FUSED_KERNELS:
                    raise UnsupportedError(
                        f"table {key} uses compute kernel {ps.compute_kernel!r}: deck checkpoints sharded "
                        "tables on TorchRec's fused kernels (their optimizer state is per row); use "
                        "compute_kernel='fused' or shard it data_parallel"
                    )
                tables[key] = _TableInfo(module_path, key, name, ps.sharding_type)
        return tables

    def _dense_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The model's parameters outside its sharded tables, by name."""
        # (data_parallel tables are parameters of their sharded collection too)
        tables = {id(p) for m in self.sharded_modules().values() for p in m.parameters()}
        return [
            (n, p)
            for n, p in self.model.named_parameters()
            if id(p) not in tables and not local_shards(p)
        ]

    def _refuse_state_deck_cannot_see(self) -> None:
        """Training state held where no optimizer deck is given can reach it, which a restore
        would lose (break-it findings: both restored without a word, then trained apart)."""
        hidden = [n for n, p in self._dense_parameters() if in_backward_optimized(p)]
        if hidden:
            raise UnsupportedError(
                f"dense parameters {hidden[:4]} are updated by an optimizer applied in backward "
                "(apply_optimizer_in_backward), whose state deck cannot reach: a restore would "
                "lose it. Give them an ordinary dense optimizer and pass it to deck.enable"
            )
        for ddp in self._ddps():
            for hook, state in ddp_comm_hooks(ddp):
                if state is not None and not isinstance(state, dist.ProcessGroup):
                    raise UnsupportedError(
                        f"DDP comm hook {getattr(hook, '__name__', hook)!r} keeps state "
                        f"({type(state).__name__}: PowerSGD's error feedback and iteration "
                        "count, ...) that deck does not save, so training on after a restore "
                        "would differ; use a stateless hook (allreduce, fp16/bf16 compression) "
                        "or none"
                    )

    def _ddps(self) -> list[DistributedDataParallel]:
        """Every DDP of the model: its dense part's and those of data_parallel lookups (sharded
        collections keep their lookups in a plain list), each once, in the same order on every
        rank."""
        found = [m for m in self.model.modules() if isinstance(m, DistributedDataParallel)]
        for module in lookup_callers(self.model):
            found += [m for m in called_lookups(module) if isinstance(m, DistributedDataParallel)]
        return list({id(d): d for d in found}.values())

    def _lookup_module_path(self, plan_path: str) -> str:
        """Path of the sharded module that owns the lookups of the tables ``plan_path`` shards.

        A FeatureProcessedEmbeddingBagCollection shards into a wrapper whose tables, fused
        optimizer states and tracker hooks belong to its inner ShardedEmbeddingBagCollection
        (``<path>._embedding_bag_collection``); its feature processors (position weights) are
        ordinary dense parameters. A managed-collision collection shards into a wrapper
        whose tables and lookups belong to its inner collection (``<path>._embedding_module``)
        and whose remappers keep state of their own (adapters/torchrec_mc.py).
        """
        root = self.model.module
        module = root.get_submodule(plan_path) if plan_path else root
        if isinstance(module, BaseShardedManagedCollisionEmbeddingCollection):
            mc = ManagedCollision.of(plan_path, module)
            self._mc[mc.inner_path] = mc
            return mc.inner_path
        if isinstance(module, ShardedFeatureProcessedEmbeddingBagCollection):
            return fp_inner_collection_path(plan_path)
        return plan_path

    def rows_written_before_lookup(self) -> str | None:
        """TorchRec's pipelines replace a sharded module's forward: TrainPipelineSparseDist's
        (PipelinedForward) looks a batch up in its own step, like no pipeline; the semi-sync and
        prefetch pipelines' (EmbeddingPipelinedForward, PrefetchPipelinedForward) look the next
        batch up before this batch's update, and any other is unknown: both are refused."""
        from torchrec.distributed.train_pipeline.runtime_forwards import (
            BaseForward,
            PipelinedForward,
        )

        # A pipeline replaces the forward of the module the plan shards: for a managed-collision
        # collection, its wrapper (whose forward evicts, remaps and looks up).
        planned = dict(self.sharded_modules())
        planned.update({mc.path: mc.module for mc in self._mc.values()})
        for path, module in planned.items():
            forward = module.__dict__.get("forward")
            if isinstance(forward, BaseForward) and type(forward) is not PipelinedForward:
                return (
                    f"the sharded module {path or '(root)'} runs through a pipeline's "
                    f"{type(forward).__name__}, which looks the next batch up before this "
                    "batch's update"
                )
        return None

    def sharded_modules(self) -> dict[str, Any]:
        """The model's sharded embedding modules by path (the holders of its tables)."""
        root = self.model.module
        return {
            path: root.get_submodule(path) if path else root
            for path in {t.module_path for t in self._tables.values()}
        }

    # ---- state -----------------------------------------------------------------------------
    def _tensors_generation(self) -> int:
        """A number that changes whenever a parameter, buffer or submodule of the model moved
        (:class:`TensorSlots`) since the last call: views read in the same generation are live."""
        if self._slots is None or self._slots.moved():
            self._slots = TensorSlots(self.model)
            self._generation += 1
        return self._generation

    def table_shards(self) -> list[TableShard]:
        """The local shards as live views. Read from the state_dict once and reused while no
        tensor of the model moved (a reshard or reallocation re-reads them); read every time
        while a TBE caches rows (only a state walk, which flushes the cache, gives current
        tables)."""
        caching = any(tbe_caches_rows(tbe) for tbe in self._tbes)
        key = None if caching else self._tensors_generation()
        if key is None or self._shards is None or self._shards[0] != key:
            self._shards = (key, self._read_table_shards())
        return self._shards[1]

    def _read_table_shards(self) -> list[TableShard]:
        sd = self.model.state_dict()  # runs TorchRec's pre-state-dict hooks: caches are flushed
        opt_state = self.model.fused_optimizer.state_dict()["state"]
        shards: list[TableShard] = []
        for key in sorted(self._tables):
            info = self._tables[key]
            weight = sd[key]
            num_rows, num_cols = global_shape(weight)
            wshards = sorted(local_shards(weight), key=lambda s: tuple(s.metadata.shard_offsets))
            # Optimizer states are ShardedTensors with one local shard per weight shard, in column
            # order (column-wise rowwise states are laid out shard after shard).
            per_state: dict[str, list[torch.Tensor]] = {}
            for sname, st in opt_state.get(key, {}).items():
                short = sname.split(".", 1)[1] if sname.startswith(info.name + ".") else sname
                local = sorted(local_shards(st), key=lambda s: tuple(s.metadata.shard_offsets))
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
        for path, module in self.sharded_modules().items():
            for tbe, tables in tbes_of(module):
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
        for tbe in self._tbes:
            tbe_reset_step_cache(tbe)

    def table_shapes(self) -> dict[str, tuple[int, int]]:
        sd = self.model.state_dict()
        shapes = {k: global_shape(sd[k]) for k in sorted(self._tables)}
        return {k: (rows, cols) for k, (rows, cols) in shapes.items()}

    def replicated_tables(self) -> dict[str, torch.Tensor]:
        sd = self.model.state_dict()
        return {k: sd[k] for k in sorted(self._replicated)}

    def dense_state(self) -> dict[str, torch.Tensor]:
        """The dense state_dict entries (detached, live). Read once and reused while no
        parameter, buffer or submodule of the model moved."""
        key = self._tensors_generation()
        if self._dense is None or self._dense[0] != key:
            dense = {
                k: v
                for k, v in self.model.state_dict().items()
                if type(v) is torch.Tensor or isinstance(v, nn.Parameter)
            }
            self._dense = (key, dense)
        return dict(self._dense[1])

    def module_state(self) -> dict[str, Any]:
        """The remapping state of the managed-collision collections (adapters/torchrec_mc.py)."""
        return module_state(list(self._mc.values()), _world_size())

    def prepare_module_state(
        self, saved: dict[str, Any], saved_ranks: int, where: str
    ) -> Callable[[], None]:
        return prepare_restore(list(self._mc.values()), saved, saved_ranks, _world_size(), where)

    def optimizers(self, optimizers: object) -> Optimizers:
        fused = {id(o) for o in flatten(self.model.fused_optimizer)}
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
        out = Optimizers(
            sparse_grads=frozenset(
                id(m.weight)
                for m in self.model.modules()
                if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
            )
        )
        names = {id(p): n for n, p in self.model.named_parameters()}
        # An optimizer reached twice (listed twice, or also inside a combined one) is saved
        # and restored once, under its first name.
        seen = set(fused)
        for name, opt in items:
            for k, wrapper in enumerate(wrappers(opt)):
                if id(wrapper) not in seen:
                    seen.add(id(wrapper))
                    out.wrappers[f"{name}.w{k}"] = wrapper_state(name, wrapper)
            # Leaves are named by their position among every leaf (fused ones included), as
            # checkpoints written before wrappers were unwrapped named them.
            for j, leaf in enumerate(flatten(opt)):
                if id(leaf) in seen:
                    continue
                seen.add(id(leaf))
                check_dense_leaf(name, leaf)
                out.dense[f"{name}.{j}"] = leaf
                out.classes[f"{name}.{j}"] = algorithm_class(leaf)
                out.param_names[f"{name}.{j}"] = [
                    [names.get(id(p)) for p in g["params"]] for g in leaf.param_groups
                ]
        return out

    def watch_gradients(self, optimizers: Optimizers) -> RemovableHandle | None:
        if self._grads is not None:
            self._grads.handle.remove()
        watched = {
            id(p)
            for opt in optimizers.dense.values()
            for g in opt.param_groups
            for p in g["params"]
        }
        names = [(n, p) for n, p in self.model.named_parameters() if id(p) in watched]
        self._grads = GradientWatch(names)
        self._unwatched = [
            (n, p) for n, p in self._dense_parameters() if p.requires_grad and id(p) not in watched
        ]
        return self._grads.handle

    def unoptimized_parameters(self) -> list[str]:
        if self._said_unoptimized:
            return []
        got = [n for n, p in self._unwatched if p.grad is not None]
        self._said_unoptimized = bool(got)
        return got

    def unapplied_gradients(self) -> list[str]:
        return [] if self._grads is None else self._grads.unapplied()

    def fused_hyperparameters(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for leaf, keys in fused_leaves(self.model.fused_optimizer, ""):
            saved: dict[str, Any] = {"param_groups": hyperparameters(leaf)}
            tbe = fused_optimizer_tbe(leaf)
            if tbe is not None:
                saved["kernel"] = tbe_kernel_hyperparameters(tbe)
            out.update(dict.fromkeys(keys, saved))
        return out

    def check_fused_optimizers(
        self, saved: dict[str, dict[str, Any]], where: str, fresh: set[str]
    ) -> None:
        # Every kernel's difference in one error (an EmbeddingCollection's kernel beside an
        # EmbeddingBagCollection's was left out of it: a break-it finding)
        tables: list[str] = []
        rules: set[tuple[str, str]] = set()
        for leaf, held in self._saved_leaves(fresh):
            tbe = fused_optimizer_tbe(leaf)
            if tbe is None:
                continue
            choices, _ = _saved_for(saved, held)
            # (none in checkpoints of a deck before it saved them)
            found = {
                c["kernel"]["optimizer"]
                for c in choices.values()
                if "optimizer" in c.get("kernel", {})
            }
            live = tbe_optimizer_name(tbe)
            if found - {live}:
                tables += held
                rules.add(("/".join(sorted(found)), live))
        if tables:
            more = f" and {len(tables) - 6} more" if len(tables) > 6 else ""
            raise IncompatibleModelError(
                f"{where}: tables {sorted(tables)[:6]}{more} were saved with another fused "
                f"optimizer than this model's kernels run "
                f"({', '.join(f'{a} saved, {b} now' for a, b in sorted(rules))}): their saved "
                "optimizer state would be read by another update rule. Build the tables with "
                "the optimizer the job saved with (fused_params / the sharder's optimizer)"
            )

    def _saved_leaves(self, fresh: set[str]) -> Iterator[tuple[Any, list[str]]]:
        """Each fused optimizer with its tables the checkpoint holds state of: those not in
        ``fresh`` (a break-it finding: a table data_parallel in the checkpoint took every saved
        table's update rule and hyperparameters, and was refused where they differed); one of
        ``fresh`` tables only keeps the model's own."""
        for leaf, keys in fused_leaves(self.model.fused_optimizer, ""):
            held = [k for k in keys if k not in fresh]
            if held:
                yield leaf, held

    def load_fused_hyperparameters(
        self, saved: dict[str, dict[str, Any]], where: str, fresh: set[str]
    ) -> None:
        if not saved:  # written before deck saved them
            return
        for leaf, held in self._saved_leaves(fresh):
            choices, own = _saved_for(saved, held)
            if len(choices) != 1:
                raise IncompatibleModelError(
                    f"{where}: the fused optimizer of tables {sorted(held)[:4]} "
                    + (
                        "has no saved hyperparameters and the saved tables disagree"
                        if not own
                        else f"has {len(choices)} different saved hyperparameter sets"
                    )
                    + "; restore with the plan the checkpoint was written with"
                )
            groups = next(iter(choices.values()))["param_groups"]
            load_hyperparameters(
                leaf, groups, f"{where}: the fused optimizer of tables {sorted(held)[:4]}"
            )
            kernel = next(iter(choices.values())).get("kernel")
            tbe = fused_optimizer_tbe(leaf)
            if kernel is not None and tbe is not None:
                # The rate the kernel held at the checkpoint, which the next forward's backward
                # uses: not param_groups[0]["lr"] (a scheduler may have moved that since the
                # last zero_grad()/step() copied it into the kernel).
                load_tbe_kernel_hyperparameters(
                    tbe, kernel, f"{where}: the fused optimizer of tables {sorted(held)[:4]}"
                )
            else:
                # Written before deck saved the kernel's own values: the param group's rate is
                # the best there is. zero_grad() of a fused optimizer only sets the rate.
                leaf.zero_grad()

    def pin_reduction_order(self) -> None:
        # The dense part's DDP is a submodule; a data_parallel lookup's DDP is not (sharded
        # collections keep their lookups in a plain list), yet its gradient sum depends on its
        # bucket layout just the same. Every collection is walked, not only those holding
        # tracked tables: one of data_parallel tables alone has a DDP too. Every rank walks
        # them in the same order.
        for ddp in self._ddps():
            _pin_buckets(ddp)

    # ---- tracking --------------------------------------------------------------------------
    def install_tracking(
        self, store: RowRecorder, shards: list[TableShard], is_active: Callable[[nn.Module], bool]
    ) -> RemovableHandle:
        bases = {(s.table, s.row_offset, s.col_offset): s.track_base for s in shards}
        by_name = {(t.module_path, t.name): t.table for t in self._tables.values()}
        hooks: list[RemovableHandle] = []
        for path, module in self.sharded_modules().items():
            key_plans = self._key_plans(path, module, by_name, bases)
            mc = self._mc.get(path)
            install = chain_hooks if mc is None else lookup_forward_hooks
            hooks.append(install(module, called_lookups(module), key_plans, store, is_active))
            tables = {tkey for (mpath, _), tkey in by_name.items() if mpath == path}
            spans = [(s.track_base, s.track_base + s.rows) for s in shards if s.table in tables]
            hooks.append(load_hooks(module, spans, store))
            if mc is not None:
                # Row-wise: this rank holds one shard of each table (or none).
                table_bases = {
                    name: base
                    for (mpath, name), tkey in by_name.items()
                    if mpath == path
                    for (table, _, _), base in bases.items()
                    if table == tkey
                }
                hooks.append(mc.track_evictions(store, table_bases))
        logger.debug(
            "deck tracking installed on %d sharded module(s), %d rows",
            len(self.sharded_modules()),
            sum(s.rows for s in shards),
        )

        def remove() -> None:
            for h in hooks:
                h.remove()

        return RemovableHandle(remove, lambda: all(h.intact() for h in hooks))

    def _key_plans(
        self,
        path: str,
        module: Any,
        by_name: dict[tuple[str, str], str],
        bases: dict[tuple[str, int, int], int],
    ) -> list[torch.Tensor | None]:
        """For each lookup of ``module``, in order: the tracker base of each key of the KJT it
        looks up (None: nothing tracked there, a data_parallel lookup or no shard here).

        A lookup splits its KJT by grouped config, and within a group by table, so key position
        j belongs to the j-th (table shard, feature) in that order; lookups are told apart by
        which one runs (not by their keys: two tables of one collection may read the same
        feature under different sharding types), so duplicate feature names and several column
        shards on one rank stay distinct.
        """
        plans: list[torch.Tensor | None] = []
        for sharding_type, lookup in lookups(module):
            key_bases: list[int] = []
            if sharding_type != "data_parallel":
                for config in lookup.grouped_configs:
                    for table in config.embedding_tables:
                        offs = table.local_metadata.shard_offsets
                        tkey = by_name[(path, table.name)]
                        base = bases[(tkey, int(offs[0]), int(offs[1]))]
                        # Ids arrive shard-local; the tracker space is indexed by local row.
                        key_bases.extend([base] * len(table.feature_names))
            plans.append(torch.tensor(key_bases, dtype=torch.int64) if key_bases else None)
        return plans


def _world_size() -> int:
    """Ranks of the job (the default process group, which deck's collectives use)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _saved_for(
    saved: dict[str, dict[str, Any]], keys: list[str]
) -> tuple[dict[str, dict[str, Any]], bool]:
    """The distinct saved fused hyperparameter sets of the tables ``keys`` (one fused
    optimizer's), and whether they are the tables' own. The loader gives those of every saved
    part where this rank's part lacks some; a table no part holds (a checkpoint of a deck before
    it saved them per table) takes those of every saved table (one, if they agree)."""
    mine = {repr(saved[k]): saved[k] for k in keys if k in saved}
    return (mine, True) if mine else ({repr(v): v for v in saved.values()}, False)


def _pin_buckets(ddp: DistributedDataParallel) -> None:
    """Collective. DDP sums gradients bucket by bucket, and gloo's ring allreduce sums each element
    in an order set by its position in its bucket; DDP rebuilds its buckets (in gradient-ready
    order) after the first iteration, so a process that starts from a restore would reduce its
    first step with another layout than the run that saved it, and with 3+ ranks its sums differ
    in the last bits. Rebuilding once now, in parameter order, fixes the layout for the whole run
    in both processes (TorchRec's DMP wraps its dense part with static_graph=True; tested
    there)."""
    if ddp_buckets_pinned(ddp):  # a second enable on the same model
        return
    if ddp_has_rebuilt_buckets(ddp):
        logger.warning(
            "deck: DDP already rebuilt its gradient buckets (training ran before deck was "
            "enabled): with 3+ ranks the first step after a restore may sum gradients in another "
            "order; enable deck before the first training step"
        )
        return
    ddp_rebuild_buckets_now(ddp)
