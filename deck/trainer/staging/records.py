"""What the stager keeps of one rank's part besides its pending record
(:class:`deck.format.pending.PendingPart`): how far the commit thread got with it
(:class:`PartProgress`, the commit thread's state), what this rank saw of it
(:class:`CheckpointStats`, the public result, which reads that state), and the error that
drops a part for good (:class:`NeverCommits`)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deck.errors import DeckError


class NeverCommits(DeckError):
    """A part that failed for good (its writes, its spool fsync, or another rank's part): the
    commit thread drops it, or every restart would retry it."""


# The states of a part whose files are written to the first tier (or that failed)
FIRST_TIER_STATES = frozenset({"durable", "uploaded", "committed", "failed"})


@dataclass(frozen=True)
class Progress:
    """One moment of a part's background progress (:class:`PartProgress`)."""

    state: str = "staged"  # staged | recovering | durable | uploaded | committed | failed
    error: str | None = None
    durable_local_s: float | None = None  # snapshot start -> this rank's files fsynced
    committed_s: float | None = None  # snapshot start -> part uploaded (rank 0: manifest written)


class PartProgress:
    """How far the commit thread got with one part: the commit thread's state machine.

    Only the commit threads move it on, one stage after the other (restart recovery marks a
    part ``recovering`` before it hands it over); any thread may read it. Every change replaces the whole :class:`Progress`
    under the lock, so a reader sees one moment: never a state without the time that goes
    with it."""

    def __init__(self, started: float) -> None:
        self.started = started  # the snapshot's start: what the times count from
        self._lock = threading.Lock()
        self._moved = threading.Condition(self._lock)  # notified at every change
        self._now = Progress()
        self._ended = threading.Event()
        self._on_end: Callable[[], None] | None = None

    def get(self) -> Progress:
        """The progress now, every field of the same moment."""
        with self._lock:
            return self._now

    def advance(self, state: str, *, durable: bool = False, committed: bool = False) -> None:
        """Move to ``state``. ``durable``: the part's files were just fsynced; ``committed``: the
        part was just uploaded (rank 0: committed); each timed from :attr:`started`."""
        elapsed = time.perf_counter() - self.started
        with self._lock:
            now = self._now
            self._now = dataclasses.replace(
                now,
                state=state,
                durable_local_s=elapsed if durable else now.durable_local_s,
                committed_s=elapsed if committed else now.committed_s,
            )
            self._moved.notify_all()

    def apply(self, now: Progress) -> None:
        """Take ``now`` as the progress (a staging process moved it on)."""
        with self._lock:
            self._now = now
            self._moved.notify_all()

    def fail(self, error: str) -> None:
        """The part failed with ``error`` (its times so far are kept)."""
        with self._lock:
            self._now = dataclasses.replace(self._now, state="failed", error=error)
            self._moved.notify_all()

    def end(self) -> None:
        """The commit thread is done with the part (its state is final): wake :meth:`wait`
        and run the :meth:`when_ended` callback, once."""
        with self._lock:
            self._ended.set()
            call, self._on_end = self._on_end, None
            self._moved.notify_all()
        if call is not None:
            call()

    def when_ended(self, call: Callable[[], None]) -> None:
        """Run ``call`` once the part has ended: now (in this thread) if it has, else in the
        commit thread when it does."""
        with self._lock:
            if not self._ended.is_set():
                self._on_end = call
                return
        call()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the part has ended; False on timeout."""
        return self._ended.wait(timeout)

    def in_first_tier(self) -> bool:
        """Whether the part's files are in the first tier (a restart finishes it from there),
        or the part ended: nothing of it is only in memory any more."""
        with self._lock:
            return self._ended.is_set() or self._now.state in FIRST_TIER_STATES

    def wait_in_first_tier(self, timeout: float | None = None) -> bool:
        """Wait for :meth:`in_first_tier`; False on timeout."""
        with self._moved:
            return self._moved.wait_for(
                lambda: self._ended.is_set() or self._now.state in FIRST_TIER_STATES, timeout
            )


@dataclass
class CheckpointStats:
    """One checkpoint as this rank saw it. Stall and sizes are filled when ``step``/``save``
    returns (sizes summed over ranks). The background fields (:attr:`state`, :attr:`error`,
    :attr:`durable_local_s`, :attr:`committed_s`) fill in as the commit thread goes on: each is
    read from its progress (:attr:`progress`, written by the commit thread only), and
    :meth:`snapshot` reads them all at one moment."""

    step: int
    kind: str
    id: str
    stall_s: float = 0.0  # the longest any rank spent in the checkpoint call
    # What the checkpoint added to the job's critical path: from the last rank's arrival (wall
    # clocks) to this rank's return from the call (the vote, then handing the part to the
    # background). A rank that arrived earlier waited for it, as it would have at the next
    # training step's collective anyway.
    job_stall_s: float = 0.0
    # Of the stall, the longest any rank waited for a free chunk buffer: > 0 when a rank's part
    # was larger than the pool (the first part of a size the pool had not seen, or a part over
    # staging.snapshot_memory_bytes: ``pool_capped``), which then bounds the stall.
    buffer_wait_s: float = 0.0
    # Before the checkpoint began (not in ``stall_s``), how long this rank waited for the
    # checkpoints before it to be written to the first tier (staging.max_unwritten of them
    # were still only in memory).
    backlog_wait_s: float = 0.0
    pool_bytes: int = 0  # the largest chunk buffer pool of any rank for this part
    pool_capped: bool = False  # a rank's part needed more than staging.snapshot_memory_bytes
    # Where the stall went (each the longest of any rank): agreeing before the snapshot (only
    # when the previous checkpoint's vote settled nothing: the first of a process, or after a
    # failed one; an all-gather that absorbs the ranks' arrival skew) plus reading the dense
    # state, claiming the tracked rows, and copying them into buffers (the snapshot: rows,
    # dense and extra state). The rest of ``stall_s`` is the vote that releases training.
    agree_s: float = 0.0
    claim_s: float = 0.0
    snapshot_s: float = 0.0
    # Bytes staged, summed over ranks: the chunk files, plus the dense/extra state files counted
    # by their tensors (they are encoded in the background; the files add a small JSON header).
    bytes: int = 0
    rows: int = 0
    chunks: int = 0
    # Of ``rows``, those copied after the stall (copy-on-write: deck.trainer.cow), summed over
    # ranks; 0 when every row was copied in the stall.
    copied_after: int = 0
    started: float = field(default_factory=time.perf_counter, repr=False)
    # The commit thread's state of this part (read the fields below instead).
    progress: PartProgress = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.progress = PartProgress(self.started)

    @property
    def state(self) -> str:
        """staged | recovering | durable | uploaded | committed | failed"""
        return self.progress.get().state

    @property
    def error(self) -> str | None:
        """Why the part failed (``state == "failed"``), else None."""
        return self.progress.get().error

    @property
    def durable_local_s(self) -> float | None:
        """Seconds from the snapshot's start until this rank's files were fsynced (None: not
        yet, or no spool)."""
        return self.progress.get().durable_local_s

    @property
    def committed_s(self) -> float | None:
        """Seconds from the snapshot's start until the part was uploaded (rank 0: the
        checkpoint committed); None until then."""
        return self.progress.get().committed_s

    def snapshot(self) -> dict[str, Any]:
        """Every field by name, the background ones read at one moment (JSON-ready)."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        return {**own, **dataclasses.asdict(self.progress.get())}

    def __repr__(self) -> str:
        shown = [f.name for f in dataclasses.fields(self) if f.repr]
        now = dataclasses.asdict(self.progress.get())
        items = [f"{k}={getattr(self, k)!r}" for k in shown]
        items += [f"{k}={now[k]!r}" for k in ("durable_local_s", "committed_s", "state", "error")]
        return f"CheckpointStats({', '.join(items)})"
