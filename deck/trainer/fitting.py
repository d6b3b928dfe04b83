"""Fitting a restored checkpoint's records to the live model and optimizers (the trainer's
:class:`deck.trainer.loader.StateLoader` only).

:func:`deck.read.restore.apply_chain` writes a chain's rows into table shards and reads nothing
else; what a training rank then does with the rest of the checkpoint lives here, since it
changes live optimizers and tensors: which rank part's extra state a rank loads
(:func:`rank_part`), whether its layout changed (:func:`same_layout`), the per-shard scalars
(:func:`shard_scalars`), optimizer state loaded exactly (:func:`load_optimizer`,
:func:`reconcile_optimizer`), and tables that are data_parallel on one side and sharded on the
other (:class:`PlanMoves`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from deck.errors import IncompatibleModelError
from deck.format.manifest import CheckpointManifest, RankManifest
from deck.format.statefile import scalar_key
from deck.model import TableShard, load_hyperparameters, say_edited
from deck.read.catalog import read_rank_manifests
from deck.read.restore import read_state_file, span
from deck.storage import Storage

logger = logging.getLogger(__name__)


def rank_part(parts: list[RankManifest], rank: int) -> RankManifest:
    """The part whose extra state (dense optimizers, user state) ``rank`` loads: its own, or
    rank 0's when the checkpoint was written by fewer ranks (dense optimizer state is replicated
    across ranks; user state of a rank the writer did not have starts as rank 0's)."""
    return parts[rank] if rank < len(parts) else parts[0]


def same_layout(parts: list[RankManifest], rank: int, shards: list[TableShard]) -> bool:
    """Whether ``shards`` are exactly the shards ``rank`` saved in ``parts``. When this is false
    on any rank the restore resharded, and the next checkpoint must be a full: deltas and merged
    deltas keep one layout from their full on (the merger never mixes layouts)."""
    if rank >= len(parts):
        return not shards
    saved = [(r.table, r.row_offset, r.rows, r.col_offset, r.cols) for r in parts[rank].shards]
    return saved == [(s.table, s.row_offset, s.rows, s.col_offset, s.cols) for s in shards]


def shard_scalars(
    storage: Storage,
    step: int,
    parts: list[RankManifest],
    own_extra: dict[str, Any],
    shards: list[TableShard],
) -> dict[int, dict[str, torch.Tensor]]:
    """The saved per-shard scalars (states without a row dimension) of each of ``shards`` (by
    ``id``): the shard's own entry in ``own_extra`` when the writer had the same shard, else the
    entry of a saved shard of the same table that overlaps it (read from that rank's extra
    file), since such scalars (e.g. an iteration count) are the table's. Raises
    :class:`IncompatibleModelError` when no saved shard of the table has them."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    extras: dict[int, dict[str, Any]] = {}
    for s in shards:
        if not s.scalars:
            continue
        found = own_extra.get("scalars", {}).get(scalar_key(s.table, s.row_offset, s.col_offset))
        for part in parts if found is None else ():
            for rec in part.shards:
                r0, r1 = span(rec.row_offset, rec.rows, s.row_offset, s.rows)
                c0, c1 = span(rec.col_offset, rec.cols, s.col_offset, s.cols)
                if rec.table != s.table or r0 >= r1 or c0 >= c1:
                    continue
                if part.rank not in extras:
                    extras[part.rank] = read_state_file(storage, step, part.extra)
                saved = extras[part.rank].get("scalars", {})
                found = saved.get(scalar_key(rec.table, rec.row_offset, rec.col_offset))
                if found is not None:
                    break
            if found is not None:
                break
        if found is None:
            raise IncompatibleModelError(
                f"table {s.table}: step {step} at {storage.uri} has no saved {sorted(s.scalars)} for "
                f"rows {s.row_offset}+{s.rows}, columns {s.col_offset}+{s.cols}; use the same fused optimizer"
            )
        out[id(s)] = found
    return out


def put_scalars(
    shards: list[TableShard], saved: dict[int, dict[str, torch.Tensor]], where: str
) -> None:
    """Write :func:`shard_scalars` into the shards. Shards may share one live scalar (the
    tables of one fbgemm TBE); restored into another plan they can bring different saved values
    of it (tables saved in two TBEs, now in one: COUNTER's ``max_counter``): the largest is
    kept -- a counter's bound over the rows of both, a step count's newest -- and logged."""
    found: dict[int, tuple[torch.Tensor, str, list[tuple[str, torch.Tensor]]]] = {}
    for s in shards:
        for name, value in saved.get(id(s), {}).items():
            live = s.scalars[name]
            found.setdefault(id(live), (live, name, []))[2].append((s.table, value))
    with torch.no_grad():
        for live, name, values in found.values():
            first = values[0][1]
            if all(torch.equal(v, first) for _, v in values):
                live.copy_(first)
                continue
            top = max((v for _, v in values), key=lambda v: v.item())
            live.copy_(top)
            logger.warning(
                "deck: %s: tables %s, now in one kernel, were saved with different values of "
                "its %s (%s): the largest is kept",
                where,
                sorted({t for t, _ in values})[:4],
                name,
                sorted({v.item() for _, v in values}),
            )


def load_optimizer(
    opt: torch.optim.Optimizer,
    saved: dict[str, Any],
    name: str,
    algorithm: str,
    param_names: list[list[str | None]] | None = None,
    sparse_grads: Container[int] = frozenset(),
) -> None:
    """Load a saved :func:`deck.model.optimizer_record` into ``opt`` exactly; one saved by
    another ``algorithm`` than ``opt``'s (a record without one is not checked) raises
    :class:`IncompatibleModelError`. ``param_names``: the model's names of ``opt``'s
    parameters (:attr:`deck.model.Optimizers.param_names`): a state keyed by position (a plain
    torch optimizer's) saved with its names goes to the parameters of the same names, in
    whatever order the model hands them over now; another set of parameters raises.

    Afterwards exactly the parameters that had optimizer state when it was saved have state,
    with the saved values: a parameter that never got a gradient (no state yet) has none after
    the load either, whatever ``opt`` held before. Plain torch optimizers do this themselves;
    a keyed optimizer (TorchRec's ``KeyedOptimizer``, whose strict load copies into existing
    state of the same parameters) is first given state for exactly the saved parameters
    (``sparse_grads``: ids of the parameters whose gradients are sparse).
    """
    sd = _by_name(opt, saved["state_dict"], saved.get("param_names"), param_names, name)
    saved_class = saved.get("class")
    if saved_class is not None and saved_class != algorithm:
        # torch loads another class's state without a word (the first step then fails, or
        # the param groups make one algorithm behave as the other): refuse it here
        raise IncompatibleModelError(
            f"optimizer {name}: saved by {saved_class}, the model's is {algorithm}; build the "
            "optimizer the job saved with, or start a new URI for the new one"
        )
    say_edited(opt, saved.get("param_groups", []), f"optimizer {name}")  # (before the load)
    params = getattr(opt, "params", None)
    init = getattr(opt, "init_state", None)
    if isinstance(params, Mapping) and init is not None:
        sparse = {k for k, p in params.items() if id(p) in sparse_grads}
        _match_keyed_state(
            opt, params, lambda: init(sparse or None), set(sd.get("state", {})), name
        )
    try:
        opt.load_state_dict(sd)
    except (ValueError, KeyError, RuntimeError) as e:
        raise IncompatibleModelError(
            f"optimizer {name}: saved state does not fit ({e}): the model's optimizer is not the "
            "one that saved it (another class, or settings that change its state); build the "
            "optimizer the job saved with, or start a new URI for the new one"
        ) from None
    load_hyperparameters(opt, saved.get("param_groups", []), f"optimizer {name}", said=True)


def _by_name(
    opt: torch.optim.Optimizer,
    sd: dict[str, Any],
    saved: list[list[str | None]] | None,
    live: list[list[str | None]] | None,
    name: str,
) -> dict[str, Any]:
    """``sd`` (a state keyed by position) with each parameter's state and place at the
    position the parameter of its name has in ``opt`` now: the same state, moved; ``sd`` itself
    when the names agree, are not known on both sides (a checkpoint written before they were
    kept), or the state is keyed by name (a TorchRec KeyedOptimizer's). Parameters of other
    names, another count per group, or a parameter without a name in a changed order raise
    :class:`IncompatibleModelError` (the positional load would give one parameter another's
    state, silently where the shapes agree: a break-it finding)."""
    groups = sd.get("param_groups", [])
    # (a KeyedOptimizer's state_dict keys by name, and may hold no param groups at all)
    keys = [k for g in groups for k in g.get("params", [])]
    positional = bool(keys) and all(isinstance(k, int) for k in keys)
    if saved is None or live is None or saved == live or not positional:
        return sd
    if [len(g) for g in saved] != [len(g.get("params", [])) for g in groups]:
        raise IncompatibleModelError(
            f"optimizer {name}: the saved parameter names do not match its saved state (a "
            "damaged or hand-edited checkpoint?)"
        )
    if [sorted(map(str, g)) for g in saved] != [sorted(map(str, g)) for g in live] or any(
        None in g for g in (*saved, *live)
    ):
        gone = sorted({n for g in saved for n in g if n} - {n for g in live for n in g if n})
        new = sorted({n for g in live for n in g if n} - {n for g in saved for n in g if n})
        raise IncompatibleModelError(
            f"optimizer {name}: its parameters are not the ones it saved state for (saved only: "
            f"{gone[:4]}, the model's only: {new[:4]}, or moved between param groups, or of no "
            "name in the model): its state is keyed by position, so it cannot be matched; "
            "build the optimizer over the parameters the job saved with"
        )
    index = {
        n: k
        for g, names in zip(groups, saved, strict=True)
        for k, n in zip(g["params"], names, strict=True)
    }
    now = opt.state_dict()["param_groups"]
    state = sd.get("state", {})
    moved_state: dict[int, Any] = {}
    moved_groups = []
    for g, live_g, names in zip(groups, now, live, strict=True):
        for k, n in zip(live_g["params"], names, strict=True):
            if index[n] in state:
                moved_state[k] = state[index[n]]
        moved_groups.append({**g, "params": list(live_g["params"])})
    logger.info(
        "deck: optimizer %s holds its parameters in another order than when it saved: its "
        "state is loaded by parameter name",
        name,
    )
    return {**sd, "state": moved_state, "param_groups": moved_groups}


def _match_keyed_state(
    opt: torch.optim.Optimizer,
    params: Mapping[str, Any],
    init: Callable[[], None],
    saved_keys: set[str],
    name: str,
) -> None:
    """Give a keyed optimizer state for exactly the parameters in ``saved_keys``.

    TorchRec's strict load refuses a different number of states and only copies into tensors
    that exist. Optimizer state is created lazily by a step, so missing state is made by
    ``init_state()`` (a zero-gradient step over every parameter; the values it writes are all
    overwritten by the load and the dense parameters restored after it, and the gradients it
    sets are put back), then state of parameters the checkpoint had none for is dropped.
    """
    unknown = sorted(saved_keys - set(params))
    if unknown:
        raise IncompatibleModelError(
            f"optimizer {name}: saved state for parameters the model does not have: "
            f"{unknown[:5]}; restore into the model the checkpoint was written from"
        )
    state = opt.state
    if any(params[k] not in state for k in saved_keys):
        grads = {k: p.grad for k, p in params.items()}
        try:
            init()
        except RuntimeError as e:  # (a torch optimizer refusing the step's gradients)
            raise IncompatibleModelError(
                f"optimizer {name}: its state cannot be made for the load by a zero-gradient "
                f"step ({e}); build the optimizer the job saved with, over the same modules"
            ) from None
        finally:
            for k, p in params.items():
                p.grad = grads[k]
        missing = sorted(k for k in saved_keys if params[k] not in state)
        if missing:
            raise IncompatibleModelError(
                f"optimizer {name}: no state can be made for {missing[:5]} (does the parameter "
                "require grad?); restore into the model the checkpoint was written from"
            )
    for k, p in params.items():
        if k not in saved_keys and p in state:
            del state[p]  # no state when saved (never had a gradient): none now either


# ---- tables that are data_parallel on one side and sharded on the other ---------------------


@dataclass
class PlanMoves:
    """Tables that a checkpoint and the model keep differently.

    ``to_replicated``: sharded (row records) in the checkpoint, data_parallel in the model. Their
    rows are applied into ``staging`` shards (a whole-table weight, a copy of the live tensor)
    and then loaded with the dense state, after the dense optimizer (whose init may step).
    ``from_replicated``: data_parallel in the checkpoint (a tensor of its dense state), sharded in
    the model: their shards get the saved weight and fresh (zero) fused optimizer states.
    """

    to_replicated: dict[str, TableShard]
    from_replicated: list[str]

    @property
    def tables(self) -> set[str]:
        return set(self.to_replicated) | set(self.from_replicated)


def plan_moves(
    storage: Storage,
    chain: list[CheckpointManifest],
    tables: dict[str, tuple[int, int]],
    replicated: dict[str, torch.Tensor],
    saved_dense: dict[str, torch.Tensor],
) -> PlanMoves:
    """Which tables of the model change between data_parallel and sharded from ``chain``'s full
    (whose rank manifests say which tables it holds as rows) and the saved dense state."""
    saved = {rec.table for p in read_rank_manifests(storage, chain[0]) for rec in p.shards}
    staging = {}
    for key, live in replicated.items():
        if key in saved and key not in tables and live.dim() == 2:
            rows, cols = (int(x) for x in live.shape)
            staging[key] = TableShard(
                key,
                rows,
                cols,
                0,
                rows,
                0,
                cols,
                {"weight": live.detach().clone()},
                replicated=True,
            )
    from_dense = sorted(k for k in tables if k not in saved and k in saved_dense)
    return PlanMoves(staging, from_dense)


def fill_from_dense(
    moves: PlanMoves, shards: list[TableShard], saved_dense: dict[str, torch.Tensor], where: str
) -> None:
    """Write each ``from_replicated`` table's saved weight (popped from ``saved_dense``) into
    this rank's shards of it, and zero their other per-row states (as a new TBE starts them)."""
    for key in moves.from_replicated:
        full = saved_dense.pop(key)
        for s in (s for s in shards if s.table == key):
            if tuple(full.shape) != (s.num_rows, s.num_cols):
                raise IncompatibleModelError(
                    f"table {key}: {where} has shape {tuple(full.shape)}, the model has "
                    f"({s.num_rows}, {s.num_cols}); build the model with the same tables"
                )
            with torch.no_grad():
                for name, view in s.states.items():
                    if name == "weight":
                        part = full[s.row_offset : s.row_offset + s.rows]
                        view.copy_(part[:, s.col_offset : s.col_offset + s.cols].to(view.dtype))
                    else:
                        view.zero_()
        logger.warning(
            "deck: table %s was data_parallel in %s and is sharded in this model: its weights are "
            "restored exactly; its fused optimizer state starts fresh (zero), since the saved "
            "per-element state of the dense optimizer does not fit the fused per-row layout",
            key,
            where,
        )
    for key in moves.to_replicated:
        logger.warning(
            "deck: table %s was sharded in %s and is data_parallel in this model: its weights are "
            "restored exactly; its per-row fused optimizer state is not carried over (the dense "
            "optimizer keeps what it holds for it: a new one that makes its state at its first "
            "step, as Adam does, starts it fresh then)",
            key,
            where,
        )


def reconcile_optimizer(
    opt: torch.optim.Optimizer, saved: dict[str, Any], moved: set[str]
) -> dict[str, Any]:
    """The saved state of a TorchRec KeyedOptimizer (``{"state_dict", "param_groups"}``), fitted
    to ``opt`` when the tables ``moved`` changed between data_parallel and sharded: saved states
    of moved tables the optimizer no longer has are dropped; moved tables it has now keep the
    state the live optimizer holds for them, or none where it holds none (a lazily initialised
    optimizer such as Adam then starts theirs at its next step, as a new one would: a
    zero-gradient ``init_state()`` step would leave a step count, and with weight decay a
    momentum, that no fresh optimizer has). Other optimizers, or nothing moved: ``saved``
    unchanged."""
    params = getattr(opt, "params", None)
    sd = saved["state_dict"]
    if not moved or not isinstance(params, dict) or "state" not in sd:
        return saved

    def is_moved(k: str) -> bool:
        return any(k == m or k.endswith("." + m) for m in moved)

    state = dict(sd["state"])
    dropped = {k for k in state if k not in params and is_moved(k)}
    added = [k for k in params if k not in state and is_moved(k)]
    if not dropped and not added:
        return saved
    for k in dropped:
        del state[k]
    live = opt.state_dict()
    for k in added:
        if k in live["state"]:
            state[k] = live["state"][k]
    groups = [dict(g) for g in sd.get("param_groups", [])]
    for i, g in enumerate(groups):
        keep = [k for k in g.get("params", []) if k not in dropped]
        if i < len(live["param_groups"]):
            keep += [k for k in live["param_groups"][i]["params"] if k in added]
        g["params"] = keep
    return {**saved, "state_dict": {**sd, "state": state, "param_groups": groups}}
