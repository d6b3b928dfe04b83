"""fbgemm TBE introspection: the TBEs under a sharded TorchRec module and the optimizer state
fbgemm keeps in them beyond TorchRec's fused optimizer state (split per-row states, per-TBE
scalars), read from the live modules through adapters/torchrec_compat.py."""

from __future__ import annotations

from typing import Any

import torch
from deck.adapters.torchrec_compat import (
    LOCATION_SUFFIX,
    SPLIT_STORAGE_SUFFIXES,
    kernel_tbe,
    lookup_kernels,
    lookups,
    set_tbe_kernel_arguments,
    tbe_counter_weight_decay,
    tbe_emainplace_mode,
    tbe_kernel_arguments,
    tbe_optimizer_name,
    tbe_split_buffer,
)

from deck.model import say_kernel_edited

# optimizer_args fields that describe the TBE's layout, not the optimizer: a restore into another
# plan keeps its own.
_LAYOUT_ARGUMENTS = {"total_hash_size"}

_TBE_LAYOUT_BUFFERS = {
    "D_offsets",
    "feature_dims",
    "rows_per_table",
    "hash_size_cumsum",
    "bounds_check_warning",
    "table_wise_cache_miss",
    "placeholder_autograd_tensor",
    "lxu_cache_weights",
}


def tbes_of(module: Any) -> list[tuple[Any, list[Any]]]:
    """Every fbgemm TBE under a sharded module with its tables (ShardedEmbeddingTable, in the
    TBE's table order)."""
    out: list[tuple[Any, list[Any]]] = []
    for _, lookup in lookups(module):
        kernels = lookup_kernels(lookup)
        if kernels is None:
            continue
        for config, kernel in zip(lookup.grouped_configs, kernels, strict=True):
            tbe = kernel_tbe(kernel)
            if tbe is not None:
                out.append((tbe, list(config.embedding_tables)))
    return out


def tbe_caches_rows(tbe: Any) -> bool:
    """Whether ``tbe`` keeps rows in a cache (fused_uvm_caching): its tables are only current
    after a flush, which TorchRec's state_dict hooks do."""
    cache = getattr(tbe, "lxu_cache_weights", None)
    return isinstance(cache, torch.Tensor) and cache.numel() > 0


def tbe_rewrites_unlooked_rows(tbe: Any) -> str | None:
    """Why fbgemm's TBE ``tbe`` changes rows that were not looked up in a step, or None.

    Read from the live module: EMAINPLACE_ROWWISE_ADAGRAD lerps the slow half of every row
    every ``step_ema`` steps (``ema_inplace``); ENSEMBLE_ROWWISE_ADAGRAD blends and swaps every
    row and its momentum2 (``ensemble_and_swap``). Weight decay modes (L2, DECOUPLE, COUNTER,
    DECOUPLE_GLOBAL, COWCLIP) run inside the backward kernel on looked-up rows only (COUNTER and
    the global mode catch up lazily from the per-row ``prev_iter``, which deck saves).
    """
    opt = getattr(getattr(tbe, "optimizer", None), "name", "")
    if opt == "EMAINPLACE_ROWWISE_ADAGRAD":
        mode = tbe_emainplace_mode(tbe)
        return (
            f"fbgemm optimizer {opt} rewrites every row every {int(mode.get('step_ema', 1))} "
            f"step(s) from step {int(mode.get('step_start', 0))} on (ema_inplace)"
        )
    if opt == "ENSEMBLE_ROWWISE_ADAGRAD":
        return f"fbgemm optimizer {opt} blends and swaps every row (ensemble_and_swap)"
    return None


def _stored(tbe: Any, p: str) -> int:
    return sum(tbe_split_buffer(tbe, p + sfx).numel() for sfx in SPLIT_STORAGE_SUFFIXES)


def split_prefixes(tbe: Any) -> list[str]:
    """The split (per-table, flat) states fbgemm persists: ``<p>_offsets`` buffers in its
    state_dict, with some storage behind them."""
    persistent = set(tbe.state_dict().keys())
    out = []
    for key in sorted(persistent):
        if not key.endswith("_offsets") or f"{key[:-8]}_placements" not in persistent:
            continue
        p = key[:-8]
        if _stored(tbe, p) > 0:
            out.append(p)
    return out


def tbe_table_states(tbe: Any) -> list[dict[str, torch.Tensor]]:
    """For each table of ``tbe``: every persistent per-row state fbgemm keeps for it (besides
    ``weights``), as a live view with the table's rows first: rowwise states (momentum1 of
    rowwise Adagrad, COUNTER's ``prev_iter`` / ``row_counter``) as 1-D, elementwise ones as
    (rows, dim)."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in tbe.embedding_specs]
    rows = [int(spec[0]) for spec in tbe.embedding_specs]
    dims = [int(spec[1]) for spec in tbe.embedding_specs]
    for p in split_prefixes(tbe):
        if p == "weights":
            continue
        offsets = [int(x) for x in tbe_split_buffer(tbe, p + "_offsets").tolist()]
        placements = [int(x) for x in tbe_split_buffer(tbe, p + "_placements").tolist()]
        rowwise = _stored(tbe, p) == sum(rows)
        for i in range(len(rows)):
            flat = tbe_split_buffer(tbe, p + LOCATION_SUFFIX.get(placements[i], "_host"))
            n = rows[i] if rowwise else rows[i] * dims[i]
            view = flat[offsets[i] : offsets[i] + n]
            out[i][p] = view if rowwise else view.view(rows[i], dims[i])
    return out


def tbe_scalars(tbe: Any) -> dict[str, torch.Tensor]:
    """The TBE's persistent one-element buffers (e.g. the step counter ``iter`` that COUNTER
    weight decay and EMAINPLACE read, COUNTER's ``max_counter``): per-TBE optimizer scalars,
    saved whole with every checkpoint of each of its tables."""
    split: set[str] = set()
    for p in split_prefixes(tbe):
        split.update(p + sfx for sfx in (*SPLIT_STORAGE_SUFFIXES, "_offsets", "_placements"))
    persistent = set(tbe.state_dict().keys())
    if tbe_counter_weight_decay(tbe):
        # COUNTER weight decay passes ``iter`` to its kernel, yet fbgemm 1.8 registers it
        # non-persistent in that mode (only Adam-family, EMA/ensemble and global decay persist it).
        persistent.add("iter")
    # Layout metadata (one entry per table or feature: one element for a one-table TBE) and
    # diagnostics (out-of-range id and cache-miss counts) are not optimizer state; saving them
    # would only tie a restore to the saved layout. Anything else one-element is kept, so a
    # buffer a newer fbgemm adds is saved rather than dropped.
    persistent -= _TBE_LAYOUT_BUFFERS
    out = {}
    for name, buf in tbe.named_buffers(recurse=False):
        if name in split or name not in persistent or buf.numel() != 1:
            continue
        out[f"tbe.{name}"] = buf
    return out


def tbe_kernel_hyperparameters(tbe: Any) -> dict[str, Any]:
    """The optimizer hyperparameters the TBE's kernel reads from the TBE itself, as it holds them
    now: ``learning_rate`` (fbgemm's float32 ``learning_rate_tensor``, which the fused backward
    uses; TorchRec copies ``param_groups[0]["lr"]`` into it only in the fused optimizer's
    ``zero_grad()`` / ``step()``, so after a scheduler step it can hold the previous rate until
    the next of those calls) and every ``optimizer_args`` field (eps, betas, weight decay, ...)
    but the layout's."""
    args = {k: v for k, v in tbe_kernel_arguments(tbe).items() if k not in _LAYOUT_ARGUMENTS}
    return {
        "optimizer": tbe_optimizer_name(tbe),
        "learning_rate": float(tbe.get_learning_rate()),
        "optimizer_args": args,
    }


def load_tbe_kernel_hyperparameters(tbe: Any, saved: dict[str, Any], what: str) -> None:
    """Put :func:`tbe_kernel_hyperparameters` back into ``tbe`` exactly (the float32 rate the
    kernel held, not the param group's), saying which arguments the kernel (``what``) was built
    with otherwise (the rate: see the param groups' own line)."""
    # fill_ of the float32 tensor with the value read from it is exact.
    tbe.learning_rate_tensor.fill_(float(saved["learning_rate"]))
    live = tbe_kernel_arguments(tbe)
    args = {k: v for k, v in saved.get("optimizer_args", {}).items() if k in live}
    say_kernel_edited(
        live, args, what, "call fbgemm's update_hyper_parameters() on the embedding kernel"
    )
    set_tbe_kernel_arguments(tbe, args)
