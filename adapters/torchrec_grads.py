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
        self._params = {id(p): (name, p) for name, p in params if p.requires_grad}
        self._at: dict[int, int] = {}  # id -> the parameter's version at its last accumulation
        hooks = [
            p.register_post_accumulate_grad_hook(self._accumulated)
            for _, p in self._params.values()
        ]

        def remove() -> None:
            for h in hooks:
                h.remove()

        self.handle = RemovableHandle(remove)

    def _accumulated(self, p: torch.Tensor) -> None:
        self._at[id(p)] = tensor_version(p)

    def unapplied(self) -> list[str]:
        """The names of the parameters holding a gradient no step has applied (not zero)."""
        out = []
        for key, (name, p) in self._params.items():
            g = p.grad
            if g is not None and self._at.get(key) == tensor_version(p) and bool(g.any()):
                out.append(name)
        return out
