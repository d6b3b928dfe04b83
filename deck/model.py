"""What deck sees of a model: the interface between deck and one embedding implementation.

Everything that knows a particular model type (TorchRec DMP today: ``adapters/``) lives behind
:class:`ModelAdapter`; the checkpointer, format and restore only see :class:`TableShard`. An
adapter's tracking hooks write into a :class:`RowRecorder` (the trainer's tracker store), so
adapters need nothing of the trainer and the trainer nothing of a particular adapter.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from deck.errors import IncompatibleModelError

logger = logging.getLogger(__name__)


class RowRecorder(Protocol):
    """Where tracking hooks put the rows a lookup touched (the trainer's
    :class:`~deck.trainer.tracker.TrackerStore`): positions in the flat row space of the tracked
    shards, each shard's rows from its :attr:`TableShard.track_base` on."""

    def record(self, positions: torch.Tensor) -> None:
        """Rows ``positions`` (int64, any order, duplicates allowed) were looked up; called on
        the hot path (after each lookup), so it must not synchronise with the device."""

    def compact(self) -> None:
        """Fold what :meth:`record` got so far into the store (called after the lookup's
        output distribution, overlapping its AllToAll)."""

    def await_backward(
        self, output: torch.Tensor, positions: torch.Tensor, guarded: list[Future[None]]
    ) -> None:
        """A tracked lookup of rows ``positions`` produced ``output`` (which requires grad):
        its backward, where the fused optimizer writes the rows, is still to come, and waits
        for ``guarded`` (what :meth:`guard` started in the background) first. A checkpoint
        taken before it is refused (it would be neither the step before nor the step after);
        another backward through the same graph later writes the rows again, so it guards and
        records them again."""

    @property
    def guarding(self) -> bool:
        """Whether a copy-on-write snapshot still has rows to copy: lookups must call
        :meth:`guard` (tracked or not: paused, eval) until it is False."""

    def guard(self, positions: torch.Tensor, in_background: bool = False) -> list[Future[None]]:
        """Rows ``positions`` are about to be updated (by this step's backward): a snapshot's
        pending copy of them is made first. Returns once they are safe to write; with
        ``in_background`` (the lookup's backward is to come) it may instead return the futures
        of copies still running, which :meth:`await_backward` makes that backward wait for."""


@dataclass
class TableShard:
    """All rows ``[row_offset, row_offset + rows)`` x columns ``[col_offset, col_offset + cols)`` of
    one table held by this rank, with live views of every per-row state.

    ``states`` maps a state name ("weight", "momentum1", ...) to a tensor whose first dimension is
    ``rows``; writing into it changes the live model. ``scalars`` are per-shard states without a
    row dimension, saved whole every time. ``full_only`` marks shards whose rows can change
    without a lookup (saved in full by every checkpoint). ``track_base`` is the position of the
    shard's first row in the tracker's flat row space.
    """

    table: str
    num_rows: int
    num_cols: int
    row_offset: int
    rows: int
    col_offset: int
    cols: int
    states: dict[str, torch.Tensor]
    scalars: dict[str, torch.Tensor] = field(default_factory=dict)
    full_only: bool = False
    track_base: int = 0
    # A restore target holding a whole data_parallel table's weight: saved states other than
    # those in ``states`` (a sharded table's fused optimizer state) are skipped.
    replicated: bool = False
    # What a snapshot derives from ``states`` (their checked byte views): once per shard object,
    # which the adapter replaces when a tensor moves. Not an init field, so a replaced copy of
    # the shard starts empty.
    memo: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def whole(cls, table: str, states: dict[str, torch.Tensor], **more: Any) -> TableShard:
        """Every row and column of ``table`` (its shape from ``states["weight"]``) on one rank;
        ``more``: the other fields (``track_base``, ``scalars``, ...)."""
        rows, cols = states["weight"].shape
        return cls(
            table=table,
            num_rows=rows,
            num_cols=cols,
            row_offset=0,
            rows=rows,
            col_offset=0,
            cols=cols,
            states=states,
            **more,
        )

    def row_bytes(self) -> int:
        """Bytes one row takes on disk (id + every state)."""
        return 8 + sum(t[0:1].numel() * t.element_size() for t in self.states.values())


@dataclass
class WrapperState:
    """The state an optimizer wrapper keeps itself, outside the optimizers it wraps (e.g. a
    warmup's iteration and stage): ``get()`` returns it as a tree of numbers/tensors, ``set``
    puts a saved one back."""

    get: Callable[[], dict[str, Any]]
    set: Callable[[dict[str, Any]], None]


@dataclass
class Optimizers:
    """What deck saves of the user's optimizers: the leaves that own dense state (by name; the
    adapter's fused optimizers removed) and the wrappers around them that keep state of their
    own (by name)."""

    dense: dict[str, torch.optim.Optimizer] = field(default_factory=dict)
    # the qualified class name of the algorithm each dense leaf runs (by the same names; a
    # restore refuses another): what the adapter knows of wrappers whose class says nothing
    classes: dict[str, str] = field(default_factory=dict)
    wrappers: dict[str, WrapperState] = field(default_factory=dict)
    # the model's name of each parameter of each dense leaf, by param group and position (None:
    # not one of the model's): a plain torch optimizer keys its state by position, so a model
    # built with its parameters in another order restores by these names
    param_names: dict[str, list[list[str | None]]] = field(default_factory=dict)
    # ids of the model's parameters whose gradients are sparse (an ``nn.Embedding(sparse=True)``
    # weight): a keyed optimizer's state is made by a zero-gradient step before a load, and
    # theirs must be sparse (``torch.optim.SparseAdam`` refuses a dense one: a break-it finding)
    sparse_grads: frozenset[int] = frozenset()


class RemovableHandle:
    """Undo for something an adapter installed (e.g. tracking hooks), and whether it is still
    in place."""

    def __init__(self, remove: Callable[[], None], intact: Callable[[], bool] | None = None):
        self._remove: Callable[[], None] | None = remove
        self._intact = intact

    def remove(self) -> None:
        """Remove it; a second call does nothing."""
        if self._remove is not None:
            self._remove()
            self._remove = None

    def intact(self) -> bool:
        """False when something replaced what was installed since (e.g. another tracker's
        setter replaced a lookup callback, so lookups go untracked); True when the adapter
        cannot tell, and once removed."""
        return self._remove is None or self._intact is None or self._intact()


class ModelAdapter(abc.ABC):
    """What deck needs from a model: its table shards, its dense state, and lookup hooks."""

    @abc.abstractmethod
    def table_shards(self) -> list[TableShard]:
        """This rank's table shards with fresh live views, in a stable order.

        Flushes any embedding cache first, so the views hold post-update values.
        """

    @abc.abstractmethod
    def table_shapes(self) -> dict[str, tuple[int, int]]:
        """Global (rows, cols) of every row-tracked table of the model, on every rank."""

    @abc.abstractmethod
    def dense_state(self) -> dict[str, torch.Tensor]:
        """Every plain (replicated) tensor of the model state: dense parameters, buffers,
        data-parallel tables. Values are live tensors."""

    def replicated_tables(self) -> dict[str, torch.Tensor]:
        """Embedding tables kept whole on every rank (TorchRec data_parallel), by the same key a
        sharded table of that name would have; live tensors, also part of :meth:`dense_state`.
        A restore uses them when the checkpoint sharded such a table (and the other way round)."""
        return {}

    @abc.abstractmethod
    def optimizers(self, optimizers: object) -> Optimizers:
        """The user's optimizers split into dense leaves and stateful wrappers (the adapter's
        fused optimizers removed, wherever they sit inside). Raises
        :class:`deck.errors.UnsupportedError` naming an optimizer deck cannot save exactly."""

    def fused_hyperparameters(self) -> dict[str, dict[str, Any]]:
        """Hyperparameters (lr, ...) of the optimizers fused into the embedding kernels, by table:
        the schedule-driven part of their state, which their ``state_dict`` may leave out."""
        return {}

    def check_fused_optimizers(
        self, saved: dict[str, dict[str, Any]], where: str, fresh: set[str]
    ) -> None:
        """Before a restore writes anything: raise :class:`deck.errors.IncompatibleModelError`
        when ``saved`` (:meth:`fused_hyperparameters` of the checkpoint) names an update rule
        other than the one a table's kernel runs here (its saved state would be read by
        another rule); ``where`` names the checkpoint. Tables in ``fresh`` had no fused
        optimizer in the checkpoint (data_parallel there): their kernels start fresh, unchecked."""
        return None

    def load_fused_hyperparameters(
        self, saved: dict[str, dict[str, Any]], where: str, fresh: set[str]
    ) -> None:
        """Put :meth:`fused_hyperparameters` back and make the kernels use them from the next
        step on; ``where`` names the checkpoint in errors. A fused optimizer of ``fresh`` tables
        only keeps the model's own hyperparameters."""
        return None

    def module_state(self) -> dict[str, Any]:
        """State this rank's modules keep beside their tables and the dense state_dict that a
        restore must bring back (a managed-collision remapper's id arrays, counters and id
        history): a tree of tensors and numbers, live, saved whole by every checkpoint in this
        rank's extra state. {}: none."""
        return {}

    def prepare_module_state(
        self, saved: dict[str, Any], saved_ranks: int, where: str
    ) -> Callable[[], None]:
        """Check ``saved`` (what :meth:`module_state` returned on the rank whose extra state
        this rank loads, {} if the checkpoint has none; written by ``saved_ranks`` ranks)
        against the model before a restore writes anything: raises
        :class:`deck.errors.IncompatibleModelError` naming what cannot be put back exactly;
        returns what puts it back (called once the rest of the state is loaded)."""
        if saved:
            raise IncompatibleModelError(
                f"{where} holds module state ({', '.join(sorted(saved))}) this model has no "
                "place for; restore it into the model it was saved from"
            )
        return lambda: None

    def pin_reduction_order(self) -> None:
        """Collective, before the first training step: fix the order in which gradients are
        summed across ranks, so a process started from a restore sums them exactly as the run
        that saved it did (with 3+ ranks a float sum depends on that order)."""
        return None

    def after_restore(self) -> None:
        """Called once a restore has written every state back; lets an implementation resync
        caches it derives from that state (e.g. a step counter kept outside its buffers)."""
        return None

    def watch_gradients(self, optimizers: Optimizers) -> RemovableHandle | None:
        """Watch the dense parameters of ``optimizers`` for gradients no optimizer step has
        applied (:meth:`unapplied_gradients`), replacing an earlier watch; the handle stops it.
        None: not watched."""
        return None

    def unoptimized_parameters(self) -> list[str]:
        """The dense parameters (by name) that a backward gave a gradient but that are in none
        of the optimizers given to :meth:`watch_gradients`: an optimizer deck was not given may
        update them, whose state a restore would lose. Each list is given once (asked at every
        checkpoint, said once)."""
        return []

    def unapplied_gradients(self) -> list[str]:
        """The dense parameters (by name) holding a gradient, not zero, that a backward
        accumulated since an optimizer step last changed them: a checkpoint saves no
        gradients, so one now is refused (gradient accumulation; a checkpoint between
        ``backward()`` and ``optimizer.step()``). Asked at every checkpoint."""
        return []

    def rows_written_before_lookup(self) -> str | None:
        """Why a batch may have been looked up before the previous batch's update (a pipeline
        that looks the next batch up ahead): a checkpoint then is refused, its lookup output
        being state no checkpoint holds. None: every lookup of a step follows the update of the
        step before. Asked at every checkpoint."""
        return None

    @abc.abstractmethod
    def install_tracking(
        self,
        store: RowRecorder,
        shards: list[TableShard],
        is_active: Callable[[torch.nn.Module], bool],
    ) -> RemovableHandle:
        """Record looked-up rows of every tracked shard into ``store``; chains with any hook
        already installed. ``is_active(module)`` is asked at each lookup (pause, eval). After
        the handle's ``remove()`` nothing is recorded and neither ``store`` nor ``is_active``
        is held, even where something that chained itself behind these hooks still calls them;
        its ``intact()`` says whether they are still the ones the model calls."""


def optimizer_record(
    opt: Any, algorithm: str, param_names: list[list[str | None]] | None = None
) -> dict[str, Any]:
    """What a checkpoint keeps of a dense optimizer (docs/format.md, "Dense and extra state"):
    its ``state_dict``, its :func:`hyperparameters` and ``algorithm``, the qualified class name
    of the algorithm it runs (:attr:`Optimizers.classes`), and the model's names of its
    parameters (:attr:`Optimizers.param_names`)."""
    out = {
        "state_dict": opt.state_dict(),
        "param_groups": hyperparameters(opt),
        "class": algorithm,
    }
    if param_names is not None:
        out["param_names"] = param_names
    return out


def hyperparameters(opt: Any) -> list[dict[str, Any]]:
    """Every param group of ``opt`` without its parameters: lr, betas, weight decay, ... and
    whatever a scheduler added (``initial_lr``). Read from ``param_groups`` itself: TorchRec's
    KeyedOptimizer leaves them out of its state_dict unless told to save them."""
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def load_hyperparameters(
    opt: Any, groups: list[dict[str, Any]], what: str, *, said: bool = False
) -> None:
    """Put :func:`hyperparameters` back into ``opt``'s param groups, in order, saying which
    ones they replace (:func:`say_edited`; ``said``: the caller did, before it loaded more).
    Raises :class:`deck.errors.IncompatibleModelError` naming ``what`` when the group counts
    differ."""
    if len(groups) != len(opt.param_groups):
        raise IncompatibleModelError(
            f"{what}: {len(groups)} param groups saved, {len(opt.param_groups)} in the model"
        )
    if not said:
        say_edited(opt, groups, what)
    for live, hyper in zip(opt.param_groups, groups, strict=True):
        live.update(hyper)


_edits_level: ContextVar[int] = ContextVar("deck_edits_level", default=logging.WARNING)


@contextmanager
def edits_logged_at(level: int) -> Iterator[None]:
    """:func:`say_edited` logs at ``level`` inside: INFO where a wrapper sets the lr itself
    (TorchRec's WarmupOptimizer moves it from its own base each step, with no ``initial_lr``
    to tell its progress from an edit)."""
    token = _edits_level.set(level)
    try:
        yield
    finally:
        _edits_level.reset(token)


def say_edited(opt: Any, groups: list[dict[str, Any]], what: str) -> None:
    """Log (a WARNING, or see :func:`edits_logged_at`) each param group of ``opt`` built with
    hyperparameters other than the saved ``groups`` (called before they are loaded): the
    restore replaces the edit."""
    for i, (live, hyper) in enumerate(zip(opt.param_groups, groups, strict=False)):
        changed = _edited(live, hyper)
        if changed:
            logger.log(
                _edits_level.get(),
                "deck: %s, param group %d: the checkpoint's %s replace what the optimizer was "
                "built with (%s): hyperparameters are restored with the state, so that a "
                "schedule resumes; to change one, set it after the restore",
                what,
                i,
                _values(hyper, changed),
                _values(live, changed),
            )


def say_kernel_edited(
    live: Mapping[str, Any], saved: Mapping[str, Any], what: str, how_to_change: str
) -> None:
    """Log (as :func:`say_edited`) the arguments a fused kernel (``what``) was built with that
    differ from the checkpoint's ``saved`` (called before they are loaded): the restore
    replaces them, as the kernel held them. ``how_to_change``: how to set one after it."""
    changed = [k for k in sorted(live) if k in saved and _differs(live[k], saved[k])]
    if changed:
        logger.log(
            _edits_level.get(),
            "deck: %s: the checkpoint's %s replace what the kernel was built with (%s): the "
            "fused optimizer's arguments are restored as the kernel held them (on every rank: "
            "the tables named are the ones this rank holds); to train on with others, %s after "
            "the restore",
            what,
            _values(saved, changed),
            _values(live, changed),
            how_to_change,
        )


def _values(of: Mapping[str, Any], keys: list[str]) -> str:
    return ", ".join(f"{k}={of[k]!r}" for k in keys)


def _edited(live: Mapping[str, Any], saved: Mapping[str, Any]) -> list[str]:
    """The hyperparameters ``live`` was built with that differ from ``saved``'s: an edit
    before the restart, which the restore discards. A scheduler's progress is not one: where
    both hold an ``initial_lr`` (the scheduler's base), the lr is compared through it."""
    scheduled = "initial_lr" in live and "initial_lr" in saved
    return [
        k
        for k in sorted(live)
        if k in saved
        and k != "params"
        and not (scheduled and k == "lr")
        and _differs(live[k], saved[k])
    ]


def _differs(a: Any, b: Any) -> bool:
    """Whether two values of a hyperparameter differ, a tensor taken as its numbers and a
    tuple as a list (as a saved one reads back); values that cannot be compared (an array's
    ambiguous truth) are not said to."""

    def plain(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.tolist()
        if isinstance(value, tuple | list):
            return [v.tolist() if isinstance(v, torch.Tensor) else v for v in value]
        return value

    try:
        return bool(plain(a) != plain(b))
    except (ValueError, TypeError, RuntimeError):
        return False


def dense_state_problems(
    live: Mapping[str, torch.Tensor], saved: Mapping[str, torch.Tensor]
) -> list[str]:
    """Why ``saved`` cannot be copied into ``live`` (missing/unexpected keys, other shapes)."""
    problems = [f"missing in checkpoint: {k}" for k in live if k not in saved]
    problems += [f"not in model: {k}" for k in saved if k not in live]
    for k, t in live.items():
        s = saved.get(k)
        if s is not None and s.shape != t.shape:
            problems.append(f"{k}: shape {tuple(s.shape)} in checkpoint, {tuple(t.shape)} in model")
    return problems


def copy_dense_state(
    live: Mapping[str, torch.Tensor], saved: Mapping[str, torch.Tensor]
) -> list[str]:
    """Copy ``saved`` into ``live`` in place; returns the problems (missing/unexpected/shape)."""
    problems = dense_state_problems(live, saved)
    if not problems:
        with torch.no_grad():
            for k, t in live.items():
                t.copy_(saved[k])
    return problems
