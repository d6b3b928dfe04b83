"""Compaction kernels: multi-table ("jagged") unique over shard-local row ids.

Importable as ``deck.kernels`` (``pyproject.toml`` maps this folder with ``package-dir``).

- :func:`jagged_unique`: the entry point; validates, picks bitmap or sort, dispatches by device
  (numpy kernels on CPU, torch-only kernels in :mod:`deck.kernels.gpu` elsewhere).
- :func:`jagged_unique_reference`: a loop of ``torch.unique`` per table, the tests' oracle.
- :func:`concat_jagged`: per-table lists of id tensors -> the ``(values, lengths)`` layout.
- :func:`unique_per_table`: the same unique straight from per-table lists of id tensors.
- :func:`free_cached_buffers`: drop the zeroed map the CPU bitmap kernel keeps between calls.
- :class:`KernelInputError`: raised for malformed input.

Modules (each imports its siblings directly, never this package): :mod:`.api` (the entry
points), :mod:`.checks` (validation), :mod:`.dispatch` (algorithm choice, CPU or device),
:mod:`.cpu` (the CPU kernels), :mod:`.native` (the C kernel: loading and calling it),
:mod:`.numpy_bitmap` (its numpy fallback), :mod:`.cpu_pool` (worker threads and the kept map),
:mod:`.gpu` (torch-only kernels), :mod:`.reference` (the oracle), :mod:`.common` (shared types).
"""

from .api import concat_jagged, jagged_unique, unique_per_table
from .common import KernelInputError, Method
from .cpu_pool import free_cached_buffers
from .dispatch import BITMAP_ROWS_PER_ID
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
