"""Telling, cheaply, whether a module tree's tensors are still where views of them were taken.

The adapter keeps views of the live tables and of the dense state between checkpoints (walking
``state_dict()`` in every stall costs more than copying a delta's rows). Walking the module
tree with ``named_parameters()`` to check they are still live costs milliseconds on a
TorchRec model too (prefix strings, de-duplication, TorchRec's own overrides); comparing a
flat list of slots taken once costs a few microseconds per module.
"""

from __future__ import annotations

from typing import Any

import torch
from deck.adapters.torchrec_compat import module_slots


class TensorSlots:
    """Every parameter, buffer and submodule slot of a module tree, and where each tensor's
    storage was, when taken.

    :meth:`moved` is True once any parameter or buffer was added, removed, replaced or given
    new storage or size (``param.data = ...``, ``resize_``, ``set_``), or a submodule was added,
    removed or swapped, anywhere in the tree: then views taken before are stale. In-place writes
    to the tensors (training) leave it False.
    """

    __slots__ = ("_owners", "_tensors")

    def __init__(self, root: torch.nn.Module):
        # (the dict of a module's parameters, buffers or children, its size, its entries)
        owners: list[tuple[dict[str, Any], int, tuple[tuple[str, Any], ...]]] = []
        tensors: list[tuple[torch.Tensor, int, int]] = []
        for module in root.modules():
            for slots in module_slots(module):
                owners.append((slots, len(slots), tuple(slots.items())))
                for value in slots.values():
                    if isinstance(value, torch.Tensor):
                        tensors.append((value, value.data_ptr(), value.numel()))
        self._owners = owners
        self._tensors = tensors

    def moved(self) -> bool:
        """Whether a slot or a tensor's storage changed since these were taken."""
        for slots, size, entries in self._owners:
            if len(slots) != size:
                return True
            for name, value in entries:
                if slots.get(name) is not value:
                    return True
        return any(t.data_ptr() != ptr or t.numel() != n for t, ptr, n in self._tensors)
