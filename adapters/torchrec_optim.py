"""TorchRec optimizer trees: leaves and wrappers of CombinedOptimizer / OptimizerWrapper trees,
the fused optimizer's leaves by table and the fbgemm TBEs behind them, what a wrapper keeps
itself, and the checks a dense optimizer must pass at enable."""

from __future__ import annotations

import warnings
from typing import Any

from deck.adapters.torchrec_compat import (
    clipping_steps,
    fused_optimizer_tbe,
    in_backward_optimized,
    set_clipping_steps,
    set_warmup_state,
    warmup_state,
    wrapped_optimizer,
)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torchrec.optim.clipping import GradientClippingOptimizer
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper, OptimizerWrapper
from torchrec.optim.warmup import WarmupOptimizer

from deck.errors import UnsupportedError
from deck.model import WrapperState


def global_shape(t: Any) -> tuple[int, ...]:
    """The whole (global) shape of a table's state-dict tensor. TorchRec's state dict still
    hands out ShardedTensors, whose every ``size()`` warns that torch deprecates them: the
    warning is TorchRec's to act on, and silenced here so that deck adds none of its own."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*deprecating ShardedTensor", category=FutureWarning
        )
        return tuple(int(s) for s in t.size())


def local_shards(t: Any) -> list[Any]:
    """The local shards of a ShardedTensor; [] for anything else."""
    return list(t.local_shards()) if hasattr(t, "local_shards") else []


def flatten(opt: Any) -> list[Any]:
    """The leaves of an optimizer tree: CombinedOptimizers and TorchRec's OptimizerWrappers
    (WarmupOptimizer, GradientClippingOptimizer, ...) opened, in order."""
    if isinstance(opt, CombinedOptimizer):
        return [leaf for _, sub in opt.optimizers for leaf in flatten(sub)]
    if isinstance(opt, OptimizerWrapper):
        return flatten(wrapped_optimizer(opt))
    return [opt]


def algorithm_class(leaf: Any) -> str:
    """The qualified class name of the algorithm a dense leaf runs: a KeyedOptimizerWrapper's
    inner optimizer (the wrapper's own class says nothing of the update it makes)."""
    algo = wrapped_optimizer(leaf) if isinstance(leaf, KeyedOptimizerWrapper) else leaf
    return f"{type(algo).__module__}.{type(algo).__qualname__}"


def wrappers(opt: Any) -> list[Any]:
    """The OptimizerWrappers of an optimizer tree, outermost first."""
    if isinstance(opt, CombinedOptimizer):
        return [w for _, sub in opt.optimizers for w in wrappers(sub)]
    if isinstance(opt, OptimizerWrapper):
        return [opt, *wrappers(wrapped_optimizer(opt))]
    return []


def fused_leaves(opt: Any, prefix: str) -> list[tuple[Any, list[str]]]:
    """Every leaf of TorchRec's fused optimizer tree with the full keys of its parameters (the
    tables' state_dict keys), so hyperparameters are found by table whatever the grouping."""
    if isinstance(opt, CombinedOptimizer):
        return [
            leaf
            for key, sub in opt.optimizers
            for leaf in fused_leaves(sub, CombinedOptimizer.prepend_opt_key(key, prefix))
        ]
    keys = [CombinedOptimizer.prepend_opt_key(k, prefix) for k in getattr(opt, "params", {})]
    return [(opt, keys)]


def fused_kernels(opt: Any) -> list[Any]:
    """The fbgemm TBEs behind TorchRec's fused optimizer tree, each once, in order."""
    found = [fused_optimizer_tbe(leaf) for leaf, _ in fused_leaves(opt, "")]
    return list({id(t): t for t in found if t is not None}.values())


def wrapper_state(name: str, wrapper: Any) -> WrapperState:
    """How to save and restore what a TorchRec OptimizerWrapper keeps itself; refuses a wrapper
    deck does not know (it might keep state deck would silently drop)."""
    if isinstance(wrapper, WarmupOptimizer):

        def get_warmup() -> dict[str, Any]:
            iteration, stage = warmup_state(wrapper)
            return {"iter": iteration, "stage": stage}

        def set_warmup(saved: dict[str, Any]) -> None:
            set_warmup_state(wrapper, saved["iter"], saved["stage"])

        return WrapperState(get_warmup, set_warmup)
    if isinstance(wrapper, GradientClippingOptimizer):

        def get_clip() -> dict[str, Any]:
            return {"step_num": clipping_steps(wrapper)}

        def set_clip(saved: dict[str, Any]) -> None:
            set_clipping_steps(wrapper, saved["step_num"])

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


def check_dense_leaf(name: str, leaf: Any) -> None:
    """Refuse, at enable, a dense optimizer deck cannot save: one without a state_dict, or one
    over a sharded table's parameters (their state is the fused optimizer's, saved with the
    table's rows)."""
    if not hasattr(leaf, "state_dict") or not hasattr(leaf, "load_state_dict"):
        raise UnsupportedError(f"optimizer {name!r}: {type(leaf).__name__} has no state_dict()")
    if isinstance(leaf, ZeroRedundancyOptimizer):
        # (a break-it finding: accepted, then every checkpoint failed, first blaming a gradient
        # no step had applied: each rank steps its share of the parameters only)
        raise UnsupportedError(
            f"optimizer {name!r}: ZeroRedundancyOptimizer keeps each rank's share of the state "
            "on that rank (its state_dict() needs consolidate_state_dict() on every rank "
            "first), which deck does not save: give deck the optimizer it wraps on every rank "
            "(the dense parameters are small next to the tables)"
        )
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
        if local_shards(p) or in_backward_optimized(p):
            raise UnsupportedError(
                f"optimizer {name!r} ({type(leaf).__name__}) holds {key}, a parameter of a "
                "sharded table: its optimizer state is TorchRec's fused optimizer's, saved with "
                "the table's rows. Build the dense optimizer over "
                "in_backward_optimizer_filter(model.named_parameters()) and pass "
                "model.fused_optimizer (or a CombinedOptimizer / wrapper holding it) for the tables"
            )
