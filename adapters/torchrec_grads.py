"""Gradients no optimizer step has applied: what a checkpoint would miss.

A checkpoint saves parameters and optimizer state, not gradients. A dense parameter whose
gradient a backward accumulated while the parameter is still at the value it has now (no
optimizer step changed it since) holds work a restore would lose: a checkpoint inside a
gradient-accumulation window, or between ``backward()`` and ``optimizer.step()``. Watched with
a post-accumulate-grad hook per parameter (it records the parameter's version counter); a
gradient set to None or zeroed since holds nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from deck.adapters.torchrec_compat import tensor_version

from deck.model import RemovableHandle


class GradientWatch:
    """The dense parameters ``params`` (name -> parameter) watched from now on."""

    def __init__(self, params: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._params = [(name, p) for name, p in params if p.requires_grad]
        # each parameter's version at its last accumulation (in every backward: kept lean)
        at: dict[torch.Tensor, int] = {}
        self._at = at

        def accumulated(p: torch.Tensor) -> None:
            at[p] = tensor_version(p)

        hooks = [p.register_post_accumulate_grad_hook(accumulated) for _, p in self._params]

        def remove() -> None:
            for h in hooks:
                h.remove()

        self.handle = RemovableHandle(remove)

    def unapplied(self) -> list[str]:
        """The names of the parameters holding a gradient no step has applied (not zero).
        None of them when one of those gradients is not finite: a loss scaler (AMP's
        GradScaler) found the overflow and skipped the step, and the next ``zero_grad()`` drops
        them all (a break-it finding: such a step's checkpoint was refused, blaming
        accumulation)."""
        held = [
            (name, p)
            for name, p in self._params
            if p.grad is not None and self._at.get(p) == tensor_version(p) and bool(p.grad.any())
        ]
        if any(not bool(torch.isfinite(p.grad).all()) for _, p in held if p.grad is not None):
            return []
        return [name for name, _ in held]
