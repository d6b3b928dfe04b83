"""Hook chaining: deck's row tracking installed on a sharded TorchRec module through its public
``register_post_lookup_tracker_fn`` / ``register_post_odist_tracker_fn``, behind whatever
callbacks were there before (TorchRec's own tracker keeps working)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from deck.trainer.tracker import TrackerStore


def chain_hooks(
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
