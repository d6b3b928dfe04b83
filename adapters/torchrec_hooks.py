"""Hook chaining: deck's row tracking installed on a sharded TorchRec module through its public
``register_post_lookup_tracker_fn`` / ``register_post_odist_tracker_fn``, behind whatever
callbacks were there before (TorchRec's own tracker keeps working); and, for the inner
collection of a managed-collision collection (which never calls those callbacks), through
forward hooks on its lookup modules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from deck.model import RemovableHandle, RowRecorder


def chain_hooks(
    module: Any,
    lookup_modules: list[nn.Module],
    key_plans: list[torch.Tensor | None],
    store: RowRecorder,
    is_active: Callable[[nn.Module], bool],
) -> RemovableHandle:
    """Install track/compact on ``module``, calling whatever callbacks were there before.

    ``key_plans[i]`` holds the tracker base of each KJT key of ``lookup_modules[i]`` (None:
    nothing to track). The post-lookup callback is not told which lookup ran, and two lookups
    can see the same keys (tables of different sharding types reading one feature), so a
    forward pre-hook on each lookup module records which one is running.

    The handle's ``intact()`` is False once something replaced the lookup callback (TorchRec's
    setters replace instead of chaining). A callback someone chained after deck's keeps calling
    deck's after ``remove()``: from then on deck's only pass the call on to the callbacks before
    them and no longer hold ``store`` or ``is_active`` (a bound method of the checkpointer), so
    tracking stops and the closed checkpointer's tracker and buffers can be freed, whoever
    holds the setter.
    """
    prev_lookup = module.post_lookup_tracker_fn
    prev_odist = module.post_odist_tracker_fn
    running: list[int | None] = [None]
    # Cleared by remove().
    target: list[tuple[RowRecorder, Callable[[nn.Module], bool]] | None] = [(store, is_active)]

    def entering(i: int) -> Callable[..., None]:
        def pre_hook(_mod: nn.Module, _args: Any) -> None:
            running[0] = i

        return pre_hook

    handles = [m.register_forward_pre_hook(entering(i)) for i, m in enumerate(lookup_modules)]

    def on_lookup(features: KeyedJaggedTensor, embs: torch.Tensor, mod: Any, raw_ids: Any) -> None:
        if prev_lookup is not None:
            prev_lookup(features, embs, mod, raw_ids)
        i, running[0] = running[0], None
        held = target[0]
        if held is not None and i is not None:
            _track(held[0], held[1](module), key_plans[i], features, embs)

    def on_odist() -> None:
        if prev_odist is not None:
            prev_odist()
        held = target[0]
        if held is not None:
            held[0].compact()

    # The setters keep one callback each and warn when replacing one: clear, then register our
    # chained callback so a tracker installed before us (e.g. TorchRec's) keeps working.
    module.post_lookup_tracker_fn = None
    module.post_odist_tracker_fn = None
    module.register_post_lookup_tracker_fn(on_lookup)
    module.register_post_odist_tracker_fn(on_odist)

    def remove() -> None:
        target[0] = None
        for h in handles:
            h.remove()
        if module.post_lookup_tracker_fn is on_lookup:
            module.post_lookup_tracker_fn = prev_lookup
        if module.post_odist_tracker_fn is on_odist:
            module.post_odist_tracker_fn = prev_odist

    def intact() -> bool:
        return module.post_lookup_tracker_fn is on_lookup

    return RemovableHandle(remove, intact)


def _track(
    store: RowRecorder,
    active: bool,
    bases: torch.Tensor | None,
    features: KeyedJaggedTensor,
    embs: Any,
) -> None:
    """Record (and guard) the rows one lookup of ``features`` touched; ``bases``: the tracker
    base of each KJT key (None: nothing tracked there)."""
    # A lookup a backward will follow (its output requires grad) is tracked whatever the
    # mode: the fused optimizer updates its rows in eval mode and under pause() too.
    grads = isinstance(embs, torch.Tensor) and embs.requires_grad
    # A snapshot still copying its rows guards them even while tracking is off (paused,
    # eval): this step's backward may write them.
    if not active and not grads and not store.guarding:
        return
    if bases is None or features.values().numel() == 0:
        return
    values = features.values()
    if features.variable_stride_per_key():
        per_key = torch.tensor(features.length_per_key(), device=values.device)
    else:
        per_key = features.lengths().view(len(bases), -1).sum(1)
    offsets = torch.repeat_interleave(bases.to(values.device), per_key, output_size=values.numel())
    positions = values.to(torch.int64) + offsets
    # With a backward to come, a snapshot's copy of the rows runs beside the rest of the
    # step and that backward waits for it before it writes them.
    guarded = store.guard(positions, in_background=grads) if store.guarding else []
    if active or grads:
        store.record(positions)
    if grads:
        store.await_backward(embs, positions, guarded)


def lookup_forward_hooks(
    module: Any,
    lookup_modules: list[nn.Module],
    key_plans: list[torch.Tensor | None],
    store: RowRecorder,
    is_active: Callable[[nn.Module], bool],
) -> RemovableHandle:
    """Track the lookups of a sharded collection whose owner bypasses its tracker callbacks:
    a managed-collision collection calls its inner collection's ``compute`` and
    ``output_dist`` itself, and TorchRec calls the callbacks from ``compute_and_output_dist``
    only. A forward hook on each lookup module sees the same (KJT, output) pair; the rows are
    folded into the store right after (there is no output AllToAll of its own to overlap)."""
    target: list[tuple[RowRecorder, Callable[[nn.Module], bool]] | None] = [(store, is_active)]

    def hook_for(i: int) -> Callable[..., None]:
        def hook(_mod: nn.Module, args: Any, output: Any) -> None:
            held = target[0]
            if held is None or not args:
                return
            _track(held[0], held[1](module), key_plans[i], args[0], output)
            held[0].compact()

        return hook

    handles = [m.register_forward_hook(hook_for(i)) for i, m in enumerate(lookup_modules)]

    def remove() -> None:
        target[0] = None
        for h in handles:
            h.remove()

    return RemovableHandle(remove)


LOAD_ROWS_PER_CALL = 1 << 22
"""Rows handed to the tracker per call when a load marks a whole shard (bounded temporaries on
shards of billions of rows)."""


def load_hooks(
    module: nn.Module, spans: list[tuple[int, int]], store: RowRecorder
) -> RemovableHandle:
    """Track what ``module.load_state_dict`` writes: rows no lookup touched, which a delta would
    otherwise restore as they were (a warm start or a repair mid-run). Before the load, every
    copy-on-write snapshot copies its pending rows of ``module`` (the checkpoint just taken keeps
    its step's values); after it, every row of ``spans`` (tracker positions ``[start, stop)`` of
    the module's shards on this rank) is recorded, so the next checkpoint of each chain holds
    them. DMP's ``load_state_dict`` calls a sharded module's own, so both hooks run."""

    def each(fn: Callable[[torch.Tensor], object]) -> None:
        for start, stop in spans:
            for lo in range(start, stop, LOAD_ROWS_PER_CALL):
                fn(torch.arange(lo, min(lo + LOAD_ROWS_PER_CALL, stop), dtype=torch.int64))

    def before(*_: object) -> None:
        if store.guarding:
            each(store.guard)

    def after(*_: object) -> None:
        each(store.record)
        store.compact()

    handles = [
        module.register_load_state_dict_pre_hook(before),
        module.register_load_state_dict_post_hook(after),
    ]

    def remove() -> None:
        for h in handles:
            h.remove()

    return RemovableHandle(remove)
