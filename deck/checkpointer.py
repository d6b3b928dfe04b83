"""The user-facing checkpointer: track, snapshot, commit, restore."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from deck import __version__
from deck.adapters.base import ModelAdapter, RemovableHandle, TableShard, copy_dense_state
from deck.catalog import chain_for, latest_restorable, read_manifests
from deck.config import CHECKPOINT_CONSUMER, DeckConfig
from deck.coordination import Coordinator
from deck.errors import CheckpointNotFoundError, DeckError, IncompatibleModelError, StorageError
from deck.format import Kind
from deck.restore import apply_chain, load_optimizer, read_state_file
from deck.storage import Storage, check_writable, open_storage
from deck.tracker import TrackerStore
from deck.writer import RankPartWriter, commit, scalar_key

logger = logging.getLogger(__name__)


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> Any: ...


UserState = Stateful | tuple[Callable[[], Any], Callable[[Any], None]]


@dataclass(frozen=True)
class CheckpointStats:
    """One committed checkpoint as the trainer saw it (summed / maxed over ranks)."""

    step: int
    kind: str
    stall_s: float  # max over ranks of the time training was blocked
    bytes: int  # all ranks
    rows: int  # all ranks, all tables
    chunks: int


class CheckpointError(DeckError):
    """A checkpoint could not be written; nothing was committed and training may go on."""


class DeltaCheckpointer:
    """Delta checkpoints of a TorchRec ``DistributedModelParallel`` model.

    Construction checks the URI is writable (on every rank) and installs tracking hooks.
    ``step(step)`` after each optimizer step takes a checkpoint when one is due; ``restore()``
    loads the latest (or a given) committed step bitwise. Every rank must call ``step``,
    ``save`` and ``restore`` together (they use collectives).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: Any,
        config: DeckConfig,
        state: UserState | None = None,
        *,
        adapter: ModelAdapter | None = None,
    ):
        self.config = config
        self.adapter = adapter or _default_adapter(model)
        self.coord = Coordinator()
        self.storage: Storage = open_storage(config.uri, config.storage_options)
        check_writable(self.storage)
        self._optimizers = self.adapter.dense_optimizers(optimizers)
        self._state = _user_state(state)
        shards = self.adapter.table_shards()
        self.tracker = TrackerStore(sum(s.rows for s in shards), config.consumers)
        self._paused = 0
        self._hooks: RemovableHandle | None = self.adapter.install_tracking(
            self.tracker, shards, self._active
        )
        self._parent: tuple[int, str] | None = None
        self._base: int | None = None
        self._epoch = self._next_epoch()
        self._last_step: int | None = None
        self.history: list[CheckpointStats] = []

    # ---- tracking control --------------------------------------------------------------------
    def _active(self, module: torch.nn.Module) -> bool:
        return self._paused == 0 and (module.training or self.config.track_eval)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Inside this block, lookups are not tracked (e.g. evaluation forwards)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # ---- saving ------------------------------------------------------------------------------
    def step(self, step: int) -> CheckpointStats | None:
        """Call after the optimizer step of ``step``; saves when ``step % delta_every_steps == 0``.

        The checkpoint is full when there is no committed parent in this process (the first one,
        or after an unrecoverable error) or ``step`` is a multiple of ``full_every_steps``.
        """
        self._last_step = step
        if step % self.config.delta_every_steps:
            return None
        full_every = self.config.full_every_steps
        full = self._parent is None or (full_every is not None and step % full_every == 0)
        return self.save("full" if full else "delta", step=step)

    def save(
        self, kind: Literal["delta", "full"] = "delta", *, step: int | None = None
    ) -> CheckpointStats:
        """Take a checkpoint of ``kind`` at ``step`` (default: the last step given to ``step``).

        Returns once it is committed on every rank. On failure nothing is committed, the
        tracked rows stay pending for the next checkpoint, and :class:`CheckpointError` names
        the step and the cause.
        """
        if kind not in ("delta", "full"):
            raise ValueError(f"kind must be 'delta' or 'full', got {kind!r}")
        if step is None:
            step = self._last_step
        if step is None:
            raise ValueError("save() needs step=... before the first call to step()")
        if kind == "delta" and self._parent is None:
            logger.info(
                "step %d: no committed checkpoint to be a delta of in this process: taking a full",
                step,
            )
            kind = "full"
        t0 = time.perf_counter()
        ckpt_id = self.coord.new_id()
        token = self.tracker.begin_read(CHECKPOINT_CONSUMER)
        full = kind == "full"
        writer = RankPartWriter(
            self.storage,
            step,
            ckpt_id,
            self.coord.rank,
            self.coord.world_size,
            self.config.staging.chunk_bytes,
        )
        error: BaseException | None = None
        try:
            shards = self.adapter.table_shards()

            def rows_for(shard: TableShard) -> torch.Tensor | None:
                if full or shard.full_only:
                    return None
                return self.tracker.touched(token, shard.track_base, shard.track_base + shard.rows)

            dense = self.adapter.dense_state() if self.coord.rank == 0 else None
            writer.write_part(shards, rows_for, dense, self._extra_state(shards))
        except Exception as e:
            error = e
        local = [
            0.0 if error else 1.0,
            time.perf_counter() - t0,
            writer.bytes_written,
            writer.rows_written,
            writer.chunks_written,
        ]
        gathered = self.coord.gather(local)
        if gathered[:, 0].min() < 1:
            self._abort(
                writer,
                step,
                error,
                f"rank(s) {gathered[:, 0].lt(1).nonzero().view(-1).tolist()} failed",
            )
        manifest_ok = 1.0
        if self.coord.rank == 0:
            try:
                base = step if full else self._base
                commit(
                    self.storage,
                    step=step,
                    ckpt_id=ckpt_id,
                    kind=Kind.FULL if full else Kind.DELTA,
                    parent=None if full else self._parent,
                    base=base if base is not None else step,
                    epoch=self._epoch,
                    world_size=self.coord.world_size,
                    deck_version=__version__,
                )
            except Exception as e:
                error, manifest_ok = e, 0.0
        if self.coord.gather([manifest_ok])[0, 0] < 1:
            self._abort(writer, step, error, "the commit record could not be written")
        self.tracker.commit(token)
        self._parent = (step, ckpt_id)
        if full:
            self._base = step
        stats = CheckpointStats(
            step=step,
            kind=kind,
            stall_s=max(float(gathered[:, 1].max()), time.perf_counter() - t0),
            bytes=int(gathered[:, 2].sum()),
            rows=int(gathered[:, 3].sum()),
            chunks=int(gathered[:, 4].sum()),
        )
        self.history.append(stats)
        logger.info(
            "deck: %s checkpoint step %d committed at %s: %d rows, %.1f MiB, stall %.3f s",
            kind,
            step,
            self.storage.uri,
            stats.rows,
            stats.bytes / 2**20,
            stats.stall_s,
        )
        return stats

    def _abort(
        self, writer: RankPartWriter, step: int, error: BaseException | None, why: str
    ) -> None:
        try:
            writer.discard()
        except StorageError as e:  # the files are unreferenced either way; GC removes them later
            logger.warning("could not remove the partial files of step %d: %s", step, e)
        raise CheckpointError(
            f"checkpoint of step {step} at {self.storage.uri} was not committed: {why}"
            + (f"; on rank {self.coord.rank}: {error}" if error else "")
            + ". Nothing was lost: its rows stay pending for the next checkpoint."
        ) from error

    def _extra_state(self, shards: list[TableShard]) -> dict[str, Any]:
        return {
            "optimizers": {
                name: {
                    "state_dict": opt.state_dict(),
                    "param_groups": [
                        {k: v for k, v in g.items() if k != "params"} for g in opt.param_groups
                    ],
                }
                for name, opt in self._optimizers.items()
            },
            "user": self._state[0]() if self._state else None,
            "scalars": {scalar_key(s): dict(s.scalars) for s in shards if s.scalars},
        }

    # ---- restoring ---------------------------------------------------------------------------
    def restore(self, step: int | None = None) -> int | None:
        """Load committed ``step`` (the latest restorable one when None) into the live model,
        optimizers and user state, bitwise. Returns the step, or None when the URI holds no
        checkpoint. Later checkpoints are deltas relative to the restored one."""
        manifests = read_manifests(self.storage)
        target = latest_restorable(manifests) if step is None else step
        if target is None:
            if manifests:
                raise CheckpointNotFoundError(
                    f"{self.storage.uri} has checkpoints {sorted(manifests)} but none has a complete chain"
                )
            return None
        chain = chain_for(manifests, target)
        last = chain[-1]
        if last.world_size != self.coord.world_size:
            raise IncompatibleModelError(
                f"step {target} at {self.storage.uri} was written by {last.world_size} ranks, this job has "
                f"{self.coord.world_size}; restore with the same world size"
            )
        shards = self.adapter.table_shards()
        stats, parts = apply_chain(self.storage, chain, shards, self.adapter.table_shapes())
        mine = parts[self.coord.rank]
        extra = read_state_file(self.storage, target, mine.extra)
        for name, opt in self._optimizers.items():
            saved = extra["optimizers"].get(name)
            if saved is None:
                raise IncompatibleModelError(
                    f"optimizer {name} is not in step {target} at {self.storage.uri}"
                )
            load_optimizer(opt, saved, name)
        dense_rec = parts[0].dense
        if dense_rec is None:
            raise IncompatibleModelError(f"step {target}: rank 0 part has no dense state")
        problems = copy_dense_state(
            self.adapter.dense_state(), read_state_file(self.storage, target, dense_rec)
        )
        if problems:
            raise IncompatibleModelError(
                f"dense state of step {target} does not fit the model: {problems[:5]}"
            )
        with torch.no_grad():
            for s in shards:
                for name, t in extra["scalars"].get(scalar_key(s), {}).items():
                    s.scalars[name].copy_(t)
        if self._state is not None:
            self._state[1](extra["user"])
        self.tracker.reset()
        self._parent = (target, last.id)
        self._base = chain[0].step
        self._epoch = self._next_epoch(manifests)
        self._last_step = target
        self.last_restore = stats
        logger.info(
            "deck: restored step %d from %s (%d checkpoints, %d chunks, %.1f MiB on this rank)",
            target,
            self.storage.uri,
            stats.checkpoints,
            stats.chunks,
            stats.bytes / 2**20,
        )
        return target

    def _next_epoch(self, manifests: dict | None = None) -> int:
        if manifests is None:
            manifests = read_manifests(self.storage) if self.coord.rank == 0 else {}
            return self.coord.broadcast_int(
                max((m.epoch for m in manifests.values()), default=-1) + 1
            )
        return max((m.epoch for m in manifests.values()), default=-1) + 1

    # ---- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Finish pending work and remove the tracking hooks; idempotent."""
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None

    def __enter__(self) -> DeltaCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _default_adapter(model: torch.nn.Module) -> ModelAdapter:
    from deck.adapters.torchrec import TorchRecAdapter

    return TorchRecAdapter(model)  # type: ignore[arg-type]


def _user_state(state: UserState | None) -> tuple[Callable[[], Any], Callable[[Any], None]] | None:
    if state is None:
        return None
    if isinstance(state, tuple) and len(state) == 2 and all(callable(f) for f in state):
        return state
    if isinstance(state, Stateful):
        return state.state_dict, state.load_state_dict
    raise TypeError(
        "state must be an object with state_dict()/load_state_dict() or a (get_state, set_state) pair, "
        f"got {type(state).__name__}"
    )


def enable(
    model: torch.nn.Module, optimizers: Any, config: DeckConfig, state: UserState | None = None
) -> DeltaCheckpointer:
    """The one-line way in: returns a :class:`DeltaCheckpointer` tracking ``model``."""
    return DeltaCheckpointer(model, optimizers, config, state)
