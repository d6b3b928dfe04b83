"""Compaction kernels: multi-table ("jagged") unique over shard-local row ids.

Importable as ``deck.kernels`` (``pyproject.toml`` maps this folder with ``package-dir``).

- :func:`jagged_unique`: the entry point; validates, picks bitmap or sort, dispatches by device
  (numpy kernels on CPU, torch-only kernels in :mod:`deck.kernels.gpu` elsewhere).
- :func:`jagged_unique_reference`: a loop of ``torch.unique`` per table, the tests' oracle.
- :func:`concat_jagged`: per-table lists of id tensors -> the ``(values, lengths)`` layout.
- :func:`unique_per_table`: the same unique straight from per-table lists of id tensors.
- :func:`free_cached_buffers`: drop the zeroed map the CPU bitmap kernel keeps between calls.
- :class:`KernelInputError`: raised for malformed input.
"""

from .jagged_unique import (
    BITMAP_ROWS_PER_ID,
    KernelInputError,
    Method,
    concat_jagged,
    free_cached_buffers,
    jagged_unique,
    unique_per_table,
)
from .reference import jagged_unique_reference

__all__ = [
    "BITMAP_ROWS_PER_ID",
    "KernelInputError",
    "Method",
    "concat_jagged",
    "free_cached_buffers",
    "jagged_unique",
    "jagged_unique_reference",
    "unique_per_table",
]
