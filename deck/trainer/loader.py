"""Restore orchestration on the training ranks: pick the step, load its chain, agree, fall back.

:class:`StateLoader` is called by the training thread of every rank together
(:meth:`deck.trainer.checkpointer.DeltaCheckpointer.restore`, after its flush):

1. rank 0 picks the target (the latest restorable step, or the one asked) and broadcasts it;
2. every rank loads its share of the chain (rows by global id, so another world size or plan is
   fine), the dense and optimizer state, shard scalars and the user state;
3. one all-gather of each rank's :class:`LoadResult`: all loaded, or all raise -- and with
   ``allow_fallback``, when every failure was a damaged or missing checkpoint, rank 0 verifies
   chains from the target down (quarantining what is damaged) and every rank loads the first
   valid one.

It returns a :class:`Restored` for the checkpointer to continue its chain from; it never writes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from deck.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DeckError,
    IncompatibleModelError,
    NotFoundError,
)
from deck.format.epochs import newest_witness
from deck.format.manifest import MANIFEST, CheckpointManifest, RankManifest, load_model, steps_text
from deck.model import (
    ModelAdapter,
    Optimizers,
    copy_dense_state,
    dense_state_problems,
    edits_logged_at,
)
from deck.read.catalog import (
    ManifestSet,
    checkpoint_label,
    damaged_records,
    manifest_keys,
    read_manifests,
    read_rank_manifests,
)
from deck.read.lineage import (
    best_valid_chain,
    chain_for,
    confirmed,
    latest_checked,
    latest_confirmed,
    latest_restorable,
)
from deck.read.restore import RestoreStats, apply_chain, read_state_file
from deck.read.window import read_window
from deck.storage import Storage
from deck.storage.base import get_bounded
from deck.trainer.coordination import Coordinator, gather_votes
from deck.trainer.fitting import (
    fill_from_dense,
    load_optimizer,
    plan_moves,
    put_scalars,
    rank_part,
    reconcile_optimizer,
    same_layout,
    shard_scalars,
)
from deck.trainer.rng import restore_rng
from deck.units import human_bytes

logger = logging.getLogger(__name__)


# Broadcast instead of the latest step: rank 0 refused the restore (it says why)
_REFUSED = -2


class LoadResult(IntEnum):
    """One rank's result of loading a chain (step 3)."""

    LOADED = 0
    FAILED = 1  # any other error: no fallback can help
    DAMAGED = 2  # a damaged or missing checkpoint: an older valid chain may
    INCOMPATIBLE = 3  # the model does not fit the checkpoint (IncompatibleModelError)


@dataclass(frozen=True)
class _LoadVote:
    result: LoadResult


@dataclass
class Restored:
    """What a restore loaded: where the checkpointer's chain goes on from."""

    step: int
    parent: tuple[int, str] | None  # (step, id) later deltas build on; None: next is a full
    base: int  # step of the chain's full
    epoch: int  # the epoch of checkpoints written from now on
    stats: RestoreStats


def next_epoch(manifests: ManifestSet | dict, storage: Storage | None = None) -> int:
    """The epoch after every committed checkpoint's (0 for an empty URI) and, with
    ``storage``, after the newest one witnessed there (:mod:`deck.format.epochs`: listed unless
    the read of ``manifests`` did), so that a catalog leaving out a newer timeline's records
    never makes a new one reuse its epoch. A store with no witness (written by a deck before
    them) read through a catalog is read record by record here: only that names its newest
    epoch."""
    if storage is None:
        return max((m.epoch for m in manifests.values()), default=-1) + 1
    read = manifests if isinstance(manifests, ManifestSet) else None
    witness = read.witness if read is not None and read.witness_listed else newest_witness(storage)
    catalog = read is not None and read.index is not None and read.index.catalog is not None
    if witness is None and catalog:
        manifests = read_manifests(storage, manifest_keys(storage))
    newest = max((m.epoch for m in manifests.values()), default=-1)
    return max(newest, -1 if witness is None else witness) + 1


@dataclass
class StateLoader:
    """Loads committed steps into one rank's live model and state (module docstring)."""

    storage: Storage
    coord: Coordinator
    adapter: ModelAdapter
    optimizers: Optimizers
    set_user_state: Callable[[Any], None] | None
    restore_rng: bool = True
    # What a refusal says the caller can do instead (deck.load, which never falls back, says
    # its own)
    fallback_hint: str = "; restore(allow_fallback=True) restores the newest valid step instead"

    def restore(self, step: int | None, allow_fallback: bool) -> Restored | None:
        """Load committed ``step`` (the latest restorable one when None) bitwise. Returns None
        when the URI holds no checkpoint. Collective: every rank loads the same step or all
        raise (see :meth:`deck.trainer.checkpointer.DeltaCheckpointer.restore`)."""
        # The newest part of a long history where that answers (deck.read.window), else every
        # record: the same step and chain either way.
        manifests = read_window(self.storage, step) or read_manifests(self.storage)
        passed: str | None = None  # (rank 0) what the latest gives up, or goes around
        if step is None:
            chosen = None
            gives_up = None
            if self.coord.rank == 0:
                # Which step is the latest is the records' answer, not a catalog's copy
                manifests, chosen = latest_confirmed(self.storage, manifests)
                check = latest_checked(self.storage, manifests, chosen)
                manifests, chosen, gives_up = check.manifests, check.step, check.gives_up
                # (what it goes around, a quarantine, is said in its stats too: a break-it
                # finding, only a warning said it, which code cannot see)
                passed = gives_up or check.goes_around
            refused = gives_up is not None and not allow_fallback
            chosen_all = self.coord.broadcast_int(
                _REFUSED if refused else -1 if chosen is None else chosen
            )
            if chosen_all == _REFUSED:
                self.coord.agree_on_failure(
                    CorruptCheckpointError(f"{gives_up}{self._instead(chosen)}")
                    if refused
                    else None,
                    "restore",
                )
            if gives_up is not None and chosen is not None:
                logger.warning("deck: %s; restoring step %d", gives_up, chosen)
            target = None if chosen_all < 0 else chosen_all
            if target is not None and target not in manifests:
                manifests = read_manifests(self.storage)
        else:
            target = step
        if target is not None:  # what is loaded comes from the records, not a catalog's copy
            manifests = confirmed(self.storage, manifests, target)
        skipped = damaged_records(manifests, target, latest=step is None)
        if skipped and not allow_fallback:
            raise CorruptCheckpointError(f"{skipped}{self.fallback_hint}")
        if target is None:
            if manifests:
                raise CheckpointNotFoundError(
                    f"{self.storage.uri} has checkpoints {steps_text(manifests)} but none has a "
                    "complete chain (`deck verify URI --all` says why): give this run a URI of "
                    f"its own, or start its steps after {max(manifests)}"
                )
            if skipped:
                raise CheckpointNotFoundError(f"{skipped}; nothing else is committed")
            return None
        done, error, recoverable = self._agreed(manifests, target)
        if done is not None:
            if passed is not None:
                done.stats.fallback = passed
            if skipped:
                logger.warning(
                    "deck: restored step %d, passing newer steps by: %s", target, skipped
                )
                done.stats.fallback = f"skipped {skipped}"
            return done
        assert error is not None
        if recoverable and not allow_fallback:
            # (a fallback has nothing to fall back to on an empty URI: not offered there)
            hint = (
                self.fallback_hint if manifests else f"; nothing is committed at {self.storage.uri}"
            )
            raise type(error)(f"{error}{hint}") from error
        if not recoverable:
            raise error
        fallback, why = self._fallback_target(target, error)
        if fallback is None:
            raise CheckpointNotFoundError(
                f"{why}; nothing older is restorable either: give this run a URI of its own, or "
                f"start its steps after {max(manifests, default=target)} (the newest committed)"
            ) from error
        logger.warning("deck: %s", why)
        manifests = read_manifests(self.storage)  # now with rank 0's quarantine records
        manifests = confirmed(self.storage, manifests, fallback)
        done, error, _ = self._agreed(manifests, fallback)
        if done is None:
            assert error is not None
            raise error
        done.stats.fallback = why
        return done

    def _instead(self, step: int | None) -> str:
        """What a refusal of the latest says the caller can do instead."""
        if not self.fallback_hint:
            return ""
        return (
            f"; restore(allow_fallback=True) restores step {step} instead, and training on from "
            "it saves the steps after it again"
            if step is not None
            else "; no step before it is restorable"
        )

    def _agreed(
        self, manifests: ManifestSet | dict, target: int
    ) -> tuple[Restored | None, BaseException | None, bool]:
        """Load ``target`` on every rank. Returns (what was loaded, None, False) when it worked
        everywhere, else (None, this rank's error or one naming the ranks that failed, and --
        agreed by all ranks -- whether every failure was a damaged / missing checkpoint, so a
        fallback may help)."""
        done: Restored | None = None
        error: BaseException | None = None
        try:
            done = self._load(manifests, target)
        except CorruptCheckpointError as e:
            error = self._deleted_meanwhile(manifests, target) or e
            if error is not e:
                error.__cause__ = e
        except Exception as e:
            error = e
        damaged = isinstance(error, CorruptCheckpointError | CheckpointNotFoundError)
        mine = (
            LoadResult.LOADED
            if error is None
            else LoadResult.DAMAGED
            if damaged
            else LoadResult.INCOMPATIBLE
            if isinstance(error, IncompatibleModelError)
            else LoadResult.FAILED
        )
        votes = [v.result for v in gather_votes(self.coord, _LoadVote(mine))]
        if all(v == LoadResult.LOADED for v in votes):
            assert done is not None
            # A rollback (a step other than the latest restorable one) starts its timeline
            # with a full: a GC run that planned before this restore may be deleting the
            # restored chain right now (the latest's it retains; this one maybe by no policy),
            # and deltas on it would be committed on a deleted parent. Rank 0 decides, so that
            # every rank agrees.
            latest = latest_restorable(manifests) if self.coord.rank == 0 else None
            newest = self.coord.broadcast_int(-1 if latest is None else latest)
            if newest != target and done.parent is not None:
                done.parent = None
                if self.coord.rank == 0:
                    logger.info(
                        "deck: restored step %d of %s, not its latest step %d: the next "
                        "checkpoint is a full",
                        target,
                        self.storage.uri,
                        newest,
                    )
            return done, None, False
        recoverable = all(v in (LoadResult.LOADED, LoadResult.DAMAGED) for v in votes)
        # Every rank says why (rank 0's log is the one read): the first failed rank's message
        said = self.coord.gather_bytes(b"" if error is None else str(error)[:2000].encode())
        if error is None:
            failed = [r for r, v in enumerate(votes) if v != LoadResult.LOADED]
            # (the class every rank raises: a model that does not fit one rank's part is
            # IncompatibleModelError on all, a break-it finding saw CheckpointError elsewhere)
            kind = (
                CorruptCheckpointError
                if recoverable
                else IncompatibleModelError
                if {votes[r] for r in failed} == {LoadResult.INCOMPATIBLE}
                else CheckpointError
            )
            error = kind(
                f"restore of step {target} from {self.storage.uri} failed on rank(s) {failed}; "
                f"rank {failed[0]}: {said[failed[0]].decode(errors='replace')}"
            )
        return None, error, recoverable

    def _deleted_meanwhile(
        self, manifests: ManifestSet | dict, target: int
    ) -> CheckpointNotFoundError | None:
        """A file of ``target``'s chain missing or short may be a GC deleting that chain while
        it was read (a step no policy retains): then its commit record is gone or names another
        checkpoint now, and that is what to say, not damage. None when every record of the
        chain is still the one read (or cannot be read now: the damage stands)."""
        try:
            chain = chain_for(manifests, target)
        except DeckError:
            return None
        for m in chain:
            key = f"{m.folder}/{MANIFEST}"
            try:
                data = get_bounded(self.storage, key)
                now = load_model(CheckpointManifest, data, self.storage.describe(key)).id
            except NotFoundError:
                now = None
            except DeckError:
                return None
            if now != m.id:
                return CheckpointNotFoundError(
                    f"step {target} at {self.storage.uri}: {checkpoint_label(m)} of its chain was "
                    "deleted (by GC: no policy retains it) while it was being read; restore it "
                    "again for a clear answer, or restore a retained step"
                )
        return None

    def _fallback_target(self, target: int, error: BaseException) -> tuple[int | None, str]:
        """Rank 0 verifies chains, from ``target`` back to older steps, and picks the first with
        every file intact (quarantining damaged checkpoints on the way); agreed by all ranks."""
        chosen, why = -1, ""
        if self.coord.rank == 0:
            chosen, why = self._first_valid(target, error)
        chosen = self.coord.broadcast_int(chosen)
        if self.coord.rank != 0:
            if chosen < 0:
                why = f"rank 0 found no valid chain from step {target} down"
            elif chosen == target:
                why = (
                    f"step {target}: restored through another chain (rank 0's log names the damage)"
                )
            else:
                why = (
                    f"restored step {chosen} instead of step {target}: rank 0 found its chain "
                    "damaged (rank 0's log names the files)"
                )
        return (chosen if chosen >= 0 else None), why

    def _first_valid(self, target: int, error: BaseException) -> tuple[int, str]:
        """Rank 0: the newest step at or before ``target`` with a valid chain (-1: none), and
        what was skipped on the way."""
        manifests = read_manifests(self.storage)
        order = sorted(manifests.values(), key=lambda m: (m.epoch, m.step), reverse=True)
        at = manifests.get(target)
        key = (at.epoch, at.step) if at is not None else (float("inf"), target)
        skipped = [f"step {target}: {error}"]
        # Never newer than asked: a rollback must not land on the data it was meant to escape
        # (a target removed by retention has no epoch to compare: its step still bounds).
        for m in (m for m in order if (m.epoch, m.step) <= key and m.step <= target):
            try:
                found = best_valid_chain(self.storage, m.step, manifests=manifests)
            except CheckpointNotFoundError as e:
                if m.step != target:
                    skipped.append(f"step {m.step}: {e}")
                continue
            damaged = "; ".join(f"{i}: {p[0]}" for i, p in found.rejected.items())
            if m.step == target:
                return m.step, f"step {target}: restored through another chain, skipping {damaged}"
            return m.step, f"restored step {m.step} instead of step {target}: " + "; ".join(skipped)
        return -1, f"no valid chain from step {target} down: " + "; ".join(skipped)

    def _load(self, manifests: ManifestSet | dict, target: int) -> Restored:
        """Load the chain of ``target`` into this rank's model and state (one rank's share)."""
        chain = chain_for(manifests, target)
        last = chain[-1]
        shards = self.adapter.table_shards()
        tables = self.adapter.table_shapes()
        last_parts = read_rank_manifests(self.storage, last)
        dense_rec = last_parts[0].dense
        if dense_rec is None:
            raise IncompatibleModelError(f"step {target}: rank 0 part has no dense state")
        saved_dense = read_state_file(self.storage, last, dense_rec)
        # Tables data_parallel on one side and sharded on the other (another plan).
        moves = plan_moves(
            self.storage, chain, tables, self.adapter.replicated_tables(), saved_dense
        )
        moved = moves.tables
        where = f"step {target} at {self.storage.uri}"
        own = rank_part(last_parts, self.coord.rank)
        extra = read_state_file(self.storage, last, own.extra)
        extra["fused_hyperparameters"] = self._fused_saved(last, last_parts, own, extra, moved)
        # Checked before anything is written: module state that cannot be put back exactly
        # (e.g. managed-collision remappers into another world size) refuses the restore.
        put_module_state = self.adapter.prepare_module_state(
            extra.get("modules") or {}, len(last_parts), where
        )
        self.adapter.check_fused_optimizers(extra.get("fused_hyperparameters", {}), where, moved)
        # Another world size or plan is fine: rows go by global id (deck.read.restore.apply_chain).
        stats, parts = apply_chain(
            self.storage,
            chain,
            [s for s in shards if s.table not in moved] + list(moves.to_replicated.values()),
            {k: v for k, v in tables.items() if k not in moved}
            | {k: (s.num_rows, s.num_cols) for k, s in moves.to_replicated.items()},
        )
        fill_from_dense(moves, shards, saved_dense, f"step {target} at {self.storage.uri}")
        for key, staged in moves.to_replicated.items():
            saved_dense[key] = staged.states["weight"]
        mine = rank_part(parts, self.coord.rank)
        # The dense layers before their optimizer (the tables were checked by apply_chain): a
        # model whose dense layers changed was refused by its dense optimizer's state, blamed
        # on the optimizer
        live_dense = self.adapter.dense_state()
        problems = dense_state_problems(live_dense, saved_dense)
        if problems:
            raise IncompatibleModelError(
                f"dense state of {where} does not fit the model: {problems[:5]}; build the model "
                "with the dense layers the job saved with"
            )
        self._load_optimizers(extra, target, moved)
        # (After the optimizers, whose init may step: into the same tensors, checked above)
        copy_dense_state(live_dense, saved_dense)
        self._load_rank_local(live_dense, extra, parts, where)
        scalars = shard_scalars(
            self.storage, target, parts, extra, [s for s in shards if s.table not in moved]
        )
        put_scalars(shards, scalars, where)
        put_module_state()
        self.adapter.after_restore()
        if self.set_user_state is not None:
            if "user" not in extra:
                raise CorruptCheckpointError(f"{where}: {mine.extra.path} holds no user state")
            self.set_user_state(extra["user"])
            if len(parts) != self.coord.world_size and self.coord.rank == 0:
                # (a break-it finding: a per-rank data cursor read the same data on two ranks)
                logger.warning(
                    "deck: %s was saved by %d ranks, this job has %d: each rank's user state is "
                    "the saved rank's of its number, or rank 0's where there is none; state that "
                    "differs per rank (a data loader's position) needs remapping by your code",
                    where,
                    len(parts),
                    self.coord.world_size,
                )
        self._load_rng(extra, parts, where)
        logger.log(  # one line per restore: rank 0's (the others at DEBUG)
            logging.INFO if self.coord.rank == 0 else logging.DEBUG,
            "deck: restored step %d from %s (%d checkpoints, %d chunks, %s on this rank)",
            target,
            self.storage.uri,
            stats.checkpoints,
            stats.chunks,
            human_bytes(stats.bytes),
        )
        # Deltas build on the restored checkpoint only in its own layout (save() agrees on it).
        same = same_layout(parts, self.coord.rank, shards)
        return Restored(
            step=target,
            parent=(target, last.id) if same else None,
            base=chain[0].step,
            epoch=next_epoch(manifests, self.storage),
            stats=stats,
        )

    def _load_rank_local(
        self, live: dict[str, Any], extra: dict[str, Any], parts: list[Any], where: str
    ) -> None:
        """Dense tensors that differed across the saving ranks (e.g. BatchNorm statistics, which
        data parallelism does not synchronise) come back per rank; the dense file holds rank 0's.
        Into another world size every rank keeps rank 0's (logged)."""
        saved = extra.get("rank_local") or {}
        if not saved:
            return
        if len(parts) != self.coord.world_size:
            logger.warning(
                "deck: %s: %d dense tensor(s) differed across the %d saving ranks (%s); this job "
                "has %d ranks, so every rank starts from rank 0's values",
                where,
                len(saved),
                len(parts),
                ", ".join(sorted(saved)[:4]),
                self.coord.world_size,
            )
            return
        problems = copy_dense_state({k: v for k, v in live.items() if k in saved}, saved)
        if problems:
            raise IncompatibleModelError(f"{where}: rank-local dense state: {problems[:5]}")

    def _load_rng(self, extra: dict[str, Any], parts: list[Any], where: str) -> None:
        """Every rank's RNG states, into the same world size (another one keeps its own, logged:
        no rule maps one rank's random stream onto another's)."""
        saved = extra.get("rng")
        if not self.restore_rng:
            return
        if saved is None:
            if self.coord.rank == 0:
                logger.warning(
                    "deck: %s holds no RNG states (saved with save_rng=False, or by a deck that "
                    "did not save them): they are left as this process has them, so training on "
                    "does not repeat the saved run's random draws (dropout, ...)",
                    where,
                )
            return
        if len(parts) != self.coord.world_size:
            logger.warning(
                "deck: %s was saved by %d ranks, this job has %d: RNG states are not restored",
                where,
                len(parts),
                self.coord.world_size,
            )
            return
        restore_rng(saved, where)

    def _fused_saved(
        self,
        last: CheckpointManifest,
        parts: list[RankManifest],
        own: RankManifest,
        extra: dict[str, Any],
        moved: set[str],
    ) -> dict[str, Any]:
        """The saved fused hyperparameters of every table this rank's kernels hold: each rank
        saved its own tables', so into another world size or plan those of the tables the part
        this rank reads did not hold come from the other parts (a fuzz finding: they took that
        part's, another kernel's update rule, and the restore was refused)."""
        saved: dict[str, Any] = extra.get("fused_hyperparameters") or {}
        # (a table data_parallel in the checkpoint is in no part: its kernel starts fresh)
        wanted = set(self.adapter.fused_hyperparameters()) - moved
        for part in parts:
            if not saved or wanted <= set(saved):  # (each other part read only while needed)
                break
            if part is not own:
                other = read_state_file(self.storage, last, part.extra)
                saved = {**(other.get("fused_hyperparameters") or {}), **saved}
        return saved

    def _load_optimizers(self, extra: dict[str, Any], target: int, moved: set[str]) -> None:
        # Rank 0 says what the checkpoint replaces (every rank built the same optimizers: one
        # line per job, not per rank)
        level = logging.INFO if self.optimizers.wrappers else logging.WARNING
        with edits_logged_at(level if self.coord.rank == 0 else logging.DEBUG):
            self._load_each_optimizer(extra, target, moved)

    def _load_each_optimizer(self, extra: dict[str, Any], target: int, moved: set[str]) -> None:
        where = f"step {target} at {self.storage.uri}"
        for name, wrapper in self.optimizers.wrappers.items():
            saved_wrapper = extra.get("wrappers", {}).get(name)
            if saved_wrapper is None:
                raise IncompatibleModelError(f"optimizer wrapper {name} is not in {where}")
            wrapper.set(saved_wrapper)
        self.adapter.load_fused_hyperparameters(
            extra.get("fused_hyperparameters", {}), where, moved
        )
        saved_all = extra.get("optimizers", {})
        names = _match_names(list(self.optimizers.dense), list(saved_all))
        for name, opt in self.optimizers.dense.items():
            saved = saved_all.get(names.get(name, name))
            if saved is None:
                raise IncompatibleModelError(
                    f"optimizer {name} is not in step {target} at {self.storage.uri} (it has "
                    f"{sorted(saved_all)})"
                )
            try:
                load_optimizer(
                    opt,
                    reconcile_optimizer(opt, saved, moved),
                    f"{name} ({where})",
                    self.optimizers.classes[name],
                    self.optimizers.param_names.get(name),
                    self.optimizers.sparse_grads,
                )
            except IncompatibleModelError as e:
                if not moved:
                    raise
                raise IncompatibleModelError(
                    f"{e}; tables {sorted(moved)} are data_parallel on one side of this restore "
                    "and sharded on the other, which changes the dense optimizer's parameters: "
                    "deck fits a TorchRec KeyedOptimizer(Wrapper)'s state by parameter name, a "
                    "plain torch optimizer's (by position) it cannot; wrap it in "
                    "KeyedOptimizerWrapper, or restore with the checkpoint's plan"
                ) from None


def _match_names(live: list[str], saved: list[str]) -> dict[str, str]:
    """Live dense optimizer name -> saved name. Names are ``<given>.<position among all leaves>``
    and fused leaves count too, so another plan or world size (another number of fused leaves
    in a CombinedOptimizer) shifts them: when the names differ but each given optimizer has as
    many dense leaves on both sides, they pair up in order."""

    def by_given(names: list[str]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for n in sorted(names, key=lambda n: (n.rsplit(".", 1)[0], _position(n))):
            out.setdefault(n.rsplit(".", 1)[0], []).append(n)
        return out

    if set(live) <= set(saved):
        return {n: n for n in live}
    mine, theirs = by_given(live), by_given(saved)
    if {g: len(v) for g, v in mine.items()} != {g: len(v) for g, v in theirs.items()}:
        return {n: n for n in live}  # the caller names what is missing
    return {a: b for g in mine for a, b in zip(mine[g], theirs[g], strict=True)}


def _position(name: str) -> int:
    tail = name.rsplit(".", 1)[-1]
    return int(tail) if tail.isdigit() else -1
