"""The save protocol of one delta chain: agree, claim, snapshot, release.

A :class:`ChainWriter` owns one chain of checkpoints (the checkpoints, or the publisher's): its
tracking consumer, destination, stager and lineage state (parent, base, epoch). Its one entry
point, :meth:`ChainWriter.save`, is called by the training thread of every rank together:

1. **agree** -- one all-gather of a :class:`Proposal` per rank: rank 0's random id becomes the
   checkpoint id; the kind becomes a full on every rank if any rank lost its parent (a part that
   failed in the background, a broken chain, a reshard); a lost writer lease stops every rank;
   failed parts are told to rank 0; a hash of the dense buffers (which data parallelism does not
   keep equal across ranks) is compared. When it differs, and at every full (then over every
   dense tensor), a second all-gather of per-tensor hashes names what differs: every rank then
   saves its own value of those from now on (:attr:`ChainWriter.rank_local`).
2. **claim** the consumer's tracked rows (:meth:`deck.trainer.tracker.TrackerStore.begin_read`).
3. **snapshot** the rows, dense and extra state into the stager's CPU buffers
   (:class:`deck.trainer.writer.RankPartWriter`); with ``release="first_tier"`` also wait until
   they are in the first tier.
4. **release** -- one all-gather of an :class:`Outcome` per rank: staged everywhere, or every rank
   aborts its claim (rows stay pending) and the step fails (or is skipped: spool full).
   Then the part goes to the stager's background threads and the claim is committed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Literal

import torch
import xxhash

from deck.adapters.base import ModelAdapter, TableShard
from deck.config import StagingConfig
from deck.errors import CheckpointError, DeckError
from deck.failpoints import failpoint
from deck.format.manifest import Kind
from deck.read.lineage import needs_new_full
from deck.storage import Storage
from deck.trainer.coordination import Coordinator, gather_votes
from deck.trainer.lease import Lease
from deck.trainer.staging import CheckpointStats, PendingPart, StagedPart, Stager
from deck.trainer.tracker import ReadToken, TrackerStore
from deck.trainer.writer import RankPartWriter

_DIGEST_BITS = (1 << 52) - 1  # votes travel as float64: exact below 2**53


def tensor_digest(t: Any) -> int:
    """A 52-bit hash of a tensor's bytes (equal tensors, equal digests)."""
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_64_intdigest(data) & _DIGEST_BITS


def _digests(dense: dict[str, Any], names: set[str]) -> dict[str, int]:
    return {k: tensor_digest(dense[k]) for k in sorted(names) if k in dense}


def _combine(digests: dict[str, int]) -> int:
    return xxhash.xxh3_64_intdigest(repr(sorted(digests.items())).encode()) & _DIGEST_BITS


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Proposal:
    """One rank's vote before a checkpoint (step 1 of the protocol)."""

    id_seed: int  # rank 0's becomes the checkpoint id
    parent_failed: bool  # a part of this chain failed in the background since the last vote
    lease_lost: bool  # this job no longer holds the writer lease
    no_parent: bool  # no committed parent here (first checkpoint, reshard, broken chain)
    failed_parts: int  # this rank's parts that failed in the background, to tell rank 0
    dense_digest: int  # hash of the dense buffers not yet known to be rank-local
    dense_count: int  # how many dense tensors this rank has (the hashes pair up by position)


class Staged(IntEnum):
    """Whether a rank's part is staged (step 4)."""

    FAILED = 0
    SKIPPED = 1  # the spool is full and ``spool_full="skip"``
    STAGED = 2


@dataclass(frozen=True)
class Outcome:
    """One rank's vote after its snapshot (step 4): the part's state, sizes and stall parts."""

    status: Staged
    stall_s: float
    bytes: int
    rows: int
    chunks: int
    buffer_wait_s: float
    agree_s: float
    claim_s: float
    snapshot_s: float


@dataclass
class _Snapshot:
    """What step 3 left: the staged part and its writer (None when skipped or failed)."""

    staged: StagedPart | None = None
    writer: RankPartWriter | None = None
    error: BaseException | None = None


@dataclass
class ChainWriter:
    """One delta chain a checkpointer writes (see the module docstring for the protocol).

    Only the training thread calls :meth:`save`, on every rank together; the stager's threads
    take the part from there. Failures of one chain never touch another's state.
    """

    label: str  # "checkpoint" or "publish", for logs and errors
    consumer: str
    storage: Storage
    stager: Stager
    epoch: int
    coord: Coordinator
    tracker: TrackerStore
    adapter: ModelAdapter
    staging: StagingConfig
    extra_state: Callable[[list[TableShard]], dict[str, Any]]
    lease: Lease | None = None
    parent: tuple[int, str] | None = None  # the last committed (step, id) a delta builds on
    base: int | None = None  # step of the full the chain starts from
    history: list[CheckpointStats] = field(default_factory=list)
    quantize: str | None = None  # weight encoding of its checkpoints (None: exact)
    # Dense tensors found to differ across ranks: saved by every rank, hashed at every checkpoint
    rank_local: set[str] = field(default_factory=set)

    def save(self, kind: Literal["delta", "full"], step: int) -> CheckpointStats | None:
        """Checkpoint ``step`` (a delta of :attr:`parent`, or a full). Returns once every rank's
        part is staged (``staging.release``); None when skipped for a full spool. Raises
        :class:`CheckpointError` when any rank failed: then nothing is committed and every rank's
        claimed rows stay pending."""
        t0 = time.perf_counter()
        dense = self.adapter.dense_state()  # one state_dict walk: hashed in the vote, saved after
        kind, ckpt_id = self._agree(kind, step, dense)
        full = kind == "full"
        t_agreed = time.perf_counter()
        token = self.tracker.begin_read(self.consumer)
        t_claimed = time.perf_counter()
        snap = self._snapshot(step, ckpt_id, full, token, dense)
        t_staged = time.perf_counter()
        w = snap.writer
        votes = gather_votes(
            self.coord,
            Outcome(
                status=Staged.FAILED
                if snap.error
                else Staged.SKIPPED
                if snap.staged is None
                else Staged.STAGED,
                stall_s=t_staged - t0,
                bytes=w.bytes_written if w else 0,
                rows=w.rows_written if w else 0,
                chunks=w.chunks_written if w else 0,
                buffer_wait_s=snap.staged.buffer_wait_s if snap.staged else 0.0,
                agree_s=t_agreed - t0,
                claim_s=t_claimed - t_agreed,
                snapshot_s=t_staged - t_claimed,
            ),
        )
        if any(v.status != Staged.STAGED for v in votes):
            return self._give_up(votes, snap, token, step)
        stats = CheckpointStats(
            step=step,
            kind=kind,
            id=ckpt_id,
            stall_s=max(max(v.stall_s for v in votes), time.perf_counter() - t0),
            bytes=sum(v.bytes for v in votes),
            rows=sum(v.rows for v in votes),
            chunks=sum(v.chunks for v in votes),
            buffer_wait_s=max(v.buffer_wait_s for v in votes),
            agree_s=max(v.agree_s for v in votes),
            claim_s=max(v.claim_s for v in votes),
            snapshot_s=max(v.snapshot_s for v in votes),
            started=t0,
        )
        assert snap.staged is not None
        self.stager.enqueue(snap.staged, stats)
        failpoint("checkpointer.save.enqueued")
        # The rows are in the stager's hands: later deltas are relative to this snapshot. If the
        # part fails in the background, ``stager.take_failure()`` makes the next one a full.
        self.tracker.commit(token)
        self.parent = (step, ckpt_id)
        if full:
            self.base = step
        self.history.append(stats)
        self._log(stats)
        return stats

    def _agree(
        self, kind: Literal["delta", "full"], step: int, dense: dict[str, Any]
    ) -> tuple[Literal["delta", "full"], str]:
        """Step 1: the agreed kind and id (``dense``: this rank's live dense state)."""
        failed_parts = self.stager.take_failed()
        # Buffers not yet known to be rank-local: the same names on every rank, whatever kind
        # each rank asked for (that is only agreed by this vote).
        digests = _digests(dense, self.adapter.dense_buffers() - self.rank_local)
        proposal = Proposal(
            id_seed=self.coord.new_id_seed(),
            # Taken, not peeked: a part failing from here on is kept for the next vote.
            parent_failed=self.stager.take_failure(),
            lease_lost=self.lease is not None and self.lease.lost.is_set(),
            no_parent=self.parent is None or (kind == "delta" and self._parent_broken()),
            failed_parts=len(failed_parts),
            dense_digest=_combine(digests),
            dense_count=len(dense),
        )
        failpoint("checkpointer.agree.voting")  # test hook: between the take and the vote
        votes = gather_votes(self.coord, proposal)
        most = max(v.failed_parts for v in votes)
        if most:
            self.tell_rank0_failed(failed_parts, most)
        if any(v.lease_lost for v in votes):
            raise CheckpointError(
                f"step {step}: this job lost the writer lease of {self.storage.uri} to another "
                "trainer; not writing. Stop one of the two jobs."
            )
        if kind == "delta" and any(v.no_parent or v.parent_failed for v in votes):
            logger.info(
                "%s step %d: no committed parent to be a delta of: taking a full", self.label, step
            )
            kind = "full"
        if len({v.dense_count for v in votes}) > 1:
            # Not the same dense tensors everywhere: no hash can pair them, so each rank keeps
            # its own copy of every one (safe, larger). Collectives stay aligned: no gather.
            self.rank_local |= set(dense)
        elif kind == "full":  # every dense tensor, parameters too (one more all-gather)
            self.rank_local |= self._differing(_digests(dense, set(dense) - self.rank_local))
        elif len({v.dense_digest for v in votes}) > 1:
            self.rank_local |= self._differing(digests)
        return kind, f"{votes[0].id_seed:016x}"

    def _differing(self, digests: dict[str, int]) -> set[str]:
        """Collective: the names whose hash differs on some rank."""
        table = self.coord.gather([float(d) for d in digests.values()])
        differs = (table != table[0]).any(dim=0).tolist()
        found = {k for k, d in zip(digests, differs, strict=True) if d}
        if found - self.rank_local:
            logger.info(
                "deck: dense tensors differ across ranks and are saved per rank: %s",
                ", ".join(sorted(found - self.rank_local)[:8]),
            )
        return found

    def _parent_broken(self) -> bool:
        """Rank 0: whether the committed parent can no longer be restored (a checkpoint of its
        chain was quarantined and nothing covers it), so a delta of it would be useless too.

        Only asked while nothing is in flight: a parent still uploading is not committed yet,
        and a part that fails in the background already forces a full via
        ``stager.take_failure()``.
        """
        if self.coord.rank != 0 or self.parent is None or not self.stager.flush(timeout=0):
            return False
        try:
            why = needs_new_full(self.storage, self.parent)
        except DeckError as e:
            # Cannot tell now (e.g. the store is down): a delta still follows its committed
            # parent, and the next checkpoint asks again.
            logger.info("deck: could not check the lineage of the last checkpoint: %s", e)
            return False
        if why:
            logger.warning("deck: taking a full: the last checkpoint's chain is broken: %s", why)
        return why is not None

    def _snapshot(
        self, step: int, ckpt_id: str, full: bool, token: ReadToken, dense: dict[str, Any]
    ) -> _Snapshot:
        """Step 3. Never raises: a failure must still reach the release vote, or the other
        ranks would wait in it forever."""
        snap = _Snapshot()
        try:
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
            if not self.stager.reserve(estimate):
                return snap
            snap.staged = self.stager.begin(self._pending_part(step, ckpt_id, full), estimate)
            snap.writer = RankPartWriter(
                self.storage,
                step,
                ckpt_id,
                self.coord.rank,
                self.coord.world_size,
                self.staging.chunk_bytes,
                sink=snap.staged,
                bundle_bytes=self.staging.bundle_bytes,
                quantize=self.quantize,
            )
            order = {id(sh): i for i, sh in enumerate(shards)}
            extra = self.extra_state(shards)
            if self.rank_local:
                extra["rank_local"] = {k: dense[k] for k in sorted(self.rank_local) if k in dense}
            snap.writer.write_part(
                shards,
                lambda sh: selected[order[id(sh)]],
                dense if self.coord.rank == 0 else None,
                extra,
            )
            snap.staged.seal()
            if self.staging.release == "first_tier":
                snap.staged.wait_written()
            # else a write that fails fails the step in the background, always there (not here
            # or there by timing): the commit thread reports it, the next one is a full
            failpoint("checkpointer.save.staged")
        except Exception as e:
            snap.error = e
        return snap

    def _give_up(
        self, votes: list[Outcome], snap: _Snapshot, token: ReadToken, step: int
    ) -> CheckpointStats | None:
        """Step 4 when a rank did not stage: nothing is saved, the rows stay pending."""
        self.tracker.abort(token)
        if snap.staged is not None:
            self.stager.discard(snap.staged)
        if all(v.status != Staged.FAILED for v in votes):
            logger.warning(
                "deck: %s step %d skipped: the spool %s is full",
                self.label,
                step,
                self.stager.spool_root,
            )
            return None
        failed = [r for r, v in enumerate(votes) if v.status == Staged.FAILED]
        raise CheckpointError(
            f"{self.label} of step {step} at {self.storage.uri} was not committed: rank(s) "
            f"{failed} failed"
            + (f"; on rank {self.coord.rank}: {snap.error}" if snap.error else "")
            + ". Nothing was lost: its rows stay pending for the next checkpoint."
        ) from snap.error

    def _pending_part(self, step: int, ckpt_id: str, full: bool) -> PendingPart:
        delta_of = None if full else self.parent
        return PendingPart(
            uri=self.storage.uri,
            step=step,
            ckpt_id=ckpt_id,
            rank=self.coord.rank,
            world_size=self.coord.world_size,
            kind=Kind.FULL if full else Kind.DELTA,
            parent=None if delta_of is None else delta_of[0],
            parent_id=None if delta_of is None else delta_of[1],
            base=step if full or self.base is None else self.base,
            epoch=self.epoch,
        )

    def tell_rank0_failed(self, failed: list[tuple[int, str]], most: int) -> None:
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
                    self.stager.abandon(step, f"{cid:016x}", f"rank {r}'s part failed")

    def exchange_failures(self, timeout: float | None) -> None:
        """Collective: once every rank other than 0 has finished (or failed) its parts, rank 0
        learns which failed. Rank 0 does not wait: its commit thread may be waiting for exactly
        those parts; the other ranks' background work never waits for another rank."""
        if self.coord.rank != 0:
            self.stager.flush(timeout)
        failed = self.stager.take_failed()
        most = int(self.coord.gather([float(len(failed))])[:, 0].max())
        if most:
            self.tell_rank0_failed(failed, most)

    def _log(self, stats: CheckpointStats) -> None:
        if stats.buffer_wait_s > 0.5 * stats.stall_s and stats.kind != "full":
            logger.info(
                "deck: %s step %d waited %.3f s of its %.3f s stall for chunk buffers: a rank's "
                "part is larger than staging.chunks_in_flight x chunk_bytes (%.0f MiB); raise "
                "chunks_in_flight to trade CPU memory for stall",
                self.label,
                stats.step,
                stats.buffer_wait_s,
                stats.stall_s,
                self.staging.chunks_in_flight * self.staging.chunk_bytes / 2**20,
            )
        logger.info(
            "deck: %s %s step %d staged (%s tier): %d rows, %.1f MiB, stall %.3f s",
            stats.kind,
            self.label,
            stats.step,
            self.stager.tier,
            stats.rows,
            stats.bytes / 2**20,
            stats.stall_s,
        )
