"""The save protocol of one delta chain: claim, snapshot, and one vote that releases it.

A :class:`ChainWriter` owns one chain of checkpoints (the checkpoints, or the publisher's): its
tracking consumer, destination, stager and lineage state (parent, base, epoch). Its one entry
point, :meth:`ChainWriter.save`, is called by the training thread of every rank together. In the
steady state a checkpoint costs one collective:

1. **claim** the consumer's tracked rows (:meth:`deck.trainer.tracker.TrackerStore.begin_read`).
2. **snapshot** the rows, dense and extra state into the stager's CPU buffers
   (:class:`deck.trainer.writer.RankPartWriter`) under the id the previous checkpoint's vote
   settled (rank 0's seed); with ``release="first_tier"`` also wait until they are in the first
   tier.
3. **vote** -- one all-gather of a :class:`Vote` per rank: whether its part is staged, and what
   could make the snapshot wrong: a part of this chain failed in the background or the chain's
   committed parent is broken (a delta must then be a full; rank 0 knows it from its
   :class:`LineageWatch`, in memory), the writer lease is lost, a hash of
   the dense tensors (data parallelism keeps buffers, and parameters under per-rank updates,
   unequal across ranks) differs; plus the
   rank's parts that failed in the background (told to rank 0) and an id seed for the next one.

   - every rank staged and nothing is wrong: the part goes to the stager's background threads,
     the claim is committed, rank 0's seed names the next checkpoint;
   - a rank did not stage: every rank aborts its claim (rows stay pending) and drops its part;
     the step fails (or is skipped: spool full);
   - the lease is lost: every rank drops its part and raises;
   - the snapshot is wrong (rare): every rank drops it, aborts its claim and snapshots again as
     the vote decided (a full; dense tensors found to differ -- named by a second all-gather of
     per-tensor hashes -- saved by every rank from now on, :attr:`ChainWriter.rank_local`), then
     votes again.

   Failure flags are taken once per checkpoint, by its first vote: a part failing after that is
   kept for the next checkpoint (then a full).

The first checkpoint of a process, and the one after a failed or skipped checkpoint, have no
settled id: they vote first (the same :class:`Vote`, before the claim) and then once more.

The stall asks storage nothing: what a checkpoint needs to know from it (whether the parent's
chain was broken by a quarantine) was learned in the background after an earlier checkpoint
committed (:class:`LineageWatch`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Literal

import torch
import xxhash

from deck.config import StagingConfig
from deck.errors import CheckpointError, ConfigError, DeckError, UnsupportedError
from deck.failpoints import failpoint
from deck.format.manifest import Kind
from deck.kernels.native import native_available
from deck.model import ModelAdapter, TableShard
from deck.read.lineage import needs_new_full
from deck.storage import Storage
from deck.trainer.coordination import Coordinator, gather_votes
from deck.trainer.cow import DeferredCopy
from deck.trainer.cycles import collect_cycles
from deck.trainer.events import CheckpointEvent, log_event
from deck.trainer.lease import Lease, Leases
from deck.trainer.staging import (
    CheckpointStats,
    PendingPart,
    ProcessStager,
    RemotePart,
    StagedPart,
    Stager,
)
from deck.trainer.staging.committer import UNKNOWN_FAILURE, lower_priority
from deck.trainer.tracker import ClaimedSpan, ReadToken, TrackerStore
from deck.trainer.writer import RankPartWriter
from deck.units import human_bytes

_DIGEST_BITS = (1 << 52) - 1  # votes travel as float64: exact below 2**53


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: one landing in the stall costs ~0.4 ms (a young
    generation) to over 100 ms (the whole heap of a TorchRec process); it runs at the next
    allocations after, on the same thread, with the same work."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def tensor_digest(t: Any) -> int:
    """A 52-bit hash of a tensor's bytes (equal tensors, equal digests)."""
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_64_intdigest(data) & _DIGEST_BITS


def _digests(dense: dict[str, Any], names: set[str]) -> dict[str, int]:
    return {k: tensor_digest(dense[k]) for k in sorted(names) if k in dense}


def _combine(digests: dict[str, int]) -> int:
    return xxhash.xxh3_64_intdigest(repr(sorted(digests.items())).encode()) & _DIGEST_BITS


logger = logging.getLogger(__name__)
# How often a checkpoint waiting for the parts before it says so
BACKLOG_SAY_S = 60.0

StateKey = tuple[int, str]  # (step, id) of a trainer checkpoint: a training state

# Every open watch of this process, for lineage_changed()
_WATCHES: weakref.WeakSet[LineageWatch] = weakref.WeakSet()
_WATCHES_LOCK = threading.Lock()
# Set while no training thread of this process is stalled in a checkpoint (of any chain, any
# checkpointer): no lineage check starts then
_UNSTALLED = threading.Event()
_UNSTALLED.set()
_stalls = 0
_CLOSED_POLL_S = 0.1  # how often a check waiting for a stall to end looks whether it is closed


class LineageWatch:
    """Rank 0's knowledge of whether a chain's committed checkpoints can still be restored,
    learned off the training thread so that a checkpoint's stall asks storage nothing.

    Once a checkpoint of the chain is committed, :meth:`committed` hands its state to a thread
    of its own (``deck-lineage-<label>``, at the background threads' priority), which asks
    :func:`deck.read.lineage.needs_new_full`: one LIST of ``quarantine/``, each new quarantine
    record read once, and the lineage (every commit record) only when a quarantined checkpoint
    is at a step of that checkpoint's chain. A state found broken is remembered; the training
    thread asks :meth:`broken` (memory only) at the next checkpoint. The thread starts no check
    while a training thread of this process is stalled (:meth:`paused`): its requests and
    parsing would take the GIL from the stall.

    What it knows is as new as the last commit's check, or newer: a restore with fallback in
    this process (which may have quarantined checkpoints of the URI) has every watch of the
    URI look again before it returns (:func:`lineage_changed`). A quarantine written by another
    process (a merger, ``deck verify --quarantine``) is learned by the check after the next
    commit, so the checkpoint after that one is the full.
    """

    def __init__(self, storage: Storage, label: str, nice: int) -> None:
        self.storage = storage
        self.label = label
        self._nice = nice
        self._cond = threading.Condition()
        self._want: tuple[StateKey, int] | None = None  # (state, base) the thread checks next
        self._last: tuple[StateKey, int] | None = None  # the newest committed (state, base)
        self._busy = False
        self._closed = False
        self._broken: dict[StateKey, str] = {}  # states found broken -> why
        self._warned: set[int] = set()  # the bases of the broken chains warned about
        # One check at a time: the thread's, or lineage_changed()'s on its caller's thread
        self._checking = threading.Lock()
        self._known: dict[str, int | None] = {}  # quarantine records read (needs_new_full)
        self._thread: threading.Thread | None = None
        with _WATCHES_LOCK:
            _WATCHES.add(self)

    def committed(self, state: StateKey, base: int) -> None:
        """Checkpoint ``state`` (whose chain starts at step ``base``) is committed: check its
        chain in the background. Never waits (the commit thread calls it)."""
        with self._cond:
            if self._closed:
                return
            self._last = self._want = (state, base)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"deck-lineage-{self.label}", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def broken(self, states: Collection[StateKey]) -> str | None:
        """Why one of ``states`` (a chain: a full and deltas of it) was found broken, or None.
        Memory only: for the stall."""
        with self._cond:
            return next((why for s, why in self._broken.items() if s in states), None)

    @staticmethod
    @contextlib.contextmanager
    def paused() -> Iterator[None]:
        """While a training thread is stalled: no check of any watch starts (one already
        running ends)."""
        global _stalls
        with _WATCHES_LOCK:
            _stalls += 1
            _UNSTALLED.clear()
        try:
            yield
        finally:
            with _WATCHES_LOCK:
                _stalls -= 1
                if not _stalls:
                    _UNSTALLED.set()

    def forget(self) -> None:
        """The chain starts again elsewhere (a restore): its last commit is not the parent."""
        with self._cond:
            self._want = self._last = None

    def recheck(self) -> None:
        """Check the newest committed state now, on this thread (outside any stall)."""
        with self._cond:
            last = self._last
        if last is not None:
            self._check(*last)

    def wait(self, timeout: float | None = None) -> bool:
        """Until the checks of every commit so far are done; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._want is not None or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """Stop the thread (a check it is running finishes first)."""
        with self._cond:
            self._closed = True
            thread, self._want = self._thread, None
            self._cond.notify_all()
        if thread is not None:
            thread.join()
        with _WATCHES_LOCK:
            _WATCHES.discard(self)

    def _run(self) -> None:
        lower_priority(self._nice)
        while True:
            with self._cond:
                while self._want is None and not self._closed:
                    self._cond.wait()
                want = self._want
                if self._closed or want is None:
                    return
                self._want, self._busy = None, True
            try:
                while not _UNSTALLED.wait(_CLOSED_POLL_S) and not self._closed:
                    pass
                self._check(*want)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _check(self, state: StateKey, base: int) -> None:
        with self._checking:
            if self._closed:
                return
            try:
                why = needs_new_full(self.storage, state, base=base, known=self._known)
            except DeckError as e:
                # Cannot tell now (e.g. the store is down): the next commit's check asks again.
                logger.info("deck: could not check the lineage of step %d: %s", state[0], e)
                return
            except Exception:
                logger.exception("deck: the lineage check of step %d failed", state[0])
                return
        if why is None:
            return
        with self._cond:
            # The deltas committed before the check learned of it are of the same chain (the
            # same full): one warning for them all
            new = base not in self._warned
            self._warned.add(base)
            self._broken[state] = why
        if new:
            logger.warning(
                "deck: the chain of %s step %d at %s is broken, the next %s is a full: %s",
                self.label,
                state[0],
                self.storage.uri,
                self.label,
                why,
            )


def lineage_changed(uri: str) -> None:
    """Checkpoints at ``uri`` may have been quarantined by this process (a restore with
    fallback): every open watch of the URI checks its newest commit again now, on this
    thread, so that the next checkpoint of its chain knows (a full, if its chain is broken)."""
    with _WATCHES_LOCK:
        watches = [w for w in _WATCHES if w.storage.uri == uri]
    for w in watches:
        w.recheck()


class Staged(IntEnum):
    """Whether a rank's part is staged."""

    FAILED = 0
    SKIPPED = 1  # the spool is full and ``spool_full="skip"``
    STAGED = 2


@dataclass(frozen=True)
class Vote:
    """One rank's vote (see the module docstring). A vote before the snapshot carries only the
    checks; the one after also the part's state, sizes and where its stall went."""

    id_seed: int  # rank 0's names the next snapshot (this checkpoint's, or the next one's)
    full: bool  # this rank asked for (or snapshotted) a full: ranks may ask differently
    parent_failed: bool  # a part of this chain failed in the background since the last take
    lease_lost: bool  # this job no longer holds the writer lease
    no_parent: bool  # no committed parent here (first checkpoint, reshard, broken chain)
    failed_parts: int  # this rank's parts that failed in the background, to tell rank 0
    dense_digest: int  # hash of the dense buffers not yet known to be rank-local
    dense_count: int  # how many dense tensors this rank has (the hashes pair up by position)
    status: Staged = Staged.STAGED
    arrived_unix: float = 0.0  # wall clock when this rank entered save()
    stall_s: float = 0.0
    bytes: int = 0
    rows: int = 0
    chunks: int = 0
    buffer_wait_s: float = 0.0
    pool_bytes: int = 0
    pool_capped: bool = False
    agree_s: float = 0.0
    claim_s: float = 0.0
    snapshot_s: float = 0.0
    copied_after: int = 0  # rows copied after the stall (copy-on-write)


@dataclass
class _Snapshot:
    """What step 3 left: the staged part and its writer (None when skipped or failed)."""

    staged: StagedPart | RemotePart | None = None
    writer: RankPartWriter | None = None
    error: BaseException | None = None
    pool_capped: bool = False  # the part needed more chunk buffers than the memory cap
    deferred: DeferredCopy | None = None  # copy-on-write: its rows are copied after the stall


@dataclass
class ChainWriter:
    """One delta chain a checkpointer writes (see the module docstring for the protocol).

    Only the training thread calls :meth:`save`, on every rank together; the stager's threads
    take the part from there. Failures of one chain never touch another's state.
    """

    label: str  # "checkpoint" or "publish", for logs and errors
    consumer: str
    storage: Storage
    stager: Stager | ProcessStager
    epoch: int
    coord: Coordinator
    tracker: TrackerStore
    adapter: ModelAdapter
    staging: StagingConfig
    extra_state: Callable[[list[TableShard]], dict[str, Any]]
    lease: Lease | Leases | None = None
    parent: tuple[int, str] | None = None  # the last committed (step, id) a delta builds on
    base: int | None = None  # step of the full the chain starts from
    history: list[CheckpointStats] = field(default_factory=list)
    # The newest step this process saved (or restored) on this chain: steps only go forward.
    newest: int | None = None
    newest_saved: bool = False  # whether ``newest`` was checkpointed (or restored), not skipped
    restored: int | None = None  # the step the last restore loaded
    # The URI's latest restorable step before this process (None: none): a process that
    # restored nothing may not checkpoint over that history (set after construction)
    stored_newest: int | None = None
    flushed: int = 0  # entries of ``history`` a flush has reported on
    quantize: str | None = None  # weight encoding of its checkpoints (None: exact)
    # Dense tensors found to differ across ranks: saved by every rank, hashed at every checkpoint
    rank_local: set[str] = field(default_factory=set)
    _next_id: str | None = None  # settled by the last vote: the next snapshot's id
    _failed_parts: list[tuple[int, str]] = field(default_factory=list)  # taken, to tell rank 0
    # Gets each checkpoint's event once it has ended (deck.trainer.events); logs it by default
    notify: Callable[[CheckpointEvent], None] = log_event
    _cow_refused: str | None = None  # why copy-on-write was last found unsafe (logged once)
    # The states of the chain ending at ``parent``, from its full on (as far as this process
    # saved them): a state on it found broken breaks every later one
    _states: dict[StateKey, None] = field(default_factory=dict)
    _watch: LineageWatch | None = None  # rank 0's (see LineageWatch)
    # Checkpoints this rank handed on whose parts may still be only in memory (oldest first)
    _unwritten: list[CheckpointStats] = field(default_factory=list)
    _said_backlog: bool = False  # the backlog warning is logged once
    _said_capped: bool = False  # the pool-capped warning too

    def __post_init__(self) -> None:
        if self.coord.rank == 0:
            self._watch = LineageWatch(self.storage, self.label, self.staging.background_nice)

    def refuse_going_back(self, step: int, *, again: bool) -> None:
        """Raise :class:`ConfigError` when ``step`` is older than the newest step this process
        checkpointed or restored (``again``: or that very step, checkpointed): steps only go
        forward."""
        stored = self.stored_newest
        if self.restored is None and stored is not None and step <= stored:
            # Its first checkpoint would be a new timeline's full at `step`: the records of the
            # steps from there to `stored` replaced or abandoned, the URI's latest state lost
            raise ConfigError(
                f"{self.label} of step {step} at {self.storage.uri}: the URI's history goes "
                f"up to step {stored} (its latest restorable step, or one that a lost commit "
                "record put back restores: `deck verify URI --all` says) and this process "
                "restored none; checkpointing "
                f"step {step} would start a new timeline there and leave steps {step}..{stored} "
                "of the old one unrestorable. Call restore() before training (it loads the "
                "latest step; resume the loop after it), restore(step) to go back on purpose, "
                f"start this run's steps after {stored}, or give this run a URI of its own"
            )
        newest = self.newest
        if newest is not None and (
            step < newest or (again and step == newest and self.newest_saved)
        ):
            # Caught here, not by the manifest's checks in the background (where it failed
            # while flush() still said all was well, and took the next delta with it).
            itself = (
                f" (step {step} itself is saved: a second checkpoint of a step, e.g. a final "
                "save() right after step() took one, would be a delta of itself)"
                if step == newest
                else ""
            )
            if step == newest == self.restored:  # e.g. a loop resumed at restore() itself
                raise ConfigError(
                    f"{self.label} of step {step} at {self.storage.uri}: step {step} is the step "
                    f"restore() loaded, so it is saved already; the next step to train and save "
                    f"is {step + 1} (resume the loop at restore() + 1)"
                )
            raise ConfigError(
                f"{self.label} of step {step} at {self.storage.uri}: this process already "
                f"{'restored' if newest == self.restored else 'checkpointed'} step "
                f"{newest}, and steps only go forward{itself}; to go back, restore() a committed "
                f"step at or before {step} first"
            )

    def save(self, kind: Literal["delta", "full"], step: int) -> CheckpointStats | None:
        """Checkpoint ``step`` (a delta of :attr:`parent`, or a full). Returns once every rank's
        part is staged (``staging.release``); None when skipped for a full spool. Raises
        :class:`CheckpointError` when any rank failed: then nothing is committed and every rank's
        claimed rows stay pending."""
        self.refuse_going_back(step, again=True)
        waited = self._wait_for_backlog(step)
        try:
            with gc_paused(), self.stager.stall(), LineageWatch.paused():
                stats = self._save(kind, step)
        except BaseException as e:
            if not isinstance(e, Exception):
                # Interrupted (Ctrl-C) anywhere in it: which rows it claimed, and whether its
                # part was enqueued, is unknown, so the next one is a full. (After an error
                # its rows are pending again: the next checkpoint takes them.)
                self.parent = None
            raise
        self.newest, self.newest_saved = step, stats is not None
        if stats is not None:
            stats.backlog_wait_s = waited
            self._unwritten.append(stats)
        return stats

    def _wait_for_backlog(self, step: int) -> float:
        """Wait (seconds waited) while ``staging.max_unwritten`` checkpoints of this rank are
        still only in memory: a job that checkpoints faster than its first tier writes must
        not build a backlog a crash would lose. Local (no collective): the ranks meet at the
        vote anyway."""
        self._unwritten = [s for s in self._unwritten if not s.progress.in_first_tier()]
        cap = self.staging.max_unwritten
        if len(self._unwritten) < cap:
            return 0.0
        t0 = time.perf_counter()
        oldest = self._unwritten[0]
        while not oldest.progress.wait_in_first_tier(BACKLOG_SAY_S):
            # Said, never given up on here: the other ranks may be in the vote already, and a
            # rank that left alone would hold them there (a break-it finding: a staging process
            # that stopped answering held training here without a word)
            logger.warning(
                "deck: %s of step %d at %s has waited %.0f s for step %d's part to be written "
                "to the first tier (its state: %s): a stopped or hung staging process or "
                "first-tier disk holds it; training goes on once it is written",
                self.label,
                step,
                self.storage.uri,
                time.perf_counter() - t0,
                oldest.step,
                oldest.state,
            )
        waited = time.perf_counter() - t0
        self._unwritten = [s for s in self._unwritten if not s.progress.in_first_tier()]
        # A part that failed (its own error is reported with it) says nothing of the rate
        if not self._said_backlog and oldest.state != "failed":
            self._said_backlog = True
            logger.warning(
                "deck: %s of step %d at %s waited %.3f s for step %d's part to be written: "
                "%d checkpoints of this rank were still only in memory "
                "(staging.max_unwritten), so checkpoints are taken faster than the first tier "
                "writes them. Checkpoint less often, or raise max_unwritten (a crash loses up "
                "to that many); said once",
                self.label,
                step,
                self.storage.uri,
                waited,
                oldest.step,
                cap,
            )
        return waited

    def _save(self, kind: Literal["delta", "full"], step: int) -> CheckpointStats | None:
        t0, arrived = time.perf_counter(), time.time()
        broken = kind == "delta" and self._parent_broken()
        dense = self.adapter.dense_state()  # one state walk: hashed in the votes, saved after
        # Whatever this rank knows (e.g. no parent here), every rank snapshots the kind asked
        # for until a vote says otherwise: which collectives run must not depend on local state.
        ckpt_id, self._next_id = self._next_id, None  # a failed or skipped save leaves none
        taken = False  # failure flags are taken once per checkpoint, by its first vote
        if ckpt_id is None:
            votes = gather_votes(self.coord, self._checks(kind, dense, True, broken))
            taken = True
            kind, _ = self._decide(step, votes, dense)
            ckpt_id = f"{votes[0].id_seed:016x}"
        t_agreed = time.perf_counter()
        while True:
            token = self.tracker.begin_read(self.consumer)
            t_claimed = time.perf_counter()
            snap = self._snapshot(step, ckpt_id, kind == "full", token, dense)
            t_staged = time.perf_counter()
            vote = dataclasses.replace(
                self._checks(kind, dense, not taken, broken),
                **self._outcome(snap),
                arrived_unix=arrived,
                stall_s=t_staged - t0,
                agree_s=t_agreed - t0,
                claim_s=t_claimed - t_agreed,
                snapshot_s=t_staged - t_claimed,
            )
            taken = True
            votes = gather_votes(self.coord, vote)
            try:
                decided, moved = self._decide(step, votes, dense)
            except CheckpointError:
                self._drop(snap, token)
                raise
            if any(v.status != Staged.STAGED for v in votes):
                return self._give_up(votes, snap, token, step)
            if not moved and all(v.full == (decided == "full") for v in votes):
                break
            # The snapshot is not what the ranks now know it must be: take it again (rare).
            self._drop(snap, token)
            kind, ckpt_id = decided, f"{votes[0].id_seed:016x}"
        stats = CheckpointStats(
            step=step,
            kind=kind,
            id=ckpt_id,
            bytes=sum(v.bytes for v in votes),
            rows=sum(v.rows for v in votes),
            chunks=sum(v.chunks for v in votes),
            buffer_wait_s=max(v.buffer_wait_s for v in votes),
            pool_bytes=max(v.pool_bytes for v in votes),
            pool_capped=any(v.pool_capped for v in votes),
            agree_s=max(v.agree_s for v in votes),
            claim_s=max(v.claim_s for v in votes),
            snapshot_s=max(v.snapshot_s for v in votes),
            copied_after=sum(v.copied_after for v in votes),
            started=t0,
        )
        assert snap.staged is not None
        copied: Callable[[], None] = lambda: None  # noqa: E731
        if snap.deferred is not None:
            # Guarded from before the first step that may write its rows (the stall ends below)
            protect = snap.deferred.protect
            self.tracker.add_guard(protect, self.stager.guard_runner)
            copied = functools.partial(self.tracker.remove_guard, protect)
        # (a stager's begin() made the part: a StagedPart of threads, a RemotePart of a process)
        self.stager.enqueue(snap.staged, stats, copied)  # type: ignore[arg-type]
        failpoint("checkpointer.save.enqueued")
        # The rows are in the stager's hands: later deltas are relative to this snapshot. If the
        # part fails in the background, ``stager.take_failure()`` makes the next one a full.
        self.tracker.commit(token)
        # Out of the training thread's next step: sorted (a copy-on-write part's copy needs
        # that too), then the claimed rows' bits cleared in order
        self.stager.aside(functools.partial(self._settle_claim, token))
        self._extend(kind, (step, ckpt_id))
        if kind == "full":
            self.base = step
        base = self.base if self.base is not None else step
        self._next_id = f"{votes[0].id_seed:016x}"
        # Handing the part over (its held writes start) is part of the stall too
        stats.stall_s = max(max(v.stall_s for v in votes), time.perf_counter() - t0)
        stats.job_stall_s = max(0.0, time.time() - max(v.arrived_unix for v in votes))
        self.history.append(stats)
        self._log(stats)
        # Sealed: the event goes out once the commit thread is done with the part (or now)
        stats.progress.when_ended(functools.partial(self._ended, stats, base))
        return stats

    def _ended(self, stats: CheckpointStats, base: int) -> None:
        """The commit thread is done with a checkpoint (or it ended before it was handed on):
        its event goes out, and on rank 0 a committed one's chain is checked in the background."""
        self.notify(CheckpointEvent.of(stats, self.label, self.storage.uri, self.coord.rank))
        if self._watch is not None and stats.state == "committed":
            self._watch.committed((stats.step, stats.id), base)

    def _extend(self, kind: Literal["delta", "full"], state: StateKey) -> None:
        """``state`` was handed on: the new parent, the newest state of :attr:`_states`."""
        if kind == "full" or self.parent is None:
            self._states = {}
        elif self._chain_states() is not self._states:
            # The parent came from elsewhere (a restore): of its chain only it is known here
            self._states = {self.parent: None}
        self._states[state] = None
        self.parent = state

    def _chain_failed(self, failed: set[StateKey]) -> bool:
        """Whether one of the parts that ``failed`` is of the chain a delta would extend (or
        which failed is not known). A part of an older chain does not matter: one given up
        in the background after a full was taken since (rank 0 gives a step up once it knows
        another rank's part of it failed) used to make one more full."""
        chain = self._chain_states()
        return any(f == UNKNOWN_FAILURE or f in chain for f in failed)

    def _chain_states(self) -> Collection[StateKey]:
        """The states of the chain ending at :attr:`parent` this process knows: those it saved
        since the full, or the parent alone (it came from a restore)."""
        states = self._states
        if self.parent is not None and states and next(reversed(states)) == self.parent:
            return states
        return () if self.parent is None else (self.parent,)

    def close(self) -> None:
        """Stop the background lineage check (after the stager is closed: its last commits
        start checks)."""
        if self._watch is not None:
            self._watch.close()

    def lineage_settled(self, timeout: float | None = None) -> bool:
        """Until the background lineage checks of every commit so far are done (rank 0; other
        ranks check nothing): the next checkpoint knows what they found. False on timeout."""
        return self._watch is None or self._watch.wait(timeout)

    def _settle_claim(self, token: ReadToken) -> None:
        """Background: sort a committed claim and clear its rows' bits (see above). A failure
        is the tracker's internal check (its rows stay pending: the next delta saves more)."""
        try:
            _ = token.rows
            self.tracker.clear_claimed()
        except Exception:
            logger.exception("deck: %s: clearing the claimed rows failed", self.label)

    def unsettle(self) -> None:
        """The next save agrees on its id and kind before its snapshot (as the first one of a
        process does). Call on every rank together, e.g. after a restore changed the parent
        (whose chain the restore has just read: the last commit's lineage check is moot)."""
        self._next_id = None
        self.stager.forget_committed()
        if self._watch is not None:
            self._watch.forget()

    def _checks(
        self,
        kind: Literal["delta", "full"],
        dense: dict[str, Any],
        take: bool,
        broken: bool = False,
    ) -> Vote:
        """This rank's checks for a vote on a ``kind`` snapshot (``dense``: its live dense
        state). ``take``: take the stager's failure flags and count ``broken`` (the parent's
        chain is broken: only rank 0 knows) -- the first vote of a checkpoint."""
        failed = self.stager.take_failed() if take else []
        self._failed_parts = failed
        vote = Vote(
            id_seed=self.coord.new_id_seed(),
            full=kind == "full",
            # Taken, not peeked: a part failing from here on is kept for the next vote.
            parent_failed=take and self._chain_failed(self.stager.take_failure()),
            # Gone by the clock too: a renewal blocked in a store that hangs sets no flag
            lease_lost=self.lease is not None and self.lease.gone(),
            no_parent=self.parent is None or (take and broken),
            failed_parts=len(failed),
            dense_digest=_combine(self._digests(dense)),
            dense_count=len(dense),
        )
        if take:
            failpoint("checkpointer.agree.voting")  # test hook: between the take and the vote
        return vote

    def _digests(self, dense: dict[str, Any]) -> dict[str, int]:
        """Hashes of the dense tensors not yet known to be rank-local. Every one, at every
        checkpoint: buffers (BatchNorm statistics: DMP does not broadcast them) and parameters
        too, which data parallelism keeps equal only while every rank applies the same update
        (a per-rank LR schedule, e.g. ReduceLROnPlateau on each rank's own loss, makes them
        drift apart between two fulls)."""
        return _digests(dense, set(dense) - self.rank_local)

    def _outcome(self, snap: _Snapshot) -> dict[str, Any]:
        w, staged = snap.writer, snap.staged
        return {
            "status": Staged.FAILED
            if snap.error
            else Staged.SKIPPED
            if staged is None
            else Staged.STAGED,
            "bytes": w.bytes_written if w else 0,
            "rows": w.rows_written if w else 0,
            "chunks": w.chunks_written if w else 0,
            "buffer_wait_s": staged.buffer_wait_s if staged else 0.0,
            "pool_bytes": self.stager.pool.count * self.stager.pool.size,
            "pool_capped": snap.pool_capped,
            "copied_after": snap.deferred.rows if snap.deferred is not None else 0,
        }

    def _decide(
        self, step: int, votes: list[Vote], dense: dict[str, Any]
    ) -> tuple[Literal["delta", "full"], bool]:
        """What ``votes`` decide, the same on every rank: the kind the checkpoint must be (a
        full when any rank asked for one or lost its parent), and whether the rank-local dense
        tensors changed (then the dense state a snapshot saved is incomplete). Raises when the
        lease is lost. Collective when parts failed or dense tensors differ (every
        rank sees the same votes, so every rank makes the same calls)."""
        most = max(v.failed_parts for v in votes)
        if most:
            self.tell_rank0_failed(self._failed_parts, most)
        if any(v.parent_failed for v in votes):
            # The flags were taken: should this checkpoint not commit (refused below, or
            # dropped after its snapshot), the next one must still be a full
            self.parent = None
        if any(v.lease_lost for v in votes):
            why = self.lease.why_gone() if self.lease is not None else None
            raise CheckpointError(
                f"step {step}: this job lost the writer lease of {self.storage.uri}, so this "
                "checkpoint is not written: "
                + (why or "it lapsed, was taken over or deleted (rank 0's log says which)")
            )
        full = any(v.full for v in votes)
        if not full and any(v.no_parent or v.parent_failed for v in votes):
            why = (
                "the last one failed in the background"
                if any(v.parent_failed for v in votes)
                else "none to be a delta of in this process (the first, or after a restore into "
                "another layout or a failure)"
            )
            logger.log(
                logging.INFO if self.coord.rank == 0 else logging.DEBUG,
                "deck: %s step %d is a full: %s",
                self.label,
                step,
                why,
            )
            full = True
        before = set(self.rank_local)
        if len({v.dense_count for v in votes}) > 1:
            # Not the same dense tensors everywhere: no hash can pair them, so each rank keeps
            # its own copy of every one (safe, larger). Collectives stay aligned: no gather.
            self.rank_local |= set(dense)
        elif len({v.dense_digest for v in votes}) > 1:
            self.rank_local |= self._differing(self._digests(dense))
        return ("full" if full else "delta"), self.rank_local != before

    def _drop(self, snap: _Snapshot, token: ReadToken) -> None:
        """Undo a snapshot that will not be committed: its rows stay pending, its files go."""
        self.tracker.abort(token)
        if snap.staged is not None:
            self.stager.discard(snap.staged)  # type: ignore[arg-type]

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
        Memory only: what the background lineage check found (:class:`LineageWatch`); the
        vote tells every rank. Other ranks: False."""
        if self._watch is None or self.parent is None:
            return False
        why = self._watch.broken(self._chain_states())
        if why:
            logger.warning("deck: taking a full: the last checkpoint's chain is broken: %s", why)
        return why is not None

    def _snapshot(
        self, step: int, ckpt_id: str, full: bool, token: ReadToken, dense: dict[str, Any]
    ) -> _Snapshot:
        """Step 3. Never raises: a failure must still reach the release vote, or the other
        ranks would wait in it forever."""
        snap = _Snapshot()
        if self.lease is not None and self.lease.gone():
            snap.error = CheckpointError("the writer lease is lost")  # the vote says so to all
            return snap
        ahead = self.adapter.rows_written_before_lookup()
        if ahead is not None:
            # The next batch was looked up with the rows before this batch's update: its lookup
            # output is state no checkpoint holds, so no restore could go on exactly. Every rank
            # runs the same pipeline, so every rank refuses.
            snap.error = UnsupportedError(
                f"{ahead}: deck does not checkpoint a model trained through TorchRec's "
                "semi-sync or prefetch pipeline (TrainPipelineSemiSync, "
                "PrefetchTrainPipelineSparseDist): the next batch's lookup, already run, would "
                "be lost at a restore. Use TrainPipelineSparseDist or TrainPipelineBase, or no "
                "pipeline"
            )
            return snap
        waiting = self.tracker.awaiting_backward()
        if waiting:
            # A forward whose output was dropped may hold its graph in a reference cycle (the
            # output distribution's, with 2+ ranks) until the collector runs: run it now.
            collect_cycles()
            waiting = self.tracker.awaiting_backward()
        if waiting:
            # Its rows hold the step before, its update would be missed by the next delta (the
            # claim clears them), and a restore could not repeat the forward already run.
            snap.error = CheckpointError(
                f"{waiting} embedding lookup(s) of a forward pass still wait for their backward "
                "(the fused optimizer updates their rows there): take checkpoints after "
                "optimizer.step(), between training steps -- not between a forward and its "
                "backward, nor with a pipeline that looks the next batch up ahead (TorchRec's "
                "semi-sync and prefetch pipelines), nor while the output of a forward that "
                "requires grad is kept without a backward, in train or eval mode and under "
                "pause() alike (run evaluation forwards under torch.no_grad())"
            )
            return snap
        unoptimized = self.adapter.unoptimized_parameters()
        if unoptimized:
            # (a break-it finding: a dense optimizer left out of enable restored without a
            # word, its state fresh; a parameter frozen by leaving it out is fine, so said)
            logger.warning(
                "deck: dense parameter(s) %s get gradients but are in none of the optimizers "
                "given to deck.enable: if an optimizer updates them, pass it to deck.enable "
                "(its state is not checkpointed: a restore would start it afresh); said once",
                ", ".join(unoptimized[:4]) + (", ..." if len(unoptimized) > 4 else ""),
            )
        unapplied = self.adapter.unapplied_gradients()
        if unapplied:
            # Every rank accumulates in the same loop, so every rank refuses (and the vote
            # tells the others if not)
            snap.error = CheckpointError(
                f"{len(unapplied)} dense parameter(s) ({', '.join(unapplied[:3])}) hold a "
                "gradient no optimizer step has applied yet (gradient accumulation, or a "
                "checkpoint between backward() and optimizer.step()): checkpoints save no "
                "gradients, so training on from this one would differ. Take checkpoints after "
                "optimizer.step(); with gradient accumulation, only at the steps where the "
                "optimizer steps"
            )
            return snap
        try:
            shards = self.adapter.table_shards()
            partial = [sh for sh in shards if not (full or sh.full_only)]
            spans = [(sh.track_base, sh.track_base + sh.rows) for sh in partial]
            deferred = self._copy_on_write(full)
            claimed: list[torch.Tensor] | list[ClaimedSpan]
            if deferred:
                # Counted, not sorted: the copy finds the rows after the stall
                counts_in = token.counts_in(spans)
                claimed = [
                    ClaimedSpan(token, *sp, n) for sp, n in zip(spans, counts_in, strict=True)
                ]
            else:
                # The claim's positions, read in place (no relative copy: fresh pages in the stall)
                claimed = token.rows_in(spans)
            rows: dict[int, torch.Tensor | ClaimedSpan] = dict(
                zip(map(id, partial), claimed, strict=True)
            )
            selected = [rows.get(id(sh)) for sh in shards]
            counts = [
                sh.rows
                if sel is None
                else sel.count
                if isinstance(sel, ClaimedSpan)
                else int(sel.numel())
                for sh, sel in zip(shards, selected, strict=True)
            ]
            estimate = sum(n * sh.row_bytes() for sh, n in zip(shards, counts, strict=True))
            if not self.stager.reserve(estimate):
                return snap
            snap.staged = self.stager.begin(self._pending_part(step, ckpt_id, full), estimate)
            writer = snap.writer = RankPartWriter(
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
            snap.pool_capped = self.stager.size_pool(
                snap.staged,  # type: ignore[arg-type]
                writer.buffers_needed(shards, counts),
                full,
            )
            if deferred:
                staged = snap.staged
                snap.deferred = DeferredCopy(
                    staged.buffer, self.stager.pool.release, staged.try_buffer, staged.together
                )
                writer.deferred = snap.deferred
            order = {id(sh): i for i, sh in enumerate(shards)}
            extra = self.extra_state(shards)
            if self.rank_local:
                extra["rank_local"] = {k: dense[k] for k in sorted(self.rank_local) if k in dense}
            writer.write_part(
                shards,
                lambda sh: selected[order[id(sh)]],
                dense if self.coord.rank == 0 else None,
                extra,
                flat=True,
            )
            if snap.deferred is not None:
                snap.deferred.seal()
                snap.staged.defer(snap.deferred)  # sealed once the rows are copied
            else:
                snap.staged.seal()
            if self.staging.release == "first_tier":
                snap.staged.wait_written()
            # else a write that fails fails the step in the background, always there (not here
            # or there by timing): the commit thread reports it, the next one is a full
            failpoint("checkpointer.save.staged")
        except BaseException as e:
            # An interrupt on this rank alone (raised by the user's state_dict, say) must reach
            # the vote too, or the others wait in it forever; it is raised again after it
            snap.error = e
        return snap

    def _copy_on_write(self, full: bool) -> bool:
        """Whether this part's rows are copied after the stall (:mod:`deck.trainer.cow`): asked
        for (``staging.copy_on_write``: deltas, or all), released in memory, and safe for this
        model now (logged when it is not)."""
        mode = self.staging.copy_on_write
        if mode == "off" or (mode == "deltas" and full):
            return False
        why = None
        if self.staging.release != "in_memory":
            why = f"staging.release={self.staging.release!r} writes the rows in the stall"
        elif self.staging.bundle_bytes:
            why = "staging.bundle_bytes bundles chunks, which are filled in the stall"
        elif not native_available():
            why = "deck's native kernel (kernels/_native.c) is not built"
        if why != self._cow_refused:
            if why is not None:
                logger.log(
                    logging.INFO if self.coord.rank == 0 else logging.DEBUG,
                    "deck: %s: rows are copied in the stall, not after it (copy-on-write off): %s",
                    self.label,
                    why,
                )
            self._cow_refused = why
        return why is None

    def _give_up(
        self, votes: list[Vote], snap: _Snapshot, token: ReadToken, step: int
    ) -> CheckpointStats | None:
        """The vote when a rank did not stage: nothing is saved, the rows stay pending."""
        self._drop(snap, token)
        if all(v.status != Staged.FAILED for v in votes):
            logger.warning(
                "deck: %s step %d skipped: the spool %s is full",
                self.label,
                step,
                self.stager.spool_root,
            )
            return None
        if snap.error is not None and not isinstance(snap.error, Exception):
            raise snap.error  # (an interrupt here: the others were told by the vote)
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

    def failed_since_last_report(self, settled: bool) -> bool:
        """Whether a checkpoint of this chain saved since the last report failed (its part on
        this rank, or rank 0's commit). ``settled``: the stager was flushed, so every one of
        them has its outcome and they count as reported; otherwise the next call looks again."""
        fresh = self.history[self.flushed :]
        if settled:
            self.flushed = len(self.history)
        return any(s.state == "failed" for s in fresh)

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
        if stats.pool_capped:
            # Said once at WARNING, and only for a wait (a break-it finding: a line per rank and
            # checkpoint, "waited 0.000 s", with a checkpoint every step); then at DEBUG
            waited = stats.buffer_wait_s >= 0.001
            level = logging.WARNING if waited and not self._said_capped else logging.DEBUG
            self._said_capped = self._said_capped or waited
            logger.log(
                level,
                "deck: %s step %d: a rank's part needs more chunk buffers than "
                "staging.snapshot_memory_bytes (%s) allows; it waited %.3f s of its %.3f s "
                "stall for buffers%s. Raise snapshot_memory_bytes to trade CPU memory for stall",
                self.label,
                stats.step,
                human_bytes(self.staging.snapshot_memory_bytes),
                stats.buffer_wait_s,
                stats.stall_s,
                # (a break-it finding: seconds of a staging process's start said as the cap's)
                " (freed as the staging process writes them: the first checkpoints also wait "
                "for it to start)"
                if isinstance(self.stager, ProcessStager)
                else "",
            )
        logger.debug(
            "deck: %s %s step %d staged (%s tier): %d rows, %s, stall %.3f s (job %.3f s), "
            "buffer pool %s",
            stats.kind,
            self.label,
            stats.step,
            self.stager.tier,
            stats.rows,
            human_bytes(stats.bytes),
            stats.stall_s,
            stats.job_stall_s,
            human_bytes(stats.pool_bytes),
        )
