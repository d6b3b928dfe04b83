"""The non-table part of an exported step: the dense state, the dense optimizer state and the
fused optimizers' per-shard scalar states, as one nested state dict; and DCP's names for it."""

from __future__ import annotations

from typing import Any

import torch

from deck.errors import UnsupportedError
from deck.format.manifest import CheckpointManifest, RankManifest
from deck.format.statefile import parse_scalar_key
from deck.read.catalog import checkpoint_label
from deck.read.restore import read_state_file
from deck.storage import Storage


def table_name(table: str) -> str:
    """The table's name inside its module (what TorchRec's fused optimizer keys states by) from
    its state_dict key ``<module path>.embedding_bags.<name>.weight``."""
    parts = table.split(".")
    if len(parts) < 2 or parts[-1] != "weight":
        raise UnsupportedError(f"table key {table!r} does not end in '<name>.weight'")
    return parts[-2]


def eager_state(
    storage: Storage,
    last: CheckpointManifest,
    parts: list[RankManifest],
    skipped: list[str] | None = None,
) -> dict[str, Any]:
    """:meth:`StepState.eager_state` of checkpoint ``last`` (its rank manifests ``parts``):
    reads only its dense and extra files, never the tables."""
    skipped = skipped if skipped is not None else []
    model = _dense_model(storage, last, parts[0], skipped)
    extra = read_state_file(storage, last, parts[0].extra)
    opt_state = _dense_optimizer_state(extra, skipped)
    _add_scalar_states(opt_state, storage, last, parts, extra)
    if extra.get("user") is not None:
        skipped.append(
            "user state (a restore gives it back: deck.enable(model, [opt], config, state=...).restore(step))"
        )
    return {"model": model, "optim": {"state": opt_state}}


def _dense_model(
    storage: Storage, last: CheckpointManifest, rank0: RankManifest, skipped: list[str]
) -> dict[str, torch.Tensor]:
    """The tensors of the dense state (rank 0's part holds it)."""
    where = checkpoint_label(last)
    if rank0.dense is None:
        skipped.append(f"{where}: rank 0 part has no dense state")
        return {}
    dense = read_state_file(storage, last, rank0.dense)
    return {k: v for k, v in dense.items() if isinstance(v, torch.Tensor)}


def _dense_optimizer_state(
    extra: dict[str, Any], skipped: list[str]
) -> dict[str, dict[str, torch.Tensor]]:
    """The tensor states of the dense optimizers saved in rank 0's extra file, by parameter
    name."""
    opt_state: dict[str, dict[str, torch.Tensor]] = {}
    for name, saved in sorted(extra.get("optimizers", {}).items()):
        state = saved.get("state_dict", {}).get("state", {})
        if not all(isinstance(k, str) for k in state):
            skipped.append(
                f"dense optimizer {name}: its state is keyed by parameter index, not name "
                "(a plain torch.optim optimizer); wrap it in torchrec's KeyedOptimizerWrapper"
            )
            continue
        for param, values in state.items():
            for k, v in values.items():
                if isinstance(v, torch.Tensor):
                    opt_state.setdefault(param, {})[k] = v
                else:
                    skipped.append(f"dense optimizer {name}: {param}.{k} is not a tensor")
    return opt_state


def _add_scalar_states(
    opt_state: dict[str, dict[str, torch.Tensor]],
    storage: Storage,
    last: CheckpointManifest,
    parts: list[RankManifest],
    extra: dict[str, Any],
) -> None:
    """Add the fused optimizers' per-shard scalar states (every rank's extra file; ``extra`` is
    rank 0's) to ``opt_state``, one tensor per table and state."""
    scalars: dict[str, dict[str, list[tuple[tuple[int, int], torch.Tensor]]]] = {}
    for part in parts:
        ex = extra if part.rank == 0 else read_state_file(storage, last, part.extra)
        for key, values in ex.get("scalars", {}).items():
            table, row_off, col_off = parse_scalar_key(key)
            for k, v in values.items():
                scalars.setdefault(table, {}).setdefault(k, []).append(
                    ((row_off, col_off), v.reshape(1))
                )
    for table, per_name in scalars.items():
        for k, blocks in per_name.items():
            # TorchRec: one value per shard, in the table's shard order.
            opt_state.setdefault(table, {})[f"{table_name(table)}.{k}"] = torch.cat(
                [v for _, v in sorted(blocks, key=lambda b: b[0])]
            )


def flatten(nested: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": x}}`` -> ``{"a.b": x}``: DCP's names for a nested state dict."""
    out: dict[str, Any] = {}
    for k, v in nested.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, f"{name}."))
        else:
            out[name] = v
    return out
