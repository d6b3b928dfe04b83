"""A complete copy of a rank's live training state, read with torch's and TorchRec's public APIs
only (never through deck's adapter, so a blind spot of deck's is not one of the check's), and
a bitwise comparison of two such copies."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from deck.adapters.torchrec_compat import tbe_kernel_arguments
from deck.adapters.torchrec_optim import fused_kernels
from deck.doctor.setup import DoctorSetup
from deck.trainer.checkpointer import user_state_pair

# Kinds of captured entries, in report order.
TENSOR = "tensor"  # model.state_dict(): parameters, table shards
BUFFER = "buffer"  # a buffer in model.state_dict()
HIDDEN_BUFFER = "non-persistent buffer"  # a buffer model.state_dict() leaves out
FUSED_STATE = "fused optimizer state"
FUSED_HYPER = "fused hyperparameter"
KERNEL_HYPER = "kernel hyperparameter"  # what an fbgemm TBE holds apart from param_groups
DENSE_STATE = "dense optimizer state"
DENSE_HYPER = "dense hyperparameter"
RNG = "rng"
USER = "user state"
KINDS = (
    TENSOR,
    BUFFER,
    HIDDEN_BUFFER,
    FUSED_STATE,
    FUSED_HYPER,
    KERNEL_HYPER,
    DENSE_STATE,
    DENSE_HYPER,
    RNG,
    USER,
)

MISSING = "in the live state, missing after the restore"

Key = tuple[str, str]  # (kind, name)
Captured = dict[Key, Any]  # a cloned tensor, or a plain value (number, string, None, ...)


def capture(setup: DoctorSetup) -> Captured:
    """Copy (clone) everything of this rank a restore must reproduce: ``model.state_dict()``
    (local shards of ShardedTensors, by shard offsets), every buffer of ``named_buffers()``
    that the state_dict leaves out, ``model.fused_optimizer``'s state_dict and param_groups, the
    learning rate and optimizer arguments each fbgemm TBE module holds itself,
    each dense optimizer's state_dict and param_groups (read from the optimizer: TorchRec's
    KeyedOptimizer may leave them out of its state_dict), torch's RNG states (CPU, and CUDA
    where initialised) and the user state. Reading changes nothing."""
    out: Captured = {}
    model = setup.model
    buffers = dict(model.named_buffers())
    state_dict = model.state_dict()
    for name, value in state_dict.items():
        _flatten(BUFFER if name in buffers else TENSOR, name, value, out)
    for name, value in buffers.items():
        if name not in state_dict:
            _flatten(HIDDEN_BUFFER, name, value, out)
    fused = getattr(model, "fused_optimizer", None)
    if fused is not None:
        _optimizer(fused, "fused", FUSED_STATE, FUSED_HYPER, out)
        for i, tbe in enumerate(fused_kernels(fused)):
            # The fused backward reads its rate and optimizer arguments from fbgemm's TBE, not
            # from param_groups (TorchRec copies the lr in only at zero_grad()/step()).
            out[(KERNEL_HYPER, f"kernel[{i}].learning_rate_tensor")] = (
                tbe.learning_rate_tensor.detach().clone()
            )
            _flatten(KERNEL_HYPER, f"kernel[{i}].optimizer_args", tbe_kernel_arguments(tbe), out)
    for name, opt in _dense(setup.optimizers):
        _optimizer(opt, name, DENSE_STATE, DENSE_HYPER, out)
    out[(RNG, "torch cpu")] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[(RNG, f"torch cuda:{i}")] = s
    user = user_state_pair(setup.state)
    if user is not None:
        _flatten(USER, "state", user[0](), out)
    return out


def compare(live: Captured, restored: Captured) -> list[tuple[str, str, str]]:
    """``(kind, name, what differs)`` for every entry that is not bitwise equal (tensors: dtype,
    shape and bytes; plain values: type and repr) or exists on one side only."""
    out = []
    for key in sorted(live.keys() | restored.keys(), key=_order):
        if key not in restored:
            why: str | None = MISSING
        elif key not in live:
            why = "only after the restore, not in the live state"
        else:
            why = difference(live[key], restored[key])
        if why is not None:
            out.append((key[0], key[1], why))
    return out


def recheck_created_buffers(
    differences: list[tuple[str, str, str]], live: Captured, model: Any
) -> list[tuple[str, str, str]]:
    """``differences`` with the non-persistent buffers a forward creates settled: TorchRec's
    sharded modules register some lazily at their first input (``_features_order_tensor``), so a
    fresh build lacks them until its first step. Call after that step: such a buffer equal to its
    live value is no difference; one that differs is reported with what differs."""
    now: Captured = {}
    for name, value in model.named_buffers():
        _flatten(HIDDEN_BUFFER, name, value, now)
    out = []
    for kind, name, why in differences:
        if why == MISSING and (kind, name) in now:
            later = difference(live[(kind, name)], now[(kind, name)])
            if later is None:
                continue
            why = f"missing after the restore, made by the first step after it: {later}"
        out.append((kind, name, why))
    return out


def difference(a: Any, b: Any) -> str | None:
    """None when ``a`` (live) and ``b`` (restored) are bitwise equal, else what differs."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return _tensor_difference(a, b)
    if type(a) is type(b) and repr(a) == repr(b):
        return None
    return f"{_short(a)} live vs {_short(b)} after the restore"


def count(captured: Captured) -> dict[str, int]:
    """Entries per kind (every kind listed, in report order)."""
    return {k: sum(1 for kind, _ in captured if kind == k) for k in KINDS}


def _optimizer(opt: Any, prefix: str, state_kind: str, hyper_kind: str, out: Captured) -> None:
    sd = dict(opt.state_dict())
    sd.pop("param_groups", None)  # read from the optimizer itself below
    _flatten(state_kind, prefix, sd, out)
    for i, group in enumerate(getattr(opt, "param_groups", [])):
        for k, v in group.items():
            if k != "params":
                _flatten(hyper_kind, f"{prefix}.param_groups[{i}].{k}", v, out)


def _dense(optimizers: Any) -> list[tuple[str, Any]]:
    if optimizers is None:
        return []
    if isinstance(optimizers, (list, tuple)):
        return [(f"dense[{i}]", o) for i, o in enumerate(optimizers)]
    return [("dense", optimizers)]


def _flatten(kind: str, name: str, value: Any, out: Captured) -> None:
    if hasattr(value, "local_shards"):  # ShardedTensor: this rank's shards
        for s in value.local_shards():
            out[(kind, f"{name}@{list(s.metadata.shard_offsets)}")] = s.tensor.detach().clone()
    elif hasattr(value, "to_local"):  # DTensor: this rank's part
        out[(kind, name)] = value.to_local().detach().clone()
    elif isinstance(value, torch.Tensor):
        out[(kind, name)] = value.detach().clone()
    elif isinstance(value, Mapping) and value:
        for k, v in value.items():
            _flatten(kind, f"{name}.{k}", v, out)
    elif isinstance(value, (list, tuple)) and value:
        for i, v in enumerate(value):
            _flatten(kind, f"{name}[{i}]", v, out)
    else:  # numbers, strings, None, empty containers, anything else: compared by type and repr
        out[(kind, name)] = value


def _tensor_difference(a: torch.Tensor, b: torch.Tensor) -> str | None:
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} live vs {b.dtype} after the restore"
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} live vs {tuple(b.shape)} after the restore"
    x, y = (t.detach().cpu().contiguous().reshape(-1) for t in (a, b))
    n, size = x.numel(), x.element_size()
    if n == 0:
        return None
    bad = x.view(torch.uint8).view(n, size).ne(y.view(torch.uint8).view(n, size)).any(1)
    k = int(bad.sum())
    if k == 0:
        return None
    text = f"{k} of {n} elements differ"
    if a.dtype.is_floating_point:
        gap = (x[bad].double() - y[bad].double()).abs().max()
        text += f" (max abs difference {float(gap):.3g})"
    return text


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _order(key: Key) -> tuple[int, str]:
    return KINDS.index(key[0]), key[1]
