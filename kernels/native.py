"""The native CPU kernels (``kernels/_native.c``, the extension ``deck.kernels._native``): loading
them, and switching them off.

The extension is built at install when a C compiler is there (``pyproject.toml``,
``optional = true``). Without it :func:`native_module` is None and every caller runs its
fallback, same results, slower: :mod:`deck.kernels.claim` claims with torch (and the tracker
keeps no journal), :mod:`deck.kernels.gather` copies with ``torch.index_select``, and
:mod:`deck.kernels.bloom` answers None so that :mod:`deck.format.rowindex` builds the index
with numpy.

The fallbacks run on every install without a compiler, so they are tested like the kernels:
``DECK_NATIVE=off`` in the environment (read at import) or :func:`use_native` (``False``) makes
a built extension act as if it were missing; ``tests/kernels`` runs each test both ways.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from deck.errors import ConfigError

__all__ = ["NATIVE_ENV", "native_available", "native_built", "native_module", "use_native"]

NATIVE_ENV = "DECK_NATIVE"  # "off" (or "0"): run the fallbacks even where the extension is built

try:  # built at install when a C compiler is there
    _built: Any = importlib.import_module("deck.kernels._native")
except ImportError:  # pragma: no cover - depends on the install
    _built = None


def _wanted(value: str) -> bool:
    text = value.strip().lower()
    if text in ("", "1", "on"):
        return True
    if text in ("0", "off"):
        return False
    raise ConfigError(f"{NATIVE_ENV}={value!r}: use 'on' (the default) or 'off' (the fallbacks)")


# What callers see: the extension, or None (not built, or switched off). Tests that need one
# path for a few lines set it directly (monkeypatch ``_native``).
_native: Any = _built if _wanted(os.environ.get(NATIVE_ENV, "")) else None


def native_built() -> bool:
    """Whether the extension was built and imports (whether or not it is switched off)."""
    return _built is not None


def native_available() -> bool:
    """Whether the kernels run natively now (read at each call, so tests can switch it off)."""
    return _native is not None


def native_module() -> Any:
    """The loaded extension module, or None without it or when switched off (read at each call,
    so tests can switch it off)."""
    return _native


def use_native(on: bool) -> None:
    """Run the native kernels (``on``, when built) or the fallbacks from now on, in this process.
    A tracker takes its path when it is built: switch before building one."""
    global _native
    _native = _built if on else None
