"""The native CPU kernels (``kernels/_native.c``, the extension ``deck.kernels._native``): loading
them.

The extension is built at install when a C compiler is there (``pyproject.toml``,
``optional = true``). Without it :func:`native_module` is None and every caller runs its
fallback, same results, slower: :mod:`deck.kernels.claim` claims with torch (and the tracker
keeps no journal), :mod:`deck.kernels.gather` copies with ``torch.index_select``, and
:mod:`deck.kernels.bloom` answers None so that :mod:`deck.format.rowindex` builds the index
with numpy.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["native_available", "native_module"]

try:  # built at install when a C compiler is there
    _native: Any = importlib.import_module("deck.kernels._native")
except ImportError:  # pragma: no cover - depends on the install
    _native = None


def native_available() -> bool:
    """Whether the extension is loaded (read at each call, so tests can switch it off)."""
    return _native is not None


def native_module() -> Any:
    """The loaded extension module, or None without it (read at each call, so tests can switch
    it off)."""
    return _native
