"""Compaction kernels: multi-table ("jagged") unique over shard-local row ids.

Importable as ``deck.kernels`` (``pyproject.toml`` maps this folder with ``package-dir``).

- :func:`jagged_unique`: the entry point; validates, picks bitmap or sort, dispatches by device
  (numpy kernels on CPU, torch-only kernels in :mod:`deck.kernels.gpu` elsewhere).
- :func:`jagged_unique_reference`: a loop of ``torch.unique`` per table, the tests' oracle.
- :class:`KernelInputError`: raised for malformed input.
"""

from deck.kernels.jagged_unique import (
    BITMAP_ROWS_PER_ID,
    KernelInputError,
    Method,
    jagged_unique,
)
from deck.kernels.reference import jagged_unique_reference

__all__ = [
    "BITMAP_ROWS_PER_ID",
    "KernelInputError",
    "Method",
    "jagged_unique",
    "jagged_unique_reference",
]
