"""Every private attribute of torch / TorchRec / fbgemm-gpu that deck touches, in one place.

deck needs a few internals no public API exposes: the lookups of a sharded collection and the
fbgemm TBEs behind them, fbgemm's split optimizer-state buffers, the state TorchRec's optimizer
wrappers keep, and the DDP reducer's bucket rebuild. Each is read through a small named accessor
here, so an upgrade that moves one breaks this module only, with an :class:`UnsupportedError`
naming the attribute and the installed versions instead of an ``AttributeError`` deep in a
checkpoint. ``PRIVATE_ATTRIBUTES`` lists them; tests/test_architecture.py checks that no other
module of deck touches them.

Written against the versions the Makefile pins (torch 2.13, torchrec 1.8, fbgemm-gpu 1.8); on
another version a warning is logged once, at import.
"""

from __future__ import annotations

import importlib.metadata
import logging
import operator
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from deck.errors import UnsupportedError

logger = logging.getLogger(__name__)

# distribution -> the release series deck is tested with (Makefile: TORCH, TORCHREC, FBGEMM_*)
SUPPORTED = {"torch": "2.13.", "torchrec": "1.8.", "fbgemm-gpu": "1.8.", "fbgemm-gpu-cpu": "1.8."}

PRIVATE_ATTRIBUTES = (
    "_lookups",  # ShardedEmbedding(Bag)Collection: one lookup per sharding type
    "_sharding_types",  # ShardedEmbeddingBagCollection: sharding types, in lookup order
    "_sharding_type_to_sharding",  # ShardedEmbeddingCollection: the same, as a dict
    "_emb_modules",  # Grouped*Lookup: one kernel module per grouped config
    "_emb_module",  # Batched*Embedding*: the fbgemm TBE
    "_emainplace_mode",  # TBE: EMAINPLACE_ROWWISE_ADAGRAD's step_ema / step_start
    "_used_rowwise_adagrad_with_counter",  # TBE: COUNTER weight decay reads ``iter``
    "iter_cpu",  # TBE: step counter copy, not in the state_dict
    "_in_backward_optimizers",  # parameter marker of TorchRec's fused (in-backward) optimizers
    "_embedding_bag_collection",  # ShardedFeatureProcessedEmbeddingBagCollection's inner EBC
    "_optimizer",  # torchrec.optim.keyed.OptimizerWrapper: the wrapped optimizer
    "_get_warmup_state",  # WarmupOptimizer: (iteration, stage)
    "_warmup_param",  # WarmupOptimizer: the state key its step counter lives under
    "_step_num",  # GradientClippingOptimizer: steps taken
    "_has_rebuilt_buckets",  # DistributedDataParallel
    "_comm_hooks",  # DistributedDataParallel: (hook, state) pairs of register_comm_hook
    "_push_all_rebuilt_params",  # DDP reducer
    "_rebuild_buckets",  # DDP reducer
    "_deck_pinned_buckets",  # deck's own marker on a DDP module (a second enable)
    "_parameters",  # nn.Module: its own parameters by name (what register_parameter fills)
    "_buffers",  # nn.Module: its own buffers by name
    "_modules",  # nn.Module: its children by name
    "_asdict",  # namedtuple (fbgemm's OptimizerArgs): its fields as a dict
    "_replace",  # namedtuple: a copy with some fields replaced
    # Sharded managed-collision (ZCH) collections and TorchRec's MCHManagedCollisionModule:
    "_embedding_module",  # BaseShardedManagedCollisionEmbeddingCollection: the sharded EC/EBC
    "_managed_collision_collection",  # ... and its ShardedManagedCollisionCollection
    "_managed_collision_modules",  # ShardedManagedCollisionCollection: remapper by table
    "_evict",  # BaseShardedManagedCollisionEmbeddingCollection: resets the evicted rows
    "_mch_sorted_raw_ids",  # MCH: raw ids held, sorted (a buffer, sharded in the state_dict)
    "_mch_remapped_ids_mapping",  # MCH: the slot of each of them
    "_mch_metadata",  # MCH: the eviction policy's per-slot buffers by name (counts, ...)
    "_history_metadata",  # MCH: the policy's per-id history buffers by name (non-persistent)
    "_history_accumulator",  # MCH: ids seen since the last eviction (a plain attribute)
    "_input_history_buffer_size",  # MCH: its size, set by the first training batch
    "_current_history_buffer_offset",  # MCH: how much of it is filled
    "_current_iter",  # MCH: training iteration (Python int; -1 until the first one)
    "_last_eviction_iter",  # MCH: iteration of the last eviction
    "_evicted",  # MCH: evictions not yet handed to the collection's _evict
    "_evicted_emb_indices",  # MCH: ... their slots
    "_output_global_offset",  # MCH: first slot (table row) of this rank's remapper
    "_zch_size",  # MCH: its number of slots
)
# fbgemm's split (per-table, flat) state buffers: ``<p>_dev`` / ``_host`` / ``_uvm`` storage,
# ``<p>_offsets`` and ``<p>_placements`` (read by name with ``tbe_split_buffer``).
SPLIT_STORAGE_SUFFIXES = ("_dev", "_host", "_uvm")
# fbgemm EmbeddingLocation values: where a split state's table lives (dev / uvm / host buffer).
LOCATION_SUFFIX = {0: "_dev", 1: "_uvm", 2: "_uvm", 3: "_host", 4: "_host"}


def installed_versions() -> dict[str, str]:
    """The installed version of each distribution in ``SUPPORTED`` (absent ones left out)."""
    out = {}
    for dist in SUPPORTED:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def unsupported_versions() -> dict[str, str]:
    """The installed distributions outside the release series deck is tested with."""
    return {d: v for d, v in installed_versions().items() if not v.startswith(SUPPORTED[d])}


def _warn_untested_versions() -> None:
    other = unsupported_versions()
    if other:
        logger.warning(
            "deck: tested with torch 2.13.x, torchrec 1.8.x and fbgemm-gpu 1.8.x, found %s; deck "
            "reads a few of their internals (adapters/torchrec_compat.py) and refuses with "
            "UnsupportedError if one moved",
            ", ".join(f"{d} {v}" for d, v in sorted(other.items())),
        )


_warn_untested_versions()  # at import: once per process


def _moved(owner: Any, name: str) -> UnsupportedError:
    versions = ", ".join(f"{d} {v}" for d, v in sorted(installed_versions().items()))
    return UnsupportedError(
        f"{type(owner).__name__} has no attribute {name!r}: deck reads this internal of "
        f"torch/TorchRec/fbgemm, and the installed versions ({versions}) moved it. Install the "
        "versions the Makefile pins (torch 2.13, torchrec 1.8, fbgemm-gpu 1.8), or update "
        "adapters/torchrec_compat.py to the new location"
    )


def _get(owner: Any, name: str) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError:
        raise _moved(owner, name) from None


def _call(owner: Any, name: str) -> Any:
    return _get(owner, name)()


def _set(owner: Any, name: str, value: Any) -> None:
    if not hasattr(owner, name):
        raise _moved(owner, name)
    setattr(owner, name, value)


# ---- torch modules -----------------------------------------------------------------------------
def module_slots(module: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The live dicts of ``module``'s own parameters, buffers and children by name (what
    ``register_parameter`` / ``register_buffer`` / attribute assignment change): the cheap way
    to tell whether any was added, removed or replaced (``named_parameters()`` builds prefixed
    names and de-duplicates the whole tree)."""
    return _get(module, "_parameters"), _get(module, "_buffers"), _get(module, "_modules")


# ---- sharded collections and their lookups -------------------------------------------------
def lookups(module: Any) -> list[tuple[str, Any]]:
    """Each lookup of a sharded EmbeddingBagCollection / EmbeddingCollection with its sharding
    type, in order, unwrapped (data_parallel lookups sit inside a DDP ``module``) down to the
    module that holds ``grouped_configs``."""
    # EmbeddingBagCollection keeps a list of sharding types, EmbeddingCollection a dict; both
    # are in the order of ``_lookups``.
    types = getattr(module, "_sharding_types", None) or list(
        _get(module, "_sharding_type_to_sharding")
    )
    out = []
    for sharding_type, lookup in zip(types, _get(module, "_lookups"), strict=True):
        while not hasattr(lookup, "grouped_configs") and hasattr(lookup, "module"):
            lookup = lookup.module
        out.append((sharding_type, lookup))
    return out


def lookup_callers(model: torch.nn.Module) -> list[Any]:
    """Every module of ``model`` that calls lookups (sharded collections, those holding only
    data_parallel tables too), in module order: the same on every rank."""
    return [m for m in model.modules() if hasattr(m, "_lookups")]


def called_lookups(module: Any) -> list[torch.nn.Module]:
    """The lookup modules a sharded collection calls, in the order of :func:`lookups`, as it
    calls them (data_parallel ones still inside their DDP wrapper)."""
    return list(_get(module, "_lookups"))


def lookup_kernels(lookup: Any) -> list[Any] | None:
    """The kernel modules of an unwrapped lookup, one per grouped config; None for a lookup
    without any (it holds no fbgemm TBE)."""
    return getattr(lookup, "_emb_modules", None)


def kernel_tbe(kernel: Any) -> Any | None:
    """The fbgemm TBE behind a kernel module of a lookup, or None (not a TBE kernel)."""
    tbe = getattr(kernel, "_emb_module", None)
    return tbe if tbe is not None and hasattr(tbe, "embedding_specs") else None


def fp_inner_collection_path(plan_path: str) -> str:
    """Path of the inner ShardedEmbeddingBagCollection of the sharded FeatureProcessed EBC at
    ``plan_path`` ("" for the root)."""
    return f"{plan_path}._embedding_bag_collection" if plan_path else "_embedding_bag_collection"


def in_backward_optimized(param: Any) -> bool:
    """Whether ``param`` is updated by one of TorchRec's fused (in-backward) optimizers."""
    return hasattr(param, "_in_backward_optimizers")


# ---- managed-collision (ZCH) collections ------------------------------------------------
# Their state lives in TorchRec's MCHManagedCollisionModule partly outside any state_dict
# (Python attributes and non-persistent buffers): MCH_COUNTERS and the history are read and
# written here, by name, and nowhere else.
MCH_COUNTERS = (
    "_current_iter",
    "_last_eviction_iter",
    "_input_history_buffer_size",
    "_current_history_buffer_offset",
    "_evicted",
)


def mc_collections(module: Any) -> tuple[Any, Any]:
    """(sharded EmbeddingCollection / EmbeddingBagCollection, ShardedManagedCollisionCollection)
    of a sharded managed-collision collection."""
    return _get(module, "_embedding_module"), _get(module, "_managed_collision_collection")


def mc_inner_collection_path(plan_path: str) -> str:
    """Path of the inner sharded collection of the sharded managed-collision collection at
    ``plan_path`` ("" for the root)."""
    return f"{plan_path}._embedding_module" if plan_path else "_embedding_module"


def mc_remappers(mcc: Any) -> dict[str, Any]:
    """The remapper of each table of a ShardedManagedCollisionCollection (this rank's)."""
    return dict(_get(mcc, "_managed_collision_modules").items())


def mch_layout(mch: Any) -> tuple[int, int]:
    """(first slot, number of slots) of an MCHManagedCollisionModule: the table rows it maps
    ids to."""
    return int(_get(mch, "_output_global_offset")), int(_get(mch, "_zch_size"))


def mch_state(mch: Any) -> dict[str, Any]:
    """Everything an MCHManagedCollisionModule's next remaps and evictions depend on, live:
    ``sorted_raw_ids`` / ``remapped_ids`` / ``metadata`` (per slot, sorted by raw id), the
    counters of MCH_COUNTERS by name (without the leading underscore), ``history`` and
    ``history_metadata`` (the filled part of the ids seen since the last eviction, views) and
    ``evicted_indices`` (when ``evicted``)."""
    out: dict[str, Any] = {name[1:]: _get(mch, name) for name in MCH_COUNTERS}
    out["sorted_raw_ids"] = _get(mch, "_mch_sorted_raw_ids")
    out["remapped_ids"] = _get(mch, "_mch_remapped_ids_mapping")
    out["metadata"] = dict(_get(mch, "_mch_metadata"))
    filled = int(out["current_history_buffer_offset"])
    # The accumulator exists from the first training forward on (its size set by that batch).
    history = getattr(mch, "_history_accumulator", None)
    out["history"] = history[:filled] if history is not None else torch.empty(0, dtype=torch.int64)
    out["history_metadata"] = {k: v[:filled] for k, v in _get(mch, "_history_metadata").items()}
    if out["evicted"]:
        out["evicted_indices"] = _get(mch, "_evicted_emb_indices")
    return out


def set_mch_state(mch: Any, saved: dict[str, Any]) -> None:
    """Put a :func:`mch_state` back into an MCHManagedCollisionModule of the same layout: the
    per-slot buffers in place, the counters, and the history rebuilt at its saved size (as
    TorchRec's first training forward would have allocated it) with its filled part."""
    with torch.no_grad():
        _get(mch, "_mch_sorted_raw_ids").copy_(saved["sorted_raw_ids"])
        _get(mch, "_mch_remapped_ids_mapping").copy_(saved["remapped_ids"])
        live_meta = _get(mch, "_mch_metadata")
        for name, t in saved["metadata"].items():
            live_meta[name].copy_(t)
    for name in MCH_COUNTERS:
        value = saved[name[1:]]
        _set(mch, name, bool(value) if name == "_evicted" else int(value))
    size, filled = int(saved["input_history_buffer_size"]), int(saved["history"].numel())
    live_history = _get(mch, "_history_metadata")
    if size < 0:  # saved before its first training forward, which allocates the history
        if hasattr(mch, "_history_accumulator"):
            del mch._history_accumulator
        for name in list(live_history):
            delattr(mch, f"_history_{name}")  # a non-persistent buffer
        live_history.clear()
    else:
        history = torch.empty(size, dtype=torch.int64, device=mch.device)
        history[:filled] = saved["history"]
        mch._history_accumulator = history
        for name, t in saved["history_metadata"].items():
            buf = torch.zeros(size, dtype=torch.int64, device=mch.device)
            buf[:filled] = t
            # The names TorchRec registers them under (MCHManagedCollisionModule.
            # _init_history_buffers): non-persistent buffers.
            mch.register_buffer(f"_history_{name}", buf, persistent=False)
            live_history[name] = buf
    if saved["evicted"]:
        _set(mch, "_evicted_emb_indices", saved["evicted_indices"].clone())


def wrap_mc_evict(module: Any, before: Any) -> tuple[Any, Any]:
    """Make a sharded managed-collision collection call ``before(evictions)`` (table -> local
    rows to reset, or None) ahead of each reset of evicted rows. Returns (remove, intact):
    ``intact()`` is False once the instance no longer routes ``_evict`` through a wrapper.

    Installed as a method bound to ``module``, so a deep copy (``DistributedModelParallel.
    copy``) gets one bound to the copy, which resets the copy's rows through TorchRec's own
    method and tells ``before`` nothing: only ``module`` itself reports its evictions."""
    own = module.__dict__.get("_evict")  # an instance-level wrapper already there, kept
    owner = weakref.ref(module)
    held: list[Any] = [before]

    def _evict(self: Any, evictions: dict[str, Any]) -> None:
        mine = self is owner()
        if mine and held[0] is not None:
            held[0](evictions)
        if mine and own is not None:
            own(evictions)
        else:
            type(self)._evict(self, evictions)

    wrapper = types.MethodType(_evict, module)
    object.__setattr__(module, "_evict", wrapper)

    def remove() -> None:
        held[0] = None  # a wrapper installed behind this one keeps calling it: pass through
        if module.__dict__.get("_evict") is wrapper:
            if own is None:
                del module.__dict__["_evict"]
            else:
                object.__setattr__(module, "_evict", own)

    def intact() -> bool:
        return "_evict" in module.__dict__

    return remove, intact


# ---- fbgemm TBE ---------------------------------------------------------------------------
# The accessors below that default instead of raising read attributes some modules lack by
# design: a lookup without kernels, fbgemm's DenseTableBatchedEmbeddingBagsCodegen (data_parallel
# tables) without the split TBE's optimizer flags.
def tbe_emainplace_mode(tbe: Any) -> dict[str, Any]:
    """EMAINPLACE_ROWWISE_ADAGRAD's ``step_ema`` / ``step_start`` of ``tbe`` ({} if unset)."""
    return dict(getattr(tbe, "_emainplace_mode", None) or {})


def tbe_counter_weight_decay(tbe: Any) -> bool:
    """Whether ``tbe`` runs rowwise Adagrad with COUNTER weight decay (which reads ``iter``)."""
    return bool(getattr(tbe, "_used_rowwise_adagrad_with_counter", False))


def tbe_split_buffer(tbe: Any, name: str) -> torch.Tensor:
    """fbgemm's split-state buffer ``name`` (``<p>_dev``, ``<p>_offsets``, ...) of ``tbe``."""
    buf: torch.Tensor = _get(tbe, name)
    return buf


def tbe_reset_step_cache(tbe: Any) -> None:
    """Make ``tbe`` re-read its restored ``iter`` buffer: fbgemm counts steps in ``iter_cpu``
    (not a buffer) and re-reads ``iter`` only while ``iter_cpu`` is 0."""
    if hasattr(tbe, "iter_cpu"):
        tbe.iter_cpu.zero_()


def fused_optimizer_tbe(leaf: Any) -> Any | None:
    """The fbgemm TBE whose kernel a leaf of TorchRec's fused optimizer drives (its
    ``zero_grad()`` / ``step()`` copy ``param_groups[0]["lr"]`` into it), or None."""
    tbe = getattr(leaf, "_emb_module", None)
    return tbe if tbe is not None and hasattr(tbe, "learning_rate_tensor") else None


def tbe_kernel_arguments(tbe: Any) -> dict[str, Any]:
    """fbgemm's ``optimizer_args`` of ``tbe`` (eps, betas, weight decay, counter settings, ...)
    and ``gwd_lower_bound``: hyperparameters the backward kernel reads from the TBE itself
    (``update_hyper_parameters`` changes them), not from TorchRec's param_groups."""
    args = getattr(tbe, "optimizer_args", None)
    out: dict[str, Any] = dict(args._asdict()) if args is not None else {}
    if hasattr(tbe, "gwd_lower_bound"):
        out["gwd_lower_bound"] = tbe.gwd_lower_bound
    if tbe_emainplace_mode(tbe):  # (EMAINPLACE_ROWWISE_ADAGRAD's EMA schedule)
        out["emainplace_mode"] = tbe_emainplace_mode(tbe)
    return out


def tbe_optimizer_name(tbe: Any) -> str:
    """The update rule ``tbe``'s backward kernel runs: fbgemm's ``EmbOptimType`` name."""
    return str(_get(tbe, "optimizer").name)


def set_tbe_kernel_arguments(tbe: Any, values: dict[str, Any]) -> None:
    """Put :func:`tbe_kernel_arguments` values back into ``tbe``."""
    values = dict(values)
    if "gwd_lower_bound" in values:
        _set(tbe, "gwd_lower_bound", values.pop("gwd_lower_bound"))
    if "emainplace_mode" in values:
        _set(
            tbe, "_emainplace_mode", {k: float(v) for k, v in values.pop("emainplace_mode").items()}
        )
    if values:
        tbe.optimizer_args = _get(tbe, "optimizer_args")._replace(**values)


# ---- TorchRec optimizer wrappers ----------------------------------------------------------
def wrapped_optimizer(wrapper: Any) -> Any:
    """The optimizer a TorchRec ``OptimizerWrapper`` wraps."""
    return _get(wrapper, "_optimizer")


def warmup_state(wrapper: Any) -> tuple[int, int]:
    """(iteration, stage) of a ``WarmupOptimizer``."""
    iteration, stage = _call(wrapper, "_get_warmup_state")
    return int(iteration), int(stage)


def set_warmup_state(wrapper: Any, iteration: int, stage: int) -> None:
    """Put (iteration, stage) where ``WarmupOptimizer.step`` keeps it, and set the matching lr."""
    wrapper.state[_get(wrapper, "_warmup_param")] = {
        "warmup": torch.tensor([iteration, stage], dtype=torch.long)
    }
    wrapper.post_load_state_dict()


def clipping_steps(wrapper: Any) -> int:
    """Steps a ``GradientClippingOptimizer`` has taken."""
    return int(_get(wrapper, "_step_num"))


def set_clipping_steps(wrapper: Any, steps: int) -> None:
    """Set the steps a ``GradientClippingOptimizer`` has taken."""
    _set(wrapper, "_step_num", int(steps))


# ---- DistributedDataParallel --------------------------------------------------------------
def ddp_buckets_pinned(ddp: Any) -> bool:
    """Whether deck already pinned the gradient buckets of ``ddp`` (a second enable)."""
    return bool(getattr(ddp, "_deck_pinned_buckets", False))


def ddp_comm_hooks(ddp: Any) -> list[tuple[Any, Any]]:
    """The ``(hook, state)`` pairs registered on ``ddp`` with ``register_comm_hook``."""
    return list(getattr(ddp, "_comm_hooks", None) or [])


def ddp_has_rebuilt_buckets(ddp: Any) -> bool:
    """Whether ``ddp`` already rebuilt its gradient buckets (training ran)."""
    return bool(getattr(ddp, "_has_rebuilt_buckets", False))


def ddp_rebuild_buckets_now(ddp: Any) -> None:
    """Collective. Rebuild the gradient buckets of ``ddp`` now, in parameter order, as DDP
    does after its first iteration, and mark them pinned."""
    reducer = ddp.reducer
    _call(reducer, "_push_all_rebuilt_params")
    if _call(reducer, "_rebuild_buckets"):
        ddp._has_rebuilt_buckets = True
    ddp._deck_pinned_buckets = True


# ---- torch tensors ------------------------------------------------------------------------
# autograd's version counter of a tensor: it grows with every in-place change (an optimizer
# step's update of a parameter). Read in a hook of every backward: a C getter, no wrapper.
tensor_version: Callable[[torch.Tensor], int] = operator.attrgetter("_version")
