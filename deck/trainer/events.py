"""What a checkpoint reports when it is done: one :class:`CheckpointEvent` per checkpoint and
rank, logged (one INFO line per commit) and handed to the user's ``on_checkpoint`` callback.

The event is built once both sides are done with the checkpoint: the training thread has
sealed its stats (the stall is known when ``step``/``save`` returns) and the commit thread has
finished the part (committed, uploaded or failed). Whichever comes second queues it to an
:class:`EventQueue`, whose own thread (``deck-events``) logs it and calls the callback, in
order: a slow callback delays neither training nor the next checkpoint's commit (it must be
thread-safe: TensorBoard's ``SummaryWriter`` is).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import Any

from deck.trainer.staging import CheckpointStats
from deck.units import human_bytes

logger = logging.getLogger("deck.trainer.checkpointer")

OnCheckpoint = Callable[["CheckpointEvent"], Any]


@dataclass(frozen=True)
class CheckpointEvent:
    """One checkpoint as one rank finished it.

    ``state`` is ``committed`` on rank 0 (the commit record is written: a restore can load
    ``step``), ``uploaded`` on the other ranks (this rank's part is at the destination; rank 0
    writes the commit record once every rank's is), or ``failed`` (``error`` says why; nothing
    of ``step`` was committed and the next checkpoint is a full). Sizes are summed over ranks;
    ``stall_s`` is the longest any rank spent in the checkpoint call; ``durable_local_s`` and
    ``committed_s`` count from the snapshot's start (None where the part did not get there).
    """

    step: int
    kind: str  # "full" | "delta"
    chain: str  # "checkpoint" | "publish"
    id: str
    uri: str
    rank: int
    state: str  # "committed" | "uploaded" | "failed"
    rows: int
    bytes: int
    chunks: int
    stall_s: float
    job_stall_s: float
    durable_local_s: float | None
    committed_s: float | None
    error: str | None

    @property
    def ok(self) -> bool:
        """The part got where this rank takes it (rank 0: the checkpoint committed)."""
        return self.state != "failed"

    def scalars(self) -> dict[str, float]:
        """The numeric fields under metric names (``deck/<chain>/<field>``), for a metrics
        writer; times that did not happen are left out."""
        out = {
            "rows": float(self.rows),
            "bytes": float(self.bytes),
            "stall_s": self.stall_s,
            "job_stall_s": self.job_stall_s,
            "durable_local_s": self.durable_local_s,
            "committed_s": self.committed_s,
        }
        return {f"deck/{self.chain}/{k}": v for k, v in out.items() if v is not None}

    def to_dict(self) -> dict[str, Any]:
        """Every field by name (JSON-ready)."""
        return asdict(self)

    @classmethod
    def of(cls, stats: CheckpointStats, chain: str, uri: str, rank: int) -> CheckpointEvent:
        """The event of a part that has ended (its progress read at one moment)."""
        now = stats.progress.get()
        return cls(
            step=stats.step,
            kind=stats.kind,
            chain=chain,
            id=stats.id,
            uri=uri,
            rank=rank,
            state=now.state,
            rows=stats.rows,
            bytes=stats.bytes,
            chunks=stats.chunks,
            stall_s=stats.stall_s,
            job_stall_s=stats.job_stall_s,
            durable_local_s=now.durable_local_s,
            committed_s=now.committed_s,
            error=now.error,
        )


def log_event(event: CheckpointEvent) -> None:
    """The checkpoint's one INFO line (rank 0's commit); other ranks' uploads at DEBUG. A
    failure was logged at ERROR by the commit thread already."""
    if event.state == "failed":
        return
    logger.log(
        logging.INFO if event.state == "committed" else logging.DEBUG,
        "deck: %s %s step %d %s at %s: %d rows, %s, stall %.3f s (job %.3f s), "
        "durable-local %s, %s %s after the snapshot",
        event.kind,
        event.chain,
        event.step,
        event.state,
        event.uri,
        event.rows,
        human_bytes(event.bytes),
        event.stall_s,
        event.job_stall_s,
        _seconds(event.durable_local_s),
        event.state,
        _seconds(event.committed_s),
    )


def deliver(event: CheckpointEvent, callback: OnCheckpoint | None) -> None:
    """Log ``event`` and hand it to ``callback``. A callback that raises is logged, never
    propagated: it must not fail the commit thread or the training step it runs in."""
    log_event(event)
    if callback is None:
        return
    try:
        callback(event)
    except Exception:
        logger.exception(
            "deck: the on_checkpoint callback raised for %s step %d; checkpointing goes on",
            event.chain,
            event.step,
        )


def _seconds(s: float | None) -> str:
    return "-" if s is None else f"{s:.3f} s"


class EventQueue:
    """Delivers events in order on one worker thread of its own (``deck-events``, started at
    the first event), so that what a callback costs lands on no checkpoint's critical path.
    ``callback()`` is read at delivery (the callback may be set at any time)."""

    def __init__(self, callback: Callable[[], OnCheckpoint | None]) -> None:
        self._callback = callback
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deck-events")
        self._last: Future[None] | None = None

    def put(self, event: CheckpointEvent) -> None:
        """Queue ``event`` for delivery (any thread); delivered at once, on this thread, when
        the queue no longer takes work (closed, or the interpreter is shutting down)."""
        try:
            self._last = self._pool.submit(lambda: deliver(event, self._callback()))
        except RuntimeError:
            deliver(event, self._callback())

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued event was delivered (one worker, in order: the last one
        done means all are); False on timeout."""
        last = self._last
        return last is None or not wait([last], timeout).not_done

    def close(self) -> None:
        """Deliver what is queued, then stop the thread."""
        self._pool.shutdown(wait=True)
