"""A CPU kernel for ``fbgemm::reset_weight_momentum``, for tests only.

TorchRec's managed-collision (ZCH) collections reset the rows their remapper evicted through
fbgemm's ``reset_weight_momentum`` (``SplitTableBatchedEmbeddingBagsCodegen.
reset_embedding_weight_momentum``), which fbgemm-gpu 1.8 implements for CUDA only
(``fbgemm_gpu/src/split_embeddings_cache/reset_weight_momentum.cu``; its CPU library registers no
kernel for it), so on CPU the first eviction fails with ``NotImplementedError``.
:func:`enable_cpu_eviction` registers a CPU kernel through ``torch.library`` with the op's own
schema, so TorchRec's eviction path runs unchanged on CPU tests.

It does what the CUDA kernel does, for each entry ``t`` of ``buffer_ids``: the rows
``pruned_indices[pruned_indices_offsets[b]:pruned_indices_offsets[b + 1]]`` (``b =
buffer_ids[t]``) of logical table ``logical_table_ids[t]`` get their ``momentum1`` entry (one
per row: the op serves rowwise Adagrad only, as the Python caller says) set to 0 and the first
``4 * (D // 4)`` weights of the row set to 0 (the CUDA kernel works in chunks of four
columns: a table with ``D % 4 != 0`` keeps its last ``D % 4`` columns, and one with ``D < 4``
is left alone, momentum included). A table placed on the device reads ``*_dev``, any other
placement ``*_uvm``.

One difference is forced on it: a CPU TBE keeps its tables in ``weights_host`` /
``momentum1_host`` (placement HOST), which the op's schema does not pass (it was written for
GPUs, where ``*_dev`` and ``*_uvm`` are all there is; on CPU both are empty). A HOST table is
found through the TBE that owns the ``weights_placements`` tensor the op receives: each TBE of
the models given to :func:`enable_cpu_eviction` is registered (weakly) under it. A HOST table
of an unregistered TBE, 8-bit weights (the CUDA kernel also writes their row's qparams) and an
LXU cache (``total_cache_hash_size > 0``: a CPU TBE has none) raise ``NotImplementedError``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

_OP = "fbgemm::reset_weight_momentum"
_DEVICE, _HOST = 0, 3  # fbgemm's EmbeddingLocation / PlacementType values
_registered: list[Any] = []  # the torch.library.Library holding the kernel (kept alive)
# id(tbe.weights_placements) -> the TBE, weakly: the HOST buffers the op's schema leaves out
_tbes: dict[int, weakref.ref[Any]] = {}


def enable_cpu_eviction(*models: torch.nn.Module) -> None:
    """Register the CPU kernel (once per process) and the fbgemm TBEs of ``models``, whose
    HOST tables it resets. Call it for every model that will evict (a fresh build too)."""
    if not _registered:
        import fbgemm_gpu  # noqa: F401  (defines the fbgemm ops)

        lib = torch.library.Library("fbgemm", "IMPL")
        lib.impl("reset_weight_momentum", _reset_weight_momentum, "CPU")
        _registered.append(lib)
    for model in models:
        for module in _modules(model):
            placements = getattr(module, "weights_placements", None)
            if isinstance(placements, torch.Tensor) and hasattr(module, "momentum1_offsets"):
                _tbes[id(placements)] = weakref.ref(module)


def _modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module under ``model``, the lookups TorchRec's sharded collections keep in plain
    lists (out of ``modules()``) and theirs included."""
    from torchrec.distributed.embedding_types import ShardedEmbeddingModule

    from deck.adapters.torchrec_compat import called_lookups
    from deck.errors import UnsupportedError

    out = []
    for module in model.modules():
        out.append(module)
        if not isinstance(module, ShardedEmbeddingModule):
            continue
        try:
            found = called_lookups(module)
        except UnsupportedError:  # a wrapper (e.g. a managed-collision collection's)
            continue
        for lookup in found:
            out.extend(lookup.modules())
    return out


def _host(placements: torch.Tensor, name: str) -> torch.Tensor:
    ref = _tbes.get(id(placements))
    tbe = ref() if ref is not None else None
    if tbe is None or tbe.weights_placements is not placements:
        raise NotImplementedError(
            f"{_OP} (deck.testing CPU kernel): a HOST-placed table of a TBE that "
            "enable_cpu_eviction() was not given; pass the model to it"
        )
    out: torch.Tensor = getattr(tbe, name)
    return out


def _reset_weight_momentum(
    dev_weights: torch.Tensor,
    uvm_weights: torch.Tensor,
    lxu_cache_weights: torch.Tensor,
    weights_placements: torch.Tensor,
    weights_offsets: torch.Tensor,
    momentum1_dev: torch.Tensor,
    momentum1_uvm: torch.Tensor,
    momentum1_placements: torch.Tensor,
    momentum1_offsets: torch.Tensor,
    D_offsets: torch.Tensor,
    pruned_indices: torch.Tensor,
    pruned_indices_offsets: torch.Tensor,
    logical_table_ids: torch.Tensor,
    buffer_ids: torch.Tensor,
    cache_hash_size_cumsum: torch.Tensor,
    lxu_cache_state: torch.Tensor,
    total_cache_hash_size: int,
) -> None:
    if total_cache_hash_size > 0:
        raise NotImplementedError(f"{_OP} (deck.testing CPU kernel): no LXU cache on CPU")
    # A standalone TBE's host weights are a leaf parameter: written as the CUDA kernel does,
    # outside autograd (TorchRec calls it under no_grad too).
    with torch.no_grad():
        _reset(
            dev_weights,
            uvm_weights,
            weights_placements,
            weights_offsets,
            momentum1_dev,
            momentum1_uvm,
            momentum1_placements,
            momentum1_offsets,
            D_offsets,
            pruned_indices,
            pruned_indices_offsets,
            logical_table_ids,
            buffer_ids,
        )


def _reset(
    dev_weights: torch.Tensor,
    uvm_weights: torch.Tensor,
    weights_placements: torch.Tensor,
    weights_offsets: torch.Tensor,
    momentum1_dev: torch.Tensor,
    momentum1_uvm: torch.Tensor,
    momentum1_placements: torch.Tensor,
    momentum1_offsets: torch.Tensor,
    D_offsets: torch.Tensor,
    pruned_indices: torch.Tensor,
    pruned_indices_offsets: torch.Tensor,
    logical_table_ids: torch.Tensor,
    buffer_ids: torch.Tensor,
) -> None:
    for t in range(buffer_ids.numel()):
        b = int(buffer_ids[t])
        start, end = int(pruned_indices_offsets[b]), int(pruned_indices_offsets[b + 1])
        if end <= start:
            continue
        table = int(logical_table_ids[t])
        dim = int(D_offsets[table + 1]) - int(D_offsets[table])
        cols = dim // 4 * 4  # the CUDA kernel's work is chunks of 4 columns
        if cols == 0:
            continue
        rows = pruned_indices[start:end].to(torch.int64)

        m_place = int(momentum1_placements[table])
        momentum = (
            momentum1_dev
            if m_place == _DEVICE
            else _host(weights_placements, "momentum1_host")
            if m_place == _HOST
            else momentum1_uvm
        )
        momentum[int(momentum1_offsets[table]) + rows] = 0

        w_place = int(weights_placements[table])
        weights = (
            dev_weights
            if w_place == _DEVICE
            else _host(weights_placements, "weights_host")
            if w_place == _HOST
            else uvm_weights
        )
        if weights.dtype == torch.uint8:
            raise NotImplementedError(f"{_OP} (deck.testing CPU kernel): 8-bit weights")
        starts = int(weights_offsets[table]) + rows * dim
        flat = (starts.unsqueeze(1) + torch.arange(cols)).reshape(-1)
        weights[flat] = 0
