"""The user-facing checkpointer: track, snapshot, commit, restore."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from deck.adapters.base import ModelAdapter, RemovableHandle, TableShard, copy_dense_state
from deck.config import CHECKPOINT_CONSUMER, PUBLISH_CONSUMER, DeckConfig
from deck.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DeckError,
    IncompatibleModelError,
    LeaseHeldError,
    StorageError,
)
from deck.failpoints import failpoint
from deck.format.manifest import Kind
from deck.read.catalog import (
    ManifestSet,
    chain_for,
    damaged_records,
    latest_restorable,
    read_manifests,
    read_rank_manifests,
)
from deck.read.lineage import best_valid_chain, needs_new_full
from deck.read.restore import (
    RestoreStats,
    apply_chain,
    fill_from_dense,
    load_optimizer,
    plan_moves,
    rank_part,
    read_state_file,
    reconcile_optimizer,
    same_layout,
    shard_scalars,
)
from deck.storage import Storage, check_writable, open_storage
from deck.trainer.coordination import Coordinator
from deck.trainer.lease import Lease
from deck.trainer.staging import CheckpointStats, PendingPart, Stager
from deck.trainer.tracker import TrackerStore
from deck.trainer.writer import RankPartWriter, scalar_key

logger = logging.getLogger(__name__)


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> Any: ...


UserState = Stateful | tuple[Callable[[], Any], Callable[[Any], None]]


@dataclass
class _Chain:
    """One delta chain this checkpointer writes: its tracking consumer, destination, stager and
    lineage state. The checkpoints are one chain; the publisher's (``DeckConfig.publish``) is
    another, with its own parent, base and epoch, so neither's failures touch the other."""

    label: str  # "checkpoint" or "publish", for logs and errors
    consumer: str
    storage: Storage
    stager: Stager
    epoch: int
    parent: tuple[int, str] | None = None  # the last committed (step, id) a delta builds on
    base: int | None = None  # step of the full the chain starts from
    history: list[CheckpointStats] = field(default_factory=list)
    quantize: str | None = None  # weight encoding of its checkpoints (None: exact)


def _chain_attr(name: str) -> property:
    # The checkpoint chain's state, under the attribute names the rest of the class uses.
    return property(
        lambda self: getattr(self._ckpt, name), lambda self, v: setattr(self._ckpt, name, v)
    )


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
        storage: Storage | None = None,
        publish_storage: Storage | None = None,
    ):
        self.config = config
        self.adapter = adapter or _default_adapter(model)
        self.coord = Coordinator()
        # ``storage`` replaces the store opened from ``config.uri`` (a custom backend, or a
        # fault-injecting wrapper in tests); everything goes through this one interface.
        self.storage: Storage = storage or open_storage(config.uri, config.storage_options)
        if self.coord.world_size > 1 and config.uri.startswith("memory://"):
            raise ConfigError(
                f"DeckConfig.uri {config.uri!r}: memory:// exists inside one process only, so the ranks "
                "of a multi-process job cannot see each other's parts; use a shared path or object store"
            )
        check_writable(self.storage)
        self._lease = self._take_lease()
        self._optimizers = self.adapter.dense_optimizers(optimizers)
        self._state = _user_state(state)
        shards = self.adapter.table_shards()
        self.tracker = TrackerStore(sum(s.rows for s in shards), config.tracking_consumers)
        self._paused = 0
        self._hooks: RemovableHandle | None = self.adapter.install_tracking(
            self.tracker, shards, self._active
        )
        self._last_step: int | None = None
        on_gpu = any(t.is_cuda for s in shards for t in s.states.values())
        self.stager = Stager(self.storage, config.staging, self.coord.rank, pinned=on_gpu)
        self._ckpt = _Chain(
            CHECKPOINT_CONSUMER, CHECKPOINT_CONSUMER, self.storage, self.stager, self._next_epoch()
        )
        self._pub: _Chain | None = self._open_publisher(on_gpu, publish_storage)
        self._closed = False
        self.recovered = self.stager.recover(self.coord)  # collective: ranks agree on parts
        if self._pub is not None:
            # Parts of an earlier process's publishes are finished (or dropped); the first
            # publish of this process is a full all the same.
            self._pub.stager.recover(self.coord)
        self.last_restore: RestoreStats | None = None  # what the last restore() read on this rank

    _parent = _chain_attr("parent")
    _base = _chain_attr("base")
    _epoch = _chain_attr("epoch")
    history = _chain_attr("history")

    @property
    def published(self) -> list[CheckpointStats]:
        """Stats of this process's publishes (empty without ``DeckConfig.publish``)."""
        return [] if self._pub is None else self._pub.history

    def _open_publisher(self, on_gpu: bool, storage: Storage | None) -> _Chain | None:
        cfg = self.config.publish
        if cfg is None:
            return None
        # ``publish_storage`` replaces the store of ``publish.uri``, as ``storage`` does for
        # ``uri`` (a custom backend, or a fault-injecting wrapper in tests).
        storage = storage or open_storage(cfg.uri, cfg.storage_options)
        if self.coord.world_size > 1 and cfg.uri.startswith("memory://"):
            raise ConfigError(
                f"DeckConfig.publish.uri {cfg.uri!r}: memory:// exists inside one process only; "
                "use a shared path or object store"
            )
        check_writable(storage)
        stager = Stager(storage, self.config.staging, self.coord.rank, pinned=on_gpu)
        return _Chain(
            "publish",
            PUBLISH_CONSUMER,
            storage,
            stager,
            self._next_epoch(storage=storage),
            quantize=None if cfg.quantize == "none" else cfg.quantize,
        )

    def _take_lease(self) -> Lease | None:
        if self.config.lease_ttl_s is None:
            return None
        lease, error = None, None
        if self.coord.rank == 0:
            lease = Lease(self.storage, self.config.lease_ttl_s, wait_s=self.config.lease_ttl_s)
            try:
                lease.acquire()
            except (LeaseHeldError, StorageError) as e:
                error = e
        if self.coord.broadcast_int(0 if error else 1) == 0:
            raise error or LeaseHeldError(
                f"rank 0 could not take the writer lease of {self.storage.uri}; see rank 0's error"
            )
        return lease

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
        stats = None
        if step % self.config.delta_every_steps == 0:
            full_every = self.config.full_every_steps
            full = self._parent is None or (full_every is not None and step % full_every == 0)
            stats = self.save("full" if full else "delta", step=step)
        if self.config.publish is not None and step % self.config.publish.every_steps == 0:
            self.publish(step)
        return stats

    def publish(self, step: int | None = None) -> CheckpointStats | None:
        """Publish the rows touched since the last publish as a delta of the publish chain
        (``DeckConfig.publish``; a full when it has no committed parent), staged in the background
        like a checkpoint. ``step()`` calls it every ``publish.every_steps``. Collective.

        A failed publish is logged, never raised, and leaves the checkpoint chain alone; the next
        publish is then a full. Returns None when nothing was published.
        """
        chain = self._pub
        if chain is None:
            raise ConfigError("publish() needs DeckConfig(publish=PublishConfig(uri=...))")
        if step is None:
            step = self._last_step
        if step is None:
            raise ValueError("publish() needs step=... before the first call to step()")
        try:
            return self._save_chain(chain, "delta", step)
        except CheckpointError as e:
            chain.parent = None
            logger.error("deck: publish of step %d failed; the next publish is a full: %s", step, e)
            return None

    def save(
        self, kind: Literal["delta", "full"] = "delta", *, step: int | None = None
    ) -> CheckpointStats | None:
        """Take a checkpoint of ``kind`` at ``step`` (default: the last step given to ``step``).

        Returns once every rank's part is in the first staging tier, so training may go on; the
        upload and commit finish in the background (``flush()`` waits for them, and the returned
        stats fill in as they go). Returns None when the spool is full and the policy is ``skip``.
        On failure nothing is committed, the tracked rows stay pending for the next checkpoint,
        and :class:`CheckpointError` names the step and the cause.
        """
        if kind not in ("delta", "full"):
            raise ValueError(f"kind must be 'delta' or 'full', got {kind!r}")
        if step is None:
            step = self._last_step
        if step is None:
            raise ValueError("save() needs step=... before the first call to step()")
        return self._save_chain(self._ckpt, kind, step)

    def _save_chain(
        self, chain: _Chain, kind: Literal["delta", "full"], step: int
    ) -> CheckpointStats | None:
        """``save()`` of one chain: the checkpoints, or the publisher's (same format, its own
        consumer, storage, stager and lineage)."""
        t0 = time.perf_counter()
        # One collective agrees on the id and the kind: a part that failed in the background on
        # any rank breaks the chain, so then every rank takes a full; so does a rank without a
        # parent (e.g. its shards were resharded by the restore).
        lost = self._lease is not None and self._lease.lost.is_set()
        broken = kind == "delta" and self._parent_chain_broken(chain)
        failed_parts = chain.stager.take_failed()
        agreed = self.coord.gather(
            [
                float(chain.stager.failed.is_set()),
                float(self.coord.new_id_seed()),
                float(lost),
                float(chain.parent is None or broken),
                float(len(failed_parts)),
            ]
        )
        if agreed[:, 4].max() > 0:
            self._tell_rank0_failed(chain, failed_parts, int(agreed[:, 4].max()))
        if agreed[:, 2].max() > 0:
            raise CheckpointError(
                f"step {step}: this job lost the writer lease of {self.storage.uri} to another trainer; "
                "not writing. Stop one of the two jobs."
            )
        ckpt_id = f"{int(agreed[0, 1]):016x}"
        if kind == "delta" and (agreed[:, 3].max() > 0 or agreed[:, 0].max() > 0):
            logger.info(
                "%s step %d: no committed parent to be a delta of: taking a full", chain.label, step
            )
            kind = "full"
        chain.stager.failed.clear()
        full = kind == "full"
        token = self.tracker.begin_read(chain.consumer)
        staged = None
        writer = None
        error: BaseException | None = None
        try:  # any failure here must still reach the all-gather below, or other ranks would hang
            shards = self.adapter.table_shards()
            selected = [
                None
                if full or sh.full_only
                else self.tracker.touched(token, sh.track_base, sh.track_base + sh.rows)
                for sh in shards
            ]
            estimate = sum(
                (sh.rows if sel is None else int(sel.numel())) * sh.row_bytes()
                for sh, sel in zip(shards, selected, strict=True)
            )
            if chain.stager.reserve(estimate):
                staged = chain.stager.begin(
                    self._pending_part(chain, step, ckpt_id, full), estimate
                )
                writer = RankPartWriter(
                    chain.storage,
                    step,
                    ckpt_id,
                    self.coord.rank,
                    self.coord.world_size,
                    self.config.staging.chunk_bytes,
                    sink=staged,
                    bundle_bytes=self.config.staging.bundle_bytes,
                    quantize=chain.quantize,
                )
                order = {id(sh): i for i, sh in enumerate(shards)}
                dense = self.adapter.dense_state() if self.coord.rank == 0 else None
                writer.write_part(
                    shards, lambda sh: selected[order[id(sh)]], dense, self._extra_state(shards)
                )
                staged.seal()
                if self.config.staging.release == "first_tier":
                    staged.wait_written()
                # else a write that fails fails the step in the background, always there (not
                # here or there by timing): the commit thread reports it, the next one is a full
                failpoint("checkpointer.save.staged")
        except Exception as e:
            error = e
        # status per rank: 0 failed, 1 skipped (spool full), 2 staged
        status = 0.0 if error else (1.0 if staged is None else 2.0)
        sizes = (
            [writer.bytes_written, writer.rows_written, writer.chunks_written]
            if writer
            else [0, 0, 0]
        )
        waited = 0.0 if staged is None else staged.buffer_wait_s
        gathered = self.coord.gather([status, time.perf_counter() - t0, *map(float, sizes), waited])
        if gathered[:, 0].min() < 2:
            self.tracker.abort(token)  # nothing was saved: the rows stay pending
            if staged is not None:
                chain.stager.discard(staged)
            if gathered[:, 0].min() == 1:
                logger.warning(
                    "deck: %s step %d skipped: the spool %s is full",
                    chain.label,
                    step,
                    chain.stager.spool_root,
                )
                return None
            failed = gathered[:, 0].eq(0).nonzero().view(-1).tolist()
            raise CheckpointError(
                f"{chain.label} of step {step} at {chain.storage.uri} was not committed: rank(s) {failed} failed"
                + (f"; on rank {self.coord.rank}: {error}" if error else "")
                + ". Nothing was lost: its rows stay pending for the next checkpoint."
            ) from error
        stats = CheckpointStats(
            step=step,
            kind=kind,
            id=ckpt_id,
            stall_s=max(float(gathered[:, 1].max()), time.perf_counter() - t0),
            bytes=int(gathered[:, 2].sum()),
            rows=int(gathered[:, 3].sum()),
            chunks=int(gathered[:, 4].sum()),
            buffer_wait_s=float(gathered[:, 5].max()),
            started=t0,
        )
        chain.stager.enqueue(staged, stats)  # type: ignore[arg-type]
        failpoint("checkpointer.save.enqueued")
        # The rows are in the stager's hands: later deltas are relative to this snapshot. If the
        # part fails in the background, ``stager.failed`` makes the next checkpoint a full.
        self.tracker.commit(token)
        chain.parent = (step, ckpt_id)
        if full:
            chain.base = step
        chain.history.append(stats)
        if stats.buffer_wait_s > 0.5 * stats.stall_s and not full:
            logger.info(
                "deck: %s step %d waited %.3f s of its %.3f s stall for chunk buffers: a rank's "
                "part is larger than staging.chunks_in_flight x chunk_bytes (%.0f MiB); raise "
                "chunks_in_flight to trade CPU memory for stall",
                chain.label,
                step,
                stats.buffer_wait_s,
                stats.stall_s,
                self.config.staging.chunks_in_flight * self.config.staging.chunk_bytes / 2**20,
            )
        logger.info(
            "deck: %s %s step %d staged (%s tier): %d rows, %.1f MiB, stall %.3f s",
            kind,
            chain.label,
            step,
            chain.stager.tier,
            stats.rows,
            stats.bytes / 2**20,
            stats.stall_s,
        )
        return stats

    def _parent_chain_broken(self, chain: _Chain) -> bool:
        """Rank 0: whether the committed parent can no longer be restored (a checkpoint of its
        chain was quarantined and nothing covers it), so a delta of it would be useless too.

        Only asked while nothing is in flight: a parent still uploading is not committed yet,
        and a part that fails in the background already forces a full via ``stager.failed``.
        """
        if self.coord.rank != 0 or chain.parent is None or not chain.stager.flush(timeout=0):
            return False
        try:
            why = needs_new_full(chain.storage, chain.parent)
        except DeckError as e:
            # Cannot tell now (e.g. the store is down): a delta still follows its committed
            # parent, and the next checkpoint asks again.
            logger.info("deck: could not check the lineage of the last checkpoint: %s", e)
            return False
        if why:
            logger.warning("deck: taking a full: the last checkpoint's chain is broken: %s", why)
        return why is not None

    def _pending_part(self, chain: _Chain, step: int, ckpt_id: str, full: bool) -> PendingPart:
        delta_of = None if full else chain.parent
        return PendingPart(
            uri=chain.storage.uri,
            step=step,
            ckpt_id=ckpt_id,
            rank=self.coord.rank,
            world_size=self.coord.world_size,
            kind=Kind.FULL if full else Kind.DELTA,
            parent=None if delta_of is None else delta_of[0],
            parent_id=None if delta_of is None else delta_of[1],
            base=step if full or chain.base is None else chain.base,
            epoch=chain.epoch,
        )

    def _tell_rank0_failed(self, chain: _Chain, failed: list[tuple[int, str]], most: int) -> None:
        """Collective: every rank's parts that failed in the background reach rank 0's stager,
        which stops waiting for them (when their failure records could not be written)."""
        mine = [v for step, cid in failed for v in (float(step), float(int(cid, 16)))]
        rows = self.coord.gather(mine + [-1.0] * (2 * most - len(mine)))
        if self.coord.rank != 0:
            return
        for r in range(1, rows.shape[0]):
            for i in range(most):
                step, cid = int(rows[r, 2 * i]), int(rows[r, 2 * i + 1])
                if step >= 0:
                    chain.stager.abandon(step, f"{cid:016x}", f"rank {r}'s part failed")

    def _exchange_failures(self, chain: _Chain, timeout: float | None) -> None:
        """Collective: once every rank other than 0 has finished (or failed) its parts, rank 0
        learns which failed. Rank 0 does not wait: its commit thread may be waiting for exactly
        those parts; the other ranks' background work never waits for another rank."""
        if self.coord.rank != 0:
            chain.stager.flush(timeout)
        failed = chain.stager.take_failed()
        most = int(self.coord.gather([float(len(failed))])[:, 0].max())
        if most:
            self._tell_rank0_failed(chain, failed, most)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every staged checkpoint is committed (or failed), on every rank: when it
        returns, ``list_checkpoints`` shows them from any rank. Collective: call it on all ranks.
        Returns False if any rank timed out."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        chains = [c for c in (self._ckpt, self._pub) if c is not None]
        for chain in chains:
            self._exchange_failures(chain, left())
        done = all([chain.stager.flush(left()) for chain in chains])
        # Rank 0's flush includes the commits; the gather holds the other ranks until it is done.
        return bool(self.coord.gather([float(done)]).min() > 0)

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
    def restore(self, step: int | None = None, *, allow_fallback: bool = False) -> int | None:
        """Load committed ``step`` (the latest restorable one when None) into the live model,
        optimizers and user state, bitwise. Returns the step restored, or None when the URI
        holds no checkpoint. Later checkpoints are deltas relative to the restored one.
        Collective: call it on all ranks; they load the same step or all raise.

        A damaged or missing file raises :class:`CorruptCheckpointError` naming it. With
        ``allow_fallback`` rank 0 instead re-verifies the lineage (reading every byte once more),
        quarantines what is damaged, and restores the cheapest valid chain of that step -- or, if
        it has none, of the newest older step that has one; ``last_restore.fallback`` and a
        warning say what was skipped and why.
        """
        # Every rank's pending parts first (rank 0's flush is the commit), then rank 0 alone picks
        # the target so that all ranks load the same step even while other writers commit.
        self.flush()
        manifests = read_manifests(self.storage)
        if step is None:
            chosen = latest_restorable(manifests) if self.coord.rank == 0 else None
            chosen_all = self.coord.broadcast_int(-1 if chosen is None else chosen)
            target = None if chosen_all < 0 else chosen_all
            if target is not None and target not in manifests:
                manifests = read_manifests(self.storage)
        else:
            target = step
        skipped = damaged_records(manifests, target, latest=step is None)
        if skipped and not allow_fallback:
            raise CorruptCheckpointError(
                f"{skipped}; restore(allow_fallback=True) restores the newest valid step instead"
            )
        if target is None:
            if manifests:
                raise CheckpointNotFoundError(
                    f"{self.storage.uri} has checkpoints {sorted(manifests)} but none has a complete chain"
                )
            if skipped:
                raise CheckpointNotFoundError(f"{skipped}; nothing else is committed")
            return None
        error, recoverable = self._agreed(lambda: self._load(manifests, target))
        if error is None:
            if skipped:
                logger.warning("deck: restored step %d; skipped %s", target, skipped)
                assert self.last_restore is not None
                self.last_restore.fallback = f"skipped {skipped}"
            return target
        if not (allow_fallback and recoverable):
            raise error
        fallback, why = self._fallback_target(target, error)
        if fallback is None:
            raise CheckpointNotFoundError(f"{why}; nothing older is restorable either") from error
        logger.warning("deck: %s", why)
        manifests = read_manifests(self.storage)  # now with rank 0's quarantine records
        error, _ = self._agreed(lambda: self._load(manifests, fallback))
        if error is not None:
            raise error
        assert self.last_restore is not None
        self.last_restore.fallback = why
        return fallback

    def _agreed(self, fn: Callable[[], None]) -> tuple[BaseException | None, bool]:
        """Run ``fn`` on every rank. Returns (None, False) when it succeeded everywhere, else
        this rank's error (or one naming the ranks that failed) and, agreed by all ranks,
        whether every failure was a damaged / missing checkpoint (so a fallback may help)."""
        error: BaseException | None = None
        try:
            fn()
        except Exception as e:
            error = e
        damaged = isinstance(error, CorruptCheckpointError | CheckpointNotFoundError)
        kinds = self.coord.gather([0.0 if error is None else 2.0 if damaged else 1.0])[:, 0]
        if kinds.max() == 0:
            return None, False
        recoverable = bool((kinds != 1).all())
        if error is None:
            failed = kinds.nonzero().view(-1).tolist()
            error = (CorruptCheckpointError if recoverable else CheckpointError)(
                f"restore from {self.storage.uri} failed on rank(s) {failed}; see their errors"
            )
        return error, recoverable

    def _fallback_target(self, target: int, error: BaseException) -> tuple[int | None, str]:
        """Rank 0 verifies chains, from ``target`` back to older steps, and picks the first with
        every file intact (quarantining damaged checkpoints on the way); agreed by all ranks."""
        chosen, why = -1, ""
        if self.coord.rank == 0:
            manifests = read_manifests(self.storage)
            order = sorted(manifests.values(), key=lambda m: (m.epoch, m.step), reverse=True)
            at = manifests.get(target)
            key = (at.epoch, at.step) if at is not None else (float("inf"), target)
            skipped = [f"step {target}: {error}"]
            for m in (m for m in order if (m.epoch, m.step) <= key):
                try:
                    found = best_valid_chain(self.storage, m.step, manifests=manifests)
                except CheckpointNotFoundError as e:
                    if m.step != target:
                        skipped.append(f"step {m.step}: {e}")
                    continue
                chosen = m.step
                damaged = "; ".join(f"{i}: {p[0]}" for i, p in found.rejected.items())
                if chosen == target:
                    why = f"step {target}: restored through another chain, skipping {damaged}"
                else:
                    why = f"restored step {chosen} instead of step {target}: " + "; ".join(skipped)
                break
            else:
                why = f"no valid chain from step {target} down: " + "; ".join(skipped)
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

    def _load(self, manifests: ManifestSet | dict, target: int) -> None:
        """Load the chain of ``target`` into this rank's model and state (one rank's share)."""
        chain = chain_for(manifests, target)
        last = chain[-1]
        shards = self.adapter.table_shards()
        tables = self.adapter.table_shapes()
        dense_rec = read_rank_manifests(self.storage, last)[0].dense
        if dense_rec is None:
            raise IncompatibleModelError(f"step {target}: rank 0 part has no dense state")
        saved_dense = read_state_file(self.storage, last, dense_rec)
        # Tables data_parallel on one side and sharded on the other (another plan).
        moves = plan_moves(
            self.storage, chain, tables, self.adapter.replicated_tables(), saved_dense
        )
        moved = moves.tables
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
        extra = read_state_file(self.storage, last, mine.extra)
        for name, opt in self._optimizers.items():
            saved = extra["optimizers"].get(name)
            if saved is None:
                raise IncompatibleModelError(
                    f"optimizer {name} is not in step {target} at {self.storage.uri}"
                )
            try:
                load_optimizer(opt, reconcile_optimizer(opt, saved, moved), name)
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
        problems = copy_dense_state(self.adapter.dense_state(), saved_dense)
        if problems:
            raise IncompatibleModelError(
                f"dense state of step {target} does not fit the model: {problems[:5]}"
            )
        scalars = shard_scalars(
            self.storage, target, parts, extra, [s for s in shards if s.table not in moved]
        )
        with torch.no_grad():
            for s in shards:
                for name, t in scalars.get(id(s), {}).items():
                    s.scalars[name].copy_(t)
        self.adapter.after_restore()
        if self._state is not None:
            self._state[1](extra["user"])
        self.tracker.reset()
        if self._pub is not None:
            # The model jumped to the restored step: a delta of the last publish would be wrong.
            self._pub.parent = None
            self._pub.epoch += 1
        # Deltas build on the restored checkpoint only in its own layout (save() agrees on it).
        same = same_layout(parts, self.coord.rank, shards)
        self._parent = (target, last.id) if same else None
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

    def _next_epoch(self, manifests: dict | None = None, storage: Storage | None = None) -> int:
        if manifests is None:
            store = storage or self.storage
            manifests = read_manifests(store) if self.coord.rank == 0 else {}
            return self.coord.broadcast_int(
                max((m.epoch for m in manifests.values()), default=-1) + 1
            )
        return max((m.epoch for m in manifests.values()), default=-1) + 1

    # ---- lifetime ----------------------------------------------------------------------------
    def close(self, collective: bool = True) -> None:
        """Finish pending work (uploads, commits) and remove the tracking hooks; idempotent.
        Collective unless ``collective=False``: then this rank only finishes its own background
        work (rank 0 still commits what every rank uploaded), so a rank leaving on an exception
        never waits for ranks that went on."""
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        if not self._closed:
            self._closed = True
            if collective:
                self.flush()
            self.stager.close()
            if self._pub is not None:
                self._pub.stager.close()
            if self._lease is not None:
                self._lease.release()

    def __enter__(self) -> DeltaCheckpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # Leaving on an exception: the other ranks may not be leaving with us.
        self.close(collective=exc_type is None)


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
